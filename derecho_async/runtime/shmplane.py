"""The shm data plane: large host payloads are written once into the sender's shared pool.

Theory of operation. A sender lays a large payload (plain bytes, or a call whose arrays are host
numpy arrays) out flat (:func:`~.dataplane.write_flat`: one copy per array, straight from the
array into shared memory) in a region of its *pool*: shared-memory segments it owns
(:mod:`derecho_async.transport.shm.pool`), created on demand, reused for later messages, a new
larger segment added when no free range fits. Every receiver gets only a small descriptor frame
on the channel::

    [SHM_DESC, view_id, sender, msg_no, segment, generation, offset, length, meta]

The receiver maps the sender's segment once (cached by ``(sender, segment)``, re-mapped when the
generation changes), validates the descriptor against the mapping (offset and length inside the
segment, the meta's layout exactly ``length`` bytes), copies the region out once (arrays are
numpy arrays over that copy) and lands it with the core.

Large payloads (at least ``OFF_LOOP_BYTES``) are copied in the loop's default executor, so the
loop and its heartbeats go on: the sender sends the descriptor only once its write finished,
and a receiver lands the message, from the loop, only once its copy finished; a receiver lands
one sender's messages in the order their descriptors came, so a small one waits behind a large
one being copied. Nothing a copy uses goes away under it: a region being written is freed (by
the rules below) only when the write is over, and a peer's segment being read is unmapped only
when the read is over; on close, the pool and the peers' mappings go when the last copy ends.
A failed write makes the sender leave (``staging_failed``: nobody would ever get the message),
a failed copy-out makes the receiver leave (``failed``).

Freeing rule (sender). A region is freed when the core says nobody can still need it:
the sender delivers its own message (delivery means stable, stable means every member's
frontier passed it, and a frontier passes a large message only once its bytes landed there,
i.e. the copy-out finished); or a view newer than the message's is installed (every survivor
wedged before the install, so a late copy-out is ignored by a frozen shard, and an undelivered
message is re-sent under a new key); or the member leaves the group / closes. A state chunk is
no core message (nothing freezes its landing), so only its sponsor frees it, when the joiner
acknowledged it or the transfer ended. Regions are freed in any order; the allocator coalesces
neighbours.

Cleanup of names: the owner unlinks its segments when it closes (and any leftover of an earlier
incarnation when it creates one); the survivors of a view change unlink the segments of departed
members whose process is gone (SIGKILL): their transport does it, with their rings, at
``set_view`` (see :mod:`derecho_async.transport.shm.transport`), and here their mappings are
dropped. ``ShmTransport.cleanup_group`` and ``derecho-async status --clean`` remove what a group
whose members all died left.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from derecho_async.core.effects import Evicted, Left, Partitioned, ViewInstalled
from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.dataplane import (
    OFF_LOOP_BYTES,
    FlatLayout,
    RecvBuffers,
    copy_flat,
    flat_layout,
    flat_meta,
    read_flat,
    write_flat,
)
from derecho_async.runtime.statexfer.wire import STATE_TAG
from derecho_async.transport.shm import pool as shmpool
from derecho_async.transport.shm.pool import BadPoolSegment, PoolSegment
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.transport.registry import PlaneWiring

__all__ = ["HostPool", "ShmPlane", "for_transport"]

log = logging.getLogger("derecho_async.dataplane")

Key = tuple[int, int, int]

_GRAIN = 4096  # allocation granularity (page aligned regions)
_FIRST_SEGMENT = 64 << 20  # the smallest segment
_ROUND = 2 << 20  # a larger segment is what the message needs, rounded up to this
_TRIM_AT = 8  # with this many segments, growing first drops the idle ones
_PENDING: Any = object()  # a payload still being copied out (the receive queue's placeholder)
_FAILED: Any = object()  # a payload whose copy-out failed (reported; never landed)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The running event loop, if any (without one, large copies are made on the spot)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class PoolFull(Exception):
    """No region can be allocated (segment limit reached or the OS refused)."""


class HostPool:
    """Regions of shared memory owned by this member: first fit over segments, coalescing
    free lists; when nothing fits, a new segment of what is needed (at least 64 MiB), after
    dropping idle segments once there are several."""

    def __init__(self, group: str, owner: int, first_segment: int = _FIRST_SEGMENT) -> None:
        self.group = group
        self.owner = owner
        self.first_segment = first_segment
        self.segments: list[PoolSegment] = []
        self._free: list[list[tuple[int, int]]] = []  # per segment: sorted (start, end)
        self.in_use = 0  # bytes allocated now

    def alloc(self, nbytes: int) -> tuple[PoolSegment, int, int]:
        """A region of at least ``nbytes``: (segment, offset, allocated length)."""
        size = max(_GRAIN, (nbytes + _GRAIN - 1) // _GRAIN * _GRAIN)
        for seg, free in zip(self.segments, self._free, strict=True):
            for i, (lo, hi) in enumerate(free):
                if hi - lo >= size:
                    if hi - lo == size:
                        del free[i]
                    else:
                        free[i] = (lo + size, hi)
                    self.in_use += size
                    return seg, lo, size
        seg = self._grow(size)
        self._free.append([(size, seg.capacity)] if seg.capacity > size else [])
        self.in_use += size
        return seg, 0, size

    def _grow(self, size: int) -> PoolSegment:
        if len(self.segments) >= _TRIM_AT:
            self._drop_idle()
        used = {s.index for s in self.segments}
        index = min(set(range(shmpool.MAX_SEGMENTS)) - used, default=None)
        if index is None:
            raise PoolFull(f"pool of member {self.owner} has {len(self.segments)} segments")
        cap = max(self.first_segment, (size + _ROUND - 1) // _ROUND * _ROUND)
        try:
            seg = shmpool.create_pool_segment(self.group, self.owner, index, cap)
        except (OSError, ValueError) as exc:
            raise PoolFull(f"cannot create a pool segment of {cap} bytes: {exc}") from exc
        self.segments.append(seg)
        return seg

    def _drop_idle(self) -> None:
        """Unmap and unlink the segments nothing is allocated in (peers re-map a reused index:
        its generation changes)."""
        keep_segs, keep_free = [], []
        for seg, free in zip(self.segments, self._free, strict=True):
            if free == [(0, seg.capacity)]:
                seg.close()
                shmpool.unlink_pool_segment(seg.path)
            else:
                keep_segs.append(seg)
                keep_free.append(free)
        self.segments, self._free = keep_segs, keep_free

    def segment(self, index: int) -> int:
        """The position of segment ``index`` in :attr:`segments`."""
        for i, seg in enumerate(self.segments):
            if seg.index == index:
                return i
        raise KeyError(index)

    def free(self, index: int, offset: int, size: int) -> None:
        """Return a region from :meth:`alloc` (``index`` is the segment's index)."""
        free = self._free[self.segment(index)]
        lo, hi = offset, offset + size
        # insert sorted, then merge with the neighbours
        i = 0
        while i < len(free) and free[i][0] < lo:
            i += 1
        if i > 0 and free[i - 1][1] == lo:
            lo = free[i - 1][0]
            i -= 1
            del free[i]
        if i < len(free) and free[i][0] == hi:
            hi = free[i][1]
            del free[i]
        free.insert(i, (lo, hi))
        self.in_use -= size

    def close(self) -> None:
        """Unmap and unlink every segment."""
        for seg in self.segments:
            seg.close()
        self.segments.clear()
        self._free.clear()
        self.in_use = 0
        shmpool.unlink_own_pool(self.group, self.owner)


class ShmPlane:
    """Large host payloads through the sender's shared pool (see the module docstring)."""

    kinds: tuple[int, ...] = (env.SHM_DESC,)

    def __init__(
        self,
        group: str,
        member_id: int,
        send: Callable[[int, bytes], None],
        landed: Callable[[Key, object], None],
        *,
        failed: Callable[[Key, BaseException], None] | None = None,
        staging_failed: Callable[[Key, BaseException], None] | None = None,
    ) -> None:
        self.group = group
        self.member_id = member_id
        self._send = send
        self._landed = landed
        self._failed = failed
        self._staging_failed = staging_failed
        # copies in the executor: writes by key (True once the region is to be freed when it
        # ends), reads by sender (their keys and payloads, landed in order), peer segments
        # being read (unmapped when the last read ends), and the count (under the lock: the
        # copy that ends last after close releases everything, in its worker thread)
        self._writing: dict[Key, bool] = {}
        self._inbox: dict[int, deque[list[Any]]] = {}
        self._pinned: dict[int, int] = {}  # id(segment) -> reads in flight
        self._doomed: dict[int, PoolSegment] = {}  # replaced or departed, unmapped when unpinned
        self._copies = 0
        self._lock = threading.Lock()
        self.copied_off_loop = 0  # payloads copied in the executor (statistics, tests)
        self.sent = 0  # payloads this member started (statistics, tests)
        self.landed = 0  # payloads that landed here
        self.pool = HostPool(group, member_id)
        self.outstanding: dict[Key, tuple[int, int, int]] = {}
        self._peers: dict[tuple[int, int], PoolSegment] = {}
        self.buffers = RecvBuffers()
        self._closed = False
        self._view_id = -1

    # -- sending -------------------------------------------------------------------------------
    def start(self, key: Key, payload: object, targets: tuple[int, ...]) -> bool:
        meta = flat_meta(payload)
        if meta is None or self._closed:
            return False
        if not targets:
            return True
        layout = flat_layout(meta)
        try:
            seg, off, size = self.pool.alloc(layout.total)
        except PoolFull as exc:
            log.warning("member %d: shm pool: %s; staging through the channel", self.member_id, exc)
            return False
        frame = env.encode(
            env.SHM_DESC, *key, seg.index, seg.generation, off, layout.total, meta
        )
        loop = _running_loop() if layout.total >= OFF_LOOP_BYTES else None
        if loop is not None:
            self.outstanding[key] = (seg.index, off, size)
            self._writing[key] = False
            self._begin_copy()
            fut = loop.run_in_executor(
                None, self._write, payload, layout, seg, off)
            fut.add_done_callback(functools.partial(self._written, key, frame, targets))
            self.sent += 1
            self.copied_off_loop += 1
            return True
        region = seg.data[off : off + layout.total]
        try:
            write_flat(payload, layout, region)
        except Exception as exc:  # e.g. an array resized under us: let staging report it
            self.pool.free(seg.index, off, size)
            log.warning("member %d: shm plane could not lay out %s: %r", self.member_id, key, exc)
            return False
        finally:
            region.release()
        self.outstanding[key] = (seg.index, off, size)
        for t in targets:
            self._send(t, frame)
        self.sent += 1
        return True

    def _write(self, payload: object, layout: FlatLayout, seg: PoolSegment, off: int) -> None:
        """In a worker thread: lay ``payload`` out in its region."""
        try:
            region = seg.data[off : off + layout.total]
            try:
                write_flat(payload, layout, region)
            finally:
                with contextlib.suppress(BufferError):  # a traceback may still hold a view
                    region.release()
        finally:
            self._end_copy()

    def _written(self, key: Key, frame: bytes, targets: tuple[int, ...],
                 fut: asyncio.Future[None]) -> None:
        """On the loop: the write of ``key`` ended; send its descriptor, unless it failed or
        the message was given up meanwhile (its region is freed then)."""
        if self._closed:
            return
        release = self._writing.pop(key)
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None or fut.cancelled() or release:
            self._release(key)
            if exc is not None:
                log.error("member %d: writing %s into the shm pool failed: %r", self.member_id,
                          key, exc)
                if self._staging_failed is not None:
                    self._staging_failed(key, exc)
            return
        for t in targets:
            self._send(t, frame)
    def _release(self, key: Key) -> None:
        if key in self._writing:  # freed once the write is over
            self._writing[key] = True
            return
        region = self.outstanding.pop(key, None)
        if region is not None:
            self.pool.free(*region)

    def on_own_delivered(self, key: Key) -> None:
        if self.outstanding:
            self._release(key)

    def on_event(self, event: object) -> None:
        if self._closed:
            return
        if isinstance(event, ViewInstalled):
            self._view_id = vid = event.view.view_id
            # (a state chunk's region stays: the joiner may still be reading it; the sponsor
            # releases it with the chunk's acknowledgement or the transfer's end)
            for key in [k for k in self.outstanding if k[0] < vid and k[2] < STATE_TAG]:
                self._release(key)
            members = set(event.view.members)
            # (their files: the transport's view change removes those of dead departed members)
            for pk in [pk for pk in self._peers if pk[0] not in members]:
                self._unmap(self._peers.pop(pk))
        elif isinstance(event, Evicted | Partitioned | Left):
            for key in list(self.outstanding):
                self._release(key)

    # -- receiving -----------------------------------------------------------------------------
    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        if self._closed:
            return
        _, view_id, src, msg_no, index, gen, off, length, meta = msg
        if src != sender:
            raise ProtocolViolation(f"shm descriptor for sender {src} sent by {sender}")
        if view_id < self._view_id:
            # Moot: that view ended here (its shard was frozen before the next was installed),
            # and its sender may since have freed the region or even re-created the segment.
            return
        layout = flat_layout(meta, limit=length)
        if layout.total != length:
            raise ProtocolViolation(f"shm descriptor of {length} bytes, its meta says {layout.total}")
        seg = self._segment(sender, index, gen)
        if off + length > seg.capacity or off % 8:
            raise ProtocolViolation(
                f"shm descriptor [{off}, {off + length}) outside segment {index} of "
                f"{seg.capacity} bytes"
            )
        key = (view_id, src, msg_no)
        queue = self._inbox.get(src)
        loop = _running_loop() if length >= OFF_LOOP_BYTES else None
        if loop is not None:
            entry = [key, _PENDING]
            if queue is None:
                queue = self._inbox[src] = deque()
            queue.append(entry)
            self._pinned[id(seg)] = self._pinned.get(id(seg), 0) + 1
            self._begin_copy()
            fut = loop.run_in_executor(None, self._read, layout, seg, off, length)
            fut.add_done_callback(functools.partial(self._read_done, src, entry, seg))
            self.copied_off_loop += 1
            return
        region = seg.data[off : off + length]
        try:
            payload = read_flat(layout, region, self.buffers)
        finally:
            region.release()
        if queue:  # behind a copy from the same sender
            queue.append([key, payload])
            return
        self.landed += 1
        self._landed(key, payload)

    def _read(self, layout: FlatLayout, seg: PoolSegment, off: int, length: int) -> object:
        """In a worker thread: copy a payload out of a peer's segment."""
        try:
            region = seg.data[off : off + length]
            try:
                return copy_flat(layout, region, self.buffers)
            finally:
                with contextlib.suppress(BufferError):  # a traceback may still hold a view
                    region.release()
        finally:
            self._end_copy()

    def _read_done(self, src: int, entry: list[Any], seg: PoolSegment,
                   fut: asyncio.Future[object]) -> None:
        """On the loop: a copy-out ended; land what is now at the head of ``src``'s queue."""
        if self._closed:
            return
        left = self._pinned[id(seg)] - 1
        if left:
            self._pinned[id(seg)] = left
        else:
            del self._pinned[id(seg)]
            doomed = self._doomed.pop(id(seg), None)
            if doomed is not None:
                doomed.close()
        exc = None if fut.cancelled() else fut.exception()
        if exc is None and not fut.cancelled():
            entry[1] = fut.result()
        else:
            entry[1] = _FAILED
            log.error("member %d: copying %s out of the shm pool failed: %r", self.member_id,
                      entry[0], exc)
            if self._failed is not None and exc is not None:
                self._failed(entry[0], exc)
        queue = self._inbox[src]
        while queue and queue[0][1] is not _PENDING:
            key, payload = queue.popleft()
            if payload is not _FAILED and key[0] >= self._view_id:
                self.landed += 1
                self._landed(key, payload)
        if not queue:
            del self._inbox[src]

    def _begin_copy(self) -> None:
        with self._lock:
            self._copies += 1

    def _end_copy(self) -> None:
        """A copy ended (in its worker thread): after close, the last one releases it all."""
        with self._lock:
            self._copies -= 1
            last = self._closed and not self._copies
        if last:
            self._release_all()

    def _unmap(self, seg: PoolSegment) -> None:
        """Unmap a peer's segment now, or when the reads of it in flight are over."""
        if id(seg) in self._pinned:
            self._doomed[id(seg)] = seg
        else:
            seg.close()

    def _segment(self, owner: int, index: int, gen: int) -> PoolSegment:
        seg = self._peers.get((owner, index))
        if seg is not None and seg.generation == gen:
            return seg
        if seg is not None:
            del self._peers[(owner, index)]
            self._unmap(seg)
        if self._closed:
            raise ProtocolViolation("shm descriptor after close")
        try:
            seg = shmpool.attach_pool_segment(self.group, owner, index)
        except BadPoolSegment as exc:
            raise ProtocolViolation(f"shm descriptor names a bad segment: {exc}") from exc
        if seg.generation != gen:
            seg.close()
            raise ProtocolViolation(
                f"shm descriptor names generation {gen} of segment {index}, the file has "
                f"{seg.generation}"
            )
        self._peers[(owner, index)] = seg
        return seg

    def close(self) -> None:
        """Release the pool and the peers' mappings (once the copies in flight are over)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            now = not self._copies
        self.outstanding.clear()
        self._inbox.clear()
        if now:
            self._release_all()

    def _release_all(self) -> None:
        for seg in (*self._peers.values(), *self._doomed.values()):
            seg.close()
        self._peers.clear()
        self._doomed.clear()
        self.pool.close()


def for_transport(wiring: PlaneWiring) -> ShmPlane | None:
    """The bulk plane of an shm transport (see ``transport.registry``); None for another kind
    of transport object (host staging then moves its payloads)."""
    from derecho_async.transport.shm import ShmTransport

    t = wiring.transport
    if not isinstance(t, ShmTransport):
        return None
    return ShmPlane(t.group, wiring.member_id, t.send, wiring.landed, failed=wiring.failed,
                    staging_failed=wiring.staging_failed)
