"""ShmTransport: members of one group on one host, over shared-memory rings and doorbells.

Theory of operation (DESIGN.md §5.2): every ordered pair (sender -> receiver) has a ring
(:mod:`.ring`), created lazily by the sender. Pushes and messages share the ring, so each link
is FIFO across both; a push larger than a record is split at 8-byte aligned table offsets, a
message into fragments the receiver reassembles (bounded by ``max_message``). Producer: append
records, publish ``head``; a record that does not fit waits in a FIFO backlog (never dropped),
the producer sets ``blocked`` and the consumer rings back after freeing space. Consumer: read
and validate records up to ``head``, deliver (pushes through the PushGate), publish ``tail``; a
ring whose framing is broken is abandoned and reported, a bad push inside good framing only
dropped and reported. Wake-ups (:mod:`.doorbell`): a producer rings only if the consumer
published ``sleeping``, which it does only after a pass found every ring empty, then re-checks;
with ``spin_us`` and dense traffic it polls a while first. A full fence separates each side's
store from its load of the other side's word, and a slow sweep timer (50 ms backing off to 1 s)
re-polls and retries doorbells, so a lost wake-up costs latency, never data or liveness.
Lifetime: ``close()`` marks its rings closed and unlinks every segment it is an end of; ``start()``
binds the doorbell, then removes stale segments (:mod:`.cleanup`) and tells restarted peers. At
each view (``set_view``) the members that left it are *departed*: once a departed member is dead
(the doorbell rule), every segment owned by or paired with it is removed (its links here are
dropped); one still alive is probed again at each sweep until it is dead or back in a view.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from derecho_async import hotpath
from derecho_async.errors import ConfigError, GroupClosed, UsageError
from derecho_async.transport.base import (
    GROUP_MESSAGE_LIMIT,
    Transport,
    TransportHandler,
    check_member_id,
    log,
)
from derecho_async.transport.shm import census, cleanup
from derecho_async.transport.shm.beacon import RingBeacon
from derecho_async.transport.shm.cleanup import Departures
from derecho_async.transport.shm.doorbell import (
    ABSENT,
    D_BYE,
    D_DATA,
    D_PING,
    D_RESTART,
    D_SPACE,
    FULL,
    SENT,
    Doorbell,
)
from derecho_async.transport.shm.files import (
    SHM_DIR,
    BadSegment,
    check_group,
    read_word,
    unlink_file,
)
from derecho_async.transport.shm.links import InLink, OutLink
from derecho_async.transport.shm.ring import (
    MAX_RING,
    MIN_RING,
    R_MSG,
    R_PUSH,
    REC_HEADER,
    W_CCLOSED,
    W_CINC,
    W_CSLEEP,
    W_HEAD,
    W_PALIVE,
    W_PBLOCKED,
    W_PCLOSED,
    W_PINC,
    W_TAIL,
    Record,
    attach_ring,
    create_ring,
    fence,
    record_size,
    ring_path,
    ring_segments,
)
from derecho_async.transport.unreachable import UnreachableLog

if TYPE_CHECKING:
    from derecho_async.config import Config

__all__ = ["ShmTransport", "from_config"]

_CONSUME_BUDGET = 1024  # records per ring per poll pass (fairness between rings)


class ShmTransport(Transport):
    """Transport for members of group ``group`` on this host, through shared-memory rings.

    Peers are addressed by member id alone; ``add_peer`` is optional and ignores addresses.
    ``ring_bytes`` is the data capacity of each ring (rounded up to 4 KiB, 64 KiB to 1 GiB);
    ``max_message`` bounds the size of one message (sent or received).
    """

    #: seconds a peer's doorbell may be unreachable while we hold data for it before
    #: ``on_failure`` (class attribute so tests can shorten it)
    unreachable_after: float = 3.0
    _SWEEP_MIN = 0.05
    _SWEEP_MAX = 1.0

    def __init__(
        self, group: str, member_id: int, *, ring_bytes: int = 4 << 20, max_message: int = 1 << 30,
        spin_us: float = 0.0, beacon_s: float = 0.0, hold_s: float = 0.0,
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
        if not MIN_RING <= ring_bytes <= MAX_RING:
            raise ConfigError("ring_bytes", "an int from 64 KiB to 1 GiB", ring_bytes)
        if isinstance(max_message, bool) or not isinstance(max_message, int) or max_message < 0:
            raise ConfigError("max_message", "a non-negative int", max_message)
        self.ring_bytes = (ring_bytes + 4095) & ~4095
        self.max_message = max_message
        self._chunk = min(self.ring_bytes // 2 - REC_HEADER, 1 << 20) & ~7
        self._inc = (int.from_bytes(os.urandom(8), "little") >> 1) | 1
        self._bell: Doorbell | None = None
        self._out: dict[int, OutLink] = {}
        self._in: dict[int, InLink] = {}
        #: the (sender, incarnation) pairs whose ring could not be attached: said once each
        self._attach_failed: set[tuple[int, int | None]] = set()
        self._dirty: set[OutLink] = set()
        self._kick_scheduled = False
        self._poll_scheduled = False
        self._sleeping = False
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._sweep_interval = self._SWEEP_MIN
        self._departed = Departures(member_id)  # left a view, alive when last probed
        self._beacon = RingBeacon(beacon_s, hold_s)  # liveness off the loop (.beacon)
        #: a peer whose doorbell stays unbound is a WARNING once per interval, else DEBUG
        self._unreachable = UnreachableLog()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, handler: TransportHandler) -> None:
        """Bind this member's doorbell, clean stale segments of the group, attach waiting rings.

        Raises :class:`UsageError` if this member id is already running in the group.
        """
        if not os.path.isdir(SHM_DIR):
            raise UsageError(f"{SHM_DIR} is not available: the shm transport needs Linux")
        if self._closed or self._started:
            self._begin_start(handler)  # raises the right error
        self._bell = bell = Doorbell(self.group, self.member_id, self._inc)
        loop = self._begin_start(handler)
        self._beacon.start()
        keep, notify = cleanup.clean_at_start(bell)
        for peer in notify:
            self._doorbell(peer, D_RESTART, count_refusal=False)
        loop.add_reader(bell.fileno(), self._on_readable)
        for sender in keep:
            self._attach(sender, None)
        self._schedule_poll()
        self._schedule_sweep(self._SWEEP_MIN)
        if self._departed:  # a view installed before start
            self._remove_departed()

    def set_view(self, view_id: int, members: Sequence[int], row_bytes: int) -> None:
        """Install view ``view_id``; the members of the previous view that are not in it are
        departed: the segments owned by or paired with each of them are removed once it is dead
        (now, or at a later sweep)."""
        super().set_view(view_id, members, row_bytes)
        self._beacon.set_view(view_id, self._out.values())
        if self._departed.view(members):
            self._remove_departed()

    def _remove_departed(self) -> None:
        """Remove the segments of the departed members that are dead; the others stay departed
        (probed again at the next sweep)."""
        bell = self._bell
        if bell is None or self._closed:
            return
        dead = self._departed.take_dead(bell.alive)
        if dead:
            self._forget(dead)
            removed = cleanup.remove_members(self.group, dead)
            log.info("member %d: removed %d shared-memory segments of departed members %s",
                     self.member_id, removed, sorted(dead))

    def _forget(self, members: Iterable[int]) -> None:
        """Drop (and unlink) my links with ``members``, which are gone for good."""
        for m in members:
            link = self._out.get(m)
            if link is not None:
                self._drop_out(link)
            inl = self._in.get(m)
            if inl is not None:
                self._drop_in(inl)

    def live_members(self) -> list[int]:
        """The other members of this group whose process runs now (their doorbell is bound),
        lowest id first (:mod:`.census`); none before :meth:`start` or after :meth:`close`."""
        if self._bell is None or self._closed:
            return []
        return [m for m in census.live_members(self.group) if m != self.member_id]

    @staticmethod
    def cleanup_group(group: str) -> int:
        """Unlink the segments of ``group`` left by dead members (rings and the data plane's
        pool segments); returns how many. With every member gone this removes them all."""
        return cleanup.cleanup_group(group)

    @staticmethod
    def segments(group: str) -> list[str]:
        """Paths of the shared-memory segments of ``group`` that exist now (for tests, tools)."""
        return cleanup.segments(group)

    async def close(self) -> None:
        """Mark my rings closed, tell peers, unmap and unlink every segment I am an end of."""
        if self._closed:
            return
        self._closed = True
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        if self._bell is not None and self._loop is not None:
            self._loop.remove_reader(self._bell.fileno())
        self._beacon.stop()
        for link in list(self._out.values()):
            link.ring.words[W_PCLOSED] = 1
            fence()
            self._doorbell(link.peer, D_BYE, count_refusal=False)
            self._drop_out(link)
        for inl in list(self._in.values()):
            self._drop_in(inl)
        for path, s, r in list(ring_segments(self.group)):
            if self.member_id in (s, r):
                unlink_file(path)
        if self._bell is not None:
            self._bell.close()
            self._bell = None
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
        recs: list[Record]
        if n <= self._chunk - (offset & 7):  # the usual push: one record, nothing to cut
            recs = [(R_PUSH, view_id, offset, mv)]
        else:
            recs = [
                (R_PUSH, view_id, offset + pos, mv[pos:end])
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
        recs: list[Record] = []
        pos = 0
        while True:
            end = min(total, pos + self._chunk)
            recs.append((R_MSG, total, pos, mv[pos:end]))
            pos = end
            if pos >= total:
                break
        self._enqueue(to, recs)

    def _out_link(self, peer: int) -> OutLink | None:
        link = self._out.get(peer)
        if link is not None and not link.dead:
            return link
        path = ring_path(self.group, self.member_id, peer)
        try:
            ring = create_ring(path, self.member_id, peer, self.ring_bytes, self._inc)
        except OSError as exc:
            reason = f"cannot create ring {path}: {exc}"
            assert self._loop is not None
            if exc.errno == errno.EFBIG:  # a file size limit below the ring: never better
                reason += (f" (this process may not write files of {self.ring_bytes} bytes:"
                           " raise its RLIMIT_FSIZE, `ulimit -f`)")
                log.log(self._unreachable.level(-1), "member %d: %s", self.member_id, reason)
                self._loop.call_soon(self._report_refusal, peer, GroupClosed(reason))
                return None
            # (/dev/shm full, out of memory: it may pass; said once per interval, not per try)
            log.log(self._unreachable.level(peer), "member %d: %s", self.member_id, reason)
            self._loop.call_soon(self._report_failure, peer, reason)
            return None
        link = OutLink(peer, ring)
        self._out[peer] = link
        self._beacon.produce(link)
        return link

    def _enqueue(self, peer: int, recs: Sequence[Record]) -> None:
        link = self._out_link(peer)
        if link is None:
            return
        for rec in recs:
            size = record_size(rec[3])
            link.enqueued += size
            if link.backlog or not self._write(link, rec, size):
                typ, a, b, payload = rec
                link.backlog.append((typ, a, b, bytes(payload)))
            if link.dead:
                return
        if link.backlog:
            self._block(link)
        else:
            fence()
            link.ring.words[W_HEAD] = link.head
        self._mark_dirty(link)

    def _write(self, link: OutLink, rec: Record, size: int) -> bool:
        """Write one record (of ``size`` bytes in the ring) if it fits (does not publish
        head)."""
        ring = link.ring
        tail = ring.words[W_TAIL]
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

    def _block(self, link: OutLink) -> None:
        """Backlog not empty: publish what was written, ask for a SPACE doorbell, re-check."""
        w = link.ring.words
        fence()
        w[W_HEAD] = link.head
        w[W_PBLOCKED] = 1
        fence()
        self._flush(link)

    def _flush(self, link: OutLink) -> None:
        """Move backlog records into the ring while they fit; publish head."""
        if link.dead:
            return
        wrote = False
        while link.backlog:
            rec = link.backlog[0]
            if not self._write(link, rec, record_size(rec[3])):
                break
            if link.dead:
                return
            link.backlog.popleft()
            wrote = True
        w = link.ring.words
        if wrote:
            fence()
            w[W_HEAD] = link.head
            self._mark_dirty(link)
        if not link.backlog:
            w[W_PBLOCKED] = 0
        if link.waiters:
            keep = []
            for target, fut in link.waiters:
                if link.written >= target:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    keep.append((target, fut))
            link.waiters = keep

    def _mark_dirty(self, link: OutLink) -> None:
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
        fence()
        for link in dirty:
            if link.dead:
                continue
            w = link.ring.words
            if w[W_CCLOSED]:
                self._consumer_closed(link)
            elif w[W_CSLEEP] or link.owed:
                self._ring_data(link)

    def _consumer_closed(self, link: OutLink) -> None:
        """The consumer closed its end: a failure if it left data of ours unread."""
        if link.backlog or link.ring.words[W_TAIL] != link.head:
            self._fail_out(link, f"member {link.peer} closed its end of the ring with data unread")
        else:  # a goodbye after reading everything: reported only if we send to it again
            log.info("member %d: member %d closed its ring", self.member_id, link.peer)
            self._drop_out(link)

    def _ring_data(self, link: OutLink) -> None:
        link.owed = not self._doorbell(link.peer, D_DATA, link=link)

    # -- doorbells ----------------------------------------------------------------------------
    def _doorbell(
        self, peer: int, kind: int, *, link: OutLink | None = None, count_refusal: bool = True
    ) -> bool:
        """Send one datagram; False if it must be retried (full queue or peer not running)."""
        bell = self._bell
        if bell is None:
            return True
        status = bell.ring(peer, kind)
        if status == SENT:
            if link is not None:
                link.refused_since = None
                self._unreachable.reached(peer)
            return True
        if status == FULL:
            self._schedule_sweep(self._SWEEP_MIN)
        elif status == ABSENT and link is not None and count_refusal and self._loop is not None:
            now = self._loop.time()
            if link.refused_since is None:
                link.refused_since = now
            elif now - link.refused_since > self.unreachable_after:
                # a joiner's contact that is not up fails each ring it is sent: say so once
                self._fail_out(link, f"member {peer} is not running (its doorbell is unbound)",
                               self._unreachable.level(peer))
                return True
            self._schedule_sweep(self._SWEEP_MIN)
        return False

    def _on_readable(self) -> None:
        bell = self._bell
        if bell is None:
            return
        for kind, member, inc in bell.receive():
            self._on_doorbell(kind, member, inc)
        self._poll()

    def _on_doorbell(self, kind: int, peer: int, inc: int) -> None:
        if kind == D_DATA:
            inl = self._in.get(peer)
            if inl is None or inl.inc != inc:
                self._attach(peer, inc)
        elif kind == D_SPACE:
            link = self._out.get(peer)
            if link is not None:
                self._flush(link)
        elif kind == D_BYE:
            pass  # the poll below drains the ring, then sees the producer's closed flag
        elif kind == D_RESTART:
            self._peer_restarted(peer, inc)

    def _peer_restarted(self, peer: int, inc: int) -> None:
        dropped = False
        link = self._out.get(peer)
        if link is not None and link.ring.words[W_CINC] not in (0, inc):
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
        path = ring_path(self.group, sender, self.member_id)
        try:
            ring = attach_ring(path, sender, self.member_id)
        except BadSegment as exc:
            # a dead sender's doorbells may keep coming: say it once per incarnation
            first = (sender, inc) not in self._attach_failed
            if first and len(self._attach_failed) < 1024:
                self._attach_failed.add((sender, inc))
            log.log(logging.WARNING if first else logging.DEBUG,
                    "member %d: cannot attach ring from member %d: %s", self.member_id, sender,
                    exc)
            return
        w = ring.words
        pinc = w[W_PINC]
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
        if w[W_CINC] not in (0, self._inc):
            ring.close()
            log.warning(
                "member %d: ring from member %d belongs to my earlier incarnation",
                self.member_id,
                sender,
            )
            self._doorbell(sender, D_RESTART, count_refusal=False)
            return
        if old is not None:
            self._drop_in(old, unlink=False)
        w[W_CINC] = self._inc
        w[W_CSLEEP] = 1 if self._sleeping else 0
        self._in[sender] = InLink(sender, ring, pinc, tail=w[W_TAIL], alive=w[W_PALIVE])
        self._schedule_poll()

    @property
    def beacon_on(self) -> bool:
        """Whether my beacon thread runs (from start to close, unless ``beacon_s`` is 0)."""
        return self._beacon.on

    def beacon_tick(self) -> list[int]:
        """The loop runs; the senders whose beacon moved in their ring to me, in my view (one
        gone on to a view without me does not count: I must suspect it and wedge)."""
        return self._beacon.tick(self._in.values())

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
                inl.ring.words[W_CSLEEP] = 0
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
            inl.ring.words[W_CSLEEP] = 1
        fence()
        if any(inl.ring.words[W_HEAD] != inl.tail for inl in self._in.values()):
            self._schedule_poll()

    def _consume(self, inl: InLink) -> bool:
        ring = inl.ring
        w = ring.words
        cap = ring.capacity
        head = hotpath.load_u64(w, W_HEAD * 8)  # acquire: the records it publishes are visible
        tail = inl.tail
        if head == tail:
            if w[W_PCLOSED]:
                fence()
                if w[W_HEAD] == tail:
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
                if typ == R_PUSH:
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
        hotpath.store_u64(w, W_TAIL * 8, tail)  # release: our reads of the records are done
        fence()
        if w[W_PBLOCKED]:
            self._doorbell(inl.peer, D_SPACE, count_refusal=False)
        return True

    def _message_part(self, inl: InLink, total: int, off: int, chunk: bytes) -> None:
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

    def _broken(self, inl: InLink, why: str) -> None:
        reason = f"protocol violation: ring from member {inl.peer}: {why}"
        log.error("member %d: %s; abandoning the ring", self.member_id, reason)
        inl.ring.words[W_CCLOSED] = 1
        self._drop_in(inl, unlink=True)
        self._report_failure(inl.peer, reason)

    def _drop_in(self, inl: InLink, *, unlink: bool = True) -> None:
        if self._in.get(inl.peer) is inl:
            del self._in[inl.peer]
        inl.ring.words[W_CCLOSED] = 1
        # unlink only if the file is still this ring (not a newer incarnation's)
        if unlink and read_word(inl.ring.path, W_PINC) == inl.inc:
            unlink_file(inl.ring.path)
        inl.ring.close()

    def _drop_out(self, link: OutLink, *, unlink: bool = True) -> None:
        link.dead = True
        if self._out.get(link.peer) is link:
            del self._out[link.peer]
        self._dirty.discard(link)
        link.backlog.clear()
        for _, fut in link.waiters:
            if not fut.done():
                fut.set_result(None)
        link.waiters.clear()
        if unlink and read_word(link.ring.path, W_PINC) == self._inc:
            unlink_file(link.ring.path)
        self._beacon.drop(link)
        link.ring.close()

    def _fail_out(self, link: OutLink, reason: str, level: int | None = None) -> None:
        if link.dead:
            return
        # A peer that closed its ring (it left or ended) is routine; anything else is worth a
        # warning, unless the caller says otherwise.
        if level is None:
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
        """Periodic re-check: rings with data, backlogs, doorbells owed, departed members still
        alive; backs off when idle."""
        self._sweep_handle = None
        if self._closed:
            return
        if self._departed:
            self._remove_departed()
        busy = False
        if any(inl.ring.words[W_HEAD] != inl.tail for inl in self._in.values()):
            busy = True
            self._poll()
        for link in list(self._out.values()):
            if link.dead:
                continue
            if link.backlog:
                busy = True
                self._flush(link)
                if link.backlog and not link.dead:
                    self._doorbell(link.peer, D_PING, link=link)
            if link.owed and not link.dead:
                busy = True
                self._ring_data(link)
            if not link.dead and link.ring.words[W_CCLOSED]:
                self._consumer_closed(link)
        delay = self._SWEEP_MIN if busy else min(self._sweep_interval * 2, self._SWEEP_MAX)
        self._schedule_sweep(delay)


def from_config(config: Config) -> ShmTransport:
    """The shm transport of the member ``config`` describes (see ``transport.registry``): it
    spins ``spin_us`` before sleeping, by default only where there are 8 cores or more; its
    beacon counts every ``heartbeat_ms`` while the loop ran within ``max_loop_hold_ms`` (none
    when that is 0)."""
    spin = config.spin_us
    if spin is None:
        spin = 200.0 if (os.cpu_count() or 1) >= 8 else 0.0
    hold = config.max_loop_hold_ms / 1000.0
    return ShmTransport(config.group, config.member_id, spin_us=spin,
                        max_message=GROUP_MESSAGE_LIMIT,
                        beacon_s=max(config.heartbeat_ms / 1000.0, 0.001) if hold else 0.0,
                        hold_s=hold)
