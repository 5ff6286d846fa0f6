# Theory of operation
# -------------------
# Members of one group on one host. Every ordered pair (sender -> receiver) has a
# single-producer/single-consumer ring in POSIX shared memory, file
# ``/dev/shm/derecho_async.<group>.<sender>.<receiver>``, created lazily by the sender with mode
# 0o600 (opened with ``os.open`` + ``mmap``, so Python's resource tracker never owns or unlinks
# it). Layout: a 4 KiB header of u64 words, each on its own cache line (magic, version, sender,
# receiver, capacity, producer incarnation; producer-owned ``head``, ``blocked``, ``closed``;
# consumer-owned ``tail``, ``sleeping``, consumer incarnation, ``closed``), then ``capacity``
# data bytes used circularly. ``head`` and ``tail`` are monotone byte counters; words are read
# and written as single aligned 8-byte loads/stores (``memoryview.cast("Q")``).
#
# Records are 8-byte aligned: a 32-byte ``struct`` header (type, flags=0, a, b, length) and the
# payload. PUSH: a=view_id, b=table offset. MSG: a=total message length, b=fragment offset:
# a message larger than a record is split into fragments, reassembled by the receiver (bounded
# by ``max_message``). A push larger than a record is split at 8-byte aligned table offsets,
# which the push contract allows (a push may land partially; aligned words stay whole). Pushes
# and messages share the ring, so each link is FIFO across both.
#
# Producer: append records, then publish ``head``. A record that does not fit waits in process
# memory (the backlog, FIFO, never dropped); the producer sets ``blocked`` and the consumer rings
# the producer's doorbell after it frees space. Consumer: read records up to ``head``, validate
# every header (type, flags, lengths within what was published and within the ring, fragment
# order, row ranges via the PushGate), deliver, publish ``tail``. A ring whose framing is broken
# is abandoned (marked closed, reported with ``on_failure``); a bad push inside good framing is
# only dropped and reported.
#
# Doorbells: each member binds a UNIX datagram socket in the Linux abstract namespace
# (``\0dasync/<uid>/<group>/<member>``), registered with ``loop.add_reader``. The kernel
# releases the name when the process dies, so "is member m alive" is "does a datagram to its
# name get ECONNREFUSED". Datagrams carry (kind, member, incarnation) and are only hints; those
# from other uids are ignored (SO_PASSCRED). A producer rings only if the consumer published
# ``sleeping``; the consumer sets ``sleeping`` only after a pass found every ring empty, then
# re-checks. With ``spin_us`` > 0 and dense traffic (the last two arrivals within five spin
# windows) the consumer first keeps polling (through the event loop, so other callbacks run) for
# that long after the last arrival: a doorbell costs a syscall on each side and an epoll wake-up,
# which is most of a hop's latency on a machine with idle cores. Sparse arrivals (an idle group's
# heartbeats) never spin.
# Both sides use a full fence between their store and the other side's load (an
# uncontended lock round trip is a locked RMW instruction on x86-64), and a slow sweep timer
# (50 ms backing off to 1 s) re-polls rings and retries doorbells as a safety net, so a lost
# wakeup costs latency, never data or liveness.
#
# Lifetime: ``close()`` marks its rings closed and unlinks every segment it is an end of. At
# ``start()`` (after binding its doorbell, so it is the only live holder of its id) a member
# removes stale segments of its group: its own from an earlier incarnation, those whose producer
# is dead, and those whose consumer attached and died; it tells live peers it restarted so they
# drop links to its previous incarnation. ``ShmTransport.cleanup_group(group)`` applies the same
# rule for launchers and tests.
"""Shared-memory transport for the members of a group on one host."""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import mmap
import os
import socket
import stat
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from derecho_async import hotpath
from derecho_async.errors import ConfigError, UsageError
from derecho_async.transport.base import (
    GROUP_MESSAGE_LIMIT,
    Transport,
    TransportHandler,
    check_member_id,
    log,
)
from derecho_async.transport.shmfiles import (
    PREFIX,
    SHM_DIR,
    BadSegment,
    check_group,
    create_segment,
    group_files,
    map_segment,
    unlink_file,
)

if TYPE_CHECKING:
    from derecho_async.config import Config

__all__ = ["ShmTransport", "cleanup_group", "from_config", "is_alive"]

