"""Subgroups and shards: each shard orders its own messages; an unsatisfiable layout gives an
inadequate view that carries no traffic until a join makes it adequate."""

from __future__ import annotations

from typing import Any

import pytest

from derecho_async.core import (
    CoreConfig,
    Delivered,
    Layout,
    Member,
    Send,
    SendFailed,
    SubgroupSpec,
    View,
    ViewInstalled,
    Welcome,
)
from derecho_async.errors import UsageError

LAYOUT = Layout((SubgroupSpec("all"), SubgroupSpec("kv", shards=2, min_per_shard=2)))


def test_assignment_deals_members_over_shards_and_flags_inadequate_views() -> None:
    five = LAYOUT.assign((10, 11, 12, 13, 14))
    assert five.adequate
    assert five.find("all").members == (10, 11, 12, 13, 14)  # type: ignore[union-attr]
    assert five.find("kv", 0).members == (10, 12, 14)  # type: ignore[union-attr]
    assert five.find("kv", 1).members == (11, 13)  # type: ignore[union-attr]
    assert [s.index for s in five.shards] == [0, 1, 2]
    assert not LAYOUT.assign((10, 11, 12)).adequate  # kv shard 1 would hold one member


class Fabric:
    """Instant, in-order delivery between cores: enough to test routing, not timing."""

    def __init__(self, cores: dict[int, Member]) -> None:
        self.cores = cores
        self.delivered: dict[int, list[Delivered]] = {m: [] for m in cores}
        self.views: dict[int, list[ViewInstalled]] = {m: [] for m in cores}

    def add(self, core: Member) -> None:
        self.cores[core.member_id] = core
        self.delivered[core.member_id] = []
        self.views[core.member_id] = []

    def run(self, rounds: int = 200) -> None:
        for _ in range(rounds):
            for m, core in list(self.cores.items()):
                core.tick()
                core.poll()
                ready = core.ready()
                for ev in ready.events:
                    if isinstance(ev, Delivered):
                        self.delivered[m].append(ev)
                    elif isinstance(ev, ViewInstalled):
                        self.views[m].append(ev)
                for p in ready.pushes:
                    for t in p.targets:
                        self.cores[t].receive_push(p.view_id, m, p.offset, p.data)
                for s in ready.sends:
                    self._send(m, s)
                core.advance(ready)

    def _send(self, src: int, s: Send) -> None:
        msg = s.message
        if isinstance(msg, Welcome) and s.attach_state:
            msg = Welcome(msg.view_id, msg.members, b"")
        if s.to in self.cores:
            self.cores[s.to].receive_message(src, msg)


def _cores(ids: tuple[int, ...]) -> Fabric:
    config = CoreConfig(layout=LAYOUT, suspect_after=1000, join_retry=5)
    view = View(0, ids)
    return Fabric({m: Member(m, config, view=view) for m in ids})


def test_each_shard_orders_its_own_messages_among_its_own_members() -> None:
    f = _cores((0, 1, 2, 3))  # kv shard 0: 0, 2; shard 1: 1, 3
    for m in range(4):
        for i in range(5):
            assert f.cores[m].submit("kv", b"kv %d.%d" % (m, i)) is not None
        assert f.cores[m].submit("all", b"all %d" % m) is not None
    f.run()
    for m in range(4):
        shard = 0 if m in (0, 2) else 1
        kv = [d for d in f.delivered[m] if d.subgroup == "kv"]
        assert {d.shard for d in kv} == {shard}
        assert sorted(d.sender for d in kv) == sorted([0, 2] * 5 if shard == 0 else [1, 3] * 5)
        assert len([d for d in f.delivered[m] if d.subgroup == "all"]) == 4
    for a, b in ((0, 2), (1, 3)):  # same order within a shard
        assert [d.payload for d in f.delivered[a] if d.subgroup == "kv"] == [
            d.payload for d in f.delivered[b] if d.subgroup == "kv"
        ]


def test_an_inadequate_view_holds_traffic_until_a_join_makes_it_adequate() -> None:
    f = _cores((0, 1, 2))
    f.run(5)
    assert [(v.view.view_id, v.adequate) for v in f.views[0]] == [(0, False)]
    assert f.cores[0].submit("all", b"waits") is not None
    f.run(20)
    assert f.delivered[0] == []  # inadequate: nothing flows
    config = CoreConfig(layout=LAYOUT, suspect_after=1000, join_retry=5)
    f.add(Member(3, config, contacts=(0,)))
    f.run(300)
    assert f.views[3] and f.views[3][-1].adequate
    assert f.cores[0].view.members == (0, 1, 2, 3)
    assert [d.payload for d in f.delivered[0]] == [b"waits"]
    assert [d.payload for d in f.delivered[3]] == [b"waits"]


def _blocks(members: tuple[int, ...]) -> list[tuple[int, ...]]:
    """A policy: shard 0 the first two members by rank, shard 1 the next two."""
    return [members[:2], members[2:4]]


BLOCKS = Layout((SubgroupSpec("kv", shards=2, policy=_blocks),))


def test_a_policy_assigns_the_members_and_is_checked() -> None:
    got = BLOCKS.assign((5, 6, 7, 8, 9))
    assert got.find("kv", 0).members == (5, 6)  # type: ignore[union-attr]
    assert got.find("kv", 1).members == (7, 8)  # type: ignore[union-attr]
    assert got.shards_of(9) == [] and got.adequate
    assert not BLOCKS.assign((5, 6)).adequate  # shard 1 empty
    for bad, says in ((lambda m: [m], "not 2 shards"), (lambda m: [m[:1], m[:1]], "twice"),
                      (lambda m: [(99,), ()], "not in the view"), (lambda m: "ab", "not 2")):
        with pytest.raises(UsageError, match=says):
            Layout((SubgroupSpec("kv", shards=2, policy=bad),)).assign(  # type: ignore[arg-type]
                (5, 6))


def test_a_sender_moved_to_another_shard_fails_its_queued_messages() -> None:
    """Member 1 leaves: the blocks policy moves member 2 from shard 1 to shard 0. Its message
    queued while the view changed was meant for shard 1: it fails (SendFailed), it is not
    delivered in shard 0."""
    config = CoreConfig(layout=BLOCKS, suspect_after=1000, join_retry=5)
    ids = (0, 1, 2, 3, 4)
    f = Fabric({m: Member(m, config, view=View(0, ids)) for m in ids})
    failed: list[SendFailed] = []
    original = f.cores[2].ready

    def ready() -> Any:
        r = original()
        failed.extend(e for e in r.events if isinstance(e, SendFailed))
        return r

    f.cores[2].ready = ready  # type: ignore[method-assign]
    assert f.cores[2].submit("kv", b"for shard 1") is not None
    f.run(30)
    assert [d.payload for d in f.delivered[3]] == [b"for shard 1"]
    f.cores[1].leave()
    for _ in range(200):
        f.run(1)
        if f.cores[2].wedged:
            break
    msg_no = f.cores[2].submit("kv", b"also for shard 1")
    assert msg_no is not None
    f.run(300)
    assert f.cores[2].view.members == (0, 2, 3, 4)
    assert [e.msg_no for e in failed] == [msg_no]
    assert "moved from shard 1 to shard 0" in failed[0].reason
    assert all(d.payload != b"also for shard 1" for m in ids for d in f.delivered[m])
    assert f.cores[2].submit("kv", b"for shard 0") is not None  # a new one goes to shard 0
    f.run(50)
    assert [d.payload for d in f.delivered[0]][-1] == b"for shard 0"
