"""The CUDA IPC data plane: device arrays between members of one host, through pooled buffers.

Theory of operation (DESIGN.md §4.3, §6). Every member owns a *device pool*: a few large
``cudaMalloc`` segments, each exported once with ``cudaIpcGetMemHandle``, carved up by a first-fit
:class:`RangeAllocator`, plus a set of interprocess CUDA events. Whenever a view is installed (and
whenever the pool grows) a member sends each peer of the view a POOL announcement holding its
segments' and events' IPC handles; receivers open a peer's handles once, on first use, and close
them when the peer leaves the view. No handle travels per message.

Sending an ordered call whose arguments hold device arrays: each array that already lies in the
sender's pool (allocated with :meth:`IpcPlane.device_buffer`) is sent in place (zero copy); any
other array is copied into a fresh pool region on the plane's stream. The plane then records one of
its interprocess events on that stream and sends each receiver a small descriptor frame: the
encoded call, the event's index, and per array its kind, dtype, shape and (segment, offset) (host
arrays in the same call ride inline); the descriptors made in one turn of the loop (a driver step
sends several messages) travel in one GPU_BATCH frame. Nothing waits on the GPU on the event loop.
When every array goes in place and the application's current stream has nothing queued
(``cudaStreamQuery``, a host-side check), the arrays are final: the descriptor names no event (-1)
and the sender's GPU context does no work for the message at all. This matters because processes
sharing a GPU without MPS are time-sliced: measured on an H200, handing work from one process's
context to another's costs about 150 µs each way (``benchmarks/cuda_call_costs.py``), far more than
the calls.

Receiving: the descriptor is validated against what the sender announced (segment index, offset and
length within the segment, event index, dtype, element count), and each announced segment's size
against the allocation its handle opens (``cuMemGetAddressRange``, once, when it is mapped): what
breaks these rules, or a handle that cannot be opened, is the sender's fault (a
ProtocolViolation); an allocation or a copy that fails here is this member's, and it leaves, as
it does when opening a handle fails for want of memory or of a working device here. For each
array the receiver takes a region of its *own* pool, makes the stream it keeps for that sender
wait on the sender's event, and issues a device-to-device copy (a peer copy when the sender's GPU
is another one); at the loop's next turn one local event is recorded after all the copies issued
for that sender since the last one (descriptors arrive in bursts; 8 MiB of copies closes a batch
at once). One *non-blocking*
stream per sender: a sender that dies leaves an event that may never complete, and a wait on it
must stall only that sender's copies (which the view change trims anyway), not other senders'
copies nor the application's work on the default stream. Completion is noticed without blocking the
loop: while copies complete the loop polls the events (``call_soon``, for up to 2 ms after the last
completion, or what ``Config.gpu_busy_poll_us`` says; while more than one batch is in
flight, at most once per 80 µs, ``Config.gpu_poll_interval_us``: a look costs the loop
about a microsecond at every turn, and a busy loop turns several times per message); past that,
the loop hands the blocking-sync event of each busy stream's oldest batch to that sender's *waiter
thread*, which sleeps in ``cudaEventSynchronize`` (the GIL released) and wakes the loop as soon as
that batch is done, not the whole queue behind it. Not a CUDA host-function
callback: one stalls its stream until it gets the GIL, and a CUDA call that the loop makes while
holding the GIL and that waits for that stream would never return. The loop then rebuilds arrays of
the same kind (CuPy arrays, torch tensors through DLPack) over the copied regions and lands the
message: only then does the core count it received, so a GPU message is stable only once its bytes
are everywhere.

Freeing. A receiver's region belongs to the delivered array; it returns to the pool when the array
is garbage-collected (a finalizer queues it; the event loop reclaims it, because a finalizer may
run inside a CUDA callback where CUDA calls are not allowed). Before a copy into memory that was
reclaimed since that stream's last fence, the receiving stream waits on an event recorded on the
application's current stream (its last use of the array is queued there) and, after a view change
freed staging regions, on the sending stream. The sending stream is a *blocking* stream, so
staging copies are ordered after work the application queued on the default stream; it never
waits on another process's event, so it cannot stall. A sender's staging region and event are reclaimed when the message is
delivered at the sender (delivery means stable, so every receiver's copy has completed) or when a
later view is installed (a copy still in flight from an older view lands for a view the core no
longer accepts, and is dropped).

A sender that dies mid-transfer: its receivers' copies read memory the driver keeps mapped until
they close the handle; the message either landed everywhere it was counted or is trimmed by the
view change (the core's all-or-nothing rule), and the dead member's handles are closed once the
stream kept for it has drained (never, if it stalled on the dead member's event: a bounded leak
of what was in flight from that member).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import ctypes
import functools
import logging
import math
import queue
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack  # type: ignore[import-untyped]

from derecho_async.core import ViewInstalled
from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.dataplane import ArrayInfo, OutOfBand
from derecho_async.wire import envelope as env
from derecho_async.wire.arrays import DTYPES

__all__ = [
    "ALIGN",
    "BROADCAST",
    "MAX_BROADCAST_BYTES",
    "ArraySpec",
    "Completions",
    "Descriptor",
    "IpcPlane",
    "Lane",
    "PoolAnnouncement",
    "RangeAllocator",
    "as_lib",
    "gpu_available",
    "inline_array",
]

log = logging.getLogger("derecho_async.gpuplane")

ALIGN = 256  # bytes: regions start at multiples of this (CUDA's own allocation granularity)
_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
_MAX_SEGMENTS = 4096
_MAX_EVENTS = 1 << 16
_MAX_ARRAYS = 4096
_EVENT_BATCH = 64
_MAX_BATCH = 1 << 16  # descriptors in one GPU_BATCH frame (a step sends at most a window's worth)
_BATCH_BYTES = 8 << 20  # copies tracked by one event at most (see IpcPlane.receive_descriptor)
_CUDA_MEMCPY_DEFAULT = 4
_IPC_LAZY_PEER_ACCESS = 1
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess
_WAKE_EVENT_FLAGS = 0x1 | 0x2  # cudaEventBlockingSync | cudaEventDisableTiming: a sleeping wait
# CUDA runtime error codes (CuPy's CUDARuntimeError.status) that say this process or its device
# cannot take on more, or cannot work at all, rather than that a handle it was given is bad: when
# opening a peer's IPC handle fails with one of these, the receiver is at fault (_open_peer).
_LOCAL_CUDA_ERRORS = frozenset({
    2,  # cudaErrorMemoryAllocation
    3,  # cudaErrorInitializationError
    4,  # cudaErrorCudartUnloading
    35,  # cudaErrorInsufficientDriver
    46,  # cudaErrorDevicesUnavailable
    100,  # cudaErrorNoDevice
    101,  # cudaErrorInvalidDevice
    700,  # cudaErrorIllegalAddress (sticky: this process's context is lost)
    719,  # cudaErrorLaunchFailure (sticky)
})

def gpu_available() -> bool:
    """Whether CuPy imports here and sees at least one CUDA device."""
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


# -- the allocator (pure; tested on the CPU) ---------------------------------------------------
class RangeAllocator:
    """First-fit allocation of aligned byte ranges within one segment of ``size`` bytes.

    Free ranges are kept sorted by offset and merged with their neighbours on release, so a pool
    that has returned everything is one free range again.
    """

    def __init__(self, size: int) -> None:
        if size <= 0 or size % ALIGN:
            raise ValueError(f"segment size {size} is not a positive multiple of {ALIGN}")
        self.size = size
        self._starts: list[int] = [0]
        self._lengths: list[int] = [size]
        self._taken: dict[int, int] = {}

    @property
    def in_use(self) -> int:
        """Bytes allocated and not yet released."""
        return sum(self._taken.values())

    @property
    def allocations(self) -> int:
        return len(self._taken)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free range of at least ``nbytes`` (rounded up), or None."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, length in enumerate(self._lengths):
            if length >= need:
                start = self._starts[i]
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] = start + need
                    self._lengths[i] = length - need
                self._taken[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        """Return the range allocated at ``offset``."""
        length = self._taken.pop(offset, None)
        if length is None:
            raise ValueError(f"offset {offset} is not allocated")
        i = bisect.bisect_left(self._starts, offset)
        # merge with the following free range
        if i < len(self._starts) and self._starts[i] == offset + length:
            length += self._lengths[i]
            del self._starts[i], self._lengths[i]
        # merge with the preceding free range
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset:
            self._lengths[i - 1] += length
        else:
            self._starts.insert(i, offset)
            self._lengths.insert(i, length)


# -- wire formats (pure; validated field by field) ---------------------------------------------
@dataclass(frozen=True, slots=True)
class PoolAnnouncement:
    """A member's IPC handles: ``segments`` as (size, handle), ``events`` as handles."""

    device_bus_id: str
    segments: tuple[tuple[int, bytes], ...]
    events: tuple[bytes, ...]

    def encode(self) -> bytes:
        body = [self.device_bus_id, [[s, h] for s, h in self.segments], list(self.events)]
        out = msgpack.packb(body, use_bin_type=True)
        assert isinstance(out, bytes)
        return out

    @classmethod
    def decode(cls, raw: bytes) -> PoolAnnouncement:
        try:
            msg = msgpack.unpackb(raw, raw=False, use_list=True)
        except Exception as exc:
            raise ProtocolViolation(f"undecodable pool announcement: {exc}") from exc
        if not (isinstance(msg, list) and len(msg) == 3 and isinstance(msg[0], str)
                and len(msg[0]) <= 64 and isinstance(msg[1], list) and isinstance(msg[2], list)):
            raise ProtocolViolation("pool announcement is not [bus id, segments, events]")
        if len(msg[1]) > _MAX_SEGMENTS or len(msg[2]) > _MAX_EVENTS:
            raise ProtocolViolation("pool announcement with too many segments or events")
        segments = []
        for seg in msg[1]:
            if not (isinstance(seg, list) and len(seg) == 2 and type(seg[0]) is int
                    and 0 < seg[0] < 1 << 48 and seg[0] % ALIGN == 0
                    and isinstance(seg[1], bytes) and len(seg[1]) == _HANDLE_BYTES):
                raise ProtocolViolation("pool segment must be [size, 64-byte handle]")
            segments.append((seg[0], seg[1]))
        for h in msg[2]:
            if not (isinstance(h, bytes) and len(h) == _HANDLE_BYTES):
                raise ProtocolViolation("pool event must be a 64-byte handle")
        return cls(msg[0], tuple(segments), tuple(msg[2]))