_MAGIC = int.from_bytes(b"DAshmRg1", "little")
_VERSION = 1
_HDR = 4096  # header bytes before the data area
# header word indexes (u64): 8 words = one 64-byte cache line apart
_W_MAGIC, _W_VERSION, _W_SENDER, _W_RECEIVER, _W_CAPACITY, _W_PINC = 0, 1, 2, 3, 4, 5
_W_HEAD, _W_PBLOCKED, _W_PCLOSED = 8, 16, 24
_W_TAIL, _W_CSLEEP, _W_CINC, _W_CCLOSED = 32, 40, 48, 56

_REC_HEADER = 32  # a record's header: u32 type, u32 flags, u64 a, u64 b, u64 length
_R_PUSH, _R_MSG = 1, 2
_Record = tuple[int, int, int, bytes | memoryview]
"""A record to write: (type, a, b, payload); :func:`derecho_async.hotpath.ring_put` packs the
header."""
_DG = struct.Struct("<IIQQ")  # kind, zero, member, incarnation
_D_DATA, _D_SPACE, _D_BYE, _D_RESTART, _D_PING = 1, 2, 3, 4, 5
_UCRED = struct.Struct("iII")  # pid, uid, gid
_CMSG_SPACE = socket.CMSG_SPACE(_UCRED.size)

_MIN_RING = 64 << 10
_MAX_RING = 1 << 30
_CONSUME_BUDGET = 1024  # records per ring per poll pass (fairness between rings)

_fence = hotpath.fence
"""Full memory barrier between a store and a later load of the other side's word
(sleeping/head, blocked/tail): a seq_cst fence in the native hot path, an uncontended lock round
trip (a locked RMW on x86-64) in its pure twin; the sweep timer covers any platform where this is
weaker."""


def _record_size(payload: bytes | memoryview) -> int:
    """Bytes a record with ``payload`` takes in a ring: its header, then the payload padded
    to 8 (what :func:`derecho_async.hotpath.ring_put` writes and returns)."""
    return _REC_HEADER + ((len(payload) + 7) & ~7)


def _seg_path(group: str, sender: int, receiver: int) -> str:
    return os.path.join(SHM_DIR, f"{PREFIX}{group}.{sender}.{receiver}")


def _doorbell_name(group: str, member: int) -> str:
    return f"\0dasync/{os.getuid()}/{group}/{member}"


def _group_segments(group: str) -> Iterator[tuple[str, int, int]]:
    """(path, sender, receiver) of every ring segment file of ``group``."""
    for path, sender, receiver in group_files(group):
        if receiver.isdigit() and len(receiver) <= 19:
            yield path, int(sender), int(receiver)


def _read_word(path: str, index: int) -> int | None:
    """One header word of a segment we own, without mapping it (None if unreadable/foreign)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            return None
        raw = os.pread(fd, 8, index * 8)
        return int.from_bytes(raw, "little") if len(raw) == 8 else None
    finally:
        os.close(fd)


def is_alive(probe: socket.socket, group: str, member: int) -> bool:
    """Whether a process holds ``member``'s doorbell (conservative: unsure means alive)."""
    try:
        probe.sendto(_DG.pack(_D_PING, 0, 0, 0), _doorbell_name(group, member))
        return True
    except BlockingIOError:
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True


class _Ring:
    """One mapped ring segment, seen from either end."""

    def __init__(self, path: str, mm: mmap.mmap, capacity: int) -> None:
        self.path = path
        self.mm = mm
        self.capacity = capacity
        whole = memoryview(mm)
        self.words = whole[:_HDR].cast("Q")
        self.data = whole[_HDR : _HDR + capacity]
        whole.release()

    def close(self) -> None:
        self.words.release()
        self.data.release()
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - a view leaked; the mapping dies with us
            log.warning("could not unmap %s: buffers still exported", self.path)


def _create_ring(path: str, sender: int, receiver: int, capacity: int, inc: int) -> _Ring:
    ring = _Ring(path, create_segment(path, _HDR + capacity), capacity)
    w = ring.words
    w[_W_VERSION] = _VERSION
    w[_W_SENDER] = sender
    w[_W_RECEIVER] = receiver
    w[_W_CAPACITY] = capacity
    w[_W_PINC] = inc
    w[_W_CSLEEP] = 1  # nobody attached: the first write rings the doorbell
    _fence()
    w[_W_MAGIC] = _MAGIC
    return ring


