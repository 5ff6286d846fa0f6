"""Notifications through the public API, in one process: views(), closed, subscribe()."""

from __future__ import annotations

import asyncio
import itertools
import random
import subprocess
import sys
from pathlib import Path

import pytest

import derecho_async as da
from derecho_async.testing.simnet import SimNetwork
from tests.runtime.test_durable_group import KV, cfg, close, join_all

_ids = itertools.count()


async def test_views_come_in_order_and_end_when_the_member_leaves() -> None:
    name = f"n{next(_ids)}"
    groups = await join_all(name, None)
    seen: list[da.View] = []

    async def watch() -> None:
        async for view in groups[0].views():
            seen.append(view)

    watcher = asyncio.ensure_future(watch())
    await asyncio.sleep(0)
    first = groups[0].view.view_id
    await groups[2].leave()
    groups[2] = await da.Group.join(cfg(name, 2, None), actors=[KV], timeout=10)
    while len(seen) < 2:
        await asyncio.sleep(0.01)
    assert [v.view_id for v in seen] == [first + 1, first + 2]
    assert seen[0].members == (0, 1) and sorted(seen[1].members) == [0, 1, 2]
    assert not groups[0].closed.done()
    await groups[0].leave()
    await asyncio.wait_for(watcher, 5)  # the iteration ended with the member
    with pytest.raises(da.GroupClosed, match="left"):
        await groups[0].closed
    await close(groups[1:])


async def test_closed_says_why_when_the_member_is_cut_off() -> None:
    """A member partitioned away from the majority wedges: its closed future says so, its
    views() iteration ends, and the others go on in a view without it."""
    net = SimNetwork(random.Random(7), max_delay_s=0.001)
    name = f"n{next(_ids)}"
    groups = list(await asyncio.gather(*(
        da.Group.join(cfg(name, m, None), actors=[KV], timeout=10,
                      transport=net.transport(m)) for m in range(3))))
    closed = groups[2].closed
    views = groups[0].views()
    gone = groups[2].views()
    assert not closed.done()
    net.partition([0, 1], [2])
    with pytest.raises(da.PartitionedError, match="member 2 lost a majority"):
        await asyncio.wait_for(closed, 10)
    assert [v async for v in gone] == []  # ended with the member
    view = await asyncio.wait_for(anext(views), 10)
    assert view.members == (0, 1)
    await close(groups[:2])


async def test_a_subscriber_gets_every_delivery_in_order_once() -> None:
    groups = await join_all(f"n{next(_ids)}", None)
    sub = groups[1].subscribe(KV)
    kv = groups[0].subgroup(KV)
    versions = []
    for i in range(20):
        if i % 3 == 0:
            replies = await kv.put(f"k{i}", b"%d" % i)
            versions.append(replies.version)
        else:
            versions.append(await kv.put.cast(f"k{i}", b"%d" % i))
    got = []
    async for entry in sub:
        got.append(entry)
        if len(got) == 20:
            break
    assert [e.version for e in got] == versions
    assert [e.args for e in got] == [(f"k{i}", b"%d" % i) for i in range(20)]
    assert all(e.method == "put" for e in got)
    assert [e.one_way for e in got] == [i % 3 != 0 for i in range(20)]
    await close(groups)


async def test_a_subscription_since_a_version_replays_the_log_then_goes_on(
        tmp_path: Path) -> None:
    groups = await join_all(f"n{next(_ids)}", tmp_path)
    kv = groups[0].subgroup(KV)
    versions = [await kv.put.cast(f"k{i}", b"x") for i in range(10)]
    sub = groups[2].subscribe(KV, since=versions[4])
    versions += [await kv.put.cast(f"k{i}", b"y") for i in range(10, 15)]
    got = []
    async for entry in sub:
        got.append(entry.version)
        if len(got) == 10:
            break
    assert got == versions[5:]
    # every member's subscription gives a call the same time: the sender's
    times = []
    for g in groups:
        async for entry in g.subscribe(KV, since=versions[0]):
            times.append((g.member_id, entry.version, entry.time))
            break
    assert len({t for _m, _v, t in times}) == 1
    await close(groups)


async def test_a_slow_subscriber_is_dropped_with_the_reason() -> None:
    groups = await join_all(f"n{next(_ids)}", None)
    sub = groups[1].subscribe(KV, max_backlog=5)
    kv = groups[0].subgroup(KV)
    for i in range(8):
        await kv.put(f"k{i}", b"x")  # delivered everywhere once it returns
    with pytest.raises(da.SubscriptionDropped, match="fell 5 deliveries behind"):
        async for _entry in sub:
            pass
    await close(groups)


async def test_subscribing_wrongly_says_what_is_wrong() -> None:
    groups = await join_all(f"n{next(_ids)}", None, n=1)
    with pytest.raises(da.UsageError, match="needs data_dir"):
        groups[0].subscribe(KV, since=(0, 0))
    with pytest.raises(da.UsageError, match="max_backlog"):
        groups[0].subscribe(KV, max_backlog=0)
    with pytest.raises(da.UsageError, match="not one of this group's actors"):
        groups[0].subscribe(da.Actor)
    sub = groups[0].subscribe(KV)
    await close(groups)
    assert [e async for e in sub] == []  # the member left: the iteration ends


def test_the_watch_example_sees_every_call_and_view_change() -> None:
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "examples/watch_group.py"], capture_output=True,
                       text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exit codes: [0, 0, 0]" in r.stdout
    delivered = [line for line in r.stdout.splitlines() if "member 0: delivered put" in line]
    assert len(delivered) == 8, r.stdout
    assert "installed: members [0, 1]" in r.stdout  # member 2 left
    assert "member 0: closed: this member left the group" in r.stdout


async def test_stats_count_what_this_member_did() -> None:
    name = f"n{next(_ids)}"
    groups = await join_all(name, None)
    before = groups[0].stats()
    kv = groups[0].subgroup(KV)
    for i in range(5):
        await kv.put(f"k{i}", b"v")
    await kv.put.cast("c", b"w")
    after = groups[0].stats()
    assert after["sent"] - before["sent"] == 6
    assert after["delivered"] - before["delivered"] >= 5  # (the cast may still be on its way)
    assert after["views"] >= 1 and after["members"] == 3
    assert after["view_id"] == groups[0].view.view_id
    assert after["in_flight_calls"] == 0 and after["pool_bytes"] == 0
    other = groups[1].stats()
    assert other["sent"] == 0 and other["delivered"] >= 5
    await close(groups)
    with pytest.raises(da.GroupClosed):
        groups[0].stats()
