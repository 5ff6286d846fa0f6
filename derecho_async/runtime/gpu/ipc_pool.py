"""The CUDA IPC plane's device pool and the state its two halves share.

Theory of operation (DESIGN.md §6.6). :class:`IpcPool` is the base of
:class:`~.ipc.IpcPlane`: it holds the plane's state and its *device pool*, a few large
``cudaMalloc`` segments, each exported once with ``cudaIpcGetMemHandle`` and carved up by a
:class:`~.pool.RangeAllocator`, plus a set of interprocess CUDA events; it announces them to the
view's members (:meth:`IpcPool._announce_all`) whenever they grow. Regions come back when the
message that held them is released (:mod:`.ipc_send`), or when the array over them is
garbage-collected (a :class:`~.waiter.RegionOwner` queues them; the loop reclaims them).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from derecho_async.runtime.gpu.completions import Completions, Lane
from derecho_async.runtime.gpu.descriptor import ArraySpec
from derecho_async.runtime.gpu.pool import ALIGN, PoolAnnouncement, RangeAllocator
from derecho_async.runtime.gpu.waiter import RegionOwner
from derecho_async.wire import DTYPES
from derecho_async.wire import envelope as env

__all__ = ["CUDA_MEMCPY_DEFAULT", "IpcPool", "Outgoing", "Peer", "Segment"]

log = logging.getLogger("derecho_async.gpuplane")

_EVENT_BATCH = 64  # interprocess events made at a time
CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the pointers
_EVENT_FLAGS = 0x2 | 0x4  # cudaEventDisableTiming | cudaEventInterprocess


def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype that may travel (wire.DTYPES maps each to its size)."""
    return DTYPES[dtype]


@dataclass(slots=True)
class Segment:
    """One segment of this member's pool: its address, size, IPC handle and allocator."""

    ptr: int
    size: int
    handle: bytes
    alloc: RangeAllocator


@dataclass(slots=True, eq=False)
class Peer(Lane):
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
class Outgoing:
    """What a message sent from here holds until it is released: its staging regions, its
    event (-1: none) and its device arrays."""

    regions: list[tuple[int, int]]
    event: int
    keep: tuple[object, ...]


class IpcPool:
    """The CUDA IPC plane's state and its device pool (the base of :class:`~.ipc.IpcPlane`,
    whose docstring describes the arguments)."""

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
        self._segments: list[Segment] = []
        self._alloc_hint = 0  # the segment _alloc tries first
        self._events: list[int] = []
        self._event_handles: list[bytes] = []
        self._free_events: list[int] = []
        self._generation = 0
        self._announced_to: dict[int, int] = {}
        self._peers: dict[int, Peer] = {}
        self._view_members: tuple[int, ...] = ()
        self._outgoing: dict[tuple[int, int, int], Outgoing] = {}
        self._reclaim: collections.deque[tuple[int, int]] = collections.deque()
        self._unflushed: dict[Peer, None] = {}  # peers with copies not yet tracked (_flush)
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
        self._segments.append(Segment(ptr, size, handle, RangeAllocator(size)))
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
        owner = RegionOwner(self._queue_reclaim, seg, off)  # first: from here it goes back
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
