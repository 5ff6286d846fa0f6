"""Sharded actors through the public API, in one process: calls ordered within a shard, the
assignment, and the state moving to members that gain a shard when views change."""

from __future__ import annotations

import asyncio
import itertools
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import derecho_async as da
from derecho_async.testing.simnet import SimNetwork, crash_group
from tests.runtime.client_apps import Tally
from tests.runtime.test_durable_group import KV

_ids = itertools.count()


def cfg(name: str, member: int, n: int, **kw: Any) -> da.Config:
    return da.Config(group=name, member_id=member, initial_members=n, transport="sim",
                     heartbeat_ms=5, suspect_after_ms=300, **kw)


async def start(name: str, n: int, sharded: da.Sharded, net: SimNetwork | None = None,
                ids: range | None = None) -> list[da.Group]:
    return list(await asyncio.gather(*(
        da.Group.join(cfg(name, m, n), actors=[sharded], timeout=10,
                      transport=None if net is None else net.transport(m))
        for m in (ids or range(n)))))


def data(group: da.Group) -> dict[str, bytes]:
    kv = group.local(KV)
    return kv.data


async def fill(groups: dict[int, da.Group], shard: int, keys: list[str]) -> None:
    host = next(iter(groups.values())).shards(KV)[shard][0]
    handle = groups[host].subgroup(KV, shard=shard)
    for key in keys:
        replies = await handle.put(key, key.encode())
        assert set(replies) == set(groups[host].shards(KV)[shard])


async def test_each_shard_orders_its_own_calls_among_its_own_members() -> None:
    name = f"sh{next(_ids)}"
    groups = await start(name, 6, da.Sharded(KV, shards=2, replicas=3))
    assert groups[0].shards(KV) == {0: (0, 2, 4), 1: (1, 3, 5)}  # home shard: id % 2
    by_id = {g.member_id: g for g in groups}
    await fill(by_id, 0, ["a", "b"])
    await fill(by_id, 1, ["c"])
    assert [sorted(data(g)) for g in groups] == [["a", "b"], ["c"]] * 3
    assert "x" not in data(groups[0])
    other = groups[0].subgroup(KV, shard=1)  # member 0 hosts shard 0: forwarded to shard 1
    replies = await other.put("x", b"y")
    assert set(replies) == {1, 3, 5}
    assert await other.put.cast("z", b"z") >= replies.version
    assert await other.get.any()("c") == b"c"  # served by a member of shard 1
    assert await other.get.at(3)("c") == b"c"
    with pytest.raises(da.UsageError, match="does not host"):
        other.get.at(2)
    with pytest.raises(da.UsageError, match="shards 0 to 1"):
        groups[0].subgroup(KV)
    await other.get.any()("x")  # (p2p after the cast: shard 1 ran it)
    assert [sorted(data(g)) for g in groups[1::2]] == [["c", "x", "z"]] * 3
    for g in groups:
        await g.leave()


async def test_a_joiner_that_replaces_a_crashed_member_gets_its_shards_state() -> None:
    net = SimNetwork(random.Random(2), max_delay_s=0.0005)
    name = f"sh{next(_ids)}"
    sharded = da.Sharded(KV, shards=2, replicas=3)
    groups = {g.member_id: g for g in await start(name, 6, sharded, net)}
    await fill(groups, 0, [f"k{i}" for i in range(20)])
    await fill(groups, 1, ["other"])
    crash_group(net, groups.pop(2))
    groups[6] = await da.Group.join(cfg(name, 6, 6), actors=[sharded], timeout=10,
                                    transport=net.transport(6))
    assert groups[6].shards(KV)[0] == (0, 4, 6)
    await fill(groups, 0, ["after"])  # runs after the joiner restored shard 0
    assert data(groups[6]) == data(groups[0]) and len(data(groups[6])) == 21
    assert data(groups[1]) == {"other": b"other"}
    for g in groups.values():
        await g.leave()


def _blocks(members: tuple[int, ...]) -> list[tuple[int, ...]]:
    """A layout that moves members: shard 0 the first two by rank, shard 1 the next two."""
    return [members[:2], members[2:4]]


async def test_members_that_move_between_shards_take_the_new_shards_state() -> None:
    """Member 1 leaves: member 2 moves from shard 1 to shard 0, member 4 joins shard 1. Each
    gets the state of its new shard; none keeps the old one's."""
    name = f"sh{next(_ids)}"
    sharded = da.Sharded(KV, shards=2, replicas=2, layout=_blocks)
    groups = {g.member_id: g for g in await start(name, 5, sharded)}
    assert groups[0].shards(KV) == {0: (0, 1), 1: (2, 3)}
    assert data(groups[4]) == {}  # member 4 hosts no shard yet
    await fill(groups, 0, ["zero"])
    await fill(groups, 1, ["one"])
    await groups.pop(1).leave()
    while groups[0].view.members != (0, 2, 3, 4):
        await asyncio.sleep(0.01)
    assert groups[0].shards(KV) == {0: (0, 2), 1: (3, 4)}
    await fill(groups, 0, ["zero again"])
    await fill(groups, 1, ["one again"])
    assert data(groups[0]) == data(groups[2]) == {"zero": b"zero", "zero again": b"zero again"}
    assert data(groups[3]) == data(groups[4]) == {"one": b"one", "one again": b"one again"}
    for g in groups.values():
        await g.leave()


