"""One group member's protocol state: the composition object of the core (DESIGN.md §4.5).

Theory of operation, in the style of a raft ``RawNode``: the driver feeds the member time
(:meth:`Member.tick`), remote row writes (:meth:`Member.receive_push`), channel messages
(:meth:`Member.receive_message`), landed large payloads (:meth:`Member.data_landed`) and the
application's sends (:meth:`Member.submit`); then calls :meth:`Member.poll` to let the protocol
react, takes :meth:`Member.ready`, calls :meth:`Member.advance` and carries it out. The member
never performs I/O; all its output is data in the :class:`Ready`.

Within a view the member runs ordered multicast (:mod:`.multicast`) for each shard it belongs
to; its :class:`~.view_change.ViewChange` watches heartbeats and membership columns and, once
anything calls for a view change, wedges the member and runs the agreement, asking the member for
what it owns (pushes, the shards, the next view) through the :class:`~.view_change.Host`
protocol. Pushes addressed to a view this member has not installed yet are held until it does;
pushes for older views are dropped.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from derecho_async.core.effects import (
    DataKey,
    Evicted,
    Left,
    Partitioned,
    Persisted,
    Push,
    Ready,
    Send,
    SendFailed,
    ViewInstalled,
)
from derecho_async.core.layout import Layout, ShardAssignment
from derecho_async.core.messages import JoinRequest, Message, Welcome
from derecho_async.core.multicast import Outgoing, ShardState
from derecho_async.core.schema import WORD, RowSchema
from derecho_async.core.table import Table
from derecho_async.core.view import View
from derecho_async.core.view_change import ViewChange
from derecho_async.errors import ProtocolViolation, UsageError

__all__ = ["BufferFactory", "CoreConfig", "Member", "MemberState"]

_new_tuple = tuple.__new__  # a named tuple without its Python-level __new__ frame

BufferFactory = Callable[[int, int], bytearray | memoryview]
"""``(view_id, nbytes) -> buffer`` for a view's table (shared memory, a registered region...)."""


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """Protocol parameters; time is counted in ticks."""

    window: int = 8
    max_payload: int = 256
    heartbeat_period: int = 1
    suspect_after: int = 20
    join_retry: int = 25
    partition_safety: bool = True
    layout: Layout = field(default_factory=Layout)
    max_queue: int = 1 << 20
    max_held_pushes: int = 1 << 16
    send_batch: int = 0
    """Records a sender writes per poll (0: as many as the window allows). Small batches let
    receivers start on the first while the sender writes the next: with everything written in
    one go, sender and receivers take turns instead of overlapping."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise UsageError("window must be >= 1")
        if self.max_payload < 0 or self.max_payload % WORD:
            raise UsageError("max_payload must be a non-negative multiple of 8")
        if self.heartbeat_period < 1 or self.suspect_after <= self.heartbeat_period:
            raise UsageError("need 1 <= heartbeat_period < suspect_after")
        if self.join_retry < 1:
            raise UsageError("join_retry must be >= 1")
        if self.send_batch < 0:
            raise UsageError("send_batch must be >= 0")


class MemberState(enum.Enum):
    """Where a member stands."""

    JOINING = "joining"
    ACTIVE = "active"
    PARTITIONED = "partitioned"
    EVICTED = "evicted"
    LEFT = "left"


# The states the hot paths test, as module constants: ``MemberState.ACTIVE`` is a class
# attribute lookup through the enum's descriptor (several times per message), a module global
# is a dict read.
_ACTIVE = MemberState.ACTIVE
_JOINING = MemberState.JOINING

# The state each way out of the group leaves a member in.
_OUT_STATE: dict[type[Evicted | Partitioned | Left], MemberState] = {
    Evicted: MemberState.EVICTED,
    Partitioned: MemberState.PARTITIONED,
    Left: MemberState.LEFT,
}


class Member:
    """The pure protocol state of one member (see the module docstring)."""

    def __init__(
        self,
        member_id: int,
        config: CoreConfig | None = None,
        *,
        view: View | None = None,
        contacts: tuple[int, ...] = (),
        buffer_factory: BufferFactory | None = None,
    ) -> None:
        if member_id < 0:
            raise UsageError("member ids are non-negative")
        self.member_id = member_id
        self.config = config or CoreConfig()
        self.layout = self.config.layout
        self._buffer_factory = buffer_factory
        self.now = 0
        self.state = _JOINING
        self._ready = Ready()
        self._msg_no = 0
        self.queues: dict[str, deque[Outgoing]] = {s.name: deque() for s in self.layout.subgroups}
        # per subgroup, the shard this member sends to (as of the last adequate view)
        self._sent_in: dict[str, int] = {}
        self._held: dict[int, list[tuple[int, int, bytes]]] = {}
        self._held_count = 0
        self._landed_early: dict[DataKey, object] = {}
        self._held_data: dict[DataKey, object] = {}
        self._awaiting: dict[DataKey, ShardState] = {}
        self._contacts = contacts
        self._next_join_try = 0
        self._join_attempt = 0
        self.receiving = True  # False: read no new records (backpressure; see set_receiving)
        self.view_change = ViewChange(
            self,
            member_id,
            heartbeat_period=self.config.heartbeat_period,
            suspect_after=self.config.suspect_after,
            partition_safety=self.config.partition_safety,
        )
        """The view-change rules and their state (suspicions, wedge, joiners, leave)."""
        # What changed since the last poll: shard columns or local send work (membership
        # columns: ``view_change.changed``). A poll skips the scans nothing can have changed.
        self._dirty_multicast = True
        # A persisted word changed (mine or a peer's): the next poll looks at the frontiers.
        self._dirty_persisted = False
        # Per-view state, set by _enter_view.
        self.view = View(-1, ())
        self.rank = -1
        self.view_size = 0
        self.schema: RowSchema
        self.table: Table
        self.assignment = ShardAssignment((), False)
        self.shards: list[ShardState | None] = []
        self._persisted_marks: list[int] = []  # per shard: the last Persisted mark emitted
        self._others: tuple[int, ...] = ()
        self._rank_of: dict[int, int] = {}
        if view is not None:
            if member_id not in view.members:
                raise UsageError(f"member {member_id} is not in {view}")
            self._enter_view(view, joined=view.members, departed=(), state=None)
        elif not contacts:
            raise UsageError("a member needs an initial view or contacts to join through")

    # -- inputs --------------------------------------------------------------------------------
    def submit(self, subgroup: str, payload: object, nbytes: int | None = None) -> int | None:
        """Queue an ordered multicast to ``subgroup``; returns its message number.

        ``payload`` is bytes (inline when it fits a slot, else sent as a descriptor plus
        data-plane bytes) or any object with ``nbytes`` given (always a descriptor). Returns None,
        queuing nothing, when this member is not in a view, is out of the group, or its queue is
        full. While a view change is under way the message waits for the next view.
        """
        if self.state is not _ACTIVE or self.view_change.leaving:
            return None
        queue = self.queues.get(subgroup)
        if queue is None:
            raise UsageError(f"unknown subgroup {subgroup!r}")
        if len(queue) >= self.config.max_queue:
            return None
        if type(payload) is bytes or isinstance(payload, (bytearray, memoryview)):
            # (a tuple, not bytes | bytearray | memoryview: that builds a union per call)
            data = payload if type(payload) is bytes else bytes(payload)
            size = len(data)
            large = size > self.config.max_payload
            obj: object = data
        else:
            if nbytes is None or nbytes < 0:
                raise UsageError("a non-bytes payload needs its size in nbytes")
            size, large, obj = nbytes, True, payload
        msg_no = self._msg_no
        self._msg_no += 1
        queue.append(_new_tuple(Outgoing, (msg_no, obj, size, large)))  # Outgoing(...)
        self._dirty_multicast = True
        return msg_no

    def add_contacts(self, members: Sequence[int]) -> None:
        """While joining: ask these members too (in turn, after those known), e.g. members a
        contact named that may include the leader (only the leader admits)."""
        if self.state is not _JOINING:
            return
        known = set(self._contacts)
        more = tuple(m for m in members if m != self.member_id and m not in known)
        self._contacts = (*self._contacts, *dict.fromkeys(more))

    def tick(self) -> None:
        """One unit of time: heartbeats, failure detection, join retries."""
        self.now += 1
        if self.state is _JOINING:
            if self.now >= self._next_join_try:
                to = self._contacts[self._join_attempt % len(self._contacts)]
                self._join_attempt += 1
                self._next_join_try = self.now + self.config.join_retry
                self._ready.sends.append(Send(to, JoinRequest(self.member_id)))
            return
        if self.state is not _ACTIVE:
            return
        self.view_change.tick(self.now)

    def receive_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        """A push from ``sender`` landed: bytes for table offset ``offset`` of view ``view_id``."""
        if self.state is _ACTIVE and view_id == self.view.view_id:
            self._apply_push(sender, offset, data)
        elif self.state in (_ACTIVE, _JOINING) and (
            view_id > self.view.view_id
        ):
            if self._held_count >= self.config.max_held_pushes:
                self._ready.violations.append(
                    f"dropped a push from {sender} for future view {view_id}: too many held"
                )
                return
            self._held.setdefault(view_id, []).append((sender, offset, bytes(data)))
            self._held_count += 1

    def receive_message(self, sender: int, message: Message) -> None:
        """A channel message from ``sender`` arrived."""
        if isinstance(message, JoinRequest):
            if self.state is _ACTIVE:
                self.view_change.join_request(message.joiner)
        elif isinstance(message, Welcome):
            self._on_welcome(sender, message)

    def data_landed(self, key: DataKey, payload: object) -> None:
        """The data-plane bytes of large message ``key`` landed here."""
        if key.view_id > self.view.view_id and self.state in (
            _ACTIVE,
            _JOINING,
        ):
            self._held_data[key] = payload
            return
        if self.state is not _ACTIVE or key.view_id != self.view.view_id:
            return
        self._dirty_multicast = True
        shard = self._awaiting.pop(key, None)
        if shard is None:
            self._landed_early[key] = payload
        else:
            shard.data_landed(key, payload)

    def set_receiving(self, receiving: bool) -> None:
        """Read new records from the senders' rings (True), or leave them there for now (False).

        The application's backpressure: a member whose handlers lag stops taking new messages,
        so its frontier stops moving, nothing new becomes stable anywhere, and the senders'
        windows fill: a slow member slows the group instead of queueing without bound. Sending,
        delivering what is already stable, heartbeats and view changes go on as before."""
        if receiving != self.receiving:
            self.receiving = receiving
            self._dirty_multicast = True

    def set_persisted(self, shard_index: int, mark: int) -> None:
        """Publish how far this member's log of shard ``shard_index`` is durable, as the
        ``persisted`` column encodes it (:class:`~.effects.Persisted`). Ignored outside a view,
        for a shard this member does not belong to, and when it does not raise the mark."""
        if self.state is not _ACTIVE or not 0 <= shard_index < len(self.shards):
            return
        if self.shards[shard_index] is None:
            return
        col = self.schema.persisted
        if mark <= self.table.mine(col, shard_index):
            return
        self.table.set(col, mark, shard_index)
        self._push(col.offset + shard_index * WORD, WORD, ())
        self._dirty_persisted = True

    def heard_from(self, member: int) -> None:
        """Traffic from ``member`` arrived (any message): it is alive, whatever its heartbeat
        push is queued behind (bulk data shares the link's FIFO with row pushes)."""
        if self.state is _ACTIVE and member in self.view.members:
            self.view_change.heard_from(member, self.now)

    def report_failure(self, member: int) -> None:
        """The transport lost ``member`` (its link broke, pushes may have been lost): suspect it.

        The shared-state table assumes every push on a link lands, in order; after a broken
        link that no longer holds, so the member is removed by a view change rather than
        trusted with a row that may be missing writes.
        """
        if self.state is not _ACTIVE or member == self.member_id:
            return
        if member in self.view.members:
            self.view_change.suspect(self.view.members.index(member), "link")

    def leave(self, reason: str = "") -> None:
        """Leave the group: the others remove this member in the next view. ``reason`` (empty
        for a leave the application asked for) goes into the :class:`Left` event.

        Asked for during a view change, the leave waits for that change to end: this member
        still takes part in it (it may be the leader, or have accepted a proposal that keeps it)
        and leaves the view it installs, where the others see a voluntary leave. Leaving the old
        view instead could leave a lone survivor with a new view whose other member never runs
        it, a failure that no majority outlives. Nothing new can be sent meanwhile.
        """
        if self.state is not _ACTIVE or self.view_change.leaving:
            return
        self.view_change.leave(reason)

    # -- the protocol step ---------------------------------------------------------------------
    def poll(self) -> None:
        """React to everything that changed since the last poll."""
        if self.state is not _ACTIVE:
            return
        vc = self.view_change
        try:
            if vc.changed and not vc.poll():
                return  # out of the group
            if not vc.wedged and self._dirty_multicast:
                self._dirty_multicast = False
                self._run_multicast()
                if vc.wedged:
                    vc.step()
            if self._dirty_persisted and not vc.wedged:
                self._dirty_persisted = False
                self._scan_persisted()
        except ProtocolViolation as exc:
            self._on_violation(exc)

    def ready(self) -> Ready:
        """Everything the driver must carry out now."""
        return self._ready

    def advance(self, ready: Ready) -> None:
        """The driver took ``ready`` (it carries it out next; what is added from now on goes into
        a new Ready)."""
        if ready is self._ready:
            self._ready = Ready()

    @property
    def is_active(self) -> bool:
        """True while this member is in a view and in the group."""
        return self.state is _ACTIVE

    def has_ready(self) -> bool:
        return bool(self._ready)

    def settled(self) -> bool:
        """True when a poll now would find nothing to do: an active member, not changing views,
        nothing marked changed since its last poll and nothing waiting in its Ready. Until an
        input arrives (a push, a message, a submit, a landing, a tick), it stays so."""
        vc = self.view_change
        return (
            self.state is _ACTIVE
            and not vc.wedged
            and not vc.suspected
            and not vc.changed
            and not self._dirty_multicast
            and not self._dirty_persisted
            and not self._ready
        )

    @property
    def submitted(self) -> int:
        """Messages this member queued with :meth:`submit` so far (its message numbers)."""
        return self._msg_no

    @property
    def wedged(self) -> bool:
        """True while a view change is under way here (this member stopped its shards)."""
        return self.view_change.wedged

    @property
    def suspected(self) -> int:
        """The ranks of the current view this member suspects, as a bit mask."""
        return self.view_change.suspected

    @property
    def leaving(self) -> bool:
        """A leave was asked for (see :meth:`leave`)."""
        return self.view_change.leaving

    # -- the view change's Host protocol (view_change.Host) -----------------------------------
    def push_all(self, row_offset: int, nbytes: int) -> None:
        """Push a range of my row to every unsuspected member of the view."""
        self._push(row_offset, nbytes, ())

    def freeze_shards(self) -> dict[int, int]:
        """Publish each shard's progress, then freeze it; its final frontier by shard index."""
        frontiers: dict[int, int] = {}
        for sh in self.shards:
            if sh is not None:
                sh.publish_progress()
                frontiers[sh.info.index] = sh.frontier
                sh.freeze()
        return frontiers

    def ragged_trim(self, trims: tuple[int, ...]) -> None:
        """Deliver each shard up to its trim, in seq order (rule 7 of :mod:`.view_change`)."""
        events = self._ready.events
        for sh in self.shards:
            if sh is not None:
                sh.deliver_until(trims[sh.info.index], events)

    def next_view(
        self, view: View, joined: tuple[int, ...], departed: tuple[int, ...]
    ) -> None:
        """Put my undelivered messages back at the front of their queues (re-sent in ``view``),
        then enter ``view`` with a fresh table."""
        resend: dict[str, list[Outgoing]] = {}
        for sh in self.shards:
            if sh is not None and sh.my_index is not None:
                resend.setdefault(sh.info.subgroup, []).extend(sh.leftovers())
        for sub, outs in resend.items():
            self.queues[sub].extendleft(reversed(outs))
        self._enter_view(view, joined, departed, state=None)

    def fail_queued(self, reason: str) -> None:
        """Fail every queued message with ``reason`` (a :class:`SendFailed` each)."""
        for sub, q in self.queues.items():
            for out in q:
                self._ready.events.append(SendFailed(sub, out.msg_no, reason))
            q.clear()

    def leave_group(self, event: Evicted | Partitioned | Left) -> None:
        """Leave the group for good as ``event`` says, then fail every queued message."""
        state = _OUT_STATE[type(event)]
        self.state = state
        # The event first: a host fails every waiting call with the error it names (a
        # PartitionedError for a partition), before the queued messages' own SendFailed.
        self._ready.events.append(event)
        self.fail_queued(f"this member is out of the group ({state.value})")

    # -- internals -----------------------------------------------------------------------------
    def _push(self, row_offset: int, nbytes: int, targets: tuple[int, ...]) -> None:
        if not targets:
            targets = self._others
        suspected = self.view_change.suspected
        live = (
            targets
            if not suspected
            else tuple(m for m in targets if not suspected >> self._rank_of[m] & 1)
        )
        if not live:
            return
        data = self.table.my_bytes(row_offset, nbytes)
        self._ready.pushes.append(
            Push(self.view.view_id, self.table.table_offset(row_offset), data, live)
        )

    def _enter_view(
        self,
        view: View,
        joined: tuple[int, ...],
        departed: tuple[int, ...],
        state: bytes | None,
        sponsor: int | None = None,
    ) -> None:
        self.view = view
        self.rank = view.members.index(self.member_id)
        self.view_size = n = len(view.members)
        self._others = tuple(m for m in view.members if m != self.member_id)
        self._rank_of = {m: r for r, m in enumerate(view.members)}
        self.schema = sc = RowSchema(
            n, self.layout.n_shards, self.config.window, self.config.max_payload
        )
        buf = None
        if self._buffer_factory is not None:
            buf = self._buffer_factory(view.view_id, n * sc.row_bytes)
        self.table = Table(sc, n, self.rank, buf)
        self.assignment = self.layout.assign(view.members)
        self.shards = []
        self._persisted_marks = [0] * self.layout.n_shards
        self._dirty_persisted = False
        for info in self.assignment.shards:
            if self.member_id in info.members and self.assignment.adequate:
                q = self.queues[info.subgroup] if self.member_id in info.senders else None
                self.shards.append(
                    ShardState(
                        info,
                        sc.shards[info.index],
                        self.table,
                        view.view_id,
                        view.members,
                        self.member_id,
                        self.config.max_payload,
                        q,
                        self._push,
                        self.config.send_batch,
                    )
                )
            else:
                self.shards.append(None)
        self.view_change.enter_view(view, self.table, self.assignment, self.now)
        self._dirty_multicast = True
        self._landed_early = {k: v for k, v in self._held_data.items() if k.view_id == view.view_id}
        self._held_data = {k: v for k, v in self._held_data.items() if k.view_id > view.view_id}
        self._awaiting = {}
        self.state = _ACTIVE
        if self.assignment.adequate:
            # a queued message goes to the shard of its subgroup its sender was in when it was
            # sent: a sender now in no shard of it, or in another one, fails it instead
            mine = {s.subgroup: s.shard for s in self.assignment.shards
                    if self.member_id in s.senders}
            for sub, q in self.queues.items():
                was = self._sent_in.get(sub)
                now = mine.get(sub)
                if q and (now is None or (was is not None and was != now)):
                    why = ("no longer a sender of this subgroup" if now is None else
                           f"this member moved from shard {was} to shard {now} of it")
                    for out in q:
                        self._ready.events.append(SendFailed(sub, out.msg_no, why))
                    q.clear()
            self._sent_in = mine
        self._ready.events.append(
            ViewInstalled(view, joined, departed, self.assignment.adequate, state, sponsor)
        )
        held = self._held.pop(view.view_id, [])
        self._held = {v: p for v, p in self._held.items() if v > view.view_id}
        self._held_count = sum(len(p) for p in self._held.values())
        for sender, offset, data in held:
            self._apply_push(sender, offset, data)

    def _apply_push(self, sender: int, offset: int, data: bytes) -> None:
        rank = self._rank_of.get(sender)
        if rank is None:
            self._ready.violations.append(
                f"push from {sender}, not a member of view {self.view.view_id}"
            )
            return
        try:
            self.table.apply_push(rank, offset, data)
        except ProtocolViolation as exc:
            self._on_violation(ProtocolViolation(str(exc), sender))
            return
        lo = offset - rank * self.table.row_bytes
        hi = lo + len(data)
        sc = self.schema
        if lo < sc.membership_bytes:
            hb = sc.heartbeat.offset
            if not (lo >= hb and hi <= hb + WORD):
                self.view_change.changed = True
        if hi > sc.membership_bytes:
            self._dirty_multicast = True
            if hi > sc.persisted.offset:
                self._dirty_persisted = True

    def _on_violation(self, exc: ProtocolViolation) -> None:
        self._ready.violations.append(str(exc))
        if exc.member is not None and exc.member in self.view.members:
            r = self.view.members.index(exc.member)
            if r != self.rank:
                self.view_change.suspect(r, "violation")

    def _run_multicast(self) -> None:
        events = self._ready.events
        transfers = self._ready.transfers
        for sh in self.shards:
            if sh is None:
                continue
            if self.receiving:
                sh.receive(self._landed_early, self._awaiting)
            if sh.send(transfers) and sh.queue:
                # My own progress may free more of the window (alone in a view, nobody else's
                # push will say so): look again on the next poll.
                self._dirty_multicast = True
            sh.deliver_stable(events)
            sh.publish_progress()

    def _scan_persisted(self) -> None:
        """Emit a :class:`Persisted` for each shard whose persistence frontier (the lowest
        ``persisted`` word of its members) rose since the last one."""
        col = self.schema.persisted
        get = self.table.get
        for sh in self.shards:
            if sh is None:
                continue
            i = sh.info.index
            low = min(get(r, col, i) for r in sh.member_ranks)
            if low > self._persisted_marks[i]:
                self._persisted_marks[i] = low
                self._ready.events.append(
                    Persisted(sh.info.subgroup, sh.info.shard, self.view.view_id, low)
                )

    def _on_welcome(self, sender: int, msg: Welcome) -> None:
        if self.state is not _JOINING or self.member_id not in msg.members:
            return
        self._enter_view(
            View(msg.view_id, msg.members), joined=(self.member_id,), departed=(), state=msg.state,
            sponsor=sender,
        )

    # -- introspection (tests, the simulator, status tools) ------------------------------------
    def is_idle(self) -> bool:
        """Nothing queued, nothing in flight, nothing undelivered, no view change under way."""
        if self.state is not _ACTIVE:
            return True
        if not self.view_change.idle():
            return False
        if any(self.queues.values()) and self.assignment.adequate:
            return False
        return all(sh is None or sh.idle() for sh in self.shards)

    def holds(self, shard_index: int, seq: int) -> bool:
        """Whether this member holds ``seq`` of shard ``shard_index`` in its current view."""
        sh = self.shards[shard_index] if shard_index < len(self.shards) else None
        return sh is not None and sh.frontier > seq
