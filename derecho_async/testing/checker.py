"""The invariant checker of the simulated cluster.

It is fed what every member sent, delivered and installed (with the simulator's step number),
and checks the contract of DESIGN.md §2 over that history. Cheap per-event checks run as events
arrive; :meth:`Checker.check` runs the whole-history checks. A failure raises
:class:`InvariantViolation` naming the seed and the step, so the run can be replayed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from derecho_async.core.view import View

__all__ = ["Checker", "Delivery", "InvariantViolation", "SentMessage"]


class InvariantViolation(AssertionError):
    """A contract invariant failed in a simulated run; the message names the seed and step."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One delivered message as a member saw it."""

    view_id: int
    seq: int
    sender: int
    payload: bytes


@dataclass(slots=True)
class SentMessage:
    sender: int
    msg_no: int
    payload: bytes
    step: int


@dataclass(slots=True)
class _DeliveryRecord:
    member: int
    delivery: Delivery
    msg_no: int
    step: int
    holders: frozenset[int]


@dataclass(slots=True)
class Checker:
    seed: int
    partition_safety: bool = True
    sent: dict[tuple[int, int], SentMessage] = field(default_factory=dict)
    deliveries: dict[int, list[_DeliveryRecord]] = field(default_factory=lambda: defaultdict(list))
    views: dict[int, list[View]] = field(default_factory=lambda: defaultdict(list))
    view_members: dict[int, tuple[int, ...]] = field(default_factory=dict)
    leavers: set[int] = field(default_factory=set)
    violation: InvariantViolation | None = None

    def fail(self, step: int, text: str) -> None:
        exc = InvariantViolation(
            f"seed {self.seed}, step {step}: {text}\n"
            f"replay: DERECHO_ASYNC_SEED={self.seed} pytest tests/test_sweep.py -k replay"
        )
        if self.violation is None:
            self.violation = exc
        raise exc

    # -- per-event checks ----------------------------------------------------------------------
    def on_send(self, step: int, sender: int, msg_no: int, payload: bytes) -> None:
        self.sent[(sender, msg_no)] = SentMessage(sender, msg_no, payload, step)

    def on_view(self, step: int, member: int, view: View) -> None:
        mine = self.views[member]
        if mine and view.view_id != mine[-1].view_id + 1:
            self.fail(
                step, f"member {member} installed view {view.view_id} after {mine[-1].view_id}"
            )
        if member not in view.members:
            self.fail(step, f"member {member} installed {view} without being in it")
        known = self.view_members.get(view.view_id)
        if known is None:
            self.view_members[view.view_id] = view.members
            prev = self.view_members.get(view.view_id - 1)
            if prev is not None and self.partition_safety:
                kept = len(set(prev) & set(view.members))
                voters = len(set(prev) - self.leavers)
                if 2 * kept <= voters:
                    self.fail(step, f"view {view} keeps only {kept} of the {voters} members of "
                              f"view {view.view_id - 1} that did not leave voluntarily")
        elif known != view.members:
            self.fail(
                step,
                f"view {view.view_id} is {known} elsewhere but {view.members} at member {member}",
            )
        mine.append(view)

    def on_delivery(
        self, step: int, member: int, d: Delivery, msg_no: int, holders: frozenset[int]
    ) -> None:
        sent = self.sent.get((d.sender, msg_no))
        if sent is None:
            self.fail(step, f"member {member} delivered {d} (msg_no {msg_no}) never sent")
        elif sent.payload != d.payload:
            self.fail(step, f"member {member} delivered a payload that {d.sender} did not send")
        mine = self.deliveries[member]
        views = self.views[member]
        if not views or views[-1].view_id != d.view_id:
            self.fail(step, f"member {member} delivered {d} outside its current view")
        for prev in reversed(mine):
            if prev.delivery.sender == d.sender:
                if prev.msg_no >= msg_no:
                    self.fail(
                        step,
                        f"member {member} delivered msg {msg_no} of {d.sender} "
                        f"after msg {prev.msg_no} (FIFO / duplicate)",
                    )
                break
        if mine and mine[-1].delivery.view_id == d.view_id and mine[-1].delivery.seq >= d.seq:
            self.fail(step, f"member {member} delivered seq {d.seq} after {mine[-1].delivery.seq}")
        mine.append(_DeliveryRecord(member, d, msg_no, step, holders))

    # -- whole-history checks ------------------------------------------------------------------
    def check(self, step: int, survivors: set[int] | None = None, idle: bool = False) -> None:
        if self.violation is not None:
            raise self.violation
        per_view: dict[int, dict[int, list[tuple[int, int, int]]]] = defaultdict(dict)
        for member, recs in self.deliveries.items():
            for r in recs:
                per_view[r.delivery.view_id].setdefault(member, []).append(
                    (r.delivery.seq, r.delivery.sender, r.msg_no)
                )
        installed: dict[int, set[int]] = defaultdict(set)
        for member, member_views in self.views.items():
            for view in member_views:
                installed[view.view_id].add(member)
        # Prefix of the common order; same sequence for members that install the next view.
        for view_id, by_member in per_view.items():
            longest = max(by_member.values(), key=len)
            for member, seqs in by_member.items():
                if seqs != longest[: len(seqs)]:
                    self.fail(
                        step,
                        f"view {view_id}: member {member}'s deliveries are not a "
                        f"prefix of the common order",
                    )
            movers = installed.get(view_id + 1, set()) & installed.get(view_id, set())
            ref = None
            for member in sorted(movers):
                seqs = by_member.get(member, [])
                if ref is None:
                    ref = (member, seqs)
                elif seqs != ref[1]:
                    self.fail(
                        step,
                        f"members {ref[0]} and {member} installed view "
                        f"{view_id + 1} after delivering different messages in {view_id}",
                    )
        # Stability: whoever moved on from the view (or is alive in it) held it at delivery.
        alive_now = survivors or set()
        for recs in self.deliveries.values():
            for r in recs:
                v = r.delivery.view_id
                members = self.view_members.get(v, ())
                needed = {
                    m
                    for m in members
                    if m in installed.get(v + 1, set())
                    or (m in alive_now and v + 1 not in installed)
                }
                missing = needed - r.holders
                if missing:
                    self.fail(
                        r.step,
                        f"member {r.member} delivered {r.delivery} before "
                        f"members {sorted(missing)} held it",
                    )
        # Messages of failed senders: all survivors of the view or none.
        delivered_at: dict[tuple[int, int], set[int]] = defaultdict(set)
        version: dict[tuple[int, int], tuple[int, int]] = {}
        for member, recs in self.deliveries.items():
            for r in recs:
                key = (r.delivery.sender, r.msg_no)
                delivered_at[key].add(member)
                ver = (r.delivery.view_id, r.delivery.seq)
                if version.setdefault(key, ver) != ver:
                    self.fail(
                        r.step, f"message {key} delivered with versions {version[key]} and {ver}"
                    )
        for key, ver in version.items():
            v = ver[0]
            movers = installed.get(v + 1, set()) & set(self.view_members.get(v, ()))
            lacking = movers - delivered_at[key]
            if lacking:
                self.fail(
                    step,
                    f"message {key} delivered in view {v} but not at "
                    f"{sorted(lacking)}, who installed view {v + 1}",
                )
        if idle and survivors is not None:
            for (sender, msg_no), sent in self.sent.items():
                if sender not in survivors:
                    continue
                key = (sender, msg_no)
                got = delivered_at.get(key, set())
                if key not in version:
                    self.fail(
                        step,
                        f"message {msg_no} of surviving member {sender} "
                        f"(sent at step {sent.step}) was never delivered",
                    )
                v = version[key][0]
                want = {m for m in survivors if m in self.view_members.get(v, ())}
                if not want <= got:
                    self.fail(
                        step, f"message {key} of a survivor is missing at {sorted(want - got)}"
                    )
