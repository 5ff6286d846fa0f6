"""Subgroups and shards: each shard orders its own messages; an unsatisfiable layout gives an
inadequate view that carries no traffic until a join makes it adequate."""

from __future__ import annotations

from derecho_async.core import (
    CoreConfig,
    Delivered,
    Layout,
    Member,
    Send,
    SubgroupSpec,
    View,
    ViewInstalled,
    Welcome,
)

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
