# Theory of operation
# -------------------
# ``SimNetwork`` is a simulated fabric for real transports: each member gets a ``SimTransport``
# (a full :class:`~derecho_async.transport.base.Transport`, so a real Driver and Group run on it),
# and every ordered pair of member ids is a FIFO *link* holding the pushes and messages in flight
# on it. A send copies its bytes, draws a delay from the network's seeded generator and queues the
# item on the link with due time ``max(now + delay, due time of the link's last item)``: nothing
# overtakes. Each link has at most one loop timer, armed for its head item; when it fires, the
# head lands (a push through the receiver's PushGate, a message to its handler) together with
# the items behind it that are due by then. Landing happens only from timer callbacks, never from
# inside a call into the transport.
#
# The faults are SimCluster's (derecho_async.testing.sim), moved down to the transport:
# * a push of several 8-byte words may be cut, on table-aligned word boundaries, into pieces that
#   land at distinct virtual instants (each piece goes through the PushGate like a whole push), so
#   the receiver's protocol steps run between them;
# * ``crash(member)`` kills an endpoint: what it sends afterwards and what is addressed to it is
#   dropped, and of what it had in flight on each outgoing link only a random prefix still lands,
#   possibly ending in a word-aligned part of a push;
# * ``partition(*sides)`` holds (does not drop) everything on links between sides until
#   ``heal()``; then it lands in link order;
# * per-link extra delay and jitter (``set_link``);
# * ``stall(member)`` holds everything on the links to and from ``member`` until
#   ``unstall(member)`` (or ``heal()``), while its beacon still reaches its peers: a member whose
#   event loop a handler holds, as its peers see it.
# A network made with ``beacon_hold_s`` gives its endpoints a beacon (the native liveness thread
# of the real transports): ``beacon_tick`` at a member returns every other live, started
# endpoint on its side of any partition, in the same view, whose own loop ticked within
# ``beacon_hold_s`` (stalled or not); without it endpoints have none and heartbeats alone tell
# liveness.
# Traffic for an id with no started endpoint is held on its link until one starts; traffic for an
# id whose endpoint crashed or closed is dropped silently (logged at debug). No failure is ever
# reported to a handler: detecting dead peers is the protocol's job. The only randomness is the
# ``random.Random`` given to the network, drawn in send / crash order, and the only clock is the
# event loop's, so on a VirtualTimeLoop a run replays bit for bit. ``crash_group`` crashes a whole
# Group: its endpoint, plus its driver's clock and steps, with no orderly leave.
"""A seeded, simulated network whose endpoints are real transports (for virtual-time runs)."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from derecho_async.errors import GroupClosed, UsageError
from derecho_async.transport.base import (
    GROUP_MESSAGE_LIMIT,
    Transport,
    TransportHandler,
    check_member_id,
)

if TYPE_CHECKING:
    from derecho_async.api import Group

__all__ = ["SimNetwork", "SimTransport", "TraceEvent", "crash_group"]

log = logging.getLogger("derecho_async.testing.simnet")

_WORD = 8
#: Successive pieces of one push land at least this many seconds apart (distinct instants).
MIN_PIECE_GAP_S = 1e-6
_PUSH = "push"
_MSG = "msg"


class TraceEvent(NamedTuple):
    """One thing that happened on a :class:`SimNetwork` (recorded with ``trace=True``).

    ``event`` is ``"push"`` / ``"msg"`` (landed), ``"drop-push"`` / ``"drop-msg"`` (dropped),
    ``"view"`` (``src`` installed a view in its transport), ``"crash"``, ``"close"``,
    ``"partition"`` or ``"heal"``. ``info``: for a push ``(view_id, offset, length, crc32)``, for
    a message ``(length, crc32)``, for a view ``(view_id, *members)``, for a partition
    ``(member, side, ...)``. ``dst`` is -1 where there is no receiver.
    """

    time: float
    event: str
    src: int
    dst: int
    info: tuple[int, ...]


@dataclass(slots=True)
class _Item:
    due: float
    kind: str  # _PUSH | _MSG
    view_id: int
    offset: int
    data: bytes
    more: bool = False  # a later piece of the same push follows on the link


@dataclass(slots=True)
class _Link:
    src: int
    dst: int
    items: collections.deque[_Item] = field(default_factory=collections.deque)
    last_due: float = 0.0
    timer: asyncio.TimerHandle | None = None
    extra_delay_s: float = 0.0
    jitter_s: float = 0.0


class SimNetwork:
    """A simulated fabric of :class:`SimTransport` endpoints (see the module header).

    ``rng`` is the only source of randomness. Each item on a link is delayed by a uniform draw
    from ``[min_delay_s, max_delay_s]`` (plus the link's ``set_link`` extra delay and jitter),
    never overtaking the item before it. A push of two or more words is cut into pieces with
    probability ``split_probability``; pieces land ``MIN_PIECE_GAP_S`` plus up to
    ``max_piece_gap_s`` (default: ``max_delay_s``) apart. With ``trace=True`` every landing,
    drop, view install and fault is appended to :attr:`trace`.
    """

    def __init__(
        self,
        rng: random.Random,
        *,
        max_delay_s: float = 0.0,
        min_delay_s: float = 0.0,
        split_probability: float = 0.0,
        max_piece_gap_s: float | None = None,
        trace: bool = False,
        beacon_hold_s: float | None = None,
    ) -> None:
        if not 0.0 <= min_delay_s <= max_delay_s:
            raise UsageError(
                f"need 0 <= min_delay_s <= max_delay_s, got {min_delay_s}, {max_delay_s}"
            )
        if not 0.0 <= split_probability <= 1.0:
            raise UsageError(f"split_probability must be in [0, 1], got {split_probability}")
        self.rng = rng
        self.min_delay_s = min_delay_s
        self.max_delay_s = max_delay_s
        self.split_probability = split_probability
        self.max_piece_gap_s = max_delay_s if max_piece_gap_s is None else max_piece_gap_s
        if self.max_piece_gap_s < 0:
            raise UsageError(f"max_piece_gap_s must be >= 0, got {max_piece_gap_s}")
        #: what happened, in order (empty unless the network was made with ``trace=True``)
        self.trace: list[TraceEvent] = []
        #: running totals, always kept: "landed", "dropped" (items), "split" (pushes cut into
        #: pieces), "truncated" (links a crash cut short), "partial" (pushes a crash cut inside)
        self.counts: collections.Counter[str] = collections.Counter()
        self._tracing = trace
        self._endpoints: dict[int, SimTransport] = {}
        self._dead: set[int] = set()  # ids whose endpoint crashed or closed (none new since)
        self._crashed: set[int] = set()
        self._links: dict[tuple[int, int], _Link] = {}
        self._side: dict[int, int] = {}
        self._stalled: set[int] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.beacon_hold_s = beacon_hold_s

    # -- endpoints -------------------------------------------------------------------------------
    def transport(self, member_id: int) -> SimTransport:
        """A new endpoint for ``member_id`` (an id may get a new one once its last crashed or
        closed)."""
        return SimTransport(self, member_id)

    @property
    def members(self) -> tuple[int, ...]:
        """Ids of the live endpoints (neither crashed nor closed), sorted."""
        return tuple(sorted(self._endpoints))

    @property
    def crashed(self) -> frozenset[int]:
        """Ids crashed with :meth:`crash`."""
        return frozenset(self._crashed)

    # -- faults ------------------------------------------------------------------------------------
    def crash(self, member: int) -> None:
        """Kill ``member``'s endpoint: everything it sends from now on and everything addressed
        to it is dropped; of what it has in flight on each link, a random prefix still lands.

        Nobody is told (no ``on_failure``). Crashing an id with no endpoint yet kills it ahead.
        """
        check_member_id(member, "member")
        if member in self._crashed and member not in self._endpoints:
            return
        self._crashed.add(member)
        self._dead.add(member)
        endpoint = self._endpoints.pop(member, None)
        if endpoint is not None:
            endpoint._crash()
        self._record("crash", member, -1, ())
        for link in self._links.values():
            if link.dst == member:
                self._drop_all(link)
            elif link.src == member and link.items:
                self._truncate(link)

    def partition(self, *sides: Iterable[int]) -> None:
        """Hold everything on links between different sides until :meth:`heal` (members not
        named form one more side). Replaces any earlier partition."""
        side: dict[int, int] = {}
        for i, members in enumerate(sides):
            for m in members:
                if m in side:
                    raise UsageError(f"member {m} is on two sides")
                side[check_member_id(m, "member")] = i + 1
        self._side = side
        self._record("partition", -1, -1, tuple(x for m in sorted(side) for x in (m, side[m])))
        self._rearm_all()

    def heal(self) -> None:
        """Reconnect every link (stalled members' too); what was held lands now, in link
        order."""
        self._side = {}
        self._stalled.clear()
        self._record("heal", -1, -1, ())
        self._rearm_all()

    def stall(self, member: int) -> None:
        """Hold everything to and from ``member`` until :meth:`unstall`; its beacon still
        reaches its peers."""
        self._stalled.add(check_member_id(member, "member"))
        self._record("stall", member, -1, ())
        self._rearm_all()

    def unstall(self, member: int) -> None:
        """End :meth:`stall`: what was held for ``member`` lands now, in link order."""
        self._stalled.discard(member)
        self._record("unstall", member, -1, ())
        self._rearm_all()

    def beacons_reaching(self, member: int) -> list[int]:
        """The peers whose beacon reaches ``member`` now (none without ``beacon_hold_s``)."""
        hold = self.beacon_hold_s
        if hold is None or self._loop is None or member in self._crashed:
            return []
        me = self._endpoints.get(member)
        if me is None:
            return []
        now = self._loop.time()
        side = self._side.get(member, 0)
        return [p for p, t in sorted(self._endpoints.items())
                if p != member and t._started and not t._crashed
                and self._side.get(p, 0) == side and now - t._touched <= hold
                and t._last_view == me._last_view]

    def set_link(
        self, src: int, dst: int, *, extra_delay_s: float = 0.0, jitter_s: float = 0.0
    ) -> None:
        """Add ``extra_delay_s`` plus a uniform draw from ``[0, jitter_s]`` to the delay of
        what ``src`` sends to ``dst`` from now on (still FIFO)."""
        if extra_delay_s < 0 or jitter_s < 0:
            raise UsageError("extra_delay_s and jitter_s must be >= 0")
        link = self._link(check_member_id(src, "src"), check_member_id(dst, "dst"))
        link.extra_delay_s = extra_delay_s
        link.jitter_s = jitter_s

    def in_flight(self, src: int | None = None, dst: int | None = None) -> int:
        """Items (pushes, pieces of pushes, messages) in flight or held, on the links from
        ``src`` and/or to ``dst`` (None: any)."""
        return sum(
            len(link.items)
            for link in self._links.values()
            if (src is None or link.src == src) and (dst is None or link.dst == dst)
        )

    # -- called by the endpoints --------------------------------------------------------------------
    def _register(self, t: SimTransport) -> None:
        if t.member_id in self._endpoints:
            raise UsageError(f"member {t.member_id} already has a live endpoint on this network")
        self._endpoints[t.member_id] = t
        self._dead.discard(t.member_id)
        self._crashed.discard(t.member_id)

    def _started(self, t: SimTransport, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise UsageError("every endpoint of a SimNetwork must run on the same event loop")
        for link in self._links.values():
            if link.dst == t.member_id:
                self._arm(link)

    def _closed(self, t: SimTransport) -> None:
        if self._endpoints.get(t.member_id) is not t:
            return
        del self._endpoints[t.member_id]
        self._dead.add(t.member_id)
        self._record("close", t.member_id, -1, ())
        for link in self._links.values():
            if link.dst == t.member_id:
                self._drop_all(link)

    def _view(self, member: int, view_id: int, members: Sequence[int]) -> None:
        self._record("view", member, -1, (view_id, *members))

    def _send(self, src: int, dst: int, kind: str, view_id: int, offset: int, data: bytes) -> None:
        """Queue one push or message from ``src`` to ``dst`` (bytes already copied)."""
        if dst in self._dead:
            log.debug("member %d: dropped a %s to dead member %d", src, kind, dst)
            self._record_item("drop-" + kind, src, dst, view_id, offset, data)
            return
        loop = self._loop
        assert loop is not None  # the sender has started
        link = self._link(src, dst)
        due = max(loop.time() + self._delay(link), link.last_due)
        cuts = self._cuts(offset, len(data)) if kind == _PUSH else []
        if cuts:
            self.counts["split"] += 1
        start = 0
        for cut in cuts:
            link.items.append(_Item(due, kind, view_id, offset + start, data[start:cut], True))
            start = cut
            due += MIN_PIECE_GAP_S + (
                self.rng.uniform(0.0, self.max_piece_gap_s) if self.max_piece_gap_s > 0 else 0.0
            )
        link.items.append(_Item(due, kind, view_id, offset + start, data[start:] if cuts else data))
        link.last_due = due
        self._arm(link)

    # -- links --------------------------------------------------------------------------------------
    def _link(self, src: int, dst: int) -> _Link:
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[(src, dst)] = _Link(src, dst)
        return link

    def _delay(self, link: _Link) -> float:
        delay = self.min_delay_s
        if self.max_delay_s > self.min_delay_s:
            delay = self.rng.uniform(self.min_delay_s, self.max_delay_s)
        delay += link.extra_delay_s
        if link.jitter_s > 0:
            delay += self.rng.uniform(0.0, link.jitter_s)
        return delay

    @staticmethod
    def _word_cuts(offset: int, n: int) -> list[int]:
        """Positions ``0 < p < n`` where a cut keeps the table's 8-byte words whole."""
        first = (-offset) % _WORD or _WORD
        return list(range(first, n, _WORD))

    def _cuts(self, offset: int, n: int) -> list[int]:
        """Where to cut a push (none most of the time): a random prefix of words first, then
        random prefixes of the rest, as SimCluster lands a push a few words at a time."""
        if self.split_probability <= 0.0:
            return []
        bounds = self._word_cuts(offset, n)
        if not bounds or self.rng.random() >= self.split_probability:
            return []
        segments = len(bounds) + 1
        cuts = []
        pos = self.rng.randint(1, segments - 1)
        while pos < segments:
            cuts.append(bounds[pos - 1])
            pos += self.rng.randint(1, segments - pos)
        return cuts

    def _can_land(self, link: _Link) -> bool:
        if self._side.get(link.src, 0) != self._side.get(link.dst, 0):
            return False
        if link.src in self._stalled or link.dst in self._stalled:
            return False
        target = self._endpoints.get(link.dst)
        return target is not None and target._started

    def _arm(self, link: _Link) -> None:
        if link.timer is None and link.items and self._loop is not None and self._can_land(link):
            link.timer = self._loop.call_at(link.items[0].due, self._land, link)

    def _disarm(self, link: _Link) -> None:
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None

    def _rearm_all(self) -> None:
        for link in self._links.values():
            self._disarm(link)
            self._arm(link)

    def _land(self, link: _Link) -> None:
        """The head of ``link`` is due: land it and what is due behind it, up to a piece of a
        push that has more to come (its rest lands at a later instant)."""
        link.timer = None
        loop = self._loop
        assert loop is not None
        now = loop.time()
        first = True
        while link.items and (first or link.items[0].due <= now) and self._can_land(link):
            first = False
            item = link.items.popleft()
            target = self._endpoints[link.dst]
            self.counts["landed"] += 1
            self._record_item(item.kind, link.src, link.dst, item.view_id, item.offset, item.data)
            if item.kind == _PUSH:
                target._gate.push_arrived(item.view_id, link.src, item.offset, item.data)
            else:
                target._deliver_message(link.src, item.data)
            if item.more:
                break
        self._arm(link)

    def _drop_all(self, link: _Link) -> None:
        self._disarm(link)
        for item in link.items:
            self._record_item("drop-" + item.kind, link.src, link.dst, item.view_id, item.offset,
                              item.data)
        link.items.clear()

    def _truncate(self, link: _Link) -> None:
        """Keep a random prefix of ``link``'s items, possibly ending in part of a push."""
        self._disarm(link)
        items = list(link.items)
        keep = self.rng.randint(0, len(items))
        kept = items[:keep]
        dropped = items[keep:]
        if dropped and dropped[0].kind == _PUSH:
            cut = dropped[0]
            bounds = self._word_cuts(cut.offset, len(cut.data))
            part = self.rng.randint(0, len(bounds))
            if part:
                self.counts["partial"] += 1
                end = bounds[part - 1]
                kept.append(_Item(cut.due, _PUSH, cut.view_id, cut.offset, cut.data[:end]))
                dropped[0] = _Item(cut.due, _PUSH, cut.view_id, cut.offset + end, cut.data[end:])
        if kept:
            kept[-1].more = False
        if dropped:
            self.counts["truncated"] += 1
        for item in dropped:
            self._record_item("drop-" + item.kind, link.src, link.dst, item.view_id, item.offset,
                              item.data)
        link.items = collections.deque(kept)
        self._arm(link)

    # -- trace ------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self._loop.time() if self._loop is not None else 0.0

    def _record(self, event: str, src: int, dst: int, info: tuple[int, ...]) -> None:
        if self._tracing:
            self.trace.append(TraceEvent(self._now(), event, src, dst, info))

    def _record_item(
        self, event: str, src: int, dst: int, view_id: int, offset: int, data: bytes
    ) -> None:
        if event.startswith("drop"):
            self.counts["dropped"] += 1
        if not self._tracing:
            return
        if event.endswith(_PUSH):
            info: tuple[int, ...] = (view_id, offset, len(data), zlib.crc32(data))
        else:
            info = (len(data), zlib.crc32(data))
        self.trace.append(TraceEvent(self._now(), event, src, dst, info))


class SimTransport(Transport):
    """One member's endpoint on a :class:`SimNetwork`; make it with ``network.transport(id)``.

    Pushes and messages are copied at the call and land through the network (FIFO per link
    across both kinds). Messages are limited to ``GROUP_MESSAGE_LIMIT`` bytes, as a Group's
    transports are. After :meth:`SimNetwork.crash` the endpoint still accepts calls but drops
    everything, and delivers nothing.
    """

    def __init__(self, network: SimNetwork, member_id: int) -> None:
        super().__init__(member_id)
        self._network = network
        self._crashed = False
        self._last_view = -1
        self._touched = 0.0  # the loop time of the last beacon_tick (the beacon's hold rule)
        network._register(self)

    @property
    def network(self) -> SimNetwork:
        """The network this endpoint is on."""
        return self._network

    @property
    def crashed(self) -> bool:
        """True once the network crashed this endpoint."""
        return self._crashed

    async def start(self, handler: TransportHandler) -> None:
        """Start delivering to ``handler``; traffic held for this member starts landing."""
        loop = self._begin_start(handler)
        if not self._crashed:
            self._network._started(self, loop)

    @property
    def beacon_on(self) -> bool:
        """Whether the network gives its endpoints beacons (``beacon_hold_s``)."""
        return self._network.beacon_hold_s is not None

    def beacon_tick(self) -> Sequence[int]:
        """The loop runs; the peers whose beacon reaches this member
        (:meth:`SimNetwork.beacons_reaching`)."""
        if self._loop is not None:
            self._touched = self._loop.time()
        return self._network.beacons_reaching(self.member_id)

    def add_peer(self, member_id: int, address: object) -> None:
        """Nothing to learn: every endpoint of the network is reachable by id."""
        check_member_id(member_id)

    def set_view(self, view_id: int, members: Sequence[int], row_bytes: int) -> None:
        """Install ``view_id`` for validating incoming pushes (recorded in the network trace)."""
        super().set_view(view_id, members, row_bytes)
        if view_id > self._last_view:
            self._last_view = view_id
            if not self._crashed:
                self._network._view(self.member_id, view_id, members)

    def push(
        self,
        view_id: int,
        offset: int,
        data: bytes | bytearray | memoryview,
        targets: Sequence[int],
    ) -> None:
        """Send ``data`` for table offset ``offset`` of ``view_id`` to every target (copied
        now: the caller may reuse its buffer)."""
        mv, remote = self._check_push(view_id, offset, data, targets)
        if not remote:
            return
        if self._crashed:
            log.debug("member %d (crashed): dropped a push", self.member_id)
            return
        copy = bytes(mv)
        send = self._network._send
        for t in remote:
            send(self.member_id, t, _PUSH, view_id, offset, copy)

    def send(self, to: int, payload: bytes | bytearray | memoryview) -> None:
        """Send ``payload`` to ``to``'s ``on_message``: reliable, ordered, non-blocking (copied
        now: the caller may reuse its buffer)."""
        mv = self._check_send(to, payload, GROUP_MESSAGE_LIMIT, "GROUP_MESSAGE_LIMIT")
        if mv is None:
            return
        if self._crashed:
            log.debug("member %d (crashed): dropped a message to %d", self.member_id, to)
            return
        self._network._send(self.member_id, to, _MSG, 0, 0, bytes(mv))

    async def drain(self) -> None:
        """Everything sent is already on the network: nothing to wait for."""
        self._check_usable()
        await asyncio.sleep(0)

    async def close(self) -> None:
        """Leave the network; what is addressed to this member is dropped from now on (what it
        sent before still lands)."""
        if self._closed:
            return
        self._closed = True
        self._network._closed(self)
        self._gate.clear()

    def _crash(self) -> None:
        self._crashed = True
        self._handler = None  # nothing is delivered any more (self-sends included)
        self._gate.clear()


def crash_group(network: SimNetwork, group: Group) -> None:
    """Crash ``group``'s member as a process crash would, with no orderly leave.

    Its endpoint on ``network`` dies (:meth:`SimNetwork.crash`); its driver stops for good (no
    more ticks, no more protocol steps, nothing sent); calls awaited on it fail with
    :class:`GroupClosed`, so test code acting for that member does not hang. The survivors learn
    of it only by the protocol's own failure detection.
    """
    driver = group._driver
    if driver is None or not isinstance(driver.transport, SimTransport) or (
        driver.transport.network is not network
    ):
        raise UsageError(f"member {group.member_id} is not running on this SimNetwork")
    network.crash(group.member_id)
    driver._closed = True  # kick(), _step() and _on_tick() do nothing from now on
    for handle in (driver._tick_handle, driver._step_handle):
        if handle is not None:
            handle.cancel()
    driver._tick_handle = driver._step_handle = None
    group._close(GroupClosed(f"member {group.member_id} crashed (simulated)"))
    if group._durable is not None:  # its files: nothing more is written (the disk crashes apart)
        group._durable.crash()
