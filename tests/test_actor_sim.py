"""Seeded actor-level schedules: real Groups hosting SimLog on a SimNetwork, in virtual time.

The default run covers 500 schedules (``DERECHO_ASYNC_ACTOR_SWEEP_COUNT`` sets another count);
``DERECHO_ASYNC_LONG_SWEEP=1`` runs 20,000; ``DERECHO_ASYNC_SEED=S`` replays one schedule. A
failure lists every failing seed of its chunk with the check it broke and the command that
replays it (``python -m derecho_async.testing.actor_sweep --seed S``).
"""

from __future__ import annotations

import os

import pytest

from derecho_async.api import Replies
from derecho_async.api.once import ClientCalls
from derecho_async.testing import InvariantViolation, check_actor_run, run_actor_schedule
from derecho_async.testing.actor_sweep import run_and_check

DEFAULT_COUNT = 500
LONG_COUNT = 20_000
CHUNK = 50
LONG = os.environ.get("DERECHO_ASYNC_LONG_SWEEP") == "1"
COUNT = int(os.environ.get("DERECHO_ASYNC_ACTOR_SWEEP_COUNT",
                           LONG_COUNT if LONG else DEFAULT_COUNT))


def _sweep(seeds: range) -> None:
    failures = []
    for seed in seeds:
        try:
            run_and_check(seed)
        except InvariantViolation as exc:
            failures.append(str(exc).splitlines()[0])
    if failures:
        pytest.fail(f"{len(failures)} of {len(seeds)} schedules failed:\n" + "\n".join(failures)
                    + "\nreplay one with: python -m derecho_async.testing.actor_sweep --seed S",
                    pytrace=False)


@pytest.mark.parametrize("first", range(0, COUNT, CHUNK), ids=lambda f: f"seeds{f}-{f + CHUNK - 1}")
def test_actor_sweep(first: int) -> None:
    _sweep(range(first, min(first + CHUNK, COUNT)))


@pytest.mark.skipif("DERECHO_ASYNC_SEED" not in os.environ, reason="set DERECHO_ASYNC_SEED=S")
def test_replay() -> None:
    seed = int(os.environ["DERECHO_ASYNC_SEED"])
    _sweep(range(seed, seed + 1))


@pytest.mark.parametrize("seed", [0, 4, 12])
def test_a_schedule_replays_bit_for_bit(seed: int) -> None:
    first = run_actor_schedule(seed, trace=True)
    second = run_actor_schedule(seed, trace=True)
    assert first.trace and first.calls and first.records
    assert first.digest() == second.digest()
    assert first.digest() != run_actor_schedule(seed + 1, trace=True).digest()


def _calm(seed: int, **knobs: object) -> object:
    # no faults, no raising handlers, no awaiting handlers: only what the runtime does today
    return run_actor_schedule(seed, faults=False, p_raise=0.0, p_slow=0.0, **knobs)


def test_a_replica_that_diverges_is_caught() -> None:
    caught = []
    for seed in range(10):
        run = _calm(seed)
        check_actor_run(run)  # type: ignore[arg-type]  # the same schedule, unbroken: ok
        bad = _calm(seed, skew_member=1)
        with pytest.raises(InvariantViolation) as info:
            check_actor_run(bad)  # type: ignore[arg-type]
        text = str(info.value)
        assert f"actor seed {seed}" in text
        assert f"actor_sweep --seed {seed}" in text
        caught.append(text.split("check (")[1][0])
    assert set(caught) == {"c"}


def test_a_lost_or_altered_outcome_is_caught() -> None:
    from derecho_async.api import HandlerError

    run = _calm(3)
    check_actor_run(run)  # type: ignore[arg-type]
    survivor = run.survivors[0]  # type: ignore[attr-defined]
    done = next(c for c in run.calls if c.ok and c.kind == "cast")  # type: ignore[attr-defined]
    run.final_logs[survivor].remove(done.cid)  # type: ignore[attr-defined]
    with pytest.raises(InvariantViolation, match=r"check \(f\)"):
        check_actor_run(run)  # type: ignore[arg-type]

    run = _calm(3)
    call = next(c for c in run.calls if c.ok and c.kind == "call")  # type: ignore[attr-defined]
    other = next(m for m in call.value if m != call.caller)
    call.value._results[other] = HandlerError(other, "ValueError", "no")
    with pytest.raises(InvariantViolation, match=r"check \(d\)"):
        check_actor_run(run)  # type: ignore[arg-type]

    run = _calm(3)
    member = run.survivors[0]  # type: ignore[attr-defined]
    events = run.observer.deliveries[member]  # type: ignore[attr-defined]
    events[0], events[1] = events[1], events[0]  # delivered in another order than run
    with pytest.raises(InvariantViolation, match=r"check \(a\)"):
        check_actor_run(run)  # type: ignore[arg-type]