BROADCAST = -2  # ArraySpec.segment of an array that arrives by an NCCL broadcast (.ncclplane)
MAX_BROADCAST_BYTES = 1 << 40  # device bytes one NCCL descriptor may announce, all arrays together


class ArraySpec(NamedTuple):
    """One array of a descriptor: in the sender's pool (segment >= 0), inline host bytes
    (segment -1), or arriving by an NCCL broadcast (segment :data:`BROADCAST`). A named tuple,
    like :class:`Descriptor`: both are made per message on both sides of the hot path."""

    lib: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    segment: int = -1
    offset: int = 0
    inline: bytes | None = None


class Descriptor(NamedTuple):
    """What a receiver needs to copy one message's arrays out of the sender's pool.

    Wire format (fixed little-endian fields, no general-purpose decoder on the hot path): a
    12-byte head ``<BBHiI`` (magic, 0, array count, event, call length); per array a 24-byte
    head ``<BBBBIQQ`` (lib code, dtype code, dimensions, kind, segment, offset, byte count),
    its dimensions as signed 64-bit integers, and for an inline array its bytes; then the
    encoded call, which ends the descriptor exactly. Kind 0: in the sender's pool at (segment,
    offset); 1: inline host bytes; 2: arriving by an NCCL broadcast."""

    call: bytes
    event: int
    arrays: tuple[ArraySpec, ...] = ()

    def encode(self) -> bytes:
        parts = [_DESC_HEAD.pack(_DESC_MAGIC, 0, len(self.arrays), self.event, len(self.call))]
        for a in self.arrays:
            inline = b""
            if a.segment >= 0:
                kind, seg, off, length = _KIND_POOL, a.segment, a.offset, a.nbytes
            elif a.segment == BROADCAST:
                kind, seg, off, length = _KIND_BROADCAST, 0, 0, a.nbytes
            else:
                inline = a.inline or b""
                kind, seg, off, length = _KIND_INLINE, 0, 0, len(inline)
            ndim = len(a.shape)
            parts.append(_SPEC_HEAD.pack(_LIB_CODES[a.lib], _DTYPE_CODES[a.dtype], ndim, kind,
                                         seg, off, length))
            parts.append(_DIMS[ndim].pack(*a.shape))
            if inline:
                parts.append(inline)
        parts.append(self.call)
        return b"".join(parts)

    @classmethod
    def decode(cls, raw: bytes, announced: PoolAnnouncement | None, *,
               broadcast: bool = False) -> Descriptor:
        """Parse and check ``raw`` against the sender's announced pool (None: none known).

        With ``broadcast`` (the NCCL plane) device arrays are of the broadcast kind (no pool:
        they arrive by broadcast), at most :data:`MAX_BROADCAST_BYTES` in all, and the event
        must be -1; pool arrays are refused, and broadcast arrays are refused without it."""
        end = len(raw)
        if end < _DESC_HEAD.size:
            raise ProtocolViolation(f"device descriptor of {end} bytes is truncated")
        magic, zero, count, event, call_len = _DESC_HEAD.unpack_from(raw, 0)
        if magic != _DESC_MAGIC or zero != 0:
            raise ProtocolViolation("not a device descriptor (bad magic)")
        if count > _MAX_ARRAYS:
            raise ProtocolViolation(f"device descriptor with {count} arrays")
        pos = _DESC_HEAD.size
        device_arrays = False
        broadcast_bytes = 0
        specs: list[ArraySpec] = []
        spec_head = _SPEC_HEAD.unpack_from
        for _ in range(count):
            if pos + _SPEC_HEAD.size > end:
                raise ProtocolViolation("device descriptor is truncated in an array spec")
            lib_code, dtype_code, ndim, kind, seg, off, length = spec_head(raw, pos)
            pos += _SPEC_HEAD.size
            if lib_code >= len(_LIB_NAMES) or dtype_code >= len(_DTYPE_NAMES):
                raise ProtocolViolation(f"array of lib code {lib_code} dtype code {dtype_code}")
            lib = _LIB_NAMES[lib_code]
            dtype = _DTYPE_NAMES[dtype_code]
            if ndim > 32 or pos + 8 * ndim > end:
                raise ProtocolViolation(f"bad array shape: {ndim} dimensions")
            shape: tuple[int, ...] = _DIMS[ndim].unpack_from(raw, pos)
            pos += 8 * ndim
            n = DTYPES[dtype]
            for d in shape:
                if not 0 <= d < _MAX_DIM:
                    raise ProtocolViolation(f"bad array shape {shape!r}")
                n *= d
            if kind == _KIND_POOL and not broadcast:
                if announced is None:
                    raise ProtocolViolation("device array from a member that announced no pool")
                if seg >= len(announced.segments):
                    raise ProtocolViolation(f"device array in unknown segment {seg}")
                size = announced.segments[seg][0]
                if length != n or off + length > size:
                    raise ProtocolViolation(
                        f"device array [{off}, +{length}) outside segment of {size} bytes "
                        f"({n} bytes by its shape)")
                device_arrays = True
                specs.append(_new_spec(ArraySpec, (lib, dtype, shape, n, seg, off, None)))
            elif seg or off:  # one encoding per descriptor: unused fields are zero
                raise ProtocolViolation(
                    f"array spec of kind {kind} with segment {seg} offset {off}")
            elif kind == _KIND_INLINE:
                if length != n or pos + n > end:
                    raise ProtocolViolation(
                        f"inline array of {length} bytes ({n} by its shape, "
                        f"{end - pos} left in the descriptor)")
                specs.append(_new_spec(ArraySpec, (lib, dtype, shape, n, -1, 0,
                                                   bytes(raw[pos:pos + n]))))
                pos += n
            elif kind == _KIND_BROADCAST and broadcast:
                broadcast_bytes += n
                if length != n or lib == "numpy" or broadcast_bytes > MAX_BROADCAST_BYTES:
                    raise ProtocolViolation(
                        f"broadcast array of {length} bytes ({n} by its shape; "
                        f"{broadcast_bytes} in all, lib {lib})")
                specs.append(_new_spec(ArraySpec, (lib, dtype, shape, n, BROADCAST, 0, None)))
            else:
                raise ProtocolViolation(
                    f"array spec of kind {kind} in a{' broadcast' if broadcast else 'n IPC'} "
                    "descriptor")
        if pos + call_len != end:
            raise ProtocolViolation(
                f"device descriptor of {end} bytes: {pos} of arrays and a call of {call_len}")
        if broadcast and event != -1:
            raise ProtocolViolation(f"broadcast descriptor names event {event!r}")
        if device_arrays and (announced is None or not -1 <= event < len(announced.events)):
            raise ProtocolViolation(f"device descriptor names unknown event {event!r}")
        desc: Descriptor = _new_spec(cls, (bytes(raw[pos:]), event, tuple(specs)))
        return desc


