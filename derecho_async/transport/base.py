# Theory of operation
# -------------------
# A transport moves two kinds of traffic between the members of a group:
#
# * pushes: "copy these bytes into table offset X of view V at each target". The receiving
#   transport hands them to the driver's ``TransportHandler.on_push``; the driver copies them
#   into its table. Pushes on one (sender, target) link arrive in the order issued, interleaved
#   in order with that link's messages, and each push arrives whole (so each aligned 8-byte word
#   lands atomically).
# * messages: a reliable, ordered, non-blocking byte channel per link (bootstrap, joins, state
#   transfer, p2p calls, replies), handed to ``on_message``.
#
# Every receiving transport enforces single-writer through one shared component, the
# ``PushGate`` below: a push from member m for view V may only touch m's row of V's table,
# ``[rank(m) * row_bytes, (rank(m) + 1) * row_bytes)``. The gate keeps the last few views.
# Pushes for a view newer than any it knows are held (bounded) until ``set_view`` names that
# view, then validated and delivered in arrival order; pushes for a view older than the oldest it
# keeps are dropped. An invalid push never reaches ``on_push``: it is dropped, logged on the
# ``derecho_async.transport`` logger and reported through the transport's violation hook (which
# calls ``on_failure``; tcp also closes the connection). Messages never wait behind held pushes:
# a view-install message must be able to overtake the pushes of the view it installs.
#
# Handler callbacks are never made from inside a call the driver makes into the transport
# (``push``, ``send``, ``set_view`` ...): they run from event-loop callbacks, so the driver never
# sees re-entrant calls.
"""The transport interface shared by every transport, and the push validation they all use."""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from derecho_async.errors import DerechoError, GroupClosed, UsageError

__all__ = ["GROUP_MESSAGE_LIMIT", "PushGate", "Transport", "TransportHandler"]

#: the bound on a group's channel messages (shm ``max_message``, tcp and rdma ``max_frame``;
#: rdma's channel carries that less its own 17-byte header): a data-plane frame may hold a
#: whole large call, up to 1 GiB
GROUP_MESSAGE_LIMIT = 1 << 30

log = logging.getLogger("derecho_async.transport")

#: How many views a transport keeps for validating pushes (the newest ``KEEP_VIEWS``).
KEEP_VIEWS = 3
#: Bounds on pushes held for views not installed yet (count and bytes), per transport.
MAX_HELD_PUSHES = 1 << 16
MAX_HELD_BYTES = 64 << 20

_U63 = 1 << 63


class TransportHandler(Protocol):
    """What a transport calls on its driver; always on the event loop thread."""

    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        """``sender`` wrote ``data`` at table offset ``offset`` of view ``view_id`` (validated)."""

    def on_message(self, sender: int, payload: bytes) -> None:
        """A message from ``sender`` on the reliable channel, in link order."""

    def on_failure(self, member: int, reason: str) -> None:
        """``member`` is unreachable or misbehaved; ``reason`` says how."""


def check_member_id(member_id: object, what: str = "member_id") -> int:
    """Return ``member_id`` if it is an int in ``[0, 2**63)``, else raise :class:`UsageError`."""
    if isinstance(member_id, bool) or not isinstance(member_id, int) or not 0 <= member_id < _U63:
        raise UsageError(f"{what} must be an int in [0, 2**63), got {member_id!r}")
    return member_id