def test_exceptions_without_plain_words_are_drawn_and_checked_alike_at_every_member() -> None:
    """Seed 4: replied calls whose handlers raise an exception whose ``__str__`` raises, or
    whose message holds a lone surrogate. Every member answers with the contract's words (check
    (d)); an answer in other words, or a member that left instead, is caught."""
    from derecho_async.api import HandlerError
    from derecho_async.testing.simlog import SURROGATE_AFTER, WEIRD_AFTER, SimLogWeird

    run = run_actor_schedule(4, faults=False, p_raise=0.3)
    check_actor_run(run)
    weird = next(c for c in run.calls if c.ok and c.kind == "call" and c.mode == WEIRD_AFTER)
    surrogate = next(c for c in run.calls
                     if c.ok and c.kind == "call" and c.mode == SURROGATE_AFTER)
    replies = weird.value
    assert isinstance(replies, Replies)
    assert isinstance(replies[weird.caller], SimLogWeird)
    other = next(m for m in replies if m != weird.caller)
    assert replies[other] == HandlerError(
        other, "SimLogWeird", "<SimLogWeird: str() raised RuntimeError>")
    replies = surrogate.value
    assert isinstance(replies, Replies)
    other = next(m for m in replies if m != surrogate.caller)
    assert replies[other] == HandlerError(
        other, "ValueError", f"call {surrogate.cid} refused \\udc80")
    replies._results[other] = HandlerError(other, "UnicodeEncodeError", "lone surrogate")
    with pytest.raises(InvariantViolation, match=r"check \(d\)"):
        check_actor_run(run)


def test_durable_schedules_restart_after_total_failure_and_keep_what_was_persisted() -> None:
    run = run_actor_schedule(0, durable=True)
    check_actor_run(run)
    assert run.persisted, "some one-way calls were acknowledged by persisted()"
    assert run.restarted_logs and run.restart_barrier is not None
    members = sorted(run.restarted_logs)
    lost = next(cid for cid in run.persisted if cid in run.restarted_logs[members[0]])
    for m in members:  # a restart that dropped one persisted call at every member
        run.restarted_logs[m].remove(lost)
    with pytest.raises(InvariantViolation, match=r"check \(h\)"):
        check_actor_run(run)
    run = run_actor_schedule(0, durable=True)
    run.restarted_logs[members[-1]].pop(0)  # one member restarted differently
    with pytest.raises(InvariantViolation, match=r"check \(h\).*differ"):
        check_actor_run(run)
    run = run_actor_schedule(0, durable=True)
    times = run.restarted_times[members[-1]]
    others = {v for m in members[:-1] for v, _t in run.restarted_times[m]}
    i = next(i for i, (v, _t) in enumerate(times) if v in others)  # a version others log too
    times[i] = (times[i][0], times[i][1] + 1.0)  # logged at another time here
    with pytest.raises(InvariantViolation, match=r"check \(h\).*logged at"):
        check_actor_run(run)