_DESC_MAGIC = 0xD7
_DESC_HEAD = struct.Struct("<BBHiI")  # magic, 0, arrays, event, call length
_SPEC_HEAD = struct.Struct("<BBBBIQQ")  # lib, dtype, dimensions, kind, segment, offset, bytes
_DIMS = tuple(struct.Struct(f"<{n}q") for n in range(33))  # an array's dimensions, by count
_KIND_POOL, _KIND_INLINE, _KIND_BROADCAST = 0, 1, 2
_LIB_NAMES = ("numpy", "cupy", "torch", "cuda")  # lib codes on the wire (the index)
_LIB_CODES = {name: i for i, name in enumerate(_LIB_NAMES)}
# dtype codes on the wire (the index): fixed here, not taken from codec.DTYPES's order, so a
# reordering there cannot change what a code means; append new dtypes at the end
_DTYPE_NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128")
_DTYPE_CODES = {name: i for i, name in enumerate(_DTYPE_NAMES)}
_MAX_DIM = 1 << 48  # one dimension of a traveling array, at most
# A named tuple made from a complete field tuple without its Python-level __new__ (half the
# cost; the receiver makes one spec and one descriptor per message).
_new_spec: Callable[..., Any] = tuple.__new__


def _inline_spec(arr: object, info: ArrayInfo) -> ArraySpec:
    """The spec of a host array that rides inline in the descriptor (little-endian C order)."""
    import numpy as np

    host = np.ascontiguousarray(arr)
    raw = host.astype(host.dtype.newbyteorder("<"), copy=False).tobytes()
    return ArraySpec("numpy", info.dtype, info.shape, info.nbytes, inline=raw)


_NO_SPEC = ArraySpec("cupy", "uint8", (), 0)  # a staged array's place until it has one


def inline_array(spec: ArraySpec) -> Any:
    """The numpy array of an inline (host) array spec, in native byte order."""
    import numpy as np

    assert spec.inline is not None
    host = np.frombuffer(bytearray(spec.inline), dtype=np.dtype(spec.dtype).newbyteorder("<"))
    return host.reshape(spec.shape).astype(np.dtype(spec.dtype), copy=False)


def as_lib(arr: Any, lib: str) -> object:
    """A received CuPy array as the sender's kind: a torch tensor through DLPack when ``lib``
    is torch and torch imports here, else the CuPy array itself."""
    if lib == "torch":
        try:
            import torch

            return torch.from_dlpack(arr)
        except ImportError:
            pass
        except Exception as exc:  # e.g. a torch built without CUDA: the array still lands
            if not _TORCH_FALLBACK_SAID:
                _TORCH_FALLBACK_SAID.append(True)
                log.warning("torch tensors arrive as CuPy arrays here: %r", exc)
    return arr


_TORCH_FALLBACK_SAID: list[bool] = []  # as_lib's warning is given once per process


