"""Fenced, streamed state transfer to a joiner.

Theory of operation. A member that welcomes a joiner (the leader installing the view that admits
it, or any member repeating a Welcome the joiner never answered) does not put its state into the
Welcome: the driver asks :meth:`StateTransfer.ticket` for a small *ticket* (``[1, xfer_id]``) and
sends that instead. Then, at the *sponsor*:

1. **Fence.** A hold (:meth:`SerialRunner.submit_hold`) goes into every actor's runner. At that
   moment every call delivered before the new view was handed to the runners, and nothing of the
   new view is: a hold is reached exactly when the calls before the cut finished. When every hold
   is reached each ``actor.snapshot()`` runs, the ``{actor: value}`` map is encoded with its
   large byte strings and arrays out of band (:func:`wire.encode` with ``buffers``), the buffers
   that someone could still change (numpy arrays, views of writable memory) are copied in the
   executor (a device array on the device where a GPU plane runs, else to host memory), and
   only then are the holds released. Immutable ``bytes`` are not copied.
   A hold not reached within ``fence_timeout_s``, a ``snapshot()`` raising or a state that
   cannot be encoded aborts the transfer: the joiner is told why and its join fails; the
   sponsor logs an ERROR and stays.
2. **Stream.** The *stream* is the msgpack skeleton followed by every buffer's bytes. A
   STATE_BEGIN manifest on the channel gives each part's kind, dtype, shape and size and the
   chunk size (``state_chunk_kb``); host parts share chunks, a device part has chunks of its
   own. Once the joiner answers STATE_READY the chunks move on the data planes
   (:meth:`Driver.start_transfer`: CUDA IPC for a device chunk, shm pool, tcp chain, host
   staging) as ``OutOfBand([xfer_id, index, digest, how], (uint8 chunk,))``, the digest a
   sha256 of a host chunk or, for a device chunk, a checksum computed on the GPU at both ends
   (:func:`_checksum`: no copy to the host), under keys whose msg_no carries
   :data:`STATE_TAG`, which no core message number reaches; the driver routes their landings
   here. At most :data:`WINDOW` chunks are unacknowledged; the joiner acks each (STATE_ACK) once
   it verified its digest and stored it, and the sponsor then frees the chunk's plane buffers
   (``on_own_delivered``). Chunk building and hashing run in the executor (hashlib releases the
   GIL). A view change that both survive re-sends the unacknowledged chunks under the new view
   id (the planes forget keys of older views); the joiner ignores duplicates.

At the *joiner*: state messages that arrive before the view carrying its ticket is installed
are kept (a few, bounded). On that view a hold goes into every runner at once, so the calls of
the new view wait for the restore. The joiner allocates only for a manifest of the sponsor and
transfer id its ticket named, within :data:`MAX_STATE_BYTES` (a device part in device memory
where a GPU plane runs here); checks every chunk's index, length and digest (off the loop) and
copies it into place; then decodes the skeleton with the rebuilt
buffers (off the loop), calls each ``actor.restore(value)`` and releases the holds.
:meth:`StateTransfer.restored` (which ``Group.start`` awaits) fails with :class:`GroupClosed`
naming the reason when the sponsor departs, aborts, a digest does not match, nothing progresses
for ``state_stall_s`` or a ``restore`` raises; the joiner then leaves, nobody else does.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import hashlib
import itertools
import logging
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack  # type: ignore[import-untyped]

from derecho_async import wire
from derecho_async.core import Evicted, Left, Partitioned, View, ViewInstalled
from derecho_async.errors import GroupClosed, ProtocolViolation
from derecho_async.runtime.dataplane import MAX_ARRAYS, OutOfBand
from derecho_async.wire import MAX_DECODE_SIZE, is_cupy_array
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.actor import Actor
    from derecho_async.runtime.driver import Driver
    from derecho_async.runtime.observer import GroupObserver
    from derecho_async.runtime.runner import SerialRunner

__all__ = [
    "MAX_STATE_BYTES",
    "STATE_TAG",
    "WINDOW",
    "StateTransfer",
    "chunk_msg_no",
    "decode_ticket",
    "encode_ticket",
    "is_state_key",
]

log = logging.getLogger("derecho_async.statexfer")

STATE_TAG = 1 << 62
"""Set in the msg_no of every state chunk's data key (core message numbers never reach it)."""
_INDEX_BITS = 32
_XFER_MASK = (1 << 30) - 1
WINDOW = 4
"""Chunks a sponsor keeps unacknowledged (built, hashed, sent), at most."""
MAX_STATE_BYTES = 1 << 46
"""The largest state a joiner accepts a manifest for (64 TiB: a sanity bound, not a budget)."""
_MAX_CHUNK = 1 << 30
_MIN_CHUNK = 4096
_MAX_EARLY = 16  # state messages kept while this member has no view yet
_TICK_S = 1.0
_LOG_EVERY_S = 2.0
_DIGEST = 32  # sha256


def chunk_msg_no(xfer_id: int, index: int) -> int:
    """The msg_no of chunk ``index`` of transfer ``xfer_id`` in its data key."""
    return STATE_TAG | (xfer_id & _XFER_MASK) << _INDEX_BITS | index


