"""The public simulated cluster behaves exactly as documented."""

from __future__ import annotations

import dataclasses

import pytest

from derecho_async.testing import Delivery, InvariantViolation, SimCluster, View


def payloads(c: SimCluster, m: int) -> list[bytes]:
    return [d.payload for d in c.delivered(m)]


def test_all_members_deliver_the_same_messages_in_the_same_order() -> None:
    c = SimCluster(4, seed=1)
    sent = []
    for i in range(40):
        p = b"msg-%d" % i
        assert c.send(i % 4, p)
        sent.append(p)
    assert c.run_until_idle()
    c.check()
    ref = c.delivered(0)
    assert sorted(d.payload for d in ref) == sorted(sent)
    for m in range(1, 4):
        assert c.delivered(m) == ref
    assert [d.seq for d in ref] == sorted(d.seq for d in ref)
    assert all(d.view_id == 0 for d in ref)
    # per-sender FIFO
    for s in range(4):
        mine = [d.payload for d in ref if d.sender == s]
        assert mine == [p for i, p in enumerate(sent) if i % 4 == s]


def test_delivery_and_view_are_frozen_dataclasses_with_the_documented_fields() -> None:
    assert [f.name for f in dataclasses.fields(Delivery)] == ["view_id", "seq", "sender", "payload"]
    assert [f.name for f in dataclasses.fields(View)] == ["view_id", "members"]
    d = Delivery(0, 1, 2, b"x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.seq = 5  # type: ignore[misc]
    c = SimCluster(2, seed=0)
    assert c.views(0) == [View(0, (0, 1))]
    assert c.alive() == {0, 1}


def test_large_payloads_and_a_full_window_queue_rather_than_fail() -> None:
    c = SimCluster(3, seed=7, window=1, max_payload=16)
    big = bytes(range(256)) * 40
    for i in range(30):
        assert c.send(i % 3, big if i % 5 == 0 else b"small %d" % i)
    assert c.run_until_idle()
    c.check()
    got = payloads(c, 2)
    assert len(got) == 30 and got.count(big) == 6
    assert payloads(c, 0) == got


def test_same_seed_same_run_bit_for_bit() -> None:
    def run(seed: int) -> tuple[list[str], list[Delivery], int]:
        c = SimCluster(5, seed=seed)
        for i in range(25):
            c.send(i % 5, b"%d" % i * (i % 7 + 1) * 20)
        c.run(10)
        c.crash(3)
        c.run_until_idle()
        return c.log, c.delivered(0), c.now

    assert run(99) == run(99)
    assert run(99) != run(98)


def test_send_returns_false_for_members_that_cannot_send() -> None:
    c = SimCluster(5, seed=3)
    c.crash(4)
    assert not c.send(4, b"from the dead")
    assert not c.send(17, b"from a stranger")
    c.join(9)
    assert not c.send(9, b"not in a view yet")
    assert c.run_until_idle()
    assert c.send(9, b"now a member")
    c.leave(2)
    assert not c.send(2, b"gone")
    c.partition([0, 1, 9], [3])
    assert c.run_until_idle()
    assert not c.send(3, b"minority")
    assert c.send(0, b"majority")
    assert c.run_until_idle()
    c.check()
    assert c.alive() == {0, 1, 9}
    assert payloads(c, 0)[-1] == b"majority"


def test_crash_survivors_install_a_new_view_and_lose_nothing() -> None:
    c = SimCluster(3, seed=5)
    for i in range(20):
        c.send(i % 3, b"a%d" % i)
    c.run(4)
    c.crash(1)
    for i in range(10):
        c.send(i % 2 * 2, b"b%d" % i)
    assert c.run_until_idle()
    c.check()
    assert c.views(0)[-1] == View(1, (0, 2))
    assert c.views(2) == c.views(0)
    assert c.delivered(0) == c.delivered(2)
    got = set(payloads(c, 0))
    assert {b"b%d" % i for i in range(10)} <= got
    assert {b"a%d" % i for i in range(20) if i % 3 != 1} <= got
    assert c.alive() == {0, 2}


def test_joiner_gets_the_state_before_its_first_delivery() -> None:
    c = SimCluster(3, seed=11)
    for i in range(15):
        c.send(i % 3, b"before %d" % i)
    assert c.run_until_idle()
    c.join(42)
    assert c.run_until_idle()
    joined_view = c.views(42)[0]
    assert 42 in joined_view.members and joined_view.view_id == 1
    assert c.state_of(42) == c.state_of(0)  # restored from the snapshot, nothing delivered yet
    assert c.delivered(42) == []
    for i in range(8):
        c.send([0, 1, 2, 42][i % 4], b"after %d" % i)
    assert c.run_until_idle()
    c.check()
    assert c.delivered(42) == [d for d in c.delivered(0) if d.view_id == 1]
    assert c.state_of(42) == c.state_of(1)


def test_partition_minority_wedges_and_majority_continues() -> None:
    c = SimCluster(5, seed=13)
    c.partition([0, 1, 2], [3, 4])
    for i in range(10):
        c.send(i % 5, b"p%d" % i)
    assert c.run_until_idle()
    c.heal()
    c.run(200)
    c.check()
    assert c.alive() == {0, 1, 2}
    assert [v.members for v in c.views(3)] == [(0, 1, 2, 3, 4)]
    assert c.views(0)[-1].members == (0, 1, 2)


def test_no_majority_anywhere_means_no_primary_and_no_progress() -> None:
    c = SimCluster(4, seed=17)
    c.partition([0, 1], [2, 3])
    c.send(0, b"x")
    assert c.run_until_idle()
    assert c.alive() == set()
    assert all(len(c.views(m)) == 1 for m in range(4))
    c.check()


def test_partition_safety_off_lets_a_two_member_group_survive_a_crash() -> None:
    on = SimCluster(2, seed=19)
    on.crash(1)
    on.run(200)
    assert on.alive() == set()  # one of two is no majority
    off = SimCluster(2, seed=19, partition_safety=False)
    off.crash(1)
    assert off.send(0, b"alone")
    assert off.run_until_idle()
    assert off.alive() == {0} and payloads(off, 0) == [b"alone"]


def test_check_names_the_seed_and_the_step() -> None:
    c = SimCluster(2, seed=1234)
    c.send(0, b"real")
    c.run_until_idle()
    # Forge a delivery nobody sent: the checker must object, naming seed and step.
    with pytest.raises(InvariantViolation, match=r"seed 1234, step \d+"):
        c.checker.on_delivery(c.step_no, 1, Delivery(0, 99, 0, b"forged"), 77, frozenset({0, 1}))
    with pytest.raises(InvariantViolation, match="seed 1234"):
        c.check()


def test_a_transport_failure_report_suspects_the_member_and_changes_the_view() -> None:
    c = SimCluster(3, seed=23)
    c.members[0].report_failure(2)  # as a driver does when the link to 2 broke
    c.members[0].report_failure(99)  # not a member: ignored
    assert c.run_until_idle()
    c.check()
    assert c.views(0)[-1].members == (0, 1) and c.views(1)[-1].members == (0, 1)
    assert c.alive() == {0, 1}  # 2 is out of the primary view (it wedges on its own timeouts)


def test_traffic_from_a_member_counts_as_a_heartbeat() -> None:
    from derecho_async.core import CoreConfig, Member, View

    m = Member(0, CoreConfig(suspect_after=5), view=View(0, (0, 1)))
    for _ in range(20):
        m.heard_from(1)  # a message arrived, its heartbeat push is stuck behind bulk data
        m.tick()
        m.poll()
    assert m.suspected == 0
    for _ in range(6):
        m.tick()
        m.poll()
    assert m.suspected == 0b10  # silence for suspect_after ticks: suspected


def test_send_batch_writes_a_few_records_per_poll_and_loses_nothing() -> None:
    from derecho_async.core import CoreConfig, Member, View
    from derecho_async.core.layout import DEFAULT_SUBGROUP

    m = Member(0, CoreConfig(window=16, send_batch=3), view=View(0, (0, 1)))
    for i in range(10):
        assert m.submit(DEFAULT_SUBGROUP, b"m%d" % i) is not None
    written = []
    for _ in range(5):  # the receiver is silent: only the window (16) could hold them back
        m.poll()
        ready = m.ready()
        shard = next(sh for sh in m.shards if sh is not None)
        written.append(shard.sent_turns)  # messages: small ones share a slot (a batch record)
        m.advance(ready)
    assert written == [3, 6, 9, 10, 10]

    # the same traffic through a cluster: every member delivers all of it, in one order
    c = SimCluster(3, seed=7, window=16, send_batch=2)
    for i in range(30):
        assert c.send(i % 3, b"msg-%d" % i)
    assert c.run_until_idle()
    c.check()
    assert sorted(payloads(c, 0)) == sorted(b"msg-%d" % i for i in range(30))
    assert payloads(c, 1) == payloads(c, 0) == payloads(c, 2)


def test_the_last_member_stays_when_the_other_two_leave_one_during_the_others_view_change() -> None:
    """Member 0 leaves; member 1 (the next leader) leaves while the view change that removes 0
    is under way. Had 1 left the old view, member 2 could install a view of (1, 2) that 1 never
    runs and, alone in it, lose its majority. The leave waits for the change: 1 leaves the view
    of (1, 2), and 2 goes on alone."""
    for seed in range(12):
        for gap in range(0, 24, 3):
            c = SimCluster(3, seed=seed)
            for t in range(30):
                for m in range(3):
                    c.send(m, b"%d:%d" % (m, t))
                c.run(1)
            c.leave(0)
            for _ in range(gap):
                c.send(2, b"between")
                c.run(1)
            c.leave(1)
            assert c.run_until_idle(), (seed, gap)
            c.check()
            assert c.alive() == {2}, (seed, gap)
            assert c.views(2)[-1].members == (2,), (seed, gap)
            assert c.send(2, b"alone")
            assert c.run_until_idle()
            assert payloads(c, 2)[-1] == b"alone"