def as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat, byte-format view of ``data`` (raises :class:`UsageError` for other objects)."""
    try:
        mv = memoryview(data)
        return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"expected a contiguous bytes-like object, got {type(data).__name__}"
        ) from exc


@dataclass(frozen=True, slots=True)
class _View:
    view_id: int
    members: tuple[int, ...]
    ranks: dict[int, int]
    row_bytes: int


class PushGate:
    """Validates incoming pushes against the views it knows, holding pushes for future views.

    One per transport. ``push_arrived`` is called by the receiving side for every push;
    valid pushes reach ``deliver``, invalid ones reach ``violation`` (never both).
    """

    def __init__(self, member_id: int) -> None:
        self.member_id = member_id
        self._views: dict[int, _View] = {}
        self._newest = -1
        self._held: dict[int, list[tuple[int, int, bytes]]] = {}
        self._held_count = 0
        self._held_bytes = 0
        # pushes released by set_view, delivered from a loop callback; while non-empty, pushes
        # for known views queue behind them to keep per-link order.
        self._ready: collections.deque[tuple[int, int, int, bytes]] = collections.deque()
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[int, int, int, bytes], None] | None = None
        self._violation: Callable[[int, str], None] | None = None

    def bind(
        self,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[int, int, int, bytes], None],
        violation: Callable[[int, str], None],
    ) -> None:
        """Attach the loop and the two outlets (done by ``Transport.start``)."""
        self._loop = loop
        self._deliver = deliver
        self._violation = violation
        if self._ready:
            self._schedule_flush()

    # -- views -------------------------------------------------------------------------------
    def set_view(self, view_id: int, members: Sequence[int], row_bytes: int) -> None:
        """Install ``view_id``: members in rank order, each row ``row_bytes`` long."""
        if isinstance(view_id, bool) or not isinstance(view_id, int) or not 0 <= view_id < _U63:
            raise UsageError(f"view_id must be an int in [0, 2**63), got {view_id!r}")
        if isinstance(row_bytes, bool) or not isinstance(row_bytes, int) or row_bytes <= 0:
            raise UsageError(f"row_bytes must be a positive int, got {row_bytes!r}")
        mem = tuple(check_member_id(m, "members[i]") for m in members)
        if len(set(mem)) != len(mem):
            raise UsageError(f"members of view {view_id} are not distinct: {mem!r}")
        if len(mem) * row_bytes >= _U63:
            raise UsageError("table too large")
        known = self._views.get(view_id)
        if known is not None:
            if known.members == mem and known.row_bytes == row_bytes:
                return
            raise UsageError(f"view {view_id} was already set with other members or row size")
        if view_id <= self._newest:
            raise UsageError(
                f"views must be set in increasing order: got {view_id} after {self._newest}"
            )
        self._views[view_id] = _View(view_id, mem, {m: i for i, m in enumerate(mem)}, row_bytes)
        self._newest = view_id
        while len(self._views) > KEEP_VIEWS:
            del self._views[min(self._views)]
        # Held pushes: those for this view are released (validated at delivery); those for
        # older views can never be installed any more (views only grow) and are dropped.
        for vid in sorted(self._held):
            if vid > view_id:
                break
            items = self._held.pop(vid)
            self._held_count -= len(items)
            self._held_bytes -= sum(len(d) for _, _, d in items)
            if vid == view_id:
                self._ready.extend((vid, s, o, d) for s, o, d in items)
            else:
                log.info("dropped %d held pushes for skipped view %d", len(items), vid)
        if self._ready:
            self._schedule_flush()

    def oldest_view(self) -> int | None:
        """The oldest view kept for validation, or None before the first ``set_view``."""
        return min(self._views) if self._views else None

    def rank_range(self, view_id: int, member: int) -> tuple[int, int] | None:
        """``member``'s row ``[lo, hi)`` in ``view_id``, or None if unknown."""
        view = self._views.get(view_id)
        if view is None or member not in view.ranks:
            return None
        lo = view.ranks[member] * view.row_bytes
        return lo, lo + view.row_bytes

    def clear(self) -> None:
        """Forget held and pending pushes (on close)."""
        self._held.clear()
        self._ready.clear()
        self._held_count = self._held_bytes = 0

    # -- incoming pushes --------------------------------------------------------------------
    def check(self, view_id: int, sender: int, offset: int, length: int) -> str | None:
        """Why a push for a *known* view is invalid, or None if it is valid."""
        view = self._views[view_id]
        rank = view.ranks.get(sender)
        if rank is None:
            return f"member {sender} is not in view {view_id}"
        lo = rank * view.row_bytes
        hi = lo + view.row_bytes
        if offset < lo or length < 0 or offset + length > hi:
            return (
                f"push to table bytes [{offset}, {offset + length}) of view {view_id} is outside "
                f"member {sender}'s row [{lo}, {hi})"
            )
        return None

    def push_arrived(self, view_id: int, sender: int, offset: int, data: bytes) -> bool:
        """Route one incoming push. Returns False when it was a violation (already reported)."""
        if view_id in self._views:
            if self._ready:
                self._ready.append((view_id, sender, offset, data))
                return True
            why = self.check(view_id, sender, offset, len(data))
            if why is not None:
                self._report(sender, why)
                return False
            assert self._deliver is not None
            self._deliver(view_id, sender, offset, data)
            return True
        if view_id > self._newest:
            if self._held_count >= MAX_HELD_PUSHES or self._held_bytes + len(data) > MAX_HELD_BYTES:
                self._report(
                    sender,
                    f"too many pushes held for views not installed yet (push for view {view_id},"
                    f" newest known view {self._newest})",
                )
                return False
            self._held.setdefault(view_id, []).append((sender, offset, data))
            self._held_count += 1
            self._held_bytes += len(data)
            return True
        log.debug("dropped push from member %d for old view %d", sender, view_id)
        return True

    def _report(self, sender: int, why: str) -> None:
        log.warning(
            "member %d: dropped invalid push from member %d: %s", self.member_id, sender, why
        )
        if self._violation is not None:
            self._violation(sender, "protocol violation: " + why)

    def _schedule_flush(self) -> None:
        if self._flush_scheduled or self._loop is None:
            return
        self._flush_scheduled = True
        self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        while self._ready:
            view_id, sender, offset, data = self._ready.popleft()
            if view_id not in self._views:
                log.debug(
                    "dropped released push from member %d for evicted view %d", sender, view_id
                )
                continue
            why = self.check(view_id, sender, offset, len(data))
            if why is not None:
                self._report(sender, why)
            elif self._deliver is not None:
                self._deliver(view_id, sender, offset, data)