def _attach_ring(path: str, sender: int, receiver: int) -> _Ring:
    """Map an existing ring for reading, validating ownership and the whole header."""
    mm = map_segment(path, _HDR + _MIN_RING, _HDR + _MAX_RING)
    size = len(mm)
    ring = _Ring(path, mm, size - _HDR)
    w = ring.words
    problem = None
    if w[_W_MAGIC] != _MAGIC or w[_W_VERSION] != _VERSION:
        problem = "bad magic/version (not initialised yet?)"
    elif w[_W_SENDER] != sender or w[_W_RECEIVER] != receiver:
        problem = f"header names {w[_W_SENDER]}->{w[_W_RECEIVER]}"
    elif w[_W_CAPACITY] != ring.capacity or ring.capacity % 8:
        problem = f"header capacity {w[_W_CAPACITY]} does not match size {size}"
    if problem is not None:
        ring.close()
        raise BadSegment(f"{path}: {problem}")
    return ring


@dataclass(eq=False)
class _OutLink:
    """My ring to one peer (I produce)."""

    peer: int
    ring: _Ring
    head: int = 0
    backlog: collections.deque[_Record] = field(default_factory=collections.deque)
    enqueued: int = 0  # bytes of records ever queued on this link
    written: int = 0  # bytes of records ever written into the ring
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)
    owed: bool = False  # a doorbell must be (re)sent
    refused_since: float | None = None  # the peer's doorbell has been unreachable since
    dead: bool = False


@dataclass(eq=False)
class _InLink:
    """A peer's ring to me (I consume)."""

    peer: int
    ring: _Ring
    inc: int
    tail: int = 0
    parts: list[bytes] | None = None  # fragments of the message being reassembled
    total: int = 0
    got: int = 0


