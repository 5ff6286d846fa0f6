"""Every view-change rule and the state it moves, in one place (DESIGN.md §4.4).

:class:`ViewChange` owns one member's failure detector, suspicions, wedge, pending joiners,
leave and its side of the agreement; the view-change columns it reads and writes live in the
member's table. It asks its member for the rest (pushes, the shards, the next view) through the
small :class:`Host` protocol, which :class:`~derecho_async.core.member.Member` implements.

Rules (``U`` is the set of ranks a member does not suspect, the *leader* is the lowest rank in
``U``, a proposal's *ballot* is its proposer's rank + 1; rules 3-7 run on every poll once the
member is wedged):

1. **Suspect.** A peer whose heartbeat has not moved for ``suspect_after`` ticks is suspected:
   its row is frozen and the suspicion published. Every member ORs the suspicions of all rows.
   A member that finds itself suspected is *evicted*; one whose ``U`` is not a strict majority of
   the view (partition safety on) is *partitioned* and wedges for good. Members that left
   voluntarily (their own row suspects themselves) do not count towards the majority. A member
   asked to leave while wedged first sees the change through and leaves the view it installs.
2. **Wedge.** On any suspicion, any peer's wedged flag, or a join request at the leader, a member
   stops sending, receiving and delivering in this view, publishes its final ``recv_frontier``
   and then ``wedged = 1``.
3. **Promise.** The leader waits until every member of ``U`` is wedged and either suspects every
   rank below the leader or has seen a commit.
4. **Propose.** A commit seen in ``U`` is adopted; else the accepted proposal with the highest
   ballot in ``U`` is re-proposed under the leader's ballot; else a fresh one: remove every
   suspected rank, admit pending joiners, trim each shard at the lowest final frontier in ``U``.
   Fields are pushed before the ballot.
5. **Acknowledge.** A follower copies its leader's proposal when the leader's ballot is the
   leader's own and higher than what it accepted before.
6. **Commit.** The leader commits once every member of ``U`` accepted its ballot.
7. **Ragged trim and install.** A member that sees a commit in any row echoes it, delivers every
   message below the trim in seq order and installs the next view (survivors in their old order,
   then joiners), re-sending its own undelivered messages; the new rank 0 welcomes the joiners.

Why this is safe (Paxos' promise and choice, the trim above every delivery) is DESIGN.md §4.4.
"""

from __future__ import annotations

from typing import Protocol

from derecho_async.core.effects import Evicted, Left, Partitioned, Ready, Send, Suspected
from derecho_async.core.layout import ShardAssignment
from derecho_async.core.messages import Welcome
from derecho_async.core.schema import MAX_JOINS, WORD, RowSchema
from derecho_async.core.table import Table
from derecho_async.core.view import View

__all__ = ["Host", "Proposal", "ViewChange"]


Proposal = tuple[int, tuple[int, ...], tuple[int, ...]]
"""(removed rank mask, joiner ids, per-shard trims)."""


class Host(Protocol):
    """What the view-change rules ask of the member that runs them."""

    def ready(self) -> Ready:
        """The Ready that effects go into now (events, sends)."""
        ...

    def push_all(self, row_offset: int, nbytes: int) -> None:
        """Push a range of my row to every member of the view I do not suspect."""
        ...

    def freeze_shards(self) -> dict[int, int]:
        """Publish each shard's progress, then freeze it; its final frontier by shard index."""
        ...

    def ragged_trim(self, trims: tuple[int, ...]) -> None:
        """Deliver each shard up to its trim (by shard index), in seq order."""
        ...

    def next_view(
        self, view: View, joined: tuple[int, ...], departed: tuple[int, ...]
    ) -> None:
        """Put my undelivered messages back at the front of their queues and enter ``view``
        (which calls :meth:`ViewChange.enter_view`)."""
        ...

    def fail_queued(self, reason: str) -> None:
        """Fail every queued message with ``reason``."""
        ...

    def leave_group(self, event: Evicted | Partitioned | Left) -> None:
        """Leave the group for good: emit ``event``, then fail every queued message."""
        ...


def _ranks(mask: int, n: int) -> list[int]:
    return [r for r in range(n) if not mask >> r & 1]