class Transport(abc.ABC):
    """A member's endpoint: one-sided row pushes plus a reliable message channel.

    Subclasses: :class:`~derecho_async.transport.loopback.LoopbackTransport` (in-process),
    :class:`~derecho_async.transport.shm.ShmTransport` (one host),
    :class:`~derecho_async.transport.tcp.TcpTransport` (several hosts).

    Lifecycle: construct, ``await start(handler)``, use, ``await close()``. ``set_view`` may be
    called before ``start``. After ``close`` every method but ``close`` raises
    :class:`GroupClosed`. Pushes to oneself are skipped (the local row already holds the
    bytes); messages to oneself are delivered through the event loop.
    """

    member_id: int

    def __init__(self, member_id: int) -> None:
        self.member_id = check_member_id(member_id)
        self._gate = PushGate(self.member_id)
        self._remote_targets: dict[tuple[int, ...], list[int]] = {}  # see _check_push
        self._handler: TransportHandler | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False
        #: called with (member, error) when a peer refuses this member for good: an
        #: AuthenticationError (another secret, group or protocol) or a JoinRefused (its id in
        #: use, a certificate naming another member); never retried: a join fails with it
        self.on_refused: Callable[[int, DerechoError], None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @abc.abstractmethod
    async def start(self, handler: TransportHandler) -> None:
        """Listen / attach and start delivering to ``handler``. A second call is a UsageError."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release every OS resource; idempotent. Nothing is delivered afterwards."""

    @abc.abstractmethod
    async def drain(self) -> None:
        """Wait until everything queued so far was handed to the OS (or the ring)."""

    @property
    def closed(self) -> bool:
        """True once ``close`` was called."""
        return self._closed

    # -- data path ---------------------------------------------------------------------------
    def set_view(self, view_id: int, members: Sequence[int], row_bytes: int) -> None:
        """Install view ``view_id`` (members in rank order) for validating incoming pushes."""
        if self._closed:
            raise GroupClosed(f"transport of member {self.member_id} is closed")
        self._gate.set_view(view_id, members, row_bytes)

    @abc.abstractmethod
    def push(
        self, view_id: int, offset: int, data: bytes | memoryview, targets: Sequence[int]
    ) -> None:
        """Write ``data`` at table offset ``offset`` of view ``view_id`` at every target.

        Non-blocking; FIFO per (sender, target) link together with :meth:`send`.
        """

    @abc.abstractmethod
    def send(self, to: int, payload: bytes) -> None:
        """Send ``payload`` to member ``to``: reliable, ordered, non-blocking."""

    @abc.abstractmethod
    def add_peer(self, member_id: int, address: object) -> None:
        """Learn how to reach ``member_id`` (joiners)."""

    def known_addresses(self) -> dict[int, tuple[str, int]]:
        """The listen addresses this member knows, its own included (networked transports;
        others address members by id alone)."""
        return {}

    def learn_address(self, member_id: int, address: tuple[str, int]) -> None:
        """Another member says ``member_id`` listens at ``address``: use it where no address
        is known (it admits nobody; a view still must name the member)."""
        return None  # (transports that address members by id alone learn nothing)

    @property
    def beacon_on(self) -> bool:
        """Whether a beacon thread beats for this process (:meth:`beacon_tick`)."""
        return False

    def beacon_tick(self) -> Sequence[int]:
        """Called at every heartbeat tick of the loop: the loop runs. Returns the peers whose
        beacon moved since the last call (their process runs, whatever their event loop does:
        see ``max_loop_hold_ms``). A transport without one (loopback, or any with
        ``max_loop_hold_ms`` 0) returns none, and the core's heartbeats alone tell liveness."""
        return ()

    def live_members(self) -> Sequence[int]:
        """The other members of this member's group whose process runs now, lowest id first,
        as far as the transport can tell before it is in a view (shm: the bound doorbells);
        none where it cannot tell (tcp, rdma, loopback). A joiner whose contact is not
        running asks them (see ``Driver.start``)."""
        return ()

    async def identify(self, address: object, timeout: float) -> int:
        """Reach the member at ``address`` (id unknown: the ``contact`` key) and return its id;
        networked transports only."""
        raise UsageError(f"{type(self).__name__} cannot reach a member by address: "
                         "`contact` is for the tcp and rdma transports")

    # -- helpers for subclasses ----------------------------------------------------------------
    def _begin_start(self, handler: TransportHandler) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise GroupClosed(f"transport of member {self.member_id} is closed")
        if self._started:
            raise UsageError(f"transport of member {self.member_id} was already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._handler = handler
        self._started = True
        self._gate.bind(loop, self._deliver_push, self._on_violation)
        return loop

    def _check_usable(self) -> None:
        if self._closed:
            raise GroupClosed(f"transport of member {self.member_id} is closed")
        if not self._started:
            raise UsageError(f"transport of member {self.member_id} is not started")

    def _check_push(
        self,
        view_id: int,
        offset: int,
        data: bytes | bytearray | memoryview,
        targets: Sequence[int],
    ) -> tuple[memoryview, list[int]]:
        """Validate push arguments; returns the data as a byte view and the remote targets."""
        self._check_usable()
        if isinstance(view_id, bool) or not isinstance(view_id, int) or not 0 <= view_id < _U63:
            raise UsageError(f"view_id must be an int in [0, 2**63), got {view_id!r}")
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < _U63:
            raise UsageError(f"offset must be an int in [0, 2**63), got {offset!r}")
        mv = as_bytes_view(data)
        row = self._gate.rank_range(view_id, self.member_id)
        if row is not None and not (row[0] <= offset and offset + len(mv) <= row[1]):
            raise UsageError(
                f"push to [{offset}, {offset + len(mv)}) is outside my row [{row[0]}, {row[1]})"
                f" of view {view_id}"
            )
        # The core pushes to a few target tuples again and again: check each tuple once.
        remote = self._remote_targets.get(targets) if type(targets) is tuple else None
        if remote is None:
            unique = dict.fromkeys(check_member_id(t, "target") for t in targets)
            remote = [t for t in unique if t != self.member_id]
            if type(targets) is tuple:
                if len(self._remote_targets) >= 256:
                    self._remote_targets.clear()
                self._remote_targets[targets] = remote
        return mv, remote

    def _check_send(
        self, to: int, payload: bytes | bytearray | memoryview, limit: int, limit_name: str
    ) -> memoryview | None:
        """Validate send arguments; the payload as a byte view, or None when ``to`` is this
        member (then it was delivered locally)."""
        self._check_usable()
        check_member_id(to, "to")
        mv = as_bytes_view(payload)
        if len(mv) > limit:
            raise UsageError(f"message of {len(mv)} bytes exceeds {limit_name}")
        if to == self.member_id:
            self._send_to_self(mv)
            return None
        return mv

    @staticmethod
    def _aligned_pieces(offset: int, n: int, chunk: int) -> list[tuple[int, int]]:
        """Cut an ``n``-byte push at table ``offset`` into ``(start, end)`` ranges of at most
        ``chunk`` bytes whose cuts fall on multiples of ``chunk`` from the aligned base, so each
        piece keeps 8-byte words whole. At least one piece (an empty push stays one)."""
        pieces = []
        base = offset & ~7
        pos = 0
        k = 1
        while True:
            end = min(n, base + chunk * k - offset)
            pieces.append((pos, end))
            pos = end
            k += 1
            if pos >= n:
                return pieces

    def _deliver_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        if self._closed or self._handler is None:
            return
        try:
            self._handler.on_push(view_id, sender, offset, data)
        except Exception:
            log.exception("member %d: handler.on_push raised", self.member_id)

    def _deliver_message(self, sender: int, payload: bytes) -> None:
        if self._closed or self._handler is None:
            return
        try:
            self._handler.on_message(sender, payload)
        except Exception:
            log.exception("member %d: handler.on_message raised", self.member_id)

    def _report_failure(self, member: int, reason: str) -> None:
        if self._closed or self._handler is None:
            return
        try:
            self._handler.on_failure(member, reason)
        except Exception:
            log.exception("member %d: handler.on_failure raised", self.member_id)

    def _report_refusal(self, member: int, error: DerechoError) -> None:
        """``member`` refused us for good: tell :attr:`on_refused`, then report a failure."""
        if self._closed or self._handler is None:
            return
        if self.on_refused is not None:
            try:
                self.on_refused(member, error)
            except Exception:
                log.exception("member %d: on_refused raised", self.member_id)
        self._report_failure(member, str(error))

    def _on_violation(self, sender: int, reason: str) -> None:
        """A push from ``sender`` broke the protocol (already logged). Default: report it."""
        self._report_failure(sender, reason)

    def _send_to_self(self, payload: bytes | bytearray | memoryview) -> None:
        assert self._loop is not None
        self._loop.call_soon(self._deliver_message, self.member_id, bytes(payload))