def is_state_key(key: tuple[int, int, int]) -> bool:
    """Whether a data key is a state chunk's (see :data:`STATE_TAG`)."""
    return key[2] >= STATE_TAG


def _split_msg_no(msg_no: int) -> tuple[int, int]:
    return (msg_no >> _INDEX_BITS) & _XFER_MASK, msg_no & ((1 << _INDEX_BITS) - 1)


def encode_ticket(xfer_id: int) -> bytes:
    """The small state a Welcome carries: which transfer will bring the joiner its state."""
    out = msgpack.packb([1, xfer_id], use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def decode_ticket(data: bytes) -> int:
    """The transfer id of a ticket; :class:`ProtocolViolation` if it is not one."""
    try:
        value = msgpack.unpackb(data, raw=False) if len(data) <= 64 else None
    except Exception:
        value = None
    if not (isinstance(value, list) and len(value) == 2 and value[0] == 1
            and type(value[1]) is int and 0 <= value[1] <= _XFER_MASK):
        raise ProtocolViolation("the Welcome's state is not a state-transfer ticket")
    return int(value[1])


class _Stream:
    """Where the chunks of a stream of parts (skeleton, then buffers) fall. Consecutive host
    parts share chunks; a device part (listed in ``alone``) has chunks of its own, so each of its
    chunks is one slice of one device array and can move on a GPU plane."""

    __slots__ = ("chunk", "count", "firsts", "runs", "sizes", "starts", "total")

    def __init__(self, sizes: list[int], chunk: int, alone: frozenset[int] = frozenset()) -> None:
        self.sizes = sizes
        self.chunk = chunk
        self.starts = list(itertools.accumulate([0, *sizes[:-1]]))
        self.total = sum(sizes)
        runs: list[tuple[int, int, int]] = []  # (first chunk index, stream offset, bytes)
        count = 0

        def close(lo: int, hi: int) -> None:
            nonlocal count
            if hi > lo:
                runs.append((count, lo, hi - lo))
                count += -(-(hi - lo) // chunk)

        lo = 0  # where the open run of host parts begins
        for part in sorted(alone):
            if 0 <= part < len(sizes):
                start = self.starts[part]
                close(lo, start)
                close(start, start + sizes[part])
                lo = start + sizes[part]
        close(lo, self.total)
        if not runs:  # an empty stream: one empty chunk
            runs.append((0, 0, 0))
            count = 1
        self.runs = runs
        self.firsts = [r[0] for r in runs]
        self.count = count

    def _span(self, index: int) -> tuple[int, int]:
        first, start, size = self.runs[bisect.bisect_right(self.firsts, index) - 1]
        lo = start + (index - first) * self.chunk
        return lo, min(self.chunk, start + size - lo)

    def length(self, index: int) -> int:
        return self._span(index)[1]

    def pieces(self, index: int) -> list[tuple[int, int, int, int]]:
        """(part, offset in part, offset in chunk, bytes) of chunk ``index``."""
        lo, n = self._span(index)
        hi = lo + n
        out = []
        part = max(0, bisect.bisect_right(self.starts, lo) - 1)
        pos = lo
        while pos < hi and part < len(self.sizes):
            start = self.starts[part]
            end = start + self.sizes[part]
            if end > pos:
                n = min(end, hi) - pos
                out.append((part, pos - start, pos - lo, n))
                pos += n
            part += 1
        return out


def _np() -> Any:
    import numpy

    return numpy


def _freeze(buf: object, on_device: bool) -> tuple[str, str, list[int], Any, object]:
    """(kind, dtype, shape, flat uint8 view, value for decoding) of one buffer of the encoded
    state, copied unless nobody can change it (a view of a ``bytes`` object). Runs in the
    executor. A device array is copied on the device when ``on_device`` (a GPU plane moves its
    chunks), else to host memory; host copies are little-endian."""
    np = _np()
    if is_cupy_array(buf) and on_device:
        import cupy

        c: Any = buf
        dev = cupy.array(c, order="C", copy=True)  # the actor may change ``c`` once released
        cupy.cuda.get_current_stream().synchronize()
        return ("cuda", wire.numpy_dtype_name(dev.dtype), [int(n) for n in dev.shape],
                dev.reshape(-1).view(cupy.uint8), buf)
    if is_cupy_array(buf):
        import cupy

        host = cupy.asnumpy(cupy.ascontiguousarray(buf))
        kind = "cuda"
    elif isinstance(buf, np.ndarray):
        host = buf
        kind = "numpy"
    else:
        from derecho_async.runtime.dataplane import array_info, to_host_bytes

        info = array_info(buf)
        host = np.frombuffer(to_host_bytes(buf), np.dtype(info.dtype).newbyteorder("<"))
        host = host.reshape(info.shape)
        kind = "cuda" if info.is_gpu else "numpy"
    dtype = wire.numpy_dtype_name(host.dtype)
    shape = [int(n) for n in host.shape]
    if not (kind == "numpy" and type(host.base) is bytes and host.flags.c_contiguous
            and host.dtype.itemsize == 1):
        le = host.dtype.newbyteorder("<")
        host = np.array(host, dtype=le, order="C", copy=True)
    flat = host.reshape(-1).view(np.uint8)
    value: object = host.astype(host.dtype.newbyteorder("="), copy=False)
    if kind == "cuda":
        value = buf  # the observer sees what the actor gave
    return kind, dtype, shape, flat, value


_SHA256 = 0  # how a chunk's digest was made: sha256 of host bytes
_CHECKSUM = 1  # ... or _checksum, computed where the chunk lies (a device chunk on the GPU)
_MIX = 2654435761
_MASK64 = (1 << 64) - 1
_CHECKSUM_TAG = 0x64615F7374617465  # marks the last word of a _checksum digest


@functools.cache
def _mix_kernel() -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        "uint8 x", "uint64 y, uint64 z",
        "unsigned long long v = ((unsigned long long)x + 1ULL)"
        " * ((unsigned long long)i * 2654435761ULL + 97ULL); y = v; z = v ^ (v >> 29);",
        "derecho_async_state_mix")


def _checksum(arr: Any) -> bytes:
    """A 32-byte, position-sensitive checksum of a uint8 array (numpy or CuPy), computed where
    the array lies, so a device chunk is checked without a copy to the host: the sums mod 2**64
    of y_i = (x_i + 1)(i * 2654435761 + 97) and of y_i ^ (y_i >> 29), and the length. It is
    not a cryptographic digest: it catches bytes torn, lost or misplaced by a copy."""
    n = int(arr.shape[0])
    if is_cupy_array(arr):
        y, z = _mix_kernel()(arr)
        s1, s2 = int(y.sum()), int(z.sum())
    else:
        np = _np()
        s1 = s2 = 0
        step = 1 << 20
        for lo in range(0, n, step):
            x = arr[lo:lo + step].astype(np.uint64)
            i = np.arange(lo, lo + x.shape[0], dtype=np.uint64)
            y = (x + np.uint64(1)) * (i * np.uint64(_MIX) + np.uint64(97))
            s1 = (s1 + int(y.sum(dtype=np.uint64))) & _MASK64
            s2 = (s2 + int((y ^ (y >> np.uint64(29))).sum(dtype=np.uint64))) & _MASK64
    return struct.pack("<QQQQ", s1, s2, n, _CHECKSUM_TAG)


def _build_chunk(parts: list[Any], stream: _Stream, index: int) -> tuple[Any, bytes, int]:
    """In the executor: chunk ``index`` as a flat uint8 array (a slice of a device part stays on
    the device), its digest and how the digest was made."""
    np = _np()
    pieces = stream.pieces(index)
    if len(pieces) == 1:
        part, off, _, n = pieces[0]
        arr = parts[part][off:off + n]
        if is_cupy_array(arr):
            return arr, _checksum(arr), _CHECKSUM
    else:  # host parts only (a device part has chunks of its own)
        arr = np.empty(stream.length(index), np.uint8)
        for part, off, at, n in pieces:
            arr[at:at + n] = parts[part][off:off + n]
    return arr, hashlib.sha256(memoryview(arr)).digest(), _SHA256


def _copy_into(dest: Any, off: int, src: Any, at: int, n: int) -> None:
    """``dest[off:off + n] = src[at:at + n]`` between host and device arrays, either way."""
    piece = src[at:at + n]
    if is_cupy_array(dest):
        if is_cupy_array(piece):
            dest[off:off + n] = piece
        else:
            dest[off:off + n].set(piece)
    elif is_cupy_array(piece):
        dest[off:off + n] = piece.get()
    else:
        dest[off:off + n] = piece


def _device_parts(manifest: list[list[Any]]) -> frozenset[int]:
    """The parts of a manifest that are device arrays (each has chunks of its own)."""
    return frozenset(i for i, p in enumerate(manifest) if p[0] == "cuda")


def _failure(fut: asyncio.Future[Any]) -> BaseException | None:
    """Why an executor job failed (its exception, or a cancellation), None if it succeeded."""
    return asyncio.CancelledError() if fut.cancelled() else fut.exception()


def _restore_reason(name: str, what: str, exc: BaseException) -> str:
    return f"{name}.{what} raised {type(exc).__name__}: {exc}"


@dataclass(eq=False)
class _Outgoing:
    """A transfer this member sponsors."""

    xfer_id: int
    joiner: int
    view_id: int
    runners: int
    started: float
    releases: list[Callable[[], None]] = field(default_factory=list)
    phase: str = "fence"  # fence, freeze, ready_wait, stream, done, aborted
    fence_timer: asyncio.TimerHandle | None = None
    parts: list[Any] = field(default_factory=list)
    stream: _Stream | None = None
    next_index: int = 0
    building: int = 0
    inflight: dict[int, tuple[tuple[int, int, int], OutOfBand]] = field(default_factory=dict)
    acked: int = 0
    by_gpu: set[int] = field(default_factory=set)  # chunks a GPU plane took (last sent)
    bytes_done: int = 0
    last_progress: float = 0.0
    last_log: float = 0.0


@dataclass(eq=False)
class _Incoming:
    """The transfer that brings this joiner its state."""

    xfer_id: int
    sponsor: int
    view_id: int
    started: float
    future: asyncio.Future[None]
    releases: list[Callable[[], None]] = field(default_factory=list)
    phase: str = "wait_begin"  # wait_begin, receiving, finishing, done, failed
    parts: list[tuple[str, str, list[int], Any]] = field(default_factory=list)
    stream: _Stream | None = None
    chunk_state: bytearray = field(default_factory=bytearray)
    done: int = 0
    on_device: int = 0  # chunks that landed in device memory (moved by a GPU plane)
    bytes_done: int = 0
    last_progress: float = 0.0
    last_log: float = 0.0


class StateTransfer:
    """Both ends of state transfer for one member (see the module docstring)."""

    def __init__(
        self,
        driver: Driver,
        actors: Mapping[str, Actor],
        runners: Mapping[str, SerialRunner],
        observer: GroupObserver | None = None,
    ) -> None:
        self.driver = driver
        self.me = driver.member_id
        self.actors = actors
        self.runners = runners
        self.observer = observer
        config = driver.config
        self.chunk_bytes = config.state_chunk_kb << 10
        self.stall_s = config.state_stall_s
        self.fence_s = config.fence_timeout_s
        self._ids = itertools.count(1)
        self._outgoing: dict[int, _Outgoing] = {}  # by xfer id
        self._incoming: _Incoming | None = None
        self._in_view = False
        self._view: View | None = None
        self._early: list[tuple[int, list[Any]]] = []
        self._ticker: asyncio.TimerHandle | None = None
        self._closed = False
        #: test hook: ``hook(index, chunk) -> chunk`` applied at the sponsor after hashing
        self.chunk_hook: Callable[[int, Any], Any] | None = None
        driver.statexfer = self
        for kind in (env.STATE_BEGIN, env.STATE_READY, env.STATE_ACK, env.STATE_ABORT):
            driver.receivers[kind] = self.receive

    def _now(self) -> float:
        return self._loop.time()

    @property
    def _loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    # -- the joiner's wait ---------------------------------------------------------------------
    async def restored(self) -> None:
        """Return once this member's state is restored (at once for a founding member, whose
        first view carries no ticket); :class:`GroupClosed` naming why it failed."""
        inc = self._incoming
        if inc is not None:
            await asyncio.shield(inc.future)

    # -- sponsor -------------------------------------------------------------------------------
    def ticket(self, view_id: int, joiner: int) -> bytes | None:
        """The state of a Welcome of view ``view_id`` to ``joiner``: a ticket for a transfer that
        starts now (the fence goes into every runner), or None while one to ``joiner`` runs."""
        if self._closed:
            return None
        for out in self._outgoing.values():
            if out.joiner == joiner:
                return None
        now = self._now()
        out = _Outgoing(next(self._ids) & _XFER_MASK, joiner, view_id, len(self.runners), now,
                        last_progress=now, last_log=now)
        self._outgoing[out.xfer_id] = out
        loop = self._loop
        out.fence_timer = loop.call_later(self.fence_s, self._fence_timeout, out)
        for runner in self.runners.values():
            runner.submit_hold(functools.partial(self._reached, out))
        if not self.runners:
            loop.call_soon(self._snapshot, out)
        self._tick_soon()
        log.info("member %d: state transfer %d to joiner %d (view %d): fencing %d runners",
                 self.me, out.xfer_id, joiner, view_id, len(self.runners))
        return encode_ticket(out.xfer_id)

    def _reached(self, out: _Outgoing, release: Callable[[], None]) -> None:
        if out.phase != "fence":
            release()
            return
        out.releases.append(release)
        if len(out.releases) == out.runners:
            self._loop.call_soon(self._snapshot, out)

    def _release_holds(self, holder: _Outgoing | _Incoming) -> None:
        releases, holder.releases = holder.releases, []
        for release in releases:
            release()

    def _fence_timeout(self, out: _Outgoing) -> None:
        if out.phase == "fence":
            self._abort(out, f"the calls delivered before view {out.view_id} did not finish "
                             f"within fence_timeout_s={self.fence_s:g} s at member {self.me}")

    def _snapshot(self, out: _Outgoing) -> None:
        if out.phase != "fence":
            return
        if out.fence_timer is not None:
            out.fence_timer.cancel()
        out.phase = "freeze"
        state: dict[str, object] = {}
        for name, actor in self.actors.items():
            try:
                state[name] = actor.snapshot()
            except Exception as exc:
                self._abort(out, _restore_reason(name, "snapshot", exc))
                return
        buffers: list[object] = []
        try:
            skeleton = wire.encode(state, buffers=buffers)
        except (TypeError, ValueError, OverflowError) as exc:
            self._abort(out, f"the state of member {self.me} could not be encoded: {exc}")
            return
        if len(buffers) > MAX_ARRAYS or len(skeleton) > MAX_DECODE_SIZE:
            self._abort(out, f"the state has {len(buffers)} arrays and a skeleton of "
                             f"{len(skeleton)} bytes: over the bounds ({MAX_ARRAYS}, "
                             f"{MAX_DECODE_SIZE})")
            return

        on_device = self._gpu_plane()

        def freeze() -> list[tuple[str, str, list[int], Any, object]]:
            return [_freeze(b, on_device) for b in buffers]

        fut = self._loop.run_in_executor(None, freeze)
        fut.add_done_callback(functools.partial(self._frozen, out, state, skeleton))

    def _frozen(self, out: _Outgoing, state: dict[str, object], skeleton: bytes,
                fut: asyncio.Future[list[tuple[str, str, list[int], Any, object]]]) -> None:
        if out.phase != "freeze":
            return
        exc = _failure(fut)
        if exc is not None:
            self._abort(out, f"copying the state at member {self.me} failed: {exc!r}")
            return
        frozen = fut.result()
        self._release_holds(out)  # what is sent can no longer change
        np = _np()
        manifest: list[list[Any]] = [["skeleton", "uint8", [len(skeleton)], len(skeleton)]]
        out.parts = [np.frombuffer(skeleton, np.uint8)]
        for kind, dtype, shape, flat, _value in frozen:
            manifest.append([kind, dtype, shape, int(flat.nbytes)])
            out.parts.append(flat)
        out.stream = stream = _Stream([int(p.nbytes) for p in out.parts], self.chunk_bytes,
                                      _device_parts(manifest))
        if self.observer is not None:
            try:
                seen = wire.decode(skeleton, buffers=[f[4] for f in frozen])
            except Exception:
                seen = state
            if isinstance(seen, dict):
                self.observer.snapshot_taken(self.me, out.view_id, out.joiner, seen)
        out.phase = "ready_wait"
        out.last_progress = self._now()
        log.info("member %d: state transfer %d to %d: snapshot of %d bytes in %d parts, "
                 "%d chunks of %d bytes", self.me, out.xfer_id, out.joiner, stream.total,
                 len(manifest), stream.count, stream.chunk)
        self._send(out.joiner, env.encode(env.STATE_BEGIN, out.xfer_id, out.view_id,
                                          stream.chunk, stream.total, manifest))

    def _gpu_plane(self) -> bool:
        """Whether a GPU plane runs here (device parts of a state then stay on the device)."""
        return self.driver.gpuplane is not None or self.driver.ncclplane is not None

    def _send(self, to: int, frame: bytes) -> None:
        try:
            self.driver.transport.send(to, frame)
        except Exception as exc:  # a departed peer: the view change will say so
            log.warning("member %d: state message to %d not sent: %r", self.me, to, exc)

    def _pump(self, out: _Outgoing) -> None:
        stream = out.stream
        assert stream is not None
        loop = self._loop
        while (out.phase == "stream" and out.next_index < stream.count
               and len(out.inflight) + out.building < WINDOW):
            index = out.next_index
            out.next_index += 1
            out.building += 1
            fut = loop.run_in_executor(None, _build_chunk, out.parts, stream, index)
            fut.add_done_callback(functools.partial(self._built, out, index))

    def _built(self, out: _Outgoing, index: int,
               fut: asyncio.Future[tuple[Any, bytes, int]]) -> None:
        out.building -= 1
        if out.phase != "stream":
            return
        exc = _failure(fut)
        if exc is not None:
            self._abort(out, f"building chunk {index} at member {self.me} failed: {exc!r}")
            return
        arr, digest, how = fut.result()
        if self.chunk_hook is not None:
            arr = self.chunk_hook(index, arr)
        header = msgpack.packb([out.xfer_id, index, digest, how], use_bin_type=True)
        payload = OutOfBand(header, (arr,))
        self._ship(out, index, payload)

    def _ship(self, out: _Outgoing, index: int, payload: OutOfBand) -> None:
        view = self._view
        view_id = view.view_id if view is not None else out.view_id
        key = (view_id, self.me, chunk_msg_no(out.xfer_id, index))
        out.inflight[index] = (key, payload)
        plane = self.driver.start_transfer(key, payload, (out.joiner,))
        if plane is not None and plane in (self.driver.gpuplane, self.driver.ncclplane):
            out.by_gpu.add(index)
        else:
            out.by_gpu.discard(index)

    def _on_ack(self, sender: int, out: _Outgoing, index: int) -> None:
        entry = out.inflight.pop(index, None)
        if entry is None:
            return  # a duplicate (a chunk re-sent under a new view landed twice)
        self.driver.release_sent(entry[0])
        assert out.stream is not None
        out.acked += 1
        out.bytes_done += out.stream.length(index)
        out.last_progress = self._now()
        if out.acked == out.stream.count:
            out.phase = "done"
            del self._outgoing[out.xfer_id]
            took = self._now() - out.started
            log.info("member %d: state transfer %d to %d done: %d bytes in %.2f s (%d of %d "
                     "chunks moved by a GPU plane)", self.me, out.xfer_id, out.joiner,
                     out.stream.total, took, len(out.by_gpu), out.stream.count)
            return
        self._pump(out)

    def _abort(self, out: _Outgoing, reason: str, *, tell: bool = True,
               level: int = logging.ERROR) -> None:
        if out.phase in ("done", "aborted"):
            return
        out.phase = "aborted"
        self._outgoing.pop(out.xfer_id, None)
        if out.fence_timer is not None:
            out.fence_timer.cancel()
        self._release_holds(out)
        for key, _payload in out.inflight.values():
            self.driver.release_sent(key)
        out.inflight.clear()
        out.parts = []
        log.log(level, "member %d: state transfer %d to joiner %d aborted: %s; this member "
                "stays in the group", self.me, out.xfer_id, out.joiner, reason)
        if tell:
            self._send(out.joiner, env.encode(env.STATE_ABORT, out.xfer_id, reason[:4000]))

    # -- joiner --------------------------------------------------------------------------------
    def _expect(self, ev: ViewInstalled) -> None:
        loop = self._loop
        fut: asyncio.Future[None] = loop.create_future()
        now = self._now()
        inc = _Incoming(-1, -1 if ev.sponsor is None else ev.sponsor, ev.view.view_id, now, fut,
                        last_progress=now, last_log=now)
        self._incoming = inc
        for runner in self.runners.values():  # the new view's calls wait for the restore
            runner.submit_hold(inc.releases.append)
        assert ev.state is not None
        try:
            inc.xfer_id = decode_ticket(ev.state)
        except ProtocolViolation as exc:
            self._fail(f"the Welcome from {inc.sponsor}: {exc}")
            return
        if ev.sponsor is None:
            self._fail("the Welcome names no sponsor")
            return
        log.info("member %d: waiting for state transfer %d from member %d (view %d)",
                 self.me, inc.xfer_id, inc.sponsor, inc.view_id)
        self._tick_soon()
        early, self._early = self._early, []
        for sender, msg in early:
            self._dispatch(sender, msg)

    def _on_begin(self, sender: int, msg: list[Any]) -> None:
        _, xfer_id, _view_id, chunk, total, manifest = msg
        inc = self._incoming
        if (inc is None or inc.phase != "wait_begin" or sender != inc.sponsor
                or xfer_id != inc.xfer_id):
            # a duplicate Welcome's transfer (or a stale one): the sponsor frees it at once
            self._send(sender, env.encode(env.STATE_ABORT, xfer_id,
                                          f"member {self.me} expects no state transfer "
                                          f"{xfer_id} from {sender}"))
            return
        sizes = [int(p[3]) for p in manifest]
        if not _MIN_CHUNK <= chunk <= _MAX_CHUNK or sum(sizes) != total or (
            total > MAX_STATE_BYTES
        ) or -(-total // chunk) + len(sizes) >= 1 << _INDEX_BITS:
            self._fail(f"state manifest from {sender} out of bounds: chunk {chunk}, total "
                       f"{total}, parts {len(sizes)}")
            return
        np = _np()
        cupy: Any = sys.modules.get("cupy") if self._gpu_plane() else None
        try:  # a device part lands on the device where a GPU plane runs here
            inc.parts = [(str(p[0]), str(p[1]), list(p[2]),
                          cupy.empty(int(p[3]), cupy.uint8) if p[0] == "cuda" and cupy is not None
                          else np.empty(int(p[3]), np.uint8)) for p in manifest]
        except Exception as exc:  # MemoryError, CuPy's OutOfMemoryError
            self._fail(f"no memory here for a state of {total} bytes: {exc!r}")
            return
        inc.stream = _Stream(sizes, chunk, _device_parts(manifest))
        inc.chunk_state = bytearray(inc.stream.count)
        inc.phase = "receiving"
        inc.last_progress = self._now()
        log.info("member %d: state transfer %d from %d: %d bytes in %d parts, %d chunks",
                 self.me, xfer_id, sender, total, len(sizes), inc.stream.count)
        self._send(sender, env.encode(env.STATE_READY, xfer_id))

    def landed(self, key: tuple[int, int, int], payload: object) -> None:
        """A state chunk landed here (the driver routes keys with :data:`STATE_TAG`)."""
        inc = self._incoming
        _view_id, src, msg_no = key
        xfer_id, index = _split_msg_no(msg_no)
        if inc is None or inc.phase != "receiving" or src != inc.sponsor or (
            xfer_id != inc.xfer_id
        ):
            return
        stream = inc.stream
        assert stream is not None
        np = _np()
        arr: Any = payload.arrays[0] if isinstance(payload, OutOfBand) and len(
            payload.arrays) == 1 else None
        header: object = None
        if isinstance(payload, OutOfBand):
            try:
                header = msgpack.unpackb(payload.call, raw=False) if len(
                    payload.call) <= 128 else None
            except Exception:
                header = None
        if not (
            index < stream.count
            and (isinstance(arr, np.ndarray) or is_cupy_array(arr))
            and arr.dtype == np.uint8 and arr.ndim == 1
            and arr.shape[0] == stream.length(index)
            and isinstance(header, list) and len(header) == 4 and header[0] == xfer_id
            and header[1] == index and isinstance(header[2], bytes)
            and len(header[2]) == _DIGEST and header[3] in (_SHA256, _CHECKSUM)
        ):
            self._fail(f"a malformed state chunk {index} from {src}")
            return
        if inc.chunk_state[index]:
            if inc.chunk_state[index] == 2:  # landed again (re-sent under a new view)
                self._send(src, env.encode(env.STATE_ACK, xfer_id, index))
            return
        inc.chunk_state[index] = 1
        inc.on_device += is_cupy_array(arr)
        digest, how = header[2], header[3]
        pieces = stream.pieces(index)
        dests = [p[3] for p in inc.parts]

        def store() -> bool:
            if how == _CHECKSUM:
                if _checksum(arr) != digest:
                    return False
            elif hashlib.sha256(memoryview(
                    arr.get() if is_cupy_array(arr) else arr)).digest() != digest:
                return False
            for part, off, at, n in pieces:
                _copy_into(dests[part], off, arr, at, n)
            if is_cupy_array(arr) or any(is_cupy_array(dests[p[0]]) for p in pieces):
                import cupy

                # done before the landed region can go back to the plane's pool
                cupy.cuda.get_current_stream().synchronize()
            return True

        fut = self._loop.run_in_executor(None, store)
        fut.add_done_callback(functools.partial(self._stored, inc, index))

    def _stored(self, inc: _Incoming, index: int, fut: asyncio.Future[bool]) -> None:
        if inc.phase != "receiving":
            return
        exc = _failure(fut)
        if exc is not None:
            self._fail(f"storing state chunk {index} failed here: {exc!r}")
            return
        stream = inc.stream
        assert stream is not None
        if not fut.result():
            self._fail(f"state chunk {index} from {inc.sponsor} does not match its sha256 "
                       "digest")
            return
        inc.chunk_state[index] = 2
        inc.done += 1
        inc.bytes_done += stream.length(index)
        inc.last_progress = self._now()
        self._send(inc.sponsor, env.encode(env.STATE_ACK, inc.xfer_id, index))
        if inc.done == stream.count:
            self._finish(inc)

    def _finish(self, inc: _Incoming) -> None:
        inc.phase = "finishing"
        parts, inc.parts = inc.parts, []

        def rebuild() -> object:
            np = _np()
            buffers: list[object] = []
            for kind, dtype, shape, dest in parts[1:]:
                if is_cupy_array(dest):  # landed on the device: a view, no copy
                    buffers.append(dest.view(np.dtype(dtype)).reshape(shape))
                    continue
                le = np.dtype(dtype).newbyteorder("<")
                host = dest.view(le).reshape(shape).astype(np.dtype(dtype), copy=False)
                if kind == "cuda":
                    try:
                        import cupy

                        host = cupy.asarray(host)
                    except ImportError:
                        log.warning("member %d: a device array of the state arrives as numpy "
                                    "(no CuPy here)", self.me)
                buffers.append(host)
            skeleton = parts[0][3].tobytes()
            parts.clear()  # the decoded bytes are copies: the receive buffers can go
            return wire.decode(skeleton, buffers=buffers)

        fut = self._loop.run_in_executor(None, rebuild)
        fut.add_done_callback(functools.partial(self._rebuilt, inc))

    def _rebuilt(self, inc: _Incoming, fut: asyncio.Future[object]) -> None:
        if inc.phase != "finishing":
            return
        exc = _failure(fut)
        if exc is not None:
            self._fail(f"the state from {inc.sponsor} could not be decoded: {exc!r}")
            return
        value = fut.result()
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            self._fail(f"the state from {inc.sponsor} is not a map of actor names")
            return
        for name, actor in self.actors.items():
            if name in value:
                try:
                    actor.restore(value[name])
                except Exception as exc2:
                    self._fail(_restore_reason(name, "restore", exc2))
                    return
        inc.phase = "done"
        stream = inc.stream
        total = stream.total if stream is not None else 0
        took = self._now() - inc.started
        log.info("member %d: state transfer %d from %d restored: %d bytes in %.2f s "
                 "(%.1f MiB/s; %d of %d chunks landed in device memory)", self.me, inc.xfer_id,
                 inc.sponsor, total, took, total / (1 << 20) / max(took, 1e-9), inc.on_device,
                 stream.count if stream is not None else 0)
        if self.observer is not None:
            self.observer.restored(self.me, inc.view_id, value)
        self._release_holds(inc)
        if not inc.future.done():
            inc.future.set_result(None)

    def _fail(self, reason: str) -> None:
        inc = self._incoming
        if inc is None or inc.phase in ("done", "failed"):
            return
        was = inc.phase
        inc.phase = "failed"
        inc.parts = []
        log.error("member %d: the join failed: %s", self.me, reason)
        if was != "wait_begin" or inc.xfer_id >= 0:
            self._send(inc.sponsor, env.encode(env.STATE_ABORT, max(inc.xfer_id, 0),
                                               f"the joiner failed: {reason}"[:4000]))
        if not inc.future.done():
            inc.future.set_exception(GroupClosed(f"member {self.me} could not join: {reason}"))
            inc.future.exception()  # retrieved here too: nobody may be waiting any more

    # -- messages and events -------------------------------------------------------------------
    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        """A STATE_* channel message (the driver's receiver for those kinds)."""
        if self._closed:
            return
        if not self._in_view:
            if len(self._early) < _MAX_EARLY:
                self._early.append((sender, msg))
            return
        self._dispatch(sender, msg)

    def _dispatch(self, sender: int, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == env.STATE_BEGIN:
            self._on_begin(sender, msg)
            return
        xfer_id = msg[1]
        if kind == env.STATE_ABORT:
            inc = self._incoming
            if inc is not None and sender == inc.sponsor and xfer_id == inc.xfer_id:
                self._fail(f"member {sender} aborted the state transfer: {msg[2]}")
                return
            out = self._outgoing.get(xfer_id)
            if out is not None and out.joiner == sender:
                self._abort(out, f"joiner {sender} gave it up: {msg[2]}", tell=False,
                            level=logging.INFO if out.phase == "ready_wait" else logging.ERROR)
            return
        out = self._outgoing.get(xfer_id)
        if out is None or out.joiner != sender:
            return
        if kind == env.STATE_READY and out.phase == "ready_wait":
            out.phase = "stream"
            out.last_progress = self._now()
            self._pump(out)
        elif kind == env.STATE_ACK and out.phase == "stream":
            self._on_ack(sender, out, msg[2])

    def on_event(self, event: object) -> None:
        """Every core event but deliveries, in order (the driver calls this after the host)."""
        if isinstance(event, ViewInstalled):
            first = not self._in_view
            self._in_view = True
            self._view = event.view
            members = set(event.view.members)
            if first and event.state is not None:
                self._expect(event)
            elif first:
                self._early.clear()
            inc = self._incoming
            if not first and inc is not None and inc.phase not in ("done", "failed") and (
                inc.sponsor not in members
            ):
                self._fail(f"the sponsor, member {inc.sponsor}, departed during the state "
                           f"transfer (view {event.view.view_id})")
            for out in list(self._outgoing.values()):
                if out.joiner not in members:
                    self._abort(out, f"joiner {out.joiner} departed (view {event.view.view_id})",
                                tell=False, level=logging.WARNING)
                elif out.phase == "stream":
                    # the planes forget keys of older views: send what is unacked again
                    for index, (_key, payload) in list(out.inflight.items()):
                        self._ship(out, index, payload)
        elif isinstance(event, Evicted | Left | Partitioned):
            why = type(event).__name__.lower()
            self._fail(f"this member is out of the group ({why})")
            for out in list(self._outgoing.values()):
                self._abort(out, f"the sponsor is out of the group ({why})", tell=False,
                            level=logging.WARNING)

    def landing_failed(self, key: tuple[int, int, int], exc: BaseException) -> None:
        inc = self._incoming
        xfer_id, index = _split_msg_no(key[2])
        if inc is not None and key[1] == inc.sponsor and xfer_id == inc.xfer_id:
            self._fail(f"state chunk {index} could not land here: {exc!r}")

    def staging_failed(self, key: tuple[int, int, int], exc: BaseException) -> None:
        xfer_id, index = _split_msg_no(key[2])
        out = self._outgoing.get(xfer_id)
        if out is not None:
            self._abort(out, f"state chunk {index} could not be sent from here: {exc!r}")

    def close(self) -> None:
        self._closed = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for out in list(self._outgoing.values()):
            self._abort(out, "this member closed", level=logging.WARNING)
        self._fail("this member closed")

    # -- stall detection and progress ---------------------------------------------------------
    def _tick_soon(self) -> None:
        if self._ticker is None and not self._closed:
            self._ticker = self._loop.call_later(_TICK_S, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        now = self._now()
        for out in list(self._outgoing.values()):
            if out.phase in ("ready_wait", "stream") and now - out.last_progress > self.stall_s:
                self._abort(out, f"joiner {out.joiner} made no progress for "
                                 f"state_stall_s={self.stall_s:g} s")
            elif out.phase == "stream" and now - out.last_log >= _LOG_EVERY_S:
                out.last_log = now
                assert out.stream is not None
                log.info("member %d: state transfer %d to %d: %d of %d bytes (%.1f MiB/s)",
                         self.me, out.xfer_id, out.joiner, out.bytes_done, out.stream.total,
                         out.bytes_done / (1 << 20) / max(now - out.started, 1e-9))
        inc = self._incoming
        if inc is not None and inc.phase in ("wait_begin", "receiving"):
            bound = self.stall_s + (self.fence_s if inc.phase == "wait_begin" else 0.0)
            if now - inc.last_progress > bound:
                self._fail(f"the state transfer from {inc.sponsor} made no progress for "
                           f"{bound:g} s (state_stall_s={self.stall_s:g}"
                           + (f", fence_timeout_s={self.fence_s:g})" if inc.phase == "wait_begin"
                              else ")"))
            elif inc.phase == "receiving" and now - inc.last_log >= _LOG_EVERY_S:
                inc.last_log = now
                assert inc.stream is not None
                log.info("member %d: state transfer %d from %d: %d of %d bytes (%.1f MiB/s)",
                         self.me, inc.xfer_id, inc.sponsor, inc.bytes_done, inc.stream.total,
                         inc.bytes_done / (1 << 20) / max(now - inc.started, 1e-9))
        active = self._outgoing or (inc is not None and inc.phase in ("wait_begin", "receiving",
                                                                       "finishing"))
        if active:
            self._tick_soon()

