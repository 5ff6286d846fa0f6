"""A deterministic simulated fabric and cluster for the pure core.

Theory of operation. Every member is a :class:`~derecho_async.core.Member` driven by this
simulator. Time advances in ticks. Each ordered pair of members has a FIFO *link* carrying row
pushes and channel messages, and a separate data-plane link for large payloads; each item gets a
delay drawn from the seeded generator and never overtakes the one before it. The fabric is no
kinder than hardware: a push lands word by word, a few words at a time, interleaved with the
receiver's polls; a crash keeps only a random prefix of what the member had in flight (so it can
stop in the middle of a multi-push sequence, even in the middle of one push); a partition holds
everything in flight on the links it cuts until :meth:`SimCluster.heal`. Within a tick, link
landings and member steps run in an order shuffled by the generator. Same seed, same run, bit for
bit: the only source of randomness is ``random.Random(seed)``.

Every send, delivery and view is fed to the :class:`~derecho_async.testing.checker.Checker`.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from derecho_async.core import (
    CoreConfig,
    Delivered,
    Member,
    MemberState,
    Persisted,
    Ready,
    Send,
    View,
    ViewInstalled,
    Welcome,
)
from derecho_async.core.effects import DataKey
from derecho_async.core.layout import DEFAULT_SUBGROUP
from derecho_async.testing.checker import Checker, Delivery, InvariantViolation

__all__ = ["Delivery", "InvariantViolation", "SimCluster", "View"]

_WORD = 8


@dataclass(slots=True)
class _Item:
    due: int
    kind: str  # "push" | "msg" | "data"
    view_id: int = 0
    offset: int = 0
    data: bytes = b""
    message: object = None
    key: DataKey | None = None
    payload: object = None
    attach_state: bool = False


@dataclass(slots=True)
class _Link:
    items: deque[_Item] = field(default_factory=deque)
    last_due: int = 0


class SimCluster:
    """A simulated group of ``n`` members (ids ``0..n-1``) forming view 0 together.

    One subgroup with one shard, every member a sender. See the project README for the API.
    """

    def __init__(
        self,
        n: int,
        *,
        seed: int,
        window: int = 8,
        max_payload: int = 256,
        partition_safety: bool = True,
        max_delay: int = 3,
        data_delay: int = 6,
        suspect_after: int = 30,
        heartbeat_period: int = 2,
        send_batch: int = 0,
    ) -> None:
        if n < 1:
            raise ValueError("a cluster needs at least one member")
        if max_payload % _WORD:
            max_payload += _WORD - max_payload % _WORD
        self.seed = seed
        self.rng = random.Random(seed)
        self.config = CoreConfig(
            window=window,
            max_payload=max_payload,
            heartbeat_period=heartbeat_period,
            suspect_after=suspect_after,
            join_retry=suspect_after,
            partition_safety=partition_safety,
            send_batch=send_batch,
        )
        self.max_delay = max_delay
        self.data_delay = data_delay
        self.now = 0
        self.step_no = 0
        self.checker = Checker(seed, partition_safety)
        view = View(0, tuple(range(n)))
        self.members: dict[int, Member] = {m: Member(m, self.config, view=view) for m in range(n)}
        self.crashed: set[int] = set()
        self.links: dict[tuple[int, int], _Link] = {}
        self.data_links: dict[tuple[int, int], _Link] = {}
        self.side: dict[int, int] = {}
        self._delivered: dict[int, list[Delivery]] = {m: [] for m in range(n)}
        self._views: dict[int, list[View]] = {m: [] for m in range(n)}
        self._state: dict[int, bytes] = {m: b"" for m in range(n)}
        self._restored: dict[int, bytes] = {}
        self._persisted: dict[int, list[Persisted]] = {m: [] for m in range(n)}
        self._crash_when: list[tuple[int, Callable[[Member], bool]]] = []
        self.log: list[str] = []
        for m in range(n):
            self._drain(m)

    # -- the public API ------------------------------------------------------------------------
    def send(self, member: int, payload: bytes) -> bool:
        """Queue an ordered multicast from ``member``; False (nothing sent) if it cannot send."""
        core = self.members.get(member)
        if core is None or member in self.crashed:
            return False
        msg_no = core.submit(DEFAULT_SUBGROUP, bytes(payload))
        if msg_no is None:
            return False
        self.checker.on_send(self.step_no, member, msg_no, bytes(payload))
        return True

    def crash(self, member: int) -> None:
        """Stop ``member`` dead; only a random prefix of what it had in flight still lands."""
        if member not in self.members or member in self.crashed:
            return
        self.crashed.add(member)
        self.log.append(f"t={self.now} crash {member}")
        for table in (self.links, self.data_links):
            for (src, _dst), link in table.items():
                if src != member or not link.items:
                    continue
                keep = self.rng.randint(0, len(link.items))
                items = list(link.items)[:keep]
                if keep < len(link.items) and link.items[keep].kind == "push":
                    cut = link.items[keep]
                    words = len(cut.data) // _WORD
                    part = self.rng.randint(0, words)
                    if part:
                        items.append(
                            _Item(
                                cut.due, "push", cut.view_id, cut.offset, cut.data[: part * _WORD]
                            )
                        )
                link.items = deque(items)

    def partition(self, *sides: Iterable[int]) -> None:
        """Cut every link between members of different sides (unnamed members form one more)."""
        self.side = {}
        for i, side in enumerate(sides):
            for m in side:
                self.side[m] = i + 1
        self.log.append(f"t={self.now} partition {[sorted(s) for s in map(set, sides)]}")

    def heal(self) -> None:
        """Reconnect every link; what a partition held in flight lands now."""
        self.side = {}
        self.log.append(f"t={self.now} heal")

    def join(self, member: int) -> None:
        """A new member ``member`` asks the current leader to admit it."""
        if member in self.members:
            raise ValueError(f"member id {member} is already taken")
        primary = self._primary_view()
        contacts = primary.members if primary is not None else tuple(self.members)
        self.members[member] = Member(member, self.config, contacts=contacts)
        self._delivered[member] = []
        self._views[member] = []
        self._persisted[member] = []
        self.log.append(f"t={self.now} join {member}")

    def leave(self, member: int) -> None:
        """``member`` leaves the group voluntarily."""
        core = self.members.get(member)
        if core is None or member in self.crashed:
            return
        if core.state is MemberState.ACTIVE:
            self.checker.leavers.add(member)
        core.leave()
        self._drain(member)
        self.log.append(f"t={self.now} leave {member}")

    def run(self, ticks: int) -> None:
        """Advance the simulation by ``ticks`` ticks."""
        for _ in range(ticks):
            self._tick()

    def run_until_idle(self, max_ticks: int = 100_000) -> bool:
        """Run until every live member of the primary view delivered all it can and no view
        change is pending; False if that did not happen within ``max_ticks``."""
        for _ in range(max_ticks):
            if self._idle():
                self.checker.check(self.step_no, self.alive(), idle=True)
                return True
            self._tick()
        return self._idle()

    def delivered(self, member: int) -> list[Delivery]:
        """``member``'s deliveries, in delivery order."""
        return list(self._delivered[member])

    def views(self, member: int) -> list[View]:
        """The views ``member`` installed, in order."""
        return list(self._views[member])

    def persisted(self, member: int) -> list[Persisted]:
        """The persistence frontiers ``member`` saw rise (its :class:`Persisted` events)."""
        return list(self._persisted[member])

    def alive(self) -> set[int]:
        """Members of the primary view not crashed, not wedged out and not left."""
        primary = self._primary_view()
        if primary is None:
            return set()
        return {
            m
            for m in primary.members
            if m not in self.crashed
            and self.members[m].state is MemberState.ACTIVE
            and self.members[m].view.view_id == primary.view_id
        }

    def check(self) -> None:
        """Raise :class:`InvariantViolation` if any invariant failed so far."""
        self.checker.check(self.step_no, self.alive())

    # -- extra hooks for tests -----------------------------------------------------------------
    def crash_when(self, member: int, condition: Callable[[Member], bool]) -> None:
        """Crash ``member`` at the first step after which ``condition(core)`` holds."""
        self._crash_when.append((member, condition))

    def state_of(self, member: int) -> bytes:
        """The replicated state of ``member``: a digest chain over its deliveries."""
        return self._state[member]

    # -- internals -----------------------------------------------------------------------------
    def _primary_view(self) -> View | None:
        best: View | None = None
        for m, core in self.members.items():
            if m in self.crashed or core.state is not MemberState.ACTIVE:
                continue
            if best is None or core.view.view_id > best.view_id:
                best = core.view
        return best

    def _idle(self) -> bool:
        primary = self._primary_view()
        if primary is None:
            return True
        live = self.alive()
        if live != set(primary.members):
            return False
        for m in live:
            if not self.members[m].is_idle() or self.members[m].has_ready():
                return False
        progress = set()
        for m in live:
            shard = self.members[m].shards[0] if self.members[m].shards else None
            progress.add(shard.delivered if shard is not None else -1)
        if len(progress) > 1:
            return False
        return all(
            m in self.crashed or core.state is not MemberState.JOINING
            for m, core in self.members.items()
        )

    def _link(self, table: dict[tuple[int, int], _Link], src: int, dst: int) -> _Link:
        link = table.get((src, dst))
        if link is None:
            link = table[(src, dst)] = _Link()
        return link

    def _enqueue(
        self, table: dict[tuple[int, int], _Link], src: int, dst: int, item: _Item, delay: int
    ) -> None:
        link = self._link(table, src, dst)
        item.due = max(self.now + self.rng.randint(0, delay), link.last_due)
        link.last_due = item.due
        link.items.append(item)

    def _cut(self, a: int, b: int) -> bool:
        return self.side.get(a, 0) != self.side.get(b, 0)

    def _tick(self) -> None:
        self.now += 1
        live = [m for m in self.members if m not in self.crashed]
        for m in live:
            self.members[m].tick()
        actions: list[tuple[str, object]] = [("step", m) for m in live]
        for table in (self.links, self.data_links):
            for key, link in table.items():
                if link.items and link.items[0].due <= self.now and not self._cut(*key):
                    actions.append(("land", (table, key)))
        self.rng.shuffle(actions)
        while actions:
            kind, arg = actions.pop()
            if kind == "step":
                assert isinstance(arg, int)
                self._step(arg)
            else:
                table, key = arg  # type: ignore[misc]
                if self._land(table, key):
                    actions.insert(self.rng.randint(0, len(actions)), ("land", (table, key)))
        for m in live:
            if m not in self.crashed:
                self._step(m)

    def _land(self, table: dict[tuple[int, int], _Link], key: tuple[int, int]) -> bool:
        """Land part of the head item of a link; True if more is due on it this tick."""
        src, dst = key
        link = table[key]
        if not link.items or link.items[0].due > self.now or self._cut(src, dst):
            return False
        if dst in self.crashed:
            link.items.clear()
            return False
        core = self.members[dst]
        item = link.items[0]
        if item.kind == "push":
            words = len(item.data) // _WORD
            take = words if words <= 1 else self.rng.randint(1, words)
            core.receive_push(item.view_id, src, item.offset, item.data[: take * _WORD])
            if take < words:
                item.offset += take * _WORD
                item.data = item.data[take * _WORD :]
            else:
                link.items.popleft()
        elif item.kind == "msg":
            link.items.popleft()
            message = item.message
            if isinstance(message, Welcome) and item.attach_state:
                message = Welcome(message.view_id, message.members, item.payload)  # type: ignore[arg-type]
            core.receive_message(src, message)  # type: ignore[arg-type]
        else:
            link.items.popleft()
            assert item.key is not None
            core.data_landed(item.key, item.payload)
        return bool(link.items) and link.items[0].due <= self.now

    def _step(self, m: int) -> None:
        core = self.members[m]
        core.poll()
        self._drain(m)
        for victim, cond in list(self._crash_when):
            if victim not in self.crashed and cond(self.members[victim]):
                self._crash_when.remove((victim, cond))
                self.crash(victim)

    def _drain(self, m: int) -> None:
        core = self.members[m]
        ready = core.ready()
        if not ready:
            return
        self.step_no += 1
        self._execute(m, core, ready)
        core.advance(ready)

    def _execute(self, m: int, core: Member, ready: Ready) -> None:
        for ev in ready.events:
            if isinstance(ev, Delivered):
                payload = ev.payload
                assert isinstance(payload, bytes)
                d = Delivery(ev.view_id, ev.seq, ev.sender, payload)
                holders = frozenset(
                    x
                    for x, c in self.members.items()
                    if (c.view.view_id == ev.view_id and c.holds(ev.shard, ev.seq))
                    or c.view.view_id > ev.view_id
                )
                self._delivered[m].append(d)
                self._state[m] = _chain(self._state[m], ev.sender, ev.msg_no)
                self.checker.on_delivery(self.step_no, m, d, ev.msg_no, holders)
            elif isinstance(ev, Persisted):
                self._persisted[m].append(ev)
            elif isinstance(ev, ViewInstalled):
                if ev.state is not None:
                    self._state[m] = ev.state
                    self._restored[m] = ev.state
                self._views[m].append(ev.view)
                self.checker.on_view(self.step_no, m, ev.view)
                self.log.append(
                    f"t={self.now} member {m} installs {ev.view.view_id} {list(ev.view.members)}"
                )
        for p in ready.pushes:
            for dst in p.targets:
                self._enqueue(
                    self.links,
                    m,
                    dst,
                    _Item(0, "push", p.view_id, p.offset, p.data),
                    self.max_delay,
                )
        for s in ready.sends:
            self._send(m, s)
        for t in ready.transfers:
            for dst in t.targets:
                self._enqueue(
                    self.data_links,
                    m,
                    dst,
                    _Item(0, "data", key=t.key, payload=t.payload),
                    self.data_delay,
                )

    def _send(self, m: int, s: Send) -> None:
        item = _Item(0, "msg", message=s.message, attach_state=s.attach_state)
        if s.attach_state:
            item.payload = self._state[m]
        self._enqueue(self.links, m, s.to, item, self.max_delay)


def _chain(state: bytes, sender: int, msg_no: int) -> bytes:
    """Fold one delivery into a member's state digest (a cheap, order-sensitive hash)."""
    h = int.from_bytes(state or b"\0" * 8, "little")
    h = (h * 1_000_003 ^ (sender << 32 | msg_no)) & ((1 << 64) - 1)
    return h.to_bytes(8, "little")