class ShmTransport(Transport):
    """Transport for members of group ``group`` on this host, through shared-memory rings.

    Peers are addressed by member id alone; ``add_peer`` is optional and ignores addresses. ``ring_bytes`` is the data capacity of each ring (rounded up to 4 KiB, 64 KiB to
    1 GiB); ``max_message`` bounds the size of one message (sent or received).
    """

    #: seconds a peer's doorbell may be unreachable while we hold data for it before
    #: ``on_failure`` (class attribute so tests can shorten it)
    unreachable_after: float = 3.0
    _SWEEP_MIN = 0.05
    _SWEEP_MAX = 1.0

    def __init__(
        self, group: str, member_id: int, *, ring_bytes: int = 4 << 20, max_message: int = 1 << 30,
        spin_us: float = 0.0,
    ) -> None:
        super().__init__(member_id)
        if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)) or not (
            0.0 <= spin_us <= 1e6
        ):
            raise ConfigError("spin_us", "a number of microseconds from 0 to 1e6", spin_us)
        self._spin_s = float(spin_us) / 1e6
        self._last_arrival = 0.0
        self._dense = False  # the last two arrivals came within 5 spin windows
        self.group = check_group(group)
        if isinstance(ring_bytes, bool) or not isinstance(ring_bytes, int):
            raise ConfigError("ring_bytes", "an int from 64 KiB to 1 GiB", ring_bytes)
        if not _MIN_RING <= ring_bytes <= _MAX_RING:
            raise ConfigError("ring_bytes", "an int from 64 KiB to 1 GiB", ring_bytes)
        if isinstance(max_message, bool) or not isinstance(max_message, int) or max_message < 0:
            raise ConfigError("max_message", "a non-negative int", max_message)
        self.ring_bytes = (ring_bytes + 4095) & ~4095
        self.max_message = max_message
        self._chunk = min(self.ring_bytes // 2 - _REC_HEADER, 1 << 20) & ~7
        self._inc = (int.from_bytes(os.urandom(8), "little") >> 1) | 1
        self._sock: socket.socket | None = None
        self._out: dict[int, _OutLink] = {}
        self._in: dict[int, _InLink] = {}
        self._dirty: set[_OutLink] = set()
        self._kick_scheduled = False
        self._poll_scheduled = False
        self._sleeping = False
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._sweep_interval = self._SWEEP_MIN
        self._names: dict[int, str] = {}
        self._uid = os.getuid()  # doorbells from other uids are ignored

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, handler: TransportHandler) -> None:
        """Bind this member's doorbell, clean stale segments of the group, attach waiting rings.

        Raises :class:`UsageError` if this member id is already running in the group.
        """
        if not os.path.isdir(SHM_DIR):
            raise UsageError(f"{SHM_DIR} is not available: the shm transport needs Linux")
        if self._closed or self._started:
            self._begin_start(handler)  # raises the right error
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(self._name(self.member_id))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"member {self.member_id} of group {self.group!r} is already running on this host"
                ) from exc
            raise
        sock.setblocking(False)
        self._sock = sock
        loop = self._begin_start(handler)
        keep = self._clean_stale_at_start()
        loop.add_reader(sock.fileno(), self._on_readable)
        for sender in keep:
            self._attach(sender, None)
        self._schedule_poll()
        self._schedule_sweep(self._SWEEP_MIN)

    def _clean_stale_at_start(self) -> list[int]:
        """Remove stale segments of the group; returns senders whose rings wait for me."""
        assert self._sock is not None
        me = self.member_id
        keep: list[int] = []
        notify: set[int] = set()
        for path, s, r in _group_segments(self.group):
            if s == me:  # my outgoing ring from an earlier incarnation
                unlink_file(path)
                notify.add(r)
            elif r == me:
                if not is_alive(self._sock, self.group, s):
                    unlink_file(path)
                elif _read_word(path, _W_CINC) == 0:
                    keep.append(s)  # a live producer wrote to me before I started
                else:  # it was written to my earlier incarnation
                    unlink_file(path)
                    notify.add(s)
            elif self._stale(self.group, path, s, r, self._sock):
                unlink_file(path)
        for peer in notify:
            if peer != me:
                self._doorbell(peer, _D_RESTART, count_refusal=False)
        return keep

    @staticmethod
    def _stale(group: str, path: str, s: int, r: int, probe: socket.socket) -> bool:
        if not is_alive(probe, group, s):
            return True
        return not is_alive(probe, group, r) and (_read_word(path, _W_CINC) or 0) != 0

    @staticmethod
    def cleanup_group(group: str) -> int:
        """Unlink the segments of ``group`` left by dead members; returns how many.

        A segment is stale when its producer is dead, or its consumer attached and is dead.
        With every member of the group gone this removes all of the group's segments.
        """
        check_group(group)
        removed = 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
            probe.setblocking(False)
            for path, s, r in list(_group_segments(group)):
                if ShmTransport._stale(group, path, s, r, probe) and unlink_file(path):
                    removed += 1
        from derecho_async.transport.shmpool import cleanup_pool  # data-plane pool segments

        return removed + cleanup_pool(group)

    @staticmethod
    def segments(group: str) -> list[str]:
        """Paths of the shared-memory segments of ``group`` that exist now (for tests, tools)."""
        check_group(group)
        from derecho_async.transport.shmpool import pool_segments  # data-plane pool segments

        paths = [p for p, _, _ in _group_segments(group)]
        return sorted(paths + [p for p, _, _ in pool_segments(group)])

    async def close(self) -> None:
        """Mark my rings closed, tell peers, unmap and unlink every segment I am an end of."""
        if self._closed:
            return
        self._closed = True
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
        for link in list(self._out.values()):
            link.ring.words[_W_PCLOSED] = 1
            _fence()
            self._doorbell(link.peer, _D_BYE, count_refusal=False)
            self._drop_out(link)
        for inl in list(self._in.values()):
            self._drop_in(inl)
        for path, s, r in list(_group_segments(self.group)):
            if self.member_id in (s, r):
                unlink_file(path)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._dirty.clear()
        self._gate.clear()

    async def drain(self) -> None:
        """Wait until every record queued so far is in its ring (or its link failed)."""
        self._check_usable()
        assert self._loop is not None
        futs = []
        for link in self._out.values():
            if link.written < link.enqueued:
                fut: asyncio.Future[None] = self._loop.create_future()
                link.waiters.append((link.enqueued, fut))
                futs.append(fut)
        if futs:
            await asyncio.gather(*futs)

    # -- sending ----------------------------------------------------------------------------
    def add_peer(self, member_id: int, address: object) -> None:
        """Nothing to learn: peers are addressed by member id alone (``address`` is ignored)."""
        check_member_id(member_id)

    def push(
        self, view_id: int, offset: int, data: bytes | memoryview, targets: Sequence[int]
    ) -> None:
        """Append PUSH records (split at aligned offsets if larger than a record) to each ring."""
        mv, remote = self._check_push(view_id, offset, data, targets)
        if not remote:
            return
        n = len(mv)
        recs: list[_Record]
        if n <= self._chunk - (offset & 7):  # the usual push: one record, nothing to cut
            recs = [(_R_PUSH, view_id, offset, mv)]
        else:
            recs = [
                (_R_PUSH, view_id, offset + pos, mv[pos:end])
                for pos, end in self._aligned_pieces(offset, n, self._chunk)
            ]
        for t in remote:
            self._enqueue(t, recs)

    def send(self, to: int, payload: bytes) -> None:
        """Append a MSG record (fragmented if larger than a record) to the ring to ``to``."""
        mv = self._check_send(to, payload, self.max_message, f"max_message={self.max_message}")
        if mv is None:
            return
        total = len(mv)
        recs: list[_Record] = []
        pos = 0
        while True:
            end = min(total, pos + self._chunk)
            recs.append((_R_MSG, total, pos, mv[pos:end]))
            pos = end
            if pos >= total:
                break
        self._enqueue(to, recs)

    def _out_link(self, peer: int) -> _OutLink | None:
        link = self._out.get(peer)
        if link is not None and not link.dead:
            return link
        path = _seg_path(self.group, self.member_id, peer)
        try:
            ring = _create_ring(path, self.member_id, peer, self.ring_bytes, self._inc)
        except OSError as exc:
            reason = f"cannot create ring {path}: {exc}"
            log.error("member %d: %s", self.member_id, reason)
            assert self._loop is not None
            self._loop.call_soon(self._report_failure, peer, reason)
            return None
        link = _OutLink(peer, ring)
        self._out[peer] = link
        return link

    def _enqueue(self, peer: int, recs: Sequence[_Record]) -> None:
        link = self._out_link(peer)
        if link is None:
            return
        for rec in recs:
            size = _record_size(rec[3])
            link.enqueued += size
            if link.backlog or not self._write(link, rec, size):
                typ, a, b, payload = rec
                link.backlog.append((typ, a, b, bytes(payload)))
            if link.dead:
                return
        if link.backlog:
            self._block(link)
        else:
            _fence()
            link.ring.words[_W_HEAD] = link.head
        self._mark_dirty(link)

    def _write(self, link: _OutLink, rec: _Record, size: int) -> bool:
        """Write one record (of ``size`` bytes in the ring) if it fits (does not publish
        head)."""
        ring = link.ring
        tail = ring.words[_W_TAIL]
        used = link.head - tail
        if not 0 <= used <= ring.capacity:
            self._fail_out(link, f"ring to member {link.peer} corrupted: consumer published "
                                 f"tail {tail} outside [head - capacity, head]")
            return True  # swallowed: the link is dead
        if ring.capacity - used < size:
            return False
        hotpath.ring_put(ring.data, link.head, *rec)
        link.head += size
        link.written += size
        return True

    def _block(self, link: _OutLink) -> None:
        """Backlog not empty: publish what was written, ask for a SPACE doorbell, re-check."""
        w = link.ring.words
        _fence()
        w[_W_HEAD] = link.head
        w[_W_PBLOCKED] = 1
        _fence()
        self._flush(link)

    def _flush(self, link: _OutLink) -> None:
        """Move backlog records into the ring while they fit; publish head."""
        if link.dead:
            return
        wrote = False
        while link.backlog:
            rec = link.backlog[0]
            if not self._write(link, rec, _record_size(rec[3])):
                break
            if link.dead:
                return
            link.backlog.popleft()
            wrote = True
        w = link.ring.words
        if wrote:
            _fence()
            w[_W_HEAD] = link.head
            self._mark_dirty(link)
        if not link.backlog:
            w[_W_PBLOCKED] = 0
        if link.waiters:
            keep = []
            for target, fut in link.waiters:
                if link.written >= target:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((target, fut))
            link.waiters = keep

    def _mark_dirty(self, link: _OutLink) -> None:
        self._dirty.add(link)
        if not self._kick_scheduled and self._loop is not None:
            self._kick_scheduled = True
            self._loop.call_soon(self._kick)

    def _kick(self) -> None:
        """After a batch of writes: ring the doorbell of each consumer that sleeps."""
        self._kick_scheduled = False
        dirty, self._dirty = self._dirty, set()
        if self._closed or not dirty:
            return
        _fence()
        for link in dirty:
            if link.dead:
                continue
            w = link.ring.words
            if w[_W_CCLOSED]:
                self._consumer_closed(link)
            elif w[_W_CSLEEP] or link.owed:
                self._ring_data(link)

    def _consumer_closed(self, link: _OutLink) -> None:
        """The consumer closed its end: a failure if it left data of ours unread."""
        if link.backlog or link.ring.words[_W_TAIL] != link.head:
            self._fail_out(link, f"member {link.peer} closed its end of the ring with data unread")
        else:  # a goodbye after reading everything: reported only if we send to it again
            log.info("member %d: member %d closed its ring", self.member_id, link.peer)
            self._drop_out(link)

    def _ring_data(self, link: _OutLink) -> None:
        link.owed = not self._doorbell(link.peer, _D_DATA, link=link)

    # -- doorbells ----------------------------------------------------------------------------
    def _name(self, member: int) -> str:
        name = self._names.get(member)
        if name is None:
            name = self._names[member] = _doorbell_name(self.group, member)
        return name

    def _doorbell(
        self, peer: int, kind: int, *, link: _OutLink | None = None, count_refusal: bool = True
    ) -> bool:
        """Send one datagram; False if it must be retried (full queue or peer not running)."""
        if self._sock is None:
            return True
        try:
            self._sock.sendto(_DG.pack(kind, 0, self.member_id, self._inc), self._name(peer))
        except BlockingIOError:
            self._schedule_sweep(self._SWEEP_MIN)
            return False
        except (ConnectionRefusedError, FileNotFoundError):
            if link is not None and count_refusal and self._loop is not None:
                now = self._loop.time()
                if link.refused_since is None:
                    link.refused_since = now
                elif now - link.refused_since > self.unreachable_after:
                    self._fail_out(link, f"member {peer} is not running (its doorbell is unbound)")
                    return True
                self._schedule_sweep(self._SWEEP_MIN)
            return False
        except OSError as exc:
            log.warning("member %d: doorbell to member %d failed: %s", self.member_id, peer, exc)
            return False
        if link is not None:
            link.refused_since = None
        return True

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        uid = self._uid
        cmsg_space = _CMSG_SPACE
        for _ in range(256):
            try:
                data, anc, _flags, _addr = sock.recvmsg(64, cmsg_space)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.warning("member %d: doorbell recv failed: %s", self.member_id, exc)
                break
            cred_uid = None
            for level, typ, cdata in anc:
                if (
                    level == socket.SOL_SOCKET
                    and typ == socket.SCM_CREDENTIALS
                    and len(cdata) >= _UCRED.size
                ):
                    cred_uid = _UCRED.unpack_from(cdata)[1]
            if cred_uid != uid or len(data) != _DG.size:
                log.debug("member %d: ignored a foreign or malformed doorbell", self.member_id)
                continue
            kind, zero, member, inc = _DG.unpack(data)
            if zero or member == self.member_id:
                continue
            self._on_doorbell(kind, member, inc)
        self._poll()

    def _on_doorbell(self, kind: int, peer: int, inc: int) -> None:
        if kind == _D_DATA:
            inl = self._in.get(peer)
            if inl is None or inl.inc != inc:
                self._attach(peer, inc)
        elif kind == _D_SPACE:
            link = self._out.get(peer)
            if link is not None:
                self._flush(link)
        elif kind == _D_BYE:
            pass  # the poll below drains the ring, then sees the producer's closed flag
        elif kind == _D_RESTART:
            self._peer_restarted(peer, inc)

    def _peer_restarted(self, peer: int, inc: int) -> None:
        dropped = False
        link = self._out.get(peer)
        if link is not None and link.ring.words[_W_CINC] not in (0, inc):
            self._drop_out(link, unlink=True)
            dropped = True
        inl = self._in.get(peer)
        if inl is not None and inl.inc != inc:
            self._drop_in(inl, unlink=False)
            dropped = True
        if dropped:
            reason = f"member {peer} restarted (its previous incarnation is gone)"
            log.info("member %d: %s", self.member_id, reason)
            self._report_failure(peer, reason)

    # -- receiving ----------------------------------------------------------------------------
    def _attach(self, sender: int, inc: int | None) -> None:
        old = self._in.get(sender)
        path = _seg_path(self.group, sender, self.member_id)
        try:
            ring = _attach_ring(path, sender, self.member_id)
        except BadSegment as exc:
            log.warning(
                "member %d: cannot attach ring from member %d: %s", self.member_id, sender, exc
            )
            return
        w = ring.words
        pinc = w[_W_PINC]
        if old is not None and old.inc == pinc:
            ring.close()  # same ring (a stale doorbell)
            return
        if inc is not None and pinc != inc:
            log.debug(
                "member %d: ring from %d has incarnation %x, doorbell %x",
                self.member_id,
                sender,
                pinc,
                inc,
            )
        if w[_W_CINC] not in (0, self._inc):
            ring.close()
            log.warning(
                "member %d: ring from member %d belongs to my earlier incarnation",
                self.member_id,
                sender,
            )
            self._doorbell(sender, _D_RESTART, count_refusal=False)
            return
        if old is not None:
            self._drop_in(old, unlink=False)
        w[_W_CINC] = self._inc
        w[_W_CSLEEP] = 1 if self._sleeping else 0
        self._in[sender] = _InLink(sender, ring, pinc, tail=w[_W_TAIL])
        self._schedule_poll()

    def _schedule_poll(self) -> None:
        if not self._poll_scheduled and self._loop is not None and not self._closed:
            self._poll_scheduled = True
            self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        """Consume every incoming ring; re-poll while work arrives, else publish sleeping."""
        self._poll_scheduled = False
        if self._closed:
            return
        if self._sleeping:
            self._sleeping = False
            for inl in self._in.values():
                inl.ring.words[_W_CSLEEP] = 0
        progress = False
        for inl in list(self._in.values()):
            progress |= self._consume(inl)
        if progress:
            if self._spin_s:
                now = time.monotonic()
                # spin only in dense traffic: an idle group's heartbeats must not buy a spin each
                self._dense = now - self._last_arrival < 5 * self._spin_s
                self._last_arrival = now
            self._schedule_poll()
            return
        if self._dense and time.monotonic() - self._last_arrival < self._spin_s:
            self._schedule_poll()  # keep polling a little: the next record is likely close
            return
        self._sleeping = True
        for inl in self._in.values():
            inl.ring.words[_W_CSLEEP] = 1
        _fence()
        if any(inl.ring.words[_W_HEAD] != inl.tail for inl in self._in.values()):
            self._schedule_poll()

    def _consume(self, inl: _InLink) -> bool:
        ring = inl.ring
        w = ring.words
        cap = ring.capacity
        head = hotpath.load_u64(w, _W_HEAD * 8)  # acquire: the records it publishes are visible
        tail = inl.tail
        if head == tail:
            if w[_W_PCLOSED]:
                _fence()
                if w[_W_HEAD] == tail:
                    log.debug("member %d: member %d closed its ring", self.member_id, inl.peer)
                    self._drop_in(inl, unlink=True)
            return False
        if not 0 < head - tail <= cap or head % 8:
            self._broken(inl, f"published head {head} is not within the ring (tail {tail})")
            return False
        try:
            # one call parses and validates the batch (native: one copy per payload)
            records, tail, error = hotpath.ring_scan(ring.data, tail, head, _CONSUME_BUDGET)
            peer = inl.peer
            arrived = self._gate.push_arrived
            for typ, a, b, payload in records:
                if typ == _R_PUSH:
                    arrived(a, peer, b, payload)
                else:
                    self._message_part(inl, a, b, payload)
                if self._in.get(peer) is not inl:
                    return True  # dropped meanwhile (closed, restarted, broken)
            if error is not None:
                raise BadSegment(error)
        except BadSegment as exc:
            self._broken(inl, str(exc))
            return True
        inl.tail = tail
        hotpath.store_u64(w, _W_TAIL * 8, tail)  # release: our reads of the records are done
        _fence()
        if w[_W_PBLOCKED]:
            self._doorbell(inl.peer, _D_SPACE, count_refusal=False)
        return True

    def _message_part(self, inl: _InLink, total: int, off: int, chunk: bytes) -> None:
        if off == 0:
            if inl.parts is not None:
                raise BadSegment("a new message started before the previous one was complete")
            if total > self.max_message:
                raise BadSegment(
                    f"message of {total} bytes exceeds max_message={self.max_message}"
                )
            inl.parts, inl.total, inl.got = [], total, 0
        elif inl.parts is None or off != inl.got or total != inl.total:
            raise BadSegment(f"message fragment at {off} out of order (have {inl.got})")
        assert inl.parts is not None
        if len(chunk) > inl.total - inl.got or (not chunk and inl.total):
            raise BadSegment(f"message fragment of {len(chunk)} bytes does not fit the message")
        inl.parts.append(chunk)
        inl.got += len(chunk)
        if inl.got == inl.total:
            parts, inl.parts = inl.parts, None
            self._deliver_message(inl.peer, parts[0] if len(parts) == 1 else b"".join(parts))

    def _broken(self, inl: _InLink, why: str) -> None:
        reason = f"protocol violation: ring from member {inl.peer}: {why}"
        log.error("member %d: %s; abandoning the ring", self.member_id, reason)
        inl.ring.words[_W_CCLOSED] = 1
        self._drop_in(inl, unlink=True)
        self._report_failure(inl.peer, reason)

    def _drop_in(self, inl: _InLink, *, unlink: bool = True) -> None:
        if self._in.get(inl.peer) is inl:
            del self._in[inl.peer]
        inl.ring.words[_W_CCLOSED] = 1
        # unlink only if the file is still this ring (not a newer incarnation's)
        if unlink and _read_word(inl.ring.path, _W_PINC) == inl.inc:
            unlink_file(inl.ring.path)
        inl.ring.close()

    def _drop_out(self, link: _OutLink, *, unlink: bool = True) -> None:
        link.dead = True
        if self._out.get(link.peer) is link:
            del self._out[link.peer]
        self._dirty.discard(link)
        link.backlog.clear()
        for _, fut in link.waiters:
            if not fut.done():
                fut.set_result(None)
        link.waiters.clear()
        if unlink and _read_word(link.ring.path, _W_PINC) == self._inc:
            unlink_file(link.ring.path)
        link.ring.close()

    def _fail_out(self, link: _OutLink, reason: str) -> None:
        if link.dead:
            return
        # A peer that closed its ring (it left or ended) is routine; anything else is worth a warning.
        level = logging.INFO if "closed its end" in reason else logging.WARNING
        log.log(level, "member %d: link to member %d failed: %s", self.member_id, link.peer, reason)
        self._drop_out(link)
        assert self._loop is not None
        self._loop.call_soon(self._report_failure, link.peer, reason)

    # -- safety net ---------------------------------------------------------------------------
    def _schedule_sweep(self, delay: float) -> None:
        if self._loop is None or self._closed:
            return
        if self._sweep_handle is not None:
            if self._sweep_handle.when() <= self._loop.time() + delay:
                return
            self._sweep_handle.cancel()
        self._sweep_interval = delay
        self._sweep_handle = self._loop.call_later(delay, self._sweep)

    def _sweep(self) -> None:
        """Periodic re-check: rings with data, backlogs, doorbells owed; backs off when idle."""
        self._sweep_handle = None
        if self._closed:
            return
        busy = False
        if any(inl.ring.words[_W_HEAD] != inl.tail for inl in self._in.values()):
            busy = True
            self._poll()
        for link in list(self._out.values()):
            if link.dead:
                continue
            if link.backlog:
                busy = True
                self._flush(link)
                if link.backlog and not link.dead:
                    self._doorbell(link.peer, _D_PING, link=link)
            if link.owed and not link.dead:
                busy = True
                self._ring_data(link)
            if not link.dead and link.ring.words[_W_CCLOSED]:
                self._consumer_closed(link)
        delay = self._SWEEP_MIN if busy else min(self._sweep_interval * 2, self._SWEEP_MAX)
        self._schedule_sweep(delay)


def from_config(config: Config) -> ShmTransport:
    """The shm transport of the member ``config`` describes (see ``transport.registry``): it
    spins ``spin_us`` before sleeping, by default only where there are 8 cores or more."""
    spin = config.spin_us
    if spin is None:
        spin = 200.0 if (os.cpu_count() or 1) >= 8 else 0.0
    return ShmTransport(config.group, config.member_id, spin_us=spin,
                        max_message=GROUP_MESSAGE_LIMIT)


def cleanup_group(group: str) -> None:
    """Unlink what dead members of ``group`` left in shared memory (see
    :meth:`ShmTransport.cleanup_group`)."""
    ShmTransport.cleanup_group(group)