async def test_a_view_without_enough_replicas_holds_calls_until_one_has() -> None:
    net = SimNetwork(random.Random(4), max_delay_s=0.0005)
    name = f"sh{next(_ids)}"
    sharded = da.Sharded(KV, shards=2, replicas=2, min_replicas=2)
    groups = {g.member_id: g for g in await start(name, 4, sharded, net)}
    crash_group(net, groups.pop(3))  # shard 1 would have one replica: the view is inadequate
    while groups[0].view.members != (0, 1, 2):
        await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(groups[0].subgroup(KV, shard=0).put("w", b"w"))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # it waits for an adequate view
    groups[5] = await da.Group.join(cfg(name, 5, 4), actors=[sharded], timeout=10,
                                    transport=net.transport(5))
    replies = await asyncio.wait_for(waiting, 10)
    assert set(replies) == {0, 2}
    for g in groups.values():
        await g.leave()


async def test_sharded_actors_refuse_what_they_do_not_support_yet(tmp_path: Any) -> None:
    with pytest.raises(da.UsageError, match="cannot be durable yet"):
        da.Group(cfg("shx", 0, 1, data_dir=str(tmp_path)),
                 actors=[da.Sharded(KV, shards=2, replicas=1)])
    for bad in ({"shards": 0, "replicas": 1}, {"shards": 1, "replicas": 1, "min_replicas": 2},
                {"shards": 2, "replicas": "3"}):
        with pytest.raises(da.UsageError):
            da.Sharded(KV, **bad)

    class Stateless(da.Actor):
        @da.ordered
        def put(self) -> None: ...

    with pytest.raises(da.UsageError, match="snapshot\\(\\) and restore\\(\\)"):
        da.Sharded(Stateless, shards=2, replicas=1)


async def test_a_client_calls_any_shard_through_any_relay() -> None:
    secret = da.new_secret()  # the clients'
    name = f"sh{next(_ids)}"
    groups = list(await asyncio.gather(*(
        da.Group.join(cfg(name, m, 4, client_secret=secret, client_listen="127.0.0.1:0"),
                      actors=[da.Sharded(KV, shards=2, replicas=2)], timeout=10)
        for m in range(4))))
    async with await da.Client.connect(group=name, peers={0: str(groups[0].client_address)},
                                       secret=secret) as client:
        for shard in (0, 1):  # the relay, member 0, hosts shard 0: shard 1's are forwarded
            kv = client.subgroup(KV, shard=shard)
            replies = await kv.put(f"s{shard}", b"v")
            assert set(replies) == set(groups[0].shards(KV)[shard])
            assert await kv.get.any()(f"s{shard}") == b"v"
        again = await da.Client.connect(group=name, peers={1: str(groups[1].client_address)},
                                        secret=secret, client_id=client.client_id)
        replies = await again.subgroup(KV, shard=1).put("s1", b"not again")
        assert set(replies.values()) == {None}  # the kept outcome: not run a second time
        await again.close()
    assert [data(g) for g in groups] == [{"s0": b"v"}, {"s1": b"v"}] * 2
    for g in groups:
        await g.leave()


async def test_forwarded_calls_go_on_when_the_host_they_went_to_crashes() -> None:
    """Member 0 forwards 60 calls to shard 1; one of its hosts crashes with some of them in
    flight there. Every call is answered, and each ran exactly once at the survivors."""
    net = SimNetwork(random.Random(9), max_delay_s=0.0005)
    name = f"sh{next(_ids)}"
    sharded = da.Sharded(Tally, shards=2, replicas=3)
    groups = {g.member_id: g for g in await asyncio.gather(*(
        da.Group.join(cfg(name, m, 6), actors=[sharded], timeout=10,
                      transport=net.transport(m)) for m in range(6)))}
    shard1 = groups[0].subgroup(Tally, shard=1)  # hosts 1, 3, 5: member 0 forwards

    def tokens(m: int) -> list[int]:
        tally = groups[m].local(Tally)
        return tally.tokens

    calls = [asyncio.ensure_future(shard1.add(i)) for i in range(60)]
    while len(tokens(1)) < 10:
        await asyncio.sleep(0.001)
    crash_group(net, groups.pop(3))  # some calls were forwarded to it, some of those ran
    await asyncio.wait_for(asyncio.gather(*calls), 20)
    assert tokens(1) == tokens(5) and sorted(tokens(1)) == list(range(60))
    for g in groups.values():
        await g.leave()


def test_the_sharded_example_runs() -> None:
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "examples/sharded_kv.py"], capture_output=True,
                       text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exit codes: [0, 0, -9, 0, 0, 0, 0]" in r.stdout
    shard0 = [line for line in r.stdout.splitlines() if ": shard 0 holds" in line]
    assert len(shard0) == 3 and len({line.split("holds")[1] for line in shard0}) == 1
    assert "late" in shard0[0] and "member 6 reads 'v0'" in r.stdout