def test_crashed_members_restart_from_their_disks_while_the_group_runs() -> None:
    run = run_actor_schedule(0, durable=True, clients=False)  # (member 0 crashes in it)
    check_actor_run(run)
    back = [m for m, log in run.rejoins.items() if isinstance(log, list)]
    assert back and run.rejoin_log
    log = run.rejoins[back[0]]
    assert isinstance(log, list)
    del log[len(log) // 2]  # a member that came back without one call
    with pytest.raises(InvariantViolation, match=r"check \(i\).*first difference"):
        check_actor_run(run)
    run = run_actor_schedule(0, durable=True, clients=False)
    run.rejoins[back[0]] = "not admitted: (a member that could not get back in)"
    with pytest.raises(InvariantViolation, match=r"check \(i\).*not admitted"):
        check_actor_run(run)


def test_a_joiner_is_checked_against_the_sponsor_that_admitted_it() -> None:
    """Seed 680: member 2 repeats joiner 5's Welcome after its own fence passed two calls of
    view 1; the joiner refuses that transfer and restores member 0's. Check (b) compares the
    joiner with member 0's snapshot, not with whichever snapshot came last."""
    run = run_actor_schedule(680, clients=False)
    taken = {sponsor: state for sponsor, view_id, joiner, state in run.observer.snapshots
             if joiner == 5 and view_id == 1}
    assert run.observer.views[5][0].sponsor == 0
    assert taken[0] != taken[2], "the schedule no longer repeats the Welcome late: pick another"
    check_actor_run(run)


def test_member_0s_subscription_and_views_are_checked() -> None:
    run = run_actor_schedule(0)
    check_actor_run(run)
    assert len(run.subscribed) > 10 and run.views_seen, "member 0 saw calls and views"
    run.subscribed.pop(3)  # a subscription that missed a call
    with pytest.raises(InvariantViolation, match=r"check \(j\).*first difference at 3"):
        check_actor_run(run)
    run = run_actor_schedule(0)
    run.views_seen.append(run.views_seen[-1] + 5)
    with pytest.raises(InvariantViolation, match=r"check \(j\).*views\(\)"):
        check_actor_run(run)


def test_about_half_the_sweep_runs_with_disks() -> None:
    durable = sum(run_actor_schedule(seed, steps=1).knobs["durable"] for seed in range(40))
    assert 10 <= durable <= 30


def test_external_clients_calls_run_once_and_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 3: clients' calls through relays that crash, some sent through two at once; several
    are delivered twice. Check (k) holds; a wrong answer and members that run every copy (the
    table turned off) are caught."""
    run = run_actor_schedule(3, clients=True)
    check_actor_run(run)
    acked = [c for c in run.calls if c.kind == "client" and c.ok]
    assert len(acked) > 10
    first = acked[0]
    replies = first.value
    assert isinstance(replies, Replies)
    member = next(iter(replies))
    replies._results[member] = (-1, -1)  # a member "answered" what no run gave
    with pytest.raises(InvariantViolation, match=r"check \(k\)"):
        check_actor_run(run)
    monkeypatch.setattr(ClientCalls, "admit", lambda self, client, seq: None)
    with pytest.raises(InvariantViolation, match=r"check \((a|f|k)\)"):
        check_actor_run(run_actor_schedule(3, clients=True))


def test_a_restarted_contact_whose_last_view_left_finds_the_group_through_its_peers() -> None:
    """Seed 3425: member 0 crashes; 3 joins; 1 and 2 leave, so the group runs on member 3
    alone. Member 0, restarted with its files, told only its last view (1, 2) and was never
    admitted (check (i)); it now tells the members its config names too, and 3 answers."""
    run = run_actor_schedule(3425)
    assert run.knobs["durable"] and run.fates[1] == run.fates[2] == "left"
    check_actor_run(run)
    assert isinstance(run.rejoins.get(0), list)


def test_a_stalled_member_whose_beacon_reaches_its_peers_stays_and_is_checked() -> None:
    """Stalls of several suspicion timeouts, with beacons: the member stays in every view (check
    (l)); the same stalls without beacons lose it, which check (l) catches."""
    kept = 0
    for seed in range(6):
        run = run_actor_schedule(seed, stalls=True)
        check_actor_run(run)
        kept += len(run.stalls)
    assert kept >= 3, "some stalls no other fault touched"
    caught = 0
    for seed in range(6):
        run = run_actor_schedule(seed, stalls=True, beacons=False)
        run.knobs["beacons"] = True  # judged as if beacons had run
        try:
            check_actor_run(run)
        except InvariantViolation as exc:
            assert "check (l)" in str(exc)
            caught += 1
    assert caught >= 2


def test_about_half_the_sweep_stalls_members() -> None:
    stalls = sum(run_actor_schedule(seed, steps=1).knobs["stalls"] for seed in range(40))
    assert 10 <= stalls <= 30