def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype that may travel (codec.DTYPES maps each to its size)."""
    return DTYPES[dtype]


# -- completions (needs CuPy; shared with the NCCL plane) ---------------------------------------
@dataclass(slots=True, eq=False)
class Lane:
    """One stream whose work items complete in order and are noticed without blocking the loop
    (a sending peer's copies here; a communicator's broadcasts in :mod:`.ncclplane`)."""

    stream: Any = None  # made by the owner (non-blocking), on first use
    # work in flight, oldest first: (event recorded after it, then, regions it writes into)
    inflight: collections.deque[tuple[int, Callable[[], None], list[tuple[int, int]]]] = field(
        default_factory=collections.deque)
    wakeup_armed: bool = False
    waiter: _Waiter | None = None  # made on first need


class Completions:
    """Notices completed GPU work on :class:`Lane` streams: polled while busy, a waiter thread's
    wake-up when idle (see the module docstring). Every method runs on the event loop."""

    def __init__(self, rt: Any, device: int,
                 finished: Callable[[], None] | None = None, *,
                 busy_poll_us: float = 2000.0, poll_interval_us: float = 80.0) -> None:
        """``busy_poll_us``: how long to keep polling after the last completion before the
        waiter threads take over (0: never poll); ``poll_interval_us``: while more than one item
        is in flight, the least time between two polls (0: at every turn of the loop). Both are
        :class:`~derecho_async.config.Config` keys (``gpu_busy_poll_us``,
        ``gpu_poll_interval_us``)."""
        self._rt = rt
        self.device = device
        self._finished = finished  # called after a poll that finished work (see poll)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self._busy: dict[Lane, None] = {}  # lanes with work in flight (insertion order)
        self._spare_events: list[int] = []
        self._poll_handle: asyncio.Handle | None = None
        self._busy_since = 0.0
        self._busy_poll_s = busy_poll_us / 1e6
        # never longer than the busy poll itself (past that, waiter threads take over)
        self._poll_interval_s = min(poll_interval_us / 1e6, self._busy_poll_s)
        self._last_poll = 0.0  # when a stream of transfers was last looked at
        self._inflight = 0  # items tracked and not yet finished or forgotten, on every lane
        # Events a waiter thread sleeps on -> whether their item already finished here: one is
        # reused only once its waiter is done with it (a re-record under a sleeping wait would
        # move what that wait waits for).
        self._held: dict[int, bool] = {}

    def track(self, lane: Lane, done: Callable[[], None],
              regions: list[tuple[int, int]] | None = None) -> None:
        """Call ``done`` on the loop once everything now queued on ``lane.stream`` finished."""
        # blocking-sync, so that a waiter thread can sleep on it (see _arm)
        ev = self._spare_events.pop() if self._spare_events else int(
            self._rt.eventCreateWithFlags(_WAKE_EVENT_FLAGS)
        )
        self._rt.eventRecord(ev, lane.stream.ptr)
        if not self._busy:
            self._busy_since = time.monotonic()
        lane.inflight.append((ev, done, regions if regions is not None else []))
        self._inflight += 1
        self._busy[lane] = None
        self._arm()

    def busy(self) -> bool:
        """Whether any lane has work in flight."""
        return bool(self._busy)

    def poll(self) -> None:
        """Finish every tracked item that has completed; then, if any did, call ``finished``
        (once per poll, not per item)."""
        query = self._rt.eventQuery
        spare = self._spare_events
        finished = False
        for lane in list(self._busy):
            q = lane.inflight
            while q:
                ev, done, _ = q[0]
                if query(ev) != 0:  # cudaErrorNotReady
                    break
                q.popleft()
                if ev in self._held:
                    self._held[ev] = True
                else:
                    spare.append(ev)
                self._inflight -= 1
                finished = True
                try:
                    done()
                except Exception:  # one item's failure must not stall the others
                    log.exception("finishing completed GPU work failed")
            if not q:
                self._busy.pop(lane, None)
        if finished:
            self._busy_since = time.monotonic()
        if self._busy:
            self._arm()
        if finished and self._finished is not None:
            try:
                self._finished()
            except Exception:
                log.exception("after finishing completed GPU work")

    def forget(self, lane: Lane) -> tuple[list[tuple[int, int]], list[int]]:
        """Stop tracking ``lane``: its items will never be finished. Returns the regions they
        were writing and their events (give those back with :meth:`recycle` once the lane's
        stream has drained: see :meth:`after_stream`)."""
        self._busy.pop(lane, None)
        regions = [r for _, _, rs in lane.inflight for r in rs]
        events = [ev for ev, _, _ in lane.inflight]
        self._inflight -= len(lane.inflight)
        lane.inflight.clear()
        return regions, events

    def recycle(self, events: list[int]) -> None:
        """Reuse events of a drained stream (from :meth:`forget`)."""
        for ev in events:
            if ev in self._held:
                self._held[ev] = True
            else:
                self._spare_events.append(ev)

    def _waiter(self, lane: Lane) -> _Waiter:
        if lane.waiter is None:
            lane.waiter = _Waiter(self._rt, self.device, self.loop or asyncio.get_running_loop())
        return lane.waiter

    def after_stream(self, fn: Callable[[], None], lane: Lane) -> None:
        """Run ``fn`` on the loop once everything now queued on ``lane``'s stream has finished
        (by the lane's waiter thread; never, if the stream stalled for good)."""
        waiter = self._waiter(lane)
        ev = int(self._rt.eventCreateWithFlags(_WAKE_EVENT_FLAGS))
        self._rt.eventRecord(ev, lane.stream.ptr)
        waiter.wait(ev, fn)

    def _arm(self) -> None:
        if self._poll_handle is not None or self.closed:
            return
        loop = self.loop or asyncio.get_running_loop()
        self.loop = loop
        if time.monotonic() - self._busy_since < self._busy_poll_s:
            self._poll_handle = loop.call_soon(self._on_poll)
            return
        # Long work: stop spinning; let each busy stream's waiter wake us once its oldest item
        # is done (its own event: not one recorded at the stream's tail, which would hold back
        # every finished item until the last one queued is done too). Back on the loop, poll
        # finishes what is done and spins again for a while.
        for lane in self._busy:
            if not lane.wakeup_armed and lane.inflight:
                lane.wakeup_armed = True
                ev = lane.inflight[0][0]
                self._held[ev] = False

                def woken(lane: Lane = lane, ev: int = ev) -> None:
                    lane.wakeup_armed = False
                    if self._held.pop(ev):  # finished meanwhile: free to reuse
                        self._spare_events.append(ev)
                    self._busy_since = time.monotonic()
                    self.poll()

                self._waiter(lane).wait(ev, woken, destroy=False)

    def _on_poll(self) -> None:
        self._poll_handle = None
        if self._inflight > 1 and self._poll_interval_s:
            # A stream of transfers: look at most once per interval (each look costs the loop
            # about a microsecond, and it runs at every turn). A lone transfer, the latency
            # case, is looked at on every turn.
            now = time.monotonic()
            if now - self._last_poll < self._poll_interval_s:
                self._arm()
                return
            self._last_poll = now
        self.poll()

    def close(self) -> None:
        """Stop polling; forget everything in flight."""
        self.closed = True
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        self._busy.clear()
        self._inflight = 0


# -- the plane (needs CuPy and a device) -------------------------------------------------------
@dataclass(slots=True)
class _Segment:
    ptr: int
    size: int
    handle: bytes
    alloc: RangeAllocator


@dataclass(slots=True, eq=False)
class _Peer(Lane):
    """A sending peer: its announced pool, what of it is mapped here, and (as a :class:`Lane`)
    the stream its copies run on."""

    announced: PoolAnnouncement | None = None
    mapped: dict[int, int] = field(default_factory=dict)  # segment index -> local pointer
    events: dict[int, int] = field(default_factory=dict)  # event index -> local event
    fenced: tuple[int, int] = (0, 0)  # (reclaimed, released) counts at this stream's last fence
    # copies issued since the last flush, not yet tracked: (key, call, placed), and their bytes
    batch: list[tuple[tuple[int, int, int], bytes, list[tuple[ArraySpec, int, int]]]] = field(
        default_factory=list)
    batch_bytes: int = 0


@dataclass(slots=True)
class _Outgoing:
    regions: list[tuple[int, int]]
    event: int
    keep: tuple[object, ...]


class IpcPlane:
    """Moves device arrays between members of one host through pooled CUDA IPC buffers.

    A :class:`~derecho_async.runtime.plane.Plane` for the driver: it takes payloads with
    device arrays bound for peers that announced a pool. ``send(dst, frame)`` puts its frames
    on the reliable channel (the descriptors made in one turn of the loop go together);
    ``landed(key, payload)`` reports a message whose bytes are all here, ``failed(key, exc)`` one
    whose bytes came but whose arrays could not be made (it will never land), and
    ``landed_batch()`` follows each look at the copies that landed any (the driver takes its
    step then, so the frontier goes out at once). ``busy_poll_us`` and ``poll_interval_us``
    (``Config.gpu_busy_poll_us``, ``Config.gpu_poll_interval_us``) go to its
    :class:`Completions`. See the module docstring.
    """

    kinds: tuple[int, ...] = (env.GPU_POOL, env.GPU_DATA, env.GPU_BATCH)

    def __init__(self, member_id: int, segment_bytes: int,
                 send: Callable[[int, bytes], None],
                 landed: Callable[[tuple[int, int, int], object], None], *,
                 failed: Callable[[tuple[int, int, int], BaseException], None] | None = None,
                 landed_batch: Callable[[], None] | None = None,
                 busy_poll_us: float = 2000.0, poll_interval_us: float = 80.0,
                 ) -> None:
        import cupy

        self._cp = cupy
        self._rt = cupy.cuda.runtime
        # what _array_over makes per received array, looked up once
        self._unowned = cupy.cuda.UnownedMemory
        self._memptr = cupy.cuda.MemoryPointer
        self._ndarray = cupy.ndarray
        self.member_id = member_id
        self.device = int(cupy.cuda.Device().id)
        self.bus_id = str(self._rt.deviceGetPCIBusId(self.device))
        self._segment_bytes = max(ALIGN, -(-segment_bytes // ALIGN) * ALIGN)
        self._send = send
        # descriptors made since the loop's last turn, by their targets: sent together
        self._desc_out: dict[tuple[int, ...], list[tuple[tuple[int, int, int], bytes]]] = {}
        self._landed = landed
        self._failed = failed
        self._stream = cupy.cuda.Stream(non_blocking=False)
        self._segments: list[_Segment] = []
        self._alloc_hint = 0  # the segment _alloc tries first
        self._events: list[int] = []
        self._event_handles: list[bytes] = []
        self._free_events: list[int] = []
        self._generation = 0
        self._announced_to: dict[int, int] = {}
        self._peers: dict[int, _Peer] = {}
        self._view_members: tuple[int, ...] = ()
        self._outgoing: dict[tuple[int, int, int], _Outgoing] = {}
        self._reclaim: collections.deque[tuple[int, int]] = collections.deque()
        self._unflushed: dict[_Peer, None] = {}  # peers with copies not yet tracked (_flush)
        self._closed = False
        # copies in flight, per peer; landed_batch follows each poll that landed messages
        self._done = Completions(self._rt, self.device, landed_batch,
                                 busy_poll_us=busy_poll_us, poll_interval_us=poll_interval_us)
        self._reclaimed = 0  # regions that arrays gave back (their last use: the app's stream)
        self._released = 0  # staging regions freed by a view change (last use: the send stream)
        self._fence_event = int(self._rt.eventCreateWithFlags(0x2))  # cudaEventDisableTiming
        self._grow_events()

    # -- pool ------------------------------------------------------------------------------
    def _grow_segments(self, at_least: int) -> int:
        size = max(self._segment_bytes, -(-at_least // ALIGN) * ALIGN)
        ptr = int(self._rt.malloc(size))
        handle = bytes(self._rt.ipcGetMemHandle(ptr))
        self._segments.append(_Segment(ptr, size, handle, RangeAllocator(size)))
        self._generation += 1
        log.info("member %d: device pool segment %d of %d MiB on GPU %s",
                 self.member_id, len(self._segments) - 1, size >> 20, self.bus_id)
        return len(self._segments) - 1

    def _grow_events(self) -> None:
        for _ in range(_EVENT_BATCH):
            ev = int(self._rt.eventCreateWithFlags(_EVENT_FLAGS))
            self._free_events.append(len(self._events))
            self._events.append(ev)
            self._event_handles.append(bytes(self._rt.ipcGetEventHandle(ev)))
        self._generation += 1

    def _alloc(self, nbytes: int) -> tuple[int, int]:
        if self._reclaim:
            self.reclaim()
        # The segment that served the last request first: in a stream of large messages the
        # earlier segments are full, and trying each of them first cost a call apiece.
        segments = self._segments
        hint = self._alloc_hint
        if hint < len(segments):
            off = segments[hint].alloc.alloc(nbytes)
            if off is not None:
                return hint, off
        for i, seg in enumerate(segments):
            if i != hint:
                off = seg.alloc.alloc(nbytes)
                if off is not None:
                    self._alloc_hint = i
                    return i, off
        i = self._grow_segments(nbytes)
        off = self._segments[i].alloc.alloc(nbytes)
        assert off is not None
        self._alloc_hint = i
        self._announce_all()
        return i, off

    def _queue_reclaim(self, seg: int, off: int) -> None:
        # May run in any thread (CUDA callbacks too) and inside a garbage collection that
        # reclaim() itself set off: only queue it (deque.append is atomic; no lock to re-enter).
        self._reclaim.append((seg, off))

    def reclaim(self) -> None:
        """Return the regions of garbage-collected arrays to the pool (on the loop)."""
        q = self._reclaim
        while q:  # only this loop takes from the queue (finalizers append): popleft cannot fail
            seg, off = q.popleft()
            self._segments[seg].alloc.free(off)
            self._reclaimed += 1

    def _free_regions(self, regions: list[tuple[int, int]]) -> None:
        for seg, off in regions:
            self._segments[seg].alloc.free(off)

    def stats(self) -> dict[str, int]:
        """Pool figures: segments, bytes held, bytes and regions in use, messages in flight."""
        self.reclaim()
        return {
            "segments": len(self._segments),
            "pool_bytes": sum(s.size for s in self._segments),
            "in_use_bytes": sum(s.alloc.in_use for s in self._segments),
            "regions": sum(s.alloc.allocations for s in self._segments),
            "sending": len(self._outgoing),
            "events_free": len(self._free_events),
            "events": len(self._events),
        }

    def _array_over(self, seg: int, off: int, shape: tuple[int, ...], dtype: str,
                    nbytes: int = -1) -> Any:
        """An owned CuPy array over pool region (seg, off) of ``nbytes`` (by default, what
        ``shape`` and ``dtype`` need); freed back when collected."""
        owner = _RegionOwner(self._queue_reclaim, seg, off)  # first: from here it goes back
        if nbytes < 0:
            nbytes = _itemsize(dtype) * math.prod(shape)
        mem = self._unowned(self._segments[seg].ptr + off, max(1, nbytes), owner, self.device)
        return self._ndarray(shape, dtype, self._memptr(mem, 0))

    def device_buffer(self, shape: tuple[int, ...] | int, dtype: str = "float32") -> Any:
        """A CuPy array allocated in this member's pool: sent from here without a copy."""
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        if str(self._cp.dtype(dtype)) not in DTYPES:
            raise TypeError(f"dtype {dtype!r} cannot travel")
        seg, off = self._alloc(max(1, _itemsize(str(self._cp.dtype(dtype))) * math.prod(shp)))
        return self._array_over(seg, off, shp, str(self._cp.dtype(dtype)))

    def _locate(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        for i, s in enumerate(self._segments):
            if s.ptr <= ptr and ptr + nbytes <= s.ptr + s.size:
                return i, ptr - s.ptr
        return None

    # -- views -----------------------------------------------------------------------------
    def on_view(self, view_id: int, members: tuple[int, ...]) -> None:
        """A view was installed: announce the pool to its members, forget departed peers, and
        reclaim what older views' sends held."""
        self._done.loop = asyncio.get_running_loop()
        self._view_members = members
        old = [k for k in self._outgoing if k[0] < view_id]
        for key in old:
            self.release(key)
        if old:
            self._released += 1  # receivers' copies out of these may still be queued
        for m in [m for m in self._announced_to if m not in members]:
            del self._announced_to[m]  # one that comes back gets the announcement again
        for m in [p for p in self._peers if p not in members]:
            self._drop_peer(m)
        self._announce_all()

    def _drop_peer(self, member: int) -> None:
        """Forget a departed peer: once its stream has drained, free the regions its copies
        were writing and close its handles (never, if the stream stalled on its dead event)."""
        peer = self._peers.pop(member)
        self._flush_peer(peer)  # copies not yet tracked: forgotten with the rest
        regions, events = self._done.forget(peer)

        def drained() -> None:
            self._free_regions(regions)
            self._done.recycle(events)
            self._close_peers([peer])

        if peer.stream is None:
            drained()
        else:
            self._done.after_stream(drained, peer)
        if peer.waiter is not None:
            peer.waiter.stop()  # after the drain above (a stalled stream keeps it waiting)

    def _announce_all(self) -> None:
        if not self._view_members:
            return
        body = PoolAnnouncement(
            self.bus_id,
            tuple((s.size, s.handle) for s in self._segments),
            tuple(self._event_handles),
        ).encode()
        for m in self._view_members:
            if m != self.member_id and self._announced_to.get(m) != self._generation:
                self._announced_to[m] = self._generation
                self._send(m, env.encode(env.GPU_POOL, body))

    def on_announcement(self, sender: int, raw: bytes) -> None:
        """A peer's POOL announcement arrived."""
        ann = PoolAnnouncement.decode(raw)
        peer = self._peers.setdefault(sender, _Peer())
        old = peer.announced
        if old is not None and (len(ann.segments) < len(old.segments)
                                or ann.segments[: len(old.segments)] != old.segments
                                or ann.events[: len(old.events)] != old.events):
            raise ProtocolViolation(f"member {sender} rewrote its announced pool")
        peer.announced = ann

    def peer_ready(self, member: int) -> bool:
        """Whether ``member`` announced a pool (so device arrays can go to it by IPC)."""
        p = self._peers.get(member)
        return p is not None and p.announced is not None

    def _close_peers(self, peers: list[_Peer]) -> None:
        for p in peers:
            for ptr in p.mapped.values():
                try:
                    self._rt.ipcCloseMemHandle(ptr)
                except Exception as exc:  # the exporter is gone: nothing to give back
                    log.debug("closing a peer segment: %r", exc)
            for ev in p.events.values():
                try:
                    self._rt.eventDestroy(ev)
                except Exception as exc:
                    log.debug("destroying a peer event: %r", exc)

    # -- the Plane protocol ----------------------------------------------------------------
    def start(self, key: tuple[int, int, int], payload: object,
              targets: tuple[int, ...]) -> bool:
        """Take ``payload`` if it holds device arrays and every target announced a pool."""
        if type(payload) is not OutOfBand:
            return False
        peers = self._peers
        for m in targets:
            p = peers.get(m)
            if p is None or p.announced is None:  # peer_ready, inline: once per target
                return False
        infos = payload.infos()
        for info in infos:
            if info.is_gpu:
                self.send(key, payload, targets, infos)
                return True
        return False

    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        """One of this plane's frames arrived from ``sender``."""
        if msg[0] == env.GPU_POOL:
            self.on_announcement(sender, msg[1])
            return
        if msg[0] == env.GPU_BATCH:
            _, view_id, src, items = msg
            if src != sender:
                raise ProtocolViolation(f"device data for sender {src} relayed by {sender}")
            if len(items) % 2 or len(items) > 2 * _MAX_BATCH:
                raise ProtocolViolation(f"device descriptor batch of {len(items)} fields")
            for i in range(0, len(items), 2):
                msg_no, body = items[i], items[i + 1]
                if type(msg_no) is not int or not 0 <= msg_no < 1 << 63 or type(body) is not bytes:
                    raise ProtocolViolation("device descriptor batch entry is not [msg_no, bytes]")
                self.receive_descriptor(sender, (view_id, src, msg_no), body)
            return
        _, view_id, src, msg_no, body = msg
        if src != sender:
            raise ProtocolViolation(f"device data for sender {src} relayed by {sender}")
        self.receive_descriptor(sender, (view_id, src, msg_no), body)

    def on_own_delivered(self, key: tuple[int, int, int]) -> None:
        self.release(key)

    def on_event(self, event: object) -> None:
        if isinstance(event, ViewInstalled):
            self.on_view(event.view.view_id, event.view.members)

    # -- sending ---------------------------------------------------------------------------
    def send(self, key: tuple[int, int, int], payload: OutOfBand, targets: tuple[int, ...],
             infos: tuple[ArrayInfo, ...]) -> None:
        """Stage ``payload``'s device arrays (described by ``infos``) in the pool and send
        descriptors to ``targets``."""
        if self._reclaim:
            self.reclaim()
        # One pass over the arrays: host arrays go inline, device arrays in the pool go in
        # place, the others are staged below. ``infos`` already holds dtype, shape and size.
        specs: list[ArraySpec] = []
        keep: list[object] = []  # the device arrays, held until the message is delivered here
        staged: list[tuple[int, Any, str, ArrayInfo]] = []  # (spec index, array, lib, info)
        for a, info in zip(payload.arrays, infos, strict=True):
            if not info.is_gpu:
                specs.append(_inline_spec(a, info))
                continue
            # CuPy as is; torch and others through __cuda_array_interface__ (no copy)
            arr: Any = a if type(a) is self._ndarray else self._cp.asarray(a)
            if not arr.flags.c_contiguous:
                arr = self._cp.ascontiguousarray(arr)  # queued on the current stream
            keep.append(arr)
            lib = "torch" if info.lib == "torch" else "cupy"
            nbytes = info.nbytes
            place = self._locate(arr.data.ptr, nbytes) if nbytes else None
            if place is None:
                staged.append((len(specs), arr, lib, info))
                specs.append(_NO_SPEC)
            else:
                specs.append(_new_spec(ArraySpec, (lib, info.dtype, info.shape, nbytes, place[0],
                                                   place[1], None)))
        regions: list[tuple[int, int]] = []
        ev = -1
        rt = self._rt
        current = self._cp.cuda.get_current_stream()
        if staged or rt.streamQuery(current.ptr) != 0:
            # Staging copies, or the application's stream may still be writing an array sent in
            # place: order the copies after it and let receivers wait on an event. (Otherwise
            # the arrays are final already, and receivers copy at once: no work of this
            # process's GPU context stands between the receivers' copies.)
            stream = self._stream
            if current.ptr != 0 and current.ptr != stream.ptr:
                stream.wait_event(current.record())
            for i, arr, lib, info in staged:
                nbytes = info.nbytes
                seg, off = self._alloc(nbytes)
                regions.append((seg, off))
                if nbytes:
                    rt.memcpyAsync(self._segments[seg].ptr + off, arr.data.ptr, nbytes,
                                   _CUDA_MEMCPY_DEFAULT, stream.ptr)
                specs[i] = _new_spec(ArraySpec, (lib, info.dtype, info.shape, nbytes, seg, off,
                                                 None))
            if not self._free_events:
                self._grow_events()
                self._announce_all()
            ev = self._free_events.pop()
            rt.eventRecord(self._events[ev], stream.ptr)
        self._outgoing[key] = _Outgoing(regions, ev, tuple(keep))
        body = Descriptor(payload.call, ev, tuple(specs)).encode()
        out = self._desc_out
        if not out:  # the first of this turn: send them all once the step that makes them ends
            (self._done.loop or asyncio.get_running_loop()).call_soon(self._send_queued)
        pending = out.get(targets)
        if pending is None:
            out[targets] = [(key, body)]
        else:
            pending.append((key, body))

    def _send_queued(self) -> None:
        """Send the descriptors made since the last turn: one frame per target list."""
        out, self._desc_out = self._desc_out, {}
        if self._closed:
            return
        for targets, items in out.items():
            try:
                for frame in self._frames(items):
                    for dst in targets:
                        self._send(dst, frame)
            except Exception:  # a closing transport: the others still go out
                log.exception("sending %d device descriptors to %s failed", len(items), targets)

    @staticmethod
    def _frames(items: list[tuple[tuple[int, int, int], bytes]]) -> list[bytes]:
        """GPU_DATA for one descriptor; GPU_BATCH for several of one view (a view change inside
        a turn splits them)."""
        if len(items) == 1:
            (key, body), = items
            return [env.encode(env.GPU_DATA, *key, body)]
        frames: list[bytes] = []
        start = 0
        for i in range(1, len(items) + 1):
            if i == len(items) or items[i][0][0] != items[start][0][0]:
                view_id, sender, _ = items[start][0]
                flat: list[object] = []
                for key, body in items[start:i]:
                    flat += (key[2], body)
                frames.append(env.encode(env.GPU_BATCH, view_id, sender, flat))
                start = i
        return frames

    def release(self, key: tuple[int, int, int]) -> None:
        """The message ``key`` was delivered here (or its view ended): free what it held."""
        out = self._outgoing.pop(key, None)
        if out is None:
            return
        for seg, off in out.regions:
            self._segments[seg].alloc.free(off)
        if out.event >= 0:
            self._free_events.append(out.event)

    # -- receiving -------------------------------------------------------------------------
    def receive_descriptor(self, sender: int, key: tuple[int, int, int], raw: bytes) -> None:
        """A descriptor arrived: copy its arrays into this member's pool, then land them."""
        peer = self._peers.get(sender)
        desc = Descriptor.decode(raw, peer.announced if peer is not None else None)
        if self._reclaim:
            self.reclaim()
        stream = 0  # the pointer of the peer's stream, once the first device array is met
        copied = 0  # bytes of the copies issued for this message
        placed: list[tuple[ArraySpec, int, int]] = []  # (spec, seg, off); seg -1: inline
        try:
            for spec in desc.arrays:
                segment = spec.segment
                if segment < 0:
                    placed.append((spec, -1, 0))
                    continue
                assert peer is not None and peer.announced is not None  # decode checked it
                if not stream:
                    stream = self._stream_for(peer).ptr
                    if desc.event >= 0:  # -1: the sender's arrays were final when it sent
                        ev = peer.events.get(desc.event)
                        if ev is None:
                            ev = self._open_peer(sender, self._rt.ipcOpenEventHandle,
                                                 peer.announced.events[desc.event])
                            peer.events[desc.event] = ev
                        self._rt.streamWaitEvent(stream, ev, 0)
                base = peer.mapped.get(segment)
                if base is None:
                    base = self._map_segment(sender, peer, segment)
                nbytes = spec.nbytes
                seg, off = self._alloc(nbytes)
                placed.append((spec, seg, off))
                if nbytes:
                    self._rt.memcpyAsync(self._segments[seg].ptr + off, base + spec.offset,
                                         nbytes, _CUDA_MEMCPY_DEFAULT, stream)
                    copied += nbytes
        except Exception:
            # A handle that cannot be opened is the sender's fault (_open_peer says so, unless
            # the failure is this process's own); an allocation or a copy that fails is this
            # member's, and the driver makes it leave.
            regions = [(seg, off) for _, seg, off in placed if seg >= 0]
            if regions:  # copies into them may be queued: free them once the stream is past
                assert peer is not None
                try:
                    self._done.after_stream(lambda: self._free_regions(regions), peer)
                except Exception:
                    # The device fails this too: the regions stay taken (a queued copy may
                    # still write them), and the error raised is the first one, which the
                    # member leaves for.
                    log.exception("member %d: the regions of %s stay taken", self.member_id,
                                  key)
            raise
        if not stream:  # no device arrays: nothing to wait for
            self._finish(key, desc.call, placed)
            return
        assert peer is not None
        # Tracked in batches: one event per peer for the copies issued until the loop's next
        # turn (descriptors arrive in bursts; for small copies an event record and query cost
        # about as much as the copy's own call). Copies of _BATCH_BYTES or more close the batch
        # at once: a message held back until a later large copy finished would land late.
        batch = peer.batch
        batch.append((key, desc.call, placed))
        peer.batch_bytes += copied
        if peer.batch_bytes >= _BATCH_BYTES:
            self._flush_peer(peer)
        elif len(batch) == 1:  # the first of this peer's batch: flush it at the next turn
            if not self._unflushed:
                (self._done.loop or asyncio.get_running_loop()).call_soon(self._flush)
            self._unflushed[peer] = None

    def _map_segment(self, sender: int, peer: _Peer, index: int) -> int:
        """Map ``sender``'s announced segment ``index`` here, once. The announced size is
        checked against the allocation the handle opens (the driver knows its extent): every
        copy is bounded by the announced size, so a larger claim would let a sender make its
        receivers read past its memory."""
        assert peer.announced is not None
        size, handle = peer.announced.segments[index]
        base = self._open_peer(sender, self._rt.ipcOpenMemHandle, handle, _IPC_LAZY_PEER_ACCESS)
        end = _allocation_end(base)
        if end is not None and end - base < size:
            try:
                self._rt.ipcCloseMemHandle(base)
            except Exception as exc:
                log.debug("closing a refused peer segment: %r", exc)
            raise ProtocolViolation(
                f"member {sender} announced a segment of {size} bytes; its memory holds "
                f"{end - base}")
        peer.mapped[index] = base
        return base

    @staticmethod
    def _open_peer(sender: int, opener: Callable[..., Any], *args: object) -> int:
        """Open one of ``sender``'s announced IPC handles here. A handle that does not open is
        the sender's fault, a ProtocolViolation (the exporter is gone, is not on this host, or
        sent a bad handle: its messages cannot land here); a failure that says this process or
        its device cannot take on more (:data:`_LOCAL_CUDA_ERRORS`, MemoryError) is raised as
        is: the fault is this member's, and it leaves rather than have the sender removed."""
        try:
            return int(opener(*args))
        except Exception as exc:
            if isinstance(exc, MemoryError) or getattr(exc, "status", None) in _LOCAL_CUDA_ERRORS:
                raise
            raise ProtocolViolation(
                f"cannot map member {sender}'s device memory: {exc!r}") from exc

    def _flush(self) -> None:
        """Track the copies issued since the last flush: one completion per peer."""
        peers, self._unflushed = self._unflushed, {}
        for peer in peers:
            self._flush_peer(peer)

    def _flush_peer(self, peer: _Peer) -> None:
        items, peer.batch = peer.batch, []
        peer.batch_bytes = 0
        if items and not self._closed:
            regions = [(seg, off) for _, _, placed in items for _, seg, off in placed if seg >= 0]
            self._done.track(peer, functools.partial(self._finish_batch, items), regions)

    def _finish_batch(
        self, items: list[tuple[tuple[int, int, int], bytes, list[tuple[ArraySpec, int, int]]]]
    ) -> None:
        for key, call, placed in items:
            try:
                self._finish(key, call, placed)
            except Exception as exc:  # the others of the batch still land
                log.exception("landing device message %s failed", key)
                if self._failed is not None:
                    self._failed(key, exc)

    def _stream_for(self, peer: _Peer) -> Any:
        """The stream of ``peer``'s copies, fenced after the last use of reclaimed memory."""
        stream = peer.stream
        if stream is None:
            stream = peer.stream = self._cp.cuda.Stream(non_blocking=True)
        if peer.fenced != (self._reclaimed, self._released):
            rt = self._rt
            if peer.fenced[0] != self._reclaimed:
                rt.eventRecord(self._fence_event, self._cp.cuda.get_current_stream().ptr)
                rt.streamWaitEvent(stream.ptr, self._fence_event, 0)
            if peer.fenced[1] != self._released:
                rt.eventRecord(self._fence_event, self._stream.ptr)
                rt.streamWaitEvent(stream.ptr, self._fence_event, 0)
            peer.fenced = (self._reclaimed, self._released)
        return stream

    def poll(self) -> None:
        """Finish every tracked copy that has completed (called from the event loop)."""
        self._done.poll()

    def _finish(self, key: tuple[int, int, int], call: bytes,
                placed: list[tuple[ArraySpec, int, int]]) -> None:
        arrays: list[object] = []
        for i, (spec, seg, off) in enumerate(placed):
            try:
                if seg < 0:
                    arrays.append(inline_array(spec))
                    continue
                arrays.append(as_lib(self._array_over(seg, off, spec.shape, spec.dtype,
                                                      spec.nbytes), spec.lib))
            except BaseException:
                # The arrays made so far, and this one's region once its owner exists (the
                # first thing _array_over makes), go back when collected; the regions of the
                # arrays not yet reached are freed here. The caller reports the failure.
                self._free_regions([(sg, of) for _, sg, of in placed[i + 1:] if sg >= 0])
                raise
        if not self._closed:
            self._landed(key, OutOfBand(call, tuple(arrays)))

    def close(self) -> None:
        """Stop landing messages; pool memory is released when the process ends."""
        self._closed = True
        self._done.close()
        try:
            self._stream.synchronize()
        except Exception as exc:
            log.debug("synchronizing the plane's stream at close: %r", exc)
        # a peer's stream may have stalled on a dead member's event: close only idle ones
        idle = [p for p in self._peers.values()
                if p.stream is None or self._rt.streamQuery(p.stream.ptr) == 0]
        for p in self._peers.values():
            if p.waiter is not None:
                p.waiter.stop()
        self._peers.clear()
        self._close_peers(idle)


@functools.cache
def _address_range() -> Any:
    """The driver's ``cuMemGetAddressRange_v2`` (through ctypes: CuPy does not wrap it), or None
    where the driver library cannot be loaded (then announced sizes go unchecked, said once)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError) as exc:
        log.warning("cannot check peers' announced segment sizes (no cuMemGetAddressRange): %r",
                    exc)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                   ctypes.c_uint64]
    return fn


def _allocation_end(ptr: int) -> int | None:
    """The end address of the device allocation that holds ``ptr``, or None if unknown."""
    fn = _address_range()
    if fn is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return int(base.value) + int(size.value)


class _Waiter:
    """A daemon thread that waits for one sender's stream events, then calls back on the loop.

    It sleeps in ``cudaEventSynchronize`` (CuPy releases the GIL there) on blocking-sync events,
    so it costs no CPU while it waits. A stream stalled on a dead sender's event keeps it waiting
    for good: one parked thread per such sender, never a stalled loop.
    """

    def __init__(self, rt: Any, device: int, loop: asyncio.AbstractEventLoop) -> None:
        self._rt = rt
        self._device = device
        self._loop = loop
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], None], bool] | None] = (
            queue.SimpleQueue())
        threading.Thread(target=self._run, name="derecho-gpu-waiter", daemon=True).start()

    def wait(self, event: int, fn: Callable[[], None], *, destroy: bool = True) -> None:
        """Call ``fn`` on the loop once ``event`` completes; then destroy the event unless
        ``destroy`` is false (it stays its owner's, who must not re-record it until ``fn``
        ran)."""
        self._queue.put((event, fn, destroy))

    def stop(self) -> None:
        """End the thread after the waits already queued."""
        self._queue.put(None)

    def _run(self) -> None:
        import cupy

        cupy.cuda.Device(self._device).use()
        while (item := self._queue.get()) is not None:
            event, fn, destroy = item
            try:
                self._rt.eventSynchronize(event)
                if destroy:
                    self._rt.eventDestroy(event)
            except Exception as exc:  # a broken context: wake the loop anyway
                log.debug("waiting on a copy's event: %r", exc)
            try:
                self._loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop is closed: nobody to tell
                return


class _RegionOwner:
    """The object whose collection returns a pool region (see ``IpcPlane._array_over``): the
    CuPy memory over the region holds it, and its ``__del__`` queues the region for reclaiming
    (measured: 1.8 µs per array against 6.4 µs with ``weakref.finalize``)."""

    __slots__ = ("_give_back", "_off", "_seg")

    def __init__(self, give_back: Callable[[int, int], None], seg: int, off: int) -> None:
        self._give_back = give_back
        self._seg = seg
        self._off = off

    def __del__(self) -> None:
        self._give_back(self._seg, self._off)

