"""Every view-change transition, in one place (DESIGN.md §4.4).

Rules (each member evaluates them on every poll once it is wedged; ``U`` is the set of ranks it
does not suspect, the *leader* is the lowest rank in ``U``, a proposal's *ballot* is its
proposer's rank + 1):

1. **Suspect.** A peer whose heartbeat has not moved for ``suspect_after`` ticks is suspected:
   its row is frozen and the suspicion published. Every member ORs the suspicions of all rows.
   A member that finds itself suspected is *evicted*; one whose ``U`` is not a strict majority of
   the view (partition safety on) is *partitioned* and wedges for good. Members that left
   voluntarily (their own row suspects themselves) do not count towards the majority: they will
   never form a view, so two disjoint sides still cannot both hold a majority of the rest.
   A member asked to leave while wedged first sees the change through and leaves the view it
   installs: once a proposal that keeps it may be chosen, a leave from the old view would
   leave the others a member in the new view that never runs it.
2. **Wedge.** On any suspicion, any peer's wedged flag, or a join request at the leader, a member
   stops sending, receiving and delivering in this view, publishes its final ``recv_frontier``
   and then ``wedged = 1``.
3. **Promise.** The leader waits until every member of ``U`` is wedged and either suspects every
   rank below the leader (so it will accept nothing from them again) or has seen a commit.
4. **Propose.** If some member of ``U`` saw a commit, that proposal is chosen: the leader adopts
   it as committed. Else if some member of ``U`` accepted a proposal, the leader re-proposes the
   one with the highest ballot under its own ballot (a predecessor may have committed it).
   Otherwise it proposes afresh: remove every suspected rank, admit pending joiners, and trim
   each shard at the lowest final frontier in ``U`` (everything below it is held by every
   survivor; nothing any member delivered lies above it). Fields are pushed before the ballot.
5. **Acknowledge.** A follower copies its leader's proposal into its own row when the leader's
   ballot is the leader's own and higher than what it accepted before.
6. **Commit.** The leader commits once every member of ``U`` accepted its ballot.
7. **Ragged trim and install.** A member that sees a commit in any row (its leader's, or the
   echo of a member that saw it first) echoes it (proposal and commit), delivers every message below the proposal's trim in seq order, and installs the next
   view: survivors in their old order, then joiners. It re-sends its own undelivered messages
   first; the new view's rank 0 sends each joiner a Welcome carrying its state (the driver puts
   a state-transfer ticket there; the snapshot streams after the fence).

Why it is safe: ballots rise with the leader's rank and a member follows only its current leader,
so rule 3 is Paxos' promise and rule 4 its choice of value; a commit needs every member of a
majority, so any later leader's promise set meets one of them and re-proposes the same value.
Every member of ``U`` froze its frontier before publishing ``wedged``, so the trim covers every
delivery made anywhere, and every survivor holds everything below it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from derecho_async.core.schema import MAX_JOINS, WORD

if TYPE_CHECKING:
    from derecho_async.core.member import Member

__all__ = ["Proposal", "step"]


Proposal = tuple[int, tuple[int, ...], tuple[int, ...]]
"""(removed rank mask, joiner ids, per-shard trims)."""


def _ranks(mask: int, n: int) -> list[int]:
    return [r for r in range(n) if not mask >> r & 1]


def read_proposal(m: Member, rank: int) -> Proposal:
    t = m.table
    sc = m.schema
    njoin = min(t.get(rank, sc.prop_njoin), MAX_JOINS)
    joiners = tuple(t.get(rank, sc.prop_joiners, i) for i in range(njoin))
    trims = tuple(t.get(rank, sc.prop_trim, s) for s in range(sc.n_shards))
    return t.get(rank, sc.prop_removed), joiners, trims


def write_proposal(m: Member, prop: Proposal, ballot: int, commit: int = 0) -> None:
    """Write ``prop`` into my row and push fields, then the ballot, then (if any) the commit."""
    t = m.table
    sc = m.schema
    removed, joiners, trims = prop
    t.set(sc.prop_removed, removed)
    t.set(sc.prop_njoin, len(joiners))
    for i, j in enumerate(joiners):
        t.set(sc.prop_joiners, j, i)
    for s, v in enumerate(trims):
        t.set(sc.prop_trim, v, s)
    m.push_all(sc.prop_removed.offset, sc.prop_ballot.offset - sc.prop_removed.offset)
    t.set(sc.prop_ballot, ballot)
    m.push_all(sc.prop_ballot.offset, WORD)
    if commit:
        t.set(sc.commit_ballot, commit)
        m.push_all(sc.commit_ballot.offset, WORD)
    m.mark_changed()


def step(m: Member) -> None:
    """Advance the view change by every rule whose guard holds now."""
    n = m.view_size
    unsuspected = _ranks(m.suspected, n)
    if not unsuspected:
        return
    leader = unsuspected[0]
    view_id = m.view.view_id
    _check_commit(m, leader)
    if m.view.view_id != view_id or not m.wedged or not m.is_active:
        return
    if leader == m.rank:
        _lead(m, unsuspected)
    else:
        _follow(m, leader)
    _check_commit(m, leader)


def _lead(m: Member, unsuspected: list[int]) -> None:
    t = m.table
    sc = m.schema
    my_ballot = m.rank + 1
    if t.mine(sc.commit_ballot):
        return
    if t.mine(sc.prop_ballot) == my_ballot:
        # Rule 6: commit once every unsuspected member accepted my ballot.
        if all(t.get(r, sc.prop_ballot) == my_ballot for r in unsuspected):
            t.set(sc.commit_ballot, my_ballot)
            m.push_all(sc.commit_ballot.offset, WORD)
            m.mark_changed()
        return
    # Rule 3: promises.
    lower = (1 << m.rank) - 1
    for r in unsuspected:
        if r == m.rank:
            continue
        if not t.get(r, sc.wedged):
            return
        if t.get(r, sc.suspected) & lower != lower and not t.get(r, sc.commit_ballot):
            return
    # Rule 4: choose the value.
    for r in unsuspected:
        c = t.get(r, sc.commit_ballot)
        if c and t.get(r, sc.prop_ballot) == c:
            write_proposal(m, read_proposal(m, r), c, commit=c)
            return
    best_rank = max(unsuspected, key=lambda r: t.get(r, sc.prop_ballot))
    if t.get(best_rank, sc.prop_ballot):
        write_proposal(m, read_proposal(m, best_rank), my_ballot)
        return
    members = m.view.members
    joiners = tuple(j for j in m.pending_joiners if j not in members)[:MAX_JOINS]
    trims = []
    for sh in m.assignment.shards:
        col = sc.shards[sh.index].recv_frontier
        holders = [m.view.rank_of(x) for x in sh.members]
        vals = [
            m.final_frontier(sh.index) if r == m.rank else t.get(r, col)
            for r in holders
            if not m.suspected >> r & 1
        ]
        trims.append(min(vals) if vals else 0)
    write_proposal(m, (m.suspected, joiners, tuple(trims)), my_ballot)


def _follow(m: Member, leader: int) -> None:
    t = m.table
    sc = m.schema
    if t.mine(sc.commit_ballot):
        return
    lb = t.get(leader, sc.prop_ballot)
    if lb == leader + 1 and lb > t.mine(sc.prop_ballot):
        write_proposal(m, read_proposal(m, leader), lb)


def _check_commit(m: Member, leader: int) -> None:
    if not m.is_active:
        return
    t = m.table
    sc = m.schema
    # A commit echoed in any row (frozen rows included) proves its proposal was chosen, so a
    # member need not wait to suspect a leader whose own commit push was lost with it.
    for r in (leader, *range(m.view_size)):
        c = t.get(r, sc.commit_ballot)
        if c and t.get(r, sc.prop_ballot) == c:
            prop = read_proposal(m, r)
            if r != m.rank and not t.mine(sc.commit_ballot):
                write_proposal(m, prop, c, commit=c)
            m.install(prop)
            return
