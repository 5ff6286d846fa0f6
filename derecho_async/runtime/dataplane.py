"""The data plane for large messages and arrays: what a descriptor's bytes travel on.

Theory of operation: an ordered call whose arguments hold arrays (numpy, CuPy, torch, anything
with ``__cuda_array_interface__`` or DLPack) is encoded with the arrays *out of band*: the msgpack
call carries a reference (dtype, shape, kind) for each, and the arrays ride beside it as an
:class:`OutOfBand` payload. A plain message larger than a slot is a large payload too. The core
orders the descriptor like any message and counts it received at a member only once a plane
has landed its payload there.

Planes (:class:`~derecho_async.runtime.plane.Plane`) are chosen per payload by the driver
(``Driver.start_transfer``): the bulk host planes, :mod:`.shmplane` (shm) and :mod:`.chainplane` (tcp), take plain bytes and calls
whose arrays are host numpy arrays; this module holds what they share: the *flat layout* of a
host payload (:func:`flat_meta`, :func:`flat_layout`, :func:`write_flat`, :func:`read_flat`: the
call, then each array little-endian on a 64-byte boundary, described by a small validated meta)
and :class:`RecvBuffers` (pre-faulted receive buffers, recycled when the delivered arrays die).
A bulk plane copies a payload of at least :data:`OFF_LOOP_BYTES` in the loop's default executor
(:func:`write_flat` and :func:`copy_flat` copy with numpy, which releases the GIL; their buffers
are not pre-faulted, so the page faults happen in the copy too), so the loop and its heartbeats
go on meanwhile; such a copy's memory is freed or unmapped only once it finished.

The fallback plane here, :class:`HostStagingPlane`, stages through host memory: the sender copies each array to host bytes
(device arrays on a worker thread, so the event loop never waits for the GPU) and sends one DATA
frame per receiver on the reliable channel; the receiver rebuilds arrays of the same kind on its
own device (CuPy arrays with CuPy, torch tensors on torch's current CUDA device, numpy otherwise;
when the receiver has no GPU library a device array arrives as numpy and this is logged once).
Plain large byte payloads travel the same way. Every frame is validated before use.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import msgpack  # type: ignore[import-untyped]

from derecho_async.errors import ProtocolViolation
from derecho_async.wire.arrays import DTYPES, TYPESTRS, is_cupy_array, numpy_dtype_name

__all__ = [
    "MAX_ARRAYS",
    "OFF_LOOP_BYTES",
    "ArrayInfo",
    "FlatLayout",
    "HostStagingPlane",
    "OutOfBand",
    "RecvBuffers",
    "array_info",
    "copy_flat",
    "flat_layout",
    "flat_meta",
    "read_flat",
    "to_host_bytes",
    "write_flat",
]

log = logging.getLogger("derecho_async.dataplane")

MAX_ARRAYS = 4096  # arrays in one call (a ProtocolViolation beyond: check before sending)
OFF_LOOP_BYTES = 4 << 20
"""Flat payloads of at least this many bytes are copied off the event loop by the bulk planes."""
_NUMPY_COPY = 1 << 16  # plain payloads of at least this many bytes are copied by numpy
_MAX_ARRAYS = MAX_ARRAYS
_PLAIN = 0
_CALL = 1
_T = TypeVar("_T")


@dataclass(slots=True)
class OutOfBand:
    """An encoded call and the arrays its buffer references point at, in order.

    Treat it as immutable. It is not a frozen dataclass because one is made per large message
    at the sender and at every receiver, and a frozen dataclass sets each field through
    ``object.__setattr__`` (several times the cost of a plain slot store)."""

    call: bytes
    arrays: tuple[object, ...]
    _infos: tuple[ArrayInfo, ...] | None = field(default=None, init=False, repr=False,
                                                  compare=False)

    def infos(self) -> tuple[ArrayInfo, ...]:
        """:func:`array_info` of each array, computed once (the size, the plane that takes the
        payload and the staging all need it, on the sender's hot path)."""
        infos = self._infos
        if infos is None:
            infos = self._infos = tuple([array_info(a) for a in self.arrays])
        return infos

    @property
    def nbytes(self) -> int:
        n = len(self.call)
        for info in self.infos():
            n += info.nbytes
        return n


class ArrayInfo(NamedTuple):
    """What the data plane needs to know of an array (DESIGN.md §6's adapter); a named tuple
    (made per array per message on the sender's hot path: see ``core.effects.Delivered``)."""

    lib: str  # "numpy" | "cupy" | "torch" | "cuda" (other __cuda_array_interface__ objects)
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    is_gpu: bool


# An ArrayInfo from a complete field tuple, without the named tuple's Python-level __new__.
_new_info: Callable[..., Any] = tuple.__new__


def array_info(arr: object) -> ArrayInfo:
    """Describe ``arr`` (numpy, CuPy, torch or any CUDA-array-interface object).

    CuPy and numpy arrays, the common cases, are read directly: CuPy builds
    ``__cuda_array_interface__`` anew on every access, numpy ``__array_interface__`` too (a dict
    each time), and ``str(numpy dtype)`` takes microseconds where the typestr lookup takes 0.1."""
    if is_cupy_array(arr):
        c: Any = arr
        info: ArrayInfo = _new_info(ArrayInfo, ("cupy", TYPESTRS.get(c.dtype.str) or str(c.dtype),
                                                c.shape, int(c.nbytes), True))
        return info
    cls = type(arr)
    mod = cls.__module__.split(".")[0]
    if mod == "numpy" and hasattr(cls, "__array_interface__"):
        n: Any = arr
        return ArrayInfo("numpy", numpy_dtype_name(n.dtype), n.shape, int(n.nbytes), False)
    if mod == "torch":
        t: Any = arr
        dtype = str(t.dtype).removeprefix("torch.")
        return ArrayInfo("torch", dtype, tuple(t.shape), int(t.numel() * t.element_size()),
                         bool(t.is_cuda))
    if hasattr(arr, "__cuda_array_interface__"):
        a: Any = arr
        cai = a.__cuda_array_interface__
        dtype = TYPESTRS.get(cai.get("typestr")) or str(a.dtype)
        return ArrayInfo("cupy" if mod == "cupy" else "cuda", dtype, tuple(cai["shape"]),
                         int(a.nbytes), True)
    if hasattr(arr, "__array_interface__"):
        h: Any = arr
        return ArrayInfo("numpy", numpy_dtype_name(h.dtype), tuple(h.shape), int(h.nbytes),
                         False)
    raise TypeError(f"{type(arr).__name__} is not an array the data plane can move")


def to_host_bytes(arr: object) -> bytes:
    """The array's elements as C-ordered little-endian bytes (a device-to-host copy for GPUs)."""
    info = array_info(arr)
    a: Any = arr
    if info.lib == "torch":
        host = a.detach().to("cpu").contiguous().numpy()
    elif info.is_gpu:
        import cupy

        host = cupy.asnumpy(cupy.ascontiguousarray(cupy.asarray(a)))
    else:
        import numpy as np

        host = np.ascontiguousarray(a)
    return bytes(host.astype(host.dtype.newbyteorder("<"), copy=False).data)


_warned_no_gpu = False


def _rebuild(lib: str, dtype: str, shape: tuple[int, ...], raw: bytes) -> object:
    """An array of kind ``lib`` on this member's device holding ``raw``."""
    global _warned_no_gpu
    import numpy as np

    host = np.frombuffer(bytearray(raw), dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)
    host = host.astype(np.dtype(dtype), copy=False)
    if lib == "numpy":
        return host
    try:
        if lib == "torch":
            import torch

            t = torch.from_numpy(host)
            return t.to("cuda") if torch.cuda.is_available() else t
        import cupy

        return cupy.asarray(host)
    except ImportError:
        if not _warned_no_gpu:
            _warned_no_gpu = True
            log.warning("a %s device array arrived but this member has no GPU library: "
                        "delivering numpy arrays", lib)
        return host


class HostStagingPlane:
    """Moves large payloads through host memory on the reliable channel (see module header)."""

    def __init__(self, send: Callable[[int, bytes], None],
                 landed: Callable[[tuple[int, int, int], object], None],
                 encode_frame: Callable[[tuple[int, int, int], bytes], bytes], *,
                 failed: Callable[[tuple[int, int, int], BaseException], None] | None = None,
                 staging_failed: Callable[[tuple[int, int, int], BaseException], None]
                 | None = None) -> None:
        self._send = send
        self._landed = landed
        self._failed = failed
        self._staging_failed = staging_failed
        self._encode_frame = encode_frame
        self._tasks: set[asyncio.Future[Any]] = set()

    def start(self, key: tuple[int, int, int], payload: object, targets: tuple[int, ...]) -> None:
        """Ship ``payload`` (bytes or :class:`OutOfBand`) for data key ``key`` to ``targets``."""
        if isinstance(payload, OutOfBand) and any(info.is_gpu for info in payload.infos()):
            self._off_loop(key, lambda: self.pack(payload), "staging", self._staging_failed,
                           lambda body: self._ship(key, body, targets))
        else:
            self._ship(key, self.pack(payload), targets)

    def _ship(self, key: tuple[int, int, int], body: bytes, targets: tuple[int, ...]) -> None:
        frame = self._encode_frame(key, body)
        for dst in targets:
            self._send(dst, frame)

    @staticmethod
    def pack(payload: object) -> bytes:
        if isinstance(payload, OutOfBand):
            arrays = []
            for a, info in zip(payload.arrays, payload.infos(), strict=True):
                arrays.append([info.lib, info.dtype, list(info.shape), to_host_bytes(a)])
            body = [_CALL, payload.call, arrays]
        else:
            body = [_PLAIN, bytes(memoryview(payload))]  # type: ignore[arg-type]
        out = msgpack.packb(body, use_bin_type=True)
        assert isinstance(out, bytes)
        return out

    def receive(self, key: tuple[int, int, int], body: bytes) -> None:
        """A DATA frame arrived: rebuild its payload (device copies off the loop), then land it."""
        try:
            msg = msgpack.unpackb(body, raw=False, use_list=True)
            payload_or_job = self._unpack(msg)
        except ProtocolViolation:
            raise
        except Exception as exc:
            raise ProtocolViolation(f"undecodable data frame: {exc}") from exc
        if not callable(payload_or_job):
            self._landed(key, payload_or_job)
            return
        self._off_loop(key, payload_or_job, "rebuilding", self._failed,
                       lambda payload: self._landed(key, payload))

    def _off_loop(self, key: tuple[int, int, int], job: Callable[[], _T], what: str,
                  failed: Callable[[tuple[int, int, int], BaseException], None] | None,
                  then: Callable[[_T], None]) -> None:
        """Run ``job`` in the executor, then ``then(result)`` on the loop; a failure is logged
        and reported to ``failed`` (the message of ``key`` can never land)."""
        fut = asyncio.get_running_loop().run_in_executor(None, job)
        self._tasks.add(fut)

        def done(f: asyncio.Future[_T]) -> None:
            self._tasks.discard(f)
            if f.cancelled():
                return
            exc = f.exception()
            if exc is not None:
                log.error("%s a device payload failed: %r", what, exc)
                if failed is not None:
                    failed(key, exc)
                return
            then(f.result())

        fut.add_done_callback(done)

    @staticmethod
    def _unpack(msg: object) -> object:
        if not isinstance(msg, list) or not msg or msg[0] not in (_PLAIN, _CALL):
            raise ProtocolViolation("data frame is not [kind, ...]")
        if msg[0] == _PLAIN:
            if len(msg) != 2 or not isinstance(msg[1], bytes):
                raise ProtocolViolation("plain data frame must carry bytes")
            return msg[1]
        if len(msg) != 3 or not isinstance(msg[1], bytes) or not isinstance(msg[2], list):
            raise ProtocolViolation("call data frame must be [1, call, arrays]")
        call, specs = msg[1], msg[2]
        if len(specs) > _MAX_ARRAYS:
            raise ProtocolViolation(f"data frame with {len(specs)} arrays")
        checked: list[tuple[str, str, tuple[int, ...], bytes]] = []
        any_gpu = False
        for spec in specs:
            if not (isinstance(spec, list) and len(spec) == 4):
                raise ProtocolViolation("array spec must be [lib, dtype, shape, bytes]")
            lib, dtype, shape, raw = spec
            if not (isinstance(lib, str) and isinstance(dtype, str)) or (
                lib not in ("numpy", "cupy", "torch", "cuda") or dtype not in DTYPES
            ):
                raise ProtocolViolation(f"array of lib {lib!r} dtype {dtype!r}")
            if not isinstance(shape, list) or len(shape) > 32 or not all(
                type(n) is int and 0 <= n < 1 << 62 for n in shape
            ):
                raise ProtocolViolation(f"bad array shape {shape!r}")
            if not isinstance(raw, bytes):
                raise ProtocolViolation("array bytes missing")
            import numpy as np

            count = 1
            for n in shape:
                count *= n
            if count * np.dtype(dtype).itemsize != len(raw):
                raise ProtocolViolation(f"array of shape {shape} {dtype} with {len(raw)} bytes")
            any_gpu = any_gpu or lib != "numpy"
            checked.append((lib if lib != "cuda" else "cupy", dtype, tuple(shape), raw))

        def build() -> OutOfBand:
            return OutOfBand(call, tuple(_rebuild(*c) for c in checked))

        return build if any_gpu else build()


# -- the flat host layout shared by the bulk planes (shm pool, tcp chain) ----------------------
#
# A host payload is laid out as one contiguous byte range: for plain bytes, the bytes; for a
# call, the encoded call at offset 0, then each array's elements (C order, little-endian), each
# starting on a 64-byte boundary. Its *meta* travels beside it and is all a receiver needs to
# rebuild the payload: ``[0, length]`` (plain) or ``[1, call_length, [[dtype, shape], ...]]``.
# The receiver recomputes the layout from the meta alone and checks it against the bytes.

_ALIGN = 64


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Where each piece of a flat payload lies: the call (or plain bytes) and every array."""

    plain: bool
    head: int  # bytes of the call (or of the plain payload), at offset 0
    arrays: tuple[tuple[int, str, tuple[int, ...], int], ...]  # (offset, dtype, shape, nbytes)
    total: int


def flat_meta(payload: object) -> list[Any] | None:
    """The meta of ``payload`` if a bulk host plane can move it (plain bytes, or a call whose
    arrays are all host numpy arrays of :data:`DTYPES`), else None."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return [_PLAIN, memoryview(payload).nbytes]
    if not isinstance(payload, OutOfBand):
        return None
    specs: list[list[Any]] = []
    for a in payload.arrays:
        if type(a).__module__.split(".")[0] != "numpy" or not hasattr(a, "__array_interface__"):
            return None
        n: Any = a
        dtype = numpy_dtype_name(n.dtype)
        if dtype not in DTYPES or n.dtype.fields is not None:
            return None
        specs.append([dtype, list(n.shape)])
    return [_CALL, len(payload.call), specs]


def _bad(why: str) -> ProtocolViolation:
    return ProtocolViolation(f"bad data-plane meta: {why}")


def flat_layout(meta: object, limit: int = 1 << 62) -> FlatLayout:
    """Validate ``meta`` (it may come from the network) and compute its layout; the total must
    not exceed ``limit``. Raises :class:`ProtocolViolation`."""
    if not isinstance(meta, list) or not meta or meta[0] not in (_PLAIN, _CALL):
        raise _bad("not [kind, ...]")
    if meta[0] == _PLAIN:
        if len(meta) != 2 or type(meta[1]) is not int or not 0 <= meta[1] <= limit:
            raise _bad("plain meta must be [0, length]")
        return FlatLayout(True, meta[1], (), meta[1])
    if len(meta) != 3 or type(meta[1]) is not int or not isinstance(meta[2], list):
        raise _bad("call meta must be [1, call_length, arrays]")
    head, specs = meta[1], meta[2]
    if not 0 <= head <= limit or len(specs) > _MAX_ARRAYS:
        raise _bad(f"call of {head} bytes with {len(specs)} arrays")
    pos = head
    arrays = []
    for spec in specs:
        if not (isinstance(spec, list) and len(spec) == 2):
            raise _bad("array spec must be [dtype, shape]")
        dtype, shape = spec
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _bad(f"array dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > 32 or not all(
            type(n) is int and 0 <= n <= limit for n in shape
        ):
            raise _bad(f"array shape {shape!r}")
        nbytes = DTYPES[dtype]
        for n in shape:
            nbytes *= n
            if nbytes > limit:
                raise _bad(f"array of shape {shape} {dtype} is too large")
        pos = (pos + _ALIGN - 1) & ~(_ALIGN - 1)
        arrays.append((pos, dtype, tuple(shape), nbytes))
        pos += nbytes
        if pos > limit:
            raise _bad(f"payload larger than {limit} bytes")
    return FlatLayout(False, head, tuple(arrays), pos)


def write_flat(payload: object, layout: FlatLayout, dst: memoryview) -> None:
    """Copy ``payload`` into ``dst`` (``layout.total`` bytes) in the flat layout: one copy per
    piece, byte order and strides converted on the way."""
    if layout.plain:
        src = memoryview(payload).cast("B")  # type: ignore[arg-type]
        np: Any = _numpy() if layout.total >= _NUMPY_COPY else None
        if np is None:
            dst[: layout.total] = src
        else:  # without the GIL (a memoryview slice assignment holds it)
            np.frombuffer(dst, np.uint8, count=layout.total)[...] = np.frombuffer(src, np.uint8)
        return
    assert isinstance(payload, OutOfBand)
    import numpy as np

    dst[: layout.head] = payload.call
    for (off, dtype, shape, nbytes), arr in zip(layout.arrays, payload.arrays, strict=True):
        if nbytes:
            le = np.dtype(dtype).newbyteorder("<")
            out = np.frombuffer(dst, dtype=le, count=nbytes // le.itemsize, offset=off)
            out.reshape(shape)[...] = arr


class RecvBuffers:
    """Pre-faulted receive buffers, recycled when the arrays built over them die.

    Arrays handed to handlers are owned by the application, so a receiver needs a fresh buffer
    for every message; fresh anonymous memory costs a page fault per 4 KiB page on first touch,
    which (in VMs especially) costs more than the copy itself. Buffers of at least
    ``min_bytes`` therefore come from size classes (an eighth of a power of two apart) of
    anonymous mappings populated in one system call (``MAP_POPULATE``); each is handed out as a uint8 array that every array
    of the message is a view of, and a ``weakref.finalize`` on that array returns the mapping
    to the free list once the application dropped the last view. At most ``keep_bytes`` of free
    buffers are kept.
    """

    def __init__(self, min_bytes: int = 1 << 20, keep_bytes: int = 512 << 20) -> None:
        self.min_bytes = min_bytes
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[Any]] = {}
        # finalizers run in whichever thread drops the last view (a CUDA callback thread too)
        self._lock = threading.RLock()  # re-entered when a collection under it runs one
        self.kept = 0  # bytes of free buffers held
        self.created = 0  # mappings made (statistics, tests)

    def take(self, nbytes: int, *, populate: bool = True) -> Any:
        """A writable uint8 numpy array of ``nbytes`` (contents undefined). A new mapping is
        populated at once unless ``populate`` is False (that system call holds the GIL; off
        the loop, a copy into the buffer faults its pages in without it)."""
        import numpy as np

        if nbytes < self.min_bytes:
            return np.empty(nbytes, np.uint8)
        import mmap
        import weakref

        # size classes an eighth of a power of two apart: at most 12.5% over what is asked
        step = 1 << max(12, (nbytes - 1).bit_length() - 3)
        size = (nbytes + step - 1) // step * step
        with self._lock:
            free = self._free.get(size)
            mm = free.pop() if free else None
            if mm is not None:
                self.kept -= size
        if mm is None:
            flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
            if populate:
                flags |= getattr(mmap, "MAP_POPULATE", 0)
            mm = mmap.mmap(-1, size, flags=flags)
            self.created += 1
        base = np.frombuffer(mm, np.uint8, count=nbytes)
        weakref.finalize(base, self._give_back, size, mm)
        return base

    def _give_back(self, size: int, mm: Any) -> None:
        with self._lock:
            if self.kept + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(mm)
                self.kept += size


def read_flat(
    layout: FlatLayout,
    data: bytes | bytearray | memoryview | None,
    buffers: RecvBuffers | None = None,
    owned: Any = None,
) -> object:
    """Rebuild the payload from its flat bytes (``layout.total`` long, already validated).

    Plain payloads become ``bytes`` (one copy of ``data``). A call's arrays are numpy arrays
    built directly over one writable copy of ``data`` taken from ``buffers`` (or, with
    ``owned``, over that uint8 array, which already holds the bytes: no copy at all).
    """
    if owned is None:
        assert data is not None
        if len(data) != layout.total:
            raise ProtocolViolation(f"flat payload of {len(data)} bytes, meta says {layout.total}")
        if layout.plain:
            return data if isinstance(data, bytes) else bytes(data)
    import numpy as np

    if owned is None:
        owned = (buffers or RecvBuffers()).take(layout.total)
        assert data is not None
        owned[:] = np.frombuffer(data, np.uint8)
    call = owned[: layout.head].tobytes()
    arrays: list[object] = []
    for off, dtype, shape, nbytes in layout.arrays:
        want = np.dtype(dtype)
        le = want.newbyteorder("<")
        a = owned[off : off + nbytes].view(le) if nbytes else np.zeros(0, dtype=le)
        arrays.append(a.reshape(shape).astype(want, copy=False))
    return OutOfBand(call, tuple(arrays))


def copy_flat(layout: FlatLayout, data: bytes | bytearray | memoryview,
              buffers: RecvBuffers) -> object:
    """:func:`read_flat` for a worker thread: the copy of ``data`` (``layout.total`` bytes,
    validated) runs without the GIL, page faults included: a plain payload through
    :func:`~derecho_async.hotpath.bytes_copy`, a call's bytes by numpy into a buffer of
    ``buffers`` that is not populated first."""
    if len(data) != layout.total:
        raise ProtocolViolation(f"flat payload of {len(data)} bytes, meta says {layout.total}")
    if layout.plain:
        from derecho_async import hotpath

        return hotpath.bytes_copy(data)
    import numpy as np

    owned = buffers.take(layout.total, populate=False)
    owned[:] = np.frombuffer(data, np.uint8)
    return read_flat(layout, None, owned=owned)


def _numpy() -> Any:
    """numpy, or None where it is not installed."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy
