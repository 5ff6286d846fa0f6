# Theory of operation
# -------------------
# ``check_actor_run(run)`` checks the actor-level contract over what an actor schedule
# (actorsim.py) recorded, from two independent sources: what each member's Group reported to the
# observer (deliveries in order with their versions, views, snapshots taken and restored,
# handler outcomes where the group reports them) and what each SimLog replica recorded itself
# (its restore, and the start, end, outcome and resulting state of every handler). Each check
# is named by a letter; the first one that fails raises InvariantViolation (testing/checker.py)
# naming the seed, the check and the replay command:
#   (a) ran == delivered: each member ran exactly the calls delivered to it, in delivery order,
#       each once (a crashed or departed member: a prefix); members that install view v+1
#       delivered the same calls in view v, in the same order (virtual synchrony);
#   (b) a joiner restored, before running any call, the state its sponsor took at the cut, and
#       that is the state every member of the previous view had after that view's calls;
#   (c) replicas agree: every member that ran a call ended it the same way and in the same
#       state, and the state after the last call of view v is the same at every member that
#       installs view v+1;
#   (d) the replies a caller got are what each member's handler returned or raised (the caller's
#       own exception as itself, another member's as HandlerError(member, type name, message), a
#       departed member as MemberFailed), from exactly the members of the delivering view, with
#       the version the call was delivered at; a one-way call's version is its delivery's; an
#       exception's words are the contract's (simlog.outcome_text: a __str__ that raises gives
#       a fixed text, lone surrogates are escaped), the same from every member;
#   (e) a p2p read returns the state after some delivered prefix at that member (never a
#       half-applied call); a versioned read, exactly the state after the call of that version;
#   (f) nothing is lost: every call whose caller saw it succeed is in every survivor's log once;
#       calls fail (GroupClosed, PartitionedError) only at members that left, crashed or were
#       closed, and every call of a survivor finishes;
#   (g) nothing a handler raises reaches the event loop's exception handler;
#   (h) durable schedules: after a total failure (every member and every disk crashed), the
#       restarted members agree, their log is a prefix of the order before the failure, it
#       holds every call that persisted() acknowledged, and every member's log gives a version
#       the same time (one clock for the group);
#   (i) durable schedules: a crashed member restarted from its disk while the group runs is
#       admitted and, after a barrier call, holds exactly the caller's log;
#   (j) member 0's subscription yielded exactly the calls it delivered, in order, each once, and
#       its views() iteration exactly the views it installed after its first;
#   (k) external clients' calls (relayed, retried through other relays, some sent through two
#       at once) run once: only their first delivery in the group's order runs anywhere (a
#       later copy is not a call of (a)), a copy's replies are the first run's outcomes, and
#       every such call ends acknowledged while the group has survivors.
#   (l) stalling schedules with beacons: a member stalled for several suspicion timeouts (its
#       links held, its beacon reaching its peers) is still in every live member's view when
#       the stall ends, unless another fault touched it.
"""The actor-level contract checker over an :class:`~.actorsim.ActorRun`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from derecho_async import wire
from derecho_async.api import HandlerError, Replies
from derecho_async.errors import GroupClosed, MemberFailed, PartitionedError, UsageError
from derecho_async.testing.actorsim import ActorRun, CallOutcome
from derecho_async.testing.checker import InvariantViolation
from derecho_async.testing.simlog import RAISE_BEFORE, StateKey, outcome_text, state_of

__all__ = ["check_actor_run", "replay_command"]

Version = tuple[int, int]


def replay_command(seed: int) -> str:
    """The shell command that replays actor schedule ``seed`` verbosely."""
    return f"python -m derecho_async.testing.actor_sweep --seed {seed}"


class _Fail:
    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, check: str, text: str) -> InvariantViolation:
        return InvariantViolation(
            f"actor seed {self.seed}, check ({check}): {text}\n"
            f"replay: {replay_command(self.seed)}"
        )


def _cid(payload: object) -> int | None:
    """The call id of a delivered SimLog call (its first argument), None if it is not one."""
    if not isinstance(payload, bytes | bytearray):
        call = getattr(payload, "call", None)  # an OutOfBand call: its encoded part
        if not isinstance(call, bytes | bytearray):
            return None
        payload = call
    try:
        _name, args, _kwargs = wire.decode_call(bytes(payload))
    except Exception:
        return None
    return args[0] if args and type(args[0]) is int else None


def check_actor_run(run: ActorRun) -> None:
    """Check every contract item over ``run``; raise InvariantViolation at the first failure."""
    fail = _Fail(run.seed)
    obs = run.observer
    survivors = set(run.survivors)
    initial: StateKey = (0, 0, (0,) * 8 if run.knobs.get("with_array") else ())

    # (g) first: an escaped exception explains whatever else breaks
    if run.loop_errors:
        raise fail("g", "exceptions reached the event loop: " + "; ".join(run.loop_errors[:3]))

    # -- what each member delivered and ran ----------------------------------------------------
    delivered: dict[int, list[tuple[Version, int, int | None]]] = {}  # (version, sender, cid)
    version_of: dict[int, dict[int, Version]] = {}  # member -> cid -> version
    # (k) an external client's call may be delivered more than once (a copy per relay that
    # sent it): the first delivery in the group's order is the call, the rest are copies
    first_copy: dict[int, Version] = {}
    copies: dict[int, set[Version]] = {}  # cid -> the versions of all its deliveries
    for delivered_here in obs.deliveries.values():
        for dv in delivered_here:
            if isinstance(dv.payload, bytes) and wire.client_tag(dv.payload) is not None:
                cid = _cid(dv.payload)
                if cid is not None:
                    where = (dv.view_id, dv.seq)
                    copies.setdefault(cid, set()).add(where)
                    if cid not in first_copy or where < first_copy[cid]:
                        first_copy[cid] = where
    all_delivered: dict[int, list[Version]] = {}  # every delivery, copies included ((j))
    for m, events in obs.deliveries.items():
        all_delivered[m] = [(e.view_id, e.seq) for e in events]
        rows = [((e.view_id, e.seq), e.sender, _cid(e.payload)) for e in events]
        rows = [r for r in rows if r[2] not in first_copy or first_copy[r[2]] == r[0]]
        delivered[m] = rows
        seen: dict[int, Version] = {}
        for version, _sender, cid in rows:
            if cid is None:
                raise fail("a", f"member {m} delivered a call that is no SimLog call at {version}")
            if cid in seen:
                raise fail("a", f"member {m} delivered call {cid} twice ({seen[cid]}, {version})")
            seen[cid] = version
        version_of[m] = seen
        versions = [v for v, _, _ in rows]
        if versions != sorted(versions) or len(set(versions)) != len(versions):
            raise fail("a", f"member {m} delivered versions out of order: {versions[:20]}")

    ran: dict[int, list[int]] = {}
    ends: dict[int, dict[int, tuple[bool, object, StateKey]]] = {}
    restored: dict[int, StateKey] = {}
    states_seen: dict[int, set[StateKey]] = {}
    for m, recs in run.records.items():
        order: list[int] = []
        done: dict[int, tuple[bool, object, StateKey]] = {}
        open_cid: int | None = None
        seen_states = {initial}
        rec: Any
        for rec in recs:
            if rec[0] == "restore":
                if order:
                    raise fail("b", f"member {m} restored a state after running calls {order}")
                key = rec[1]
                assert isinstance(key, tuple)
                restored[m] = key
                seen_states = {key}
            elif rec[0] == "begin":
                cid = rec[1]
                if open_cid is not None:
                    raise fail("a", f"member {m} started call {cid} while call {open_cid} "
                                    "was still running (handlers must run one at a time)")
                if cid in done or cid in order:
                    raise fail("a", f"member {m} ran call {cid} twice")
                order.append(cid)
                open_cid = cid
            else:
                _, cid, ok, value, key = rec
                if cid != open_cid:
                    raise fail("a", f"member {m}: call {cid} ended but {open_cid} was running")
                open_cid = None
                done[cid] = (ok, value, key)
                seen_states.add(key)
        ran[m], ends[m], states_seen[m] = order, done, seen_states

    barrier_ok = any(c.kind == "barrier" and c.ok for c in run.calls)
    for m in sorted(set(ran) | set(delivered)):
        d = [cid for _, _, cid in delivered.get(m, [])]
        r = ran.get(m, [])
        if r != d[: len(r)]:
            i = next((i for i, (x, y) in enumerate(zip(r, d, strict=False)) if x != y),
                     min(len(r), len(d)))
            raise fail("a", f"member {m} ran calls in another order than delivered: at position "
                            f"{i} ran {r[i:i + 5]} but delivered {d[i:i + 5]}")
        if m in survivors and barrier_ok and len(r) != len(d):
            raise fail("a", f"survivor {m} delivered {len(d)} calls but ran {len(r)}: "
                            f"never ran {d[len(r):len(r) + 5]}")

    # virtual synchrony: members that install v+1 delivered the same calls in view v
    installed: dict[int, list[int]] = {
        m: [e.view.view_id for e in evs] for m, evs in obs.views.items()
    }
    members_of: dict[int, tuple[int, ...]] = {}
    for evs in obs.views.values():
        for e in evs:
            members_of.setdefault(e.view.view_id, e.view.members)
    in_view: dict[int, dict[int, list[tuple[Version, int, int | None]]]] = {}
    for m, rows in delivered.items():
        per: dict[int, list[tuple[Version, int, int | None]]] = {}
        for row in rows:
            per.setdefault(row[0][0], []).append(row)
        in_view[m] = per
    movers: dict[int, list[int]] = {}  # view v -> members that installed v and v+1
    for m, vids in installed.items():
        for a, b in itertools.pairwise(vids):
            if b != a + 1:
                raise fail("a", f"member {m} installed view {b} after view {a}")
            movers.setdefault(a, []).append(m)
    for v, ms in sorted(movers.items()):
        lead = ms[0]
        calls = in_view.get(lead, {}).get(v, [])
        for m in ms[1:]:
            theirs = in_view.get(m, {}).get(v, [])
            if theirs != calls:
                raise fail("a", f"members {lead} and {m} both installed view {v + 1} but "
                                f"delivered different calls in view {v}: "
                                f"{[c for _, _, c in calls]} vs {[c for _, _, c in theirs]}")

    # -- (c) state after each view ---------------------------------------------------------------
    def state_after(m: int, v: int) -> StateKey | None:
        """Member m's state after every call delivered to it in views <= v (None: unknown)."""
        last = None
        for version, _s, cid in delivered.get(m, []):
            if version[0] <= v:
                last = cid
        if last is None:
            if m in unrestored:  # a joiner whose join failed: it holds no replica
                return None
            return restored.get(m, initial)
        end = ends.get(m, {}).get(last)
        return end[2] if end is not None else None

    unrestored = {m for m, evs in obs.views.items()
                  if m in evs[0].joined and evs[0].view.view_id != 0 and m not in restored}
    after_view: dict[int, dict[int, StateKey]] = {}
    for v, ms in sorted(movers.items()):
        after_view[v] = {m: s for m in ms if (s := state_after(m, v)) is not None}

    # -- (b) joiners ------------------------------------------------------------------------------
    for m, evs in obs.views.items():
        first_view = evs[0]
        if m not in first_view.joined or first_view.view.view_id == 0:
            continue
        v = first_view.view.view_id
        if ran.get(m) and m not in restored:
            raise fail("b", f"joiner {m} (view {v}) ran calls without restoring a state")
        if m in restored:
            expect = after_view.get(v - 1, {})
            for other, s in sorted(expect.items()):
                if s != restored[m]:
                    raise fail("b", f"joiner {m} restored {restored[m][:2]} in view {v}, but "
                                    f"member {other} had {s[:2]} after view {v - 1}")
    # the snapshot of the sponsor whose Welcome admitted the joiner (another member may have
    # repeated the Welcome later: the joiner refuses that transfer, whose fence came later)
    taken: dict[tuple[int | None, int, int], tuple[int, dict[str, object]]] = {
        (sponsor, view_id, joiner): (sponsor, state)
        for sponsor, view_id, joiner, state in obs.snapshots}
    sponsor_of = {m: evs[0].sponsor for m, evs in obs.views.items() if evs}
    for m, view_id, state in obs.restores:
        entry = taken.get((sponsor_of.get(m), view_id, m))
        if entry is not None and _states(entry[1]) != _states(state):
            raise fail("b", f"joiner {m} restored in view {view_id} a state other than the one "
                            f"its sponsor {entry[0]} took: {_states(state)} vs "
                            f"{_states(entry[1])}")
        if m in restored and "SimLog" in state and state_of(state["SimLog"]) != restored[m]:
            raise fail("b", f"joiner {m}: the observer's restored state differs from what the "
                            "replica restored")

    # -- (c) replicas agree after each view, and after each call -----------------------------------
    for v, states in sorted(after_view.items()):
        if len(set(states.values())) > 1:
            raise fail("c", f"replicas differ after view {v}: "
                            + ", ".join(f"member {m}: {s[:2]}" for m, s in sorted(states.items())))

    # every member that ran a call ended it the same way, in the same state (same prefix)
    outcome_of: dict[int, tuple[int, tuple[bool, object, StateKey]]] = {}
    for m in sorted(ends):
        for cid, end in ends[m].items():
            seen_end = outcome_of.setdefault(cid, (m, end))
            if seen_end[1] != end:
                raise fail("c", f"call {cid} ended differently at members {seen_end[0]} and "
                                f"{m}: {seen_end[1][:2]}, state {seen_end[1][2][:2]} vs "
                                f"{end[:2]}, state {end[2][:2]}")

    # -- (d) replies and one-way versions -----------------------------------------------------------
    def record_of(m: int, cid: int) -> tuple[bool, object, StateKey] | None:
        return ends.get(m, {}).get(cid)

    any_end: dict[int, tuple[bool, object, StateKey]] = {}
    for per_member in ends.values():
        for cid, end in per_member.items():
            any_end.setdefault(cid, end)
    for call in run.calls:
        if not call.ok:
            continue
        if call.kind.startswith("client"):
            _check_client_call(call, copies, members_of, any_end, survivors, fail)
            continue
        if call.kind == "cast":
            got_v = version_of.get(call.caller, {}).get(call.cid)
            if got_v is not None and tuple(call.value) != got_v:  # type: ignore[arg-type]
                raise fail("d", f"one-way call {call.cid} of member {call.caller} resolved to "
                                f"{call.value} but was delivered there at {got_v}")
            continue
        replies = call.value
        assert isinstance(replies, Replies)
        version = replies.version
        expected = members_of.get(version[0])
        if expected is not None and set(replies) != set(expected):
            raise fail("d", f"call {call.cid}: replies from {sorted(replies)}, but view "
                            f"{version[0]} is {list(expected)}")
        for m in replies:
            value = replies[m]
            at = version_of.get(m, {}).get(call.cid)
            if at is not None and at != version:
                raise fail("d", f"call {call.cid}: Replies.version {version}, but member {m} "
                                f"delivered it at {at}")
            if isinstance(value, MemberFailed):
                if m in survivors:
                    raise fail("d", f"call {call.cid}: survivor {m} reported as {value!r}")
                continue
            outcome = record_of(m, call.cid)
            if outcome is None:
                raise fail("d", f"call {call.cid}: member {m} replied {value!r} but its replica "
                                "never finished the call")
            ok, result, _ = outcome
            if ok:
                if value != result:
                    raise fail("d", f"call {call.cid}: member {m} returned {result!r} but the "
                                    f"caller {call.caller} got {value!r}")
                continue
            assert isinstance(result, tuple)
            tname, text = result
            if m == call.caller:  # the exception itself, read by the contract's rule
                good = isinstance(value, BaseException) and outcome_text(value) == result
            else:
                good = value == HandlerError(m, tname, text)
            if not good:
                raise fail("d", f"call {call.cid}: member {m} raised {tname}({text!r}) but the "
                                f"caller {call.caller} got {value!r}")

    # -- (e) p2p reads -----------------------------------------------------------------------------
    state_at_version: dict[Version, StateKey] = {}
    for m, rows in delivered.items():
        for version, _s, cid in rows:
            ended = ends.get(m, {}).get(cid) if cid is not None else None
            if ended is not None:
                state_at_version.setdefault(version, ended[2])
    for read in run.reads:
        if read.ok is None:
            if read.caller in survivors and read.target in survivors:
                raise fail("e", f"a p2p read of survivor {read.target} by survivor "
                                f"{read.caller} never finished")
            continue
        if not read.ok:
            if read.caller in survivors and read.target in survivors and not isinstance(
                    read.value, MemberFailed | UsageError | GroupClosed):
                raise fail("e", f"a p2p read of survivor {read.target} by {read.caller} "
                                f"failed: {read.value!r}")
            continue
        value = _key(read.value)
        if value not in states_seen.get(read.target, set()):
            raise fail("e", f"a p2p read by {read.caller} of member {read.target} returned "
                            f"{value[:2]}, the state after no delivered prefix there "
                            "(a half-applied call?)")
        if read.versioned and read.version is not None:
            want = state_at_version.get(read.version)  # type: StateKey | None
            if want is not None and want != value:
                raise fail("e", f"a versioned p2p read of member {read.target} returned "
                                f"{value[:2]} at {read.version}, but the state after that "
                                f"version is {want[:2]}")

    # -- (f) nothing lost ----------------------------------------------------------------------------
    for call in run.calls:
        if call.kind.startswith("client") and not call.ok and survivors and barrier_ok:
            raise fail("k", f"client call {call.cid} was never acknowledged though the group "
                            f"has survivors: {call.value!r}")
        if call.ok is None:
            if call.caller in survivors:
                raise fail("f", f"call {call.cid} ({call.kind}) of survivor {call.caller} never "
                                "finished")
            continue
        if not call.ok:
            if call.caller in survivors:
                raise fail("f", f"call {call.cid} ({call.kind}) of survivor {call.caller} "
                                f"failed: {call.value!r}")
            if not isinstance(call.value, GroupClosed | PartitionedError):
                raise fail("f", f"call {call.cid} ({call.kind}) of member {call.caller} "
                                f"({run.fates.get(call.caller)}) failed with {call.value!r}")
            continue
        if call.mode == RAISE_BEFORE:
            continue  # it appends nothing
        for m in sorted(survivors):
            n = run.final_logs.get(m, []).count(call.cid)
            if n != 1:
                raise fail("f", f"call {call.cid} ({call.kind}) of member {call.caller} "
                                f"succeeded but is {n} times in survivor {m}'s log")

    # -- (j) notifications at member 0 -----------------------------------------------------------
    if 0 in obs.views:
        mine = all_delivered.get(0, [])
        if run.subscription_end is not None:
            raise fail("j", f"member 0's subscription ended: {run.subscription_end}")
        if run.subscribed != mine:
            i = next((i for i, (x, y) in enumerate(zip(run.subscribed, mine, strict=False))
                      if x != y), min(len(run.subscribed), len(mine)))
            raise fail("j", f"member 0's subscription yielded {len(run.subscribed)} calls, it "
                            f"delivered {len(mine)}; first difference at {i}: "
                            f"{run.subscribed[i:i + 3]} vs {mine[i:i + 3]}")
        if run.views_seen != installed[0][1:]:
            raise fail("j", f"member 0's views() gave {run.views_seen}, it installed "
                            f"{installed[0][1:]} after its first")

    if run.knobs.get("durable"):
        _check_rejoins(run, fail)
        _check_restart(run, fail)

    # -- (l) a stalled member whose beacon reached its peers was not removed -------------------
    if run.knobs.get("beacons", True):
        for stalled, until, missing in run.stalls:
            if missing:
                raise fail("l", f"member {stalled}, stalled until {until:.3f} s with its beacon "
                                f"reaching its peers, was not in the view of members {missing}")

    # -- handler outcomes the group reported (where it does) ---------------------------------------
    for m, items in obs.finished.items():
        for _sub, version, ok, _value in items:
            cid = next((c for v, _s, c in delivered.get(m, []) if v == version), None)
            reported = ends.get(m, {}).get(cid) if cid is not None else None
            if reported is not None and reported[0] != ok:
                raise fail("d", f"member {m}: the group reported call {cid} at {version} "
                                f"{'ok' if ok else 'failed'} but the handler "
                                f"{'returned' if reported[0] else 'raised'}")


def _check_client_call(call: CallOutcome, copies: dict[int, set[Version]],
                       members_of: dict[int, tuple[int, ...]],
                       any_end: dict[int, tuple[bool, object, StateKey]],
                       survivors: set[int], fail: _Fail) -> None:
    """(k) An acknowledged external client's call: its version is one of its deliveries', and
    each reply is the outcome of the one run of it (the first delivery's)."""
    if call.kind == "client_cast":
        version: Any = tuple(call.value)  # type: ignore[arg-type]
        if version not in copies.get(call.cid, set()):
            raise fail("k", f"client cast {call.cid} resolved to {call.value}, a version at "
                            "which no member delivered it")
        return
    replies = call.value
    assert isinstance(replies, Replies)
    if replies.version not in copies.get(call.cid, set()):
        raise fail("k", f"client call {call.cid}: Replies.version {replies.version} is no "
                        "delivery of it")
    expected = members_of.get(replies.version[0])
    if expected is not None and set(replies) != set(expected):
        raise fail("k", f"client call {call.cid}: replies from {sorted(replies)}, but view "
                        f"{replies.version[0]} is {list(expected)}")
    end = any_end.get(call.cid)
    for m in replies:
        value = replies[m]
        if isinstance(value, MemberFailed):
            if m in survivors:
                raise fail("k", f"client call {call.cid}: survivor {m} reported as {value!r}")
            continue
        if end is None:
            raise fail("k", f"client call {call.cid}: member {m} replied {value!r} but no "
                            "replica ran it")
        ok, result, _ = end
        if ok:
            good = value == (list(result) if isinstance(result, tuple) else result) or (
                value == result)
        else:
            assert isinstance(result, tuple)
            good = value == HandlerError(m, result[0], result[1])
        if not good:
            raise fail("k", f"client call {call.cid}: member {m} answered {value!r}, but the "
                            f"call's one run gave {result!r}")


def _check_rejoins(run: ActorRun, fail: _Fail) -> None:
    """(i): members restarted from their disks while the group ran caught up exactly."""
    for m, log in sorted(run.rejoins.items()):
        if isinstance(log, str):
            raise fail("i", f"member {m}, restarted with its files while the group ran, {log}")
        if log != run.rejoin_log:
            i = next((i for i, (x, y) in enumerate(zip(log, run.rejoin_log, strict=False))
                      if x != y), min(len(log), len(run.rejoin_log)))
            raise fail("i", f"member {m}, restarted with its files while the group ran, holds "
                            f"{len(log)} calls, the group {len(run.rejoin_log)}; first "
                            f"difference at {i}: {log[i:i + 3]} vs {run.rejoin_log[i:i + 3]}")


def _check_restart(run: ActorRun, fail: _Fail) -> None:
    """(h): what a restart after total failure kept (see the module header)."""
    logs = run.restarted_logs
    if not logs:
        if run.persisted:
            raise fail("h", f"no member came back after the total failure, though "
                            f"{len(run.persisted)} calls were persisted")
        return
    first = logs[min(logs)]
    for m, log in sorted(logs.items()):
        if log != first:
            raise fail("h", f"restarted members {min(logs)} and {m} differ: "
                            f"{len(first)} and {len(log)} calls")
    if run.restart_barrier is None or first[-1:] != [run.restart_barrier]:
        raise fail("h", "the barrier call after the restart is not the last call of the log")
    body = first[:-1]
    if run.final_logs:
        longest = max(run.final_logs.values(), key=len)
        if body != longest[: len(body)]:
            raise fail("h", "the restarted log is not a prefix of the order before the failure")
    at: dict[tuple[int, int], tuple[int, float]] = {}
    for m, pairs in sorted(run.restarted_times.items()):
        for version, t in pairs:
            seen = at.setdefault(version, (m, t))
            if seen[1] != t:
                raise fail("h", f"version {version} is logged at {seen[1]} by member {seen[0]} "
                                f"but at {t} by member {m}")
    mode = {c.cid: c.mode for c in run.calls}
    have = set(body)
    lost = [cid for cid in run.persisted if mode.get(cid) != RAISE_BEFORE and cid not in have]
    if lost:
        raise fail("h", f"{len(lost)} persisted calls lost in the total failure: {lost[:5]}")


def _key(value: Any) -> StateKey:
    length, h, counts = value
    return (int(length), int(h), tuple(int(c) for c in counts))


def _states(state: Mapping[str, object]) -> dict[str, object]:
    return {k: (state_of(v) if k == "SimLog" else v) for k, v in state.items()}