class ViewChange:
    """One member's view-change state and rules (see the module docstring).

    The member calls :meth:`enter_view` for every view it installs, then feeds it time
    (:meth:`tick`), signs of life (:meth:`heard_from`), suspicions (:meth:`suspect`), join
    requests and leaves; its poll calls :meth:`poll` when :attr:`changed` is set.
    """

    def __init__(
        self,
        host: Host,
        member_id: int,
        *,
        heartbeat_period: int,
        suspect_after: int,
        partition_safety: bool,
    ) -> None:
        self._host = host
        self.member_id = member_id
        self.heartbeat_period = heartbeat_period
        self.suspect_after = suspect_after
        self.partition_safety = partition_safety
        self.pending_joiners: list[int] = []
        """Joiners this member (as leader) will admit in its next proposal."""
        self.leaving = False
        """A leave was asked for (it waits for a view change under way to end)."""
        self.leave_reason = ""
        """What the leave was given: the :class:`Left` event's reason."""
        self.changed = True
        """Membership columns (other than heartbeats) changed since the last :meth:`poll`."""
        # Per-view state, set by enter_view.
        self.view = View(-1, ())
        self.rank = -1
        self.view_size = 0
        self.table: Table
        self.schema: RowSchema
        self.assignment = ShardAssignment((), False)
        self.suspected = 0
        """The ranks this member suspects, as a bit mask."""
        self.wedged = False
        self.final_frontiers: dict[int, int] = {}
        self._last_hb: list[int] = []
        self._last_change: list[int] = []

    # -- inputs from the member ----------------------------------------------------------------
    def enter_view(
        self, view: View, table: Table, assignment: ShardAssignment, now: int
    ) -> None:
        """Start over in ``view`` (this member's rank in it), with its fresh ``table``."""
        self.view = view
        self.rank = view.members.index(self.member_id)
        self.view_size = n = len(view.members)
        self.table = table
        self.schema = table.schema
        self.assignment = assignment
        self.suspected = 0
        self.wedged = False
        self.changed = True
        self.final_frontiers = {}
        self._last_hb = [0] * n
        self._last_change = [now] * n

    def tick(self, now: int) -> None:
        """Rule 1's failure detector: bump my heartbeat every ``heartbeat_period`` ticks and
        suspect every peer whose heartbeat has not moved for ``suspect_after`` ticks."""
        t = self.table
        sc = self.schema
        if now % self.heartbeat_period == 0:
            t.set(sc.heartbeat, t.mine(sc.heartbeat) + 1)
            self._host.push_all(sc.heartbeat.offset, WORD)
        for r in range(self.view_size):
            if r == self.rank or self.suspected >> r & 1:
                continue
            hb = t.get(r, sc.heartbeat)
            if hb != self._last_hb[r]:
                self._last_hb[r] = hb
                self._last_change[r] = now
            elif now - self._last_change[r] >= self.suspect_after:
                self.suspect(r, "silent")

    def heard_from(self, member: int, now: int) -> None:
        """``member`` (of the view) showed a sign of life at ``now``."""
        self._last_change[self.view.members.index(member)] = now

    def suspect(self, rank: int, cause: str) -> None:
        """Suspect ``rank`` (rule 1) for ``cause`` (see :class:`Suspected`): freeze its row; a
        view change follows."""
        if self.suspected >> rank & 1:
            return
        self.suspected |= 1 << rank
        self.changed = True
        self.table.freeze(rank)
        if rank != self.rank:
            self._host.ready().events.append(Suspected(self.view.members[rank], cause))

    def join_request(self, joiner: int) -> None:
        """``joiner`` asks to join (rule 2 at the leader)."""
        view = self.view
        if joiner in view.members:
            # Its Welcome may have been lost with a failed sender: any member of the view can
            # repeat it while the joiner has not been heard from (nothing is stable without it).
            r = view.members.index(joiner)
            if self.table.get(r, self.schema.heartbeat) == 0 and not self.wedged:
                self._host.ready().sends.append(
                    Send(joiner, Welcome(view.view_id, view.members), attach_state=True)
                )
            return
        unsuspected = _ranks(self.suspected, self.view_size)
        if not unsuspected or unsuspected[0] != self.rank:
            return
        if joiner not in self.pending_joiners:
            self.pending_joiners.append(joiner)
        self._wedge()

    def leave(self, reason: str) -> None:
        """Leave the group (rule 1): at once, or, while wedged, from the view this change
        installs (see ``Member.leave``)."""
        self.leaving = True
        self.leave_reason = reason
        if self.wedged:
            self._host.fail_queued(self._left_why())  # the rest when install departs
        else:
            self._depart()

    def _left_why(self) -> str:
        """Why this member's queued calls fail when it leaves (with the reason it was given)."""
        why = "this member left the group"
        return f"{why}: {self.leave_reason}" if self.leave_reason else why

    def idle(self) -> bool:
        """No view change under way or asked for."""
        return not (self.wedged or self.suspected or self.pending_joiners)

    # -- the step ------------------------------------------------------------------------------
    def poll(self) -> bool:
        """React to changed membership columns: rules 1 and 2, then (once wedged) 3 to 7.
        False when this member is out of the group after rule 1 (evicted or partitioned)."""
        self.changed = False
        if not self._scan():
            return False
        if self.wedged:
            self.step()
        return True

    def step(self) -> None:
        """Advance the agreement (wedged) by every rule of 3 to 7 whose guard holds now."""
        unsuspected = _ranks(self.suspected, self.view_size)
        if not unsuspected:
            return
        leader = unsuspected[0]
        if self._check_commit(leader):
            return
        if leader == self.rank:
            self._lead(unsuspected)
        else:
            self._follow(leader)
        self._check_commit(leader)

    # -- rules 1 and 2 -------------------------------------------------------------------------
    def _scan(self) -> bool:
        t = self.table
        sc = self.schema
        n = self.view_size
        mask = self.suspected
        wedge_seen = False
        leavers = 0
        left = 0  # the ranks that suspect themselves: they left voluntarily
        for r in range(n):
            if r == self.rank:
                continue
            theirs = t.get(r, sc.suspected)
            mask |= theirs
            if theirs >> r & 1:
                leavers += 1
                left |= 1 << r
            if t.get(r, sc.wedged):
                wedge_seen = True
        mask &= (1 << n) - 1
        for r in range(n):
            if mask >> r & 1 and not self.suspected >> r & 1 and r != self.rank:
                self.suspect(r, "left" if left >> r & 1 else "peer")
        if mask >> self.rank & 1:
            self._host.leave_group(Evicted(self.view.view_id))
            return False
        self._publish_suspicions()
        # Partition safety: the unsuspected members must be a strict majority of the view, not
        # counting members that left voluntarily (they will never form a view of their own).
        unsuspected = n - bin(self.suspected).count("1")
        if self.partition_safety and 2 * unsuspected <= n - leavers:
            self._host.leave_group(Partitioned(self.view.view_id))
            return False
        if self.suspected or wedge_seen:
            self._wedge()
        return True

    def _publish_suspicions(self) -> None:
        sc = self.schema
        if self.table.mine(sc.suspected) != self.suspected:
            self.table.set(sc.suspected, self.suspected)
            self._host.push_all(sc.suspected.offset, WORD)

    def _wedge(self) -> None:
        if self.wedged:
            return
        self.final_frontiers = self._host.freeze_shards()
        self.wedged = True
        self.changed = True
        self.table.set(self.schema.wedged, 1)
        self._host.push_all(self.schema.wedged.offset, WORD)

    def _depart(self) -> None:
        self.suspect(self.rank, "left")
        self._publish_suspicions()
        self._host.fail_queued(self._left_why())
        # (its queues are empty now: leave_group fails nothing more)
        self._host.leave_group(Left(self.view.view_id, self.leave_reason))

    # -- rules 3 to 6 --------------------------------------------------------------------------
    def _read_proposal(self, rank: int) -> Proposal:
        t = self.table
        sc = self.schema
        njoin = min(t.get(rank, sc.prop_njoin), MAX_JOINS)
        joiners = tuple(t.get(rank, sc.prop_joiners, i) for i in range(njoin))
        trims = tuple(t.get(rank, sc.prop_trim, s) for s in range(sc.n_shards))
        return t.get(rank, sc.prop_removed), joiners, trims

    def _write_proposal(self, prop: Proposal, ballot: int, commit: int = 0) -> None:
        """Write ``prop`` into my row and push fields, then the ballot, then (if any) the
        commit."""
        t = self.table
        sc = self.schema
        push_all = self._host.push_all
        removed, joiners, trims = prop
        t.set(sc.prop_removed, removed)
        t.set(sc.prop_njoin, len(joiners))
        for i, j in enumerate(joiners):
            t.set(sc.prop_joiners, j, i)
        for s, v in enumerate(trims):
            t.set(sc.prop_trim, v, s)
        push_all(sc.prop_removed.offset, sc.prop_ballot.offset - sc.prop_removed.offset)
        t.set(sc.prop_ballot, ballot)
        push_all(sc.prop_ballot.offset, WORD)
        if commit:
            t.set(sc.commit_ballot, commit)
            push_all(sc.commit_ballot.offset, WORD)
        self.changed = True

    def _lead(self, unsuspected: list[int]) -> None:
        t = self.table
        sc = self.schema
        my_ballot = self.rank + 1
        if t.mine(sc.commit_ballot):
            return
        if t.mine(sc.prop_ballot) == my_ballot:
            # Rule 6: commit once every unsuspected member accepted my ballot.
            if all(t.get(r, sc.prop_ballot) == my_ballot for r in unsuspected):
                t.set(sc.commit_ballot, my_ballot)
                self._host.push_all(sc.commit_ballot.offset, WORD)
                self.changed = True
            return
        # Rule 3: promises.
        lower = (1 << self.rank) - 1
        for r in unsuspected:
            if r == self.rank:
                continue
            if not t.get(r, sc.wedged):
                return
            if t.get(r, sc.suspected) & lower != lower and not t.get(r, sc.commit_ballot):
                return
        # Rule 4: choose the value.
        for r in unsuspected:
            c = t.get(r, sc.commit_ballot)
            if c and t.get(r, sc.prop_ballot) == c:
                self._write_proposal(self._read_proposal(r), c, commit=c)
                return
        best_rank = max(unsuspected, key=lambda r: t.get(r, sc.prop_ballot))
        if t.get(best_rank, sc.prop_ballot):
            self._write_proposal(self._read_proposal(best_rank), my_ballot)
            return
        view = self.view
        joiners = tuple(j for j in self.pending_joiners if j not in view.members)[:MAX_JOINS]
        trims = []
        for sh in self.assignment.shards:
            col = sc.shards[sh.index].recv_frontier
            holders = [view.rank_of(x) for x in sh.members]
            vals = [
                self.final_frontiers.get(sh.index, 0) if r == self.rank else t.get(r, col)
                for r in holders
                if not self.suspected >> r & 1
            ]
            trims.append(min(vals) if vals else 0)
        self._write_proposal((self.suspected, joiners, tuple(trims)), my_ballot)

    def _follow(self, leader: int) -> None:
        # Rule 5.
        t = self.table
        sc = self.schema
        if t.mine(sc.commit_ballot):
            return
        lb = t.get(leader, sc.prop_ballot)
        if lb == leader + 1 and lb > t.mine(sc.prop_ballot):
            self._write_proposal(self._read_proposal(leader), lb)

    # -- rule 7 --------------------------------------------------------------------------------
    def _check_commit(self, leader: int) -> bool:
        """Install the next view if a commit is seen in any row; True when it did (this member
        is then in the next view or out of the group)."""
        t = self.table
        sc = self.schema
        # A commit echoed in any row (frozen rows included) proves its proposal was chosen, so a
        # member need not wait to suspect a leader whose own commit push was lost with it.
        for r in (leader, *range(self.view_size)):
            c = t.get(r, sc.commit_ballot)
            if c and t.get(r, sc.prop_ballot) == c:
                prop = self._read_proposal(r)
                if r != self.rank and not t.mine(sc.commit_ballot):
                    self._write_proposal(prop, c, commit=c)
                self._install(prop)
                return True
        return False

    def _install(self, prop: Proposal) -> None:
        removed, joiners, trims = prop
        host = self._host
        host.ragged_trim(trims)
        old = self.view
        survivors = tuple(m for r, m in enumerate(old.members) if not removed >> r & 1)
        if self.member_id not in survivors:
            if self.leaving:  # removed while a leave waited for this change: what it asked for
                host.leave_group(Left(old.view_id, self.leave_reason))
            else:
                host.leave_group(Evicted(old.view_id))
            return
        joined = tuple(j for j in dict.fromkeys(joiners) if j not in survivors)
        departed = tuple(m for m in old.members if m not in survivors)
        new_view = View(old.view_id + 1, survivors + joined)
        host.next_view(new_view, joined, departed)
        self.pending_joiners = [j for j in self.pending_joiners if j not in new_view.members]
        if self.rank != 0:
            self.pending_joiners = []
        elif self.pending_joiners:
            self._wedge()
        if self.rank == 0:
            sends = host.ready().sends
            for j in joined:
                sends.append(
                    Send(j, Welcome(new_view.view_id, new_view.members), attach_state=True)
                )
        if self.leaving:
            self._depart()  # asked for during the change just ended: leave the view it made
