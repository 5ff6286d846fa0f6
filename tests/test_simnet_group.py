"""Real Groups (driver, runners, data plane) on a SimNetwork, in virtual time.

Each scenario runs on a fresh VirtualTimeLoop with a seeded network that delays every item and
cuts pushes into pieces; it returns everything observable (every landing on the network, every
view installed with its virtual time, every delivery with its virtual time), and runs twice with
the same seed to show that the run replays bit for bit.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pytest

import derecho_async as da
from derecho_async.testing.simnet import SimNetwork, TraceEvent, crash_group
from derecho_async.testing.vloop import run_virtual

HEARTBEAT_MS = 50.0
SUSPECT_MS = 500.0


class Ledger(da.Actor):
    """A replicated log of entries; each replica also notes when (virtual time) it ran what."""

    def __init__(self) -> None:
        self.entries: list[str] = []
        self.ran: list[tuple[float, str]] = []

    def _record(self, entry: str) -> int:
        self.entries.append(entry)
        self.ran.append((asyncio.get_running_loop().time(), entry))
        return len(self.entries)

    @da.ordered
    def add(self, who: int, n: int) -> int:
        return self._record(f"add {who}:{n}")

    @da.ordered
    def note(self, who: int, n: int) -> None:
        self._record(f"note {who}:{n}")

    @da.ordered
    async def slow_add(self, who: int, n: int) -> int:
        await asyncio.sleep(0.004)  # suspends: the runner hands it to a Task
        return self._record(f"slow {who}:{n}")

    def snapshot(self) -> bytes:
        return "\n".join(self.entries).encode()

    def restore(self, state: bytes) -> None:
        self.entries = state.decode().split("\n") if state else []


def config(member: int) -> da.Config:
    return da.Config(
        group="simnet",
        member_id=member,
        initial_members=3,
        transport="sim",  # only names the kind; the SimNetwork endpoint is passed in
        heartbeat_ms=HEARTBEAT_MS,
        suspect_after_ms=SUSPECT_MS,
        send_batch=0,  # its default depends on os.cpu_count(): fixed, so runs replay anywhere
    )


def network(seed: int) -> SimNetwork:
    return SimNetwork(random.Random(seed), max_delay_s=0.003, split_probability=0.3, trace=True)


async def join(net: SimNetwork, member: int) -> da.Group:
    return await da.Group.join(config(member), [Ledger], transport=net.transport(member),
                               timeout=10.0)


def ledger(group: da.Group) -> Ledger:
    replica = group.local(Ledger)
    return replica


@dataclass
class Outcome:
    trace: list[TraceEvent]
    counts: dict[str, int]
    ran: dict[int, list[tuple[float, str]]]
    virtual_s: float
    wall_s: float

    def views(self) -> list[tuple[float, int, tuple[int, ...]]]:
        return [(e.time, e.src, e.info) for e in self.trace if e.event == "view"]

    def replay_key(self) -> tuple[object, ...]:
        return (self.trace, self.counts, self.ran, self.virtual_s)


def run_scenario(scenario: Callable[[int], Awaitable[Outcome]], seed: int) -> Outcome:
    wall = time.perf_counter()
    outcome = run_virtual(lambda: scenario(seed), max_virtual_s=120.0)
    outcome.wall_s = time.perf_counter() - wall
    return outcome


async def crash_scenario(seed: int) -> Outcome:
    loop = asyncio.get_running_loop()
    net = network(seed)
    groups = list(await asyncio.gather(*(join(net, m) for m in range(3))))
    assert all(g.view == da.View(0, (0, 1, 2)) for g in groups)
    hs = [g.subgroup(Ledger) for g in groups]

    replies = await asyncio.gather(*(hs[i % 3].add(i % 3, i) for i in range(24)))
    for r in replies:
        assert set(r) == {0, 1, 2} and len(set(r.values())) == 1
    assert sorted(next(iter(r.values())) for r in replies) == list(range(1, 25))
    versions = await asyncio.gather(*(hs[i % 3].note.cast(i % 3, i) for i in range(24)))
    assert len(set(versions)) == 24
    slow = await asyncio.gather(*(hs[i % 3].slow_add(i % 3, i) for i in range(6)))
    assert all(set(r) == {0, 1, 2} for r in slow)
    # one ordered call from each member: once all replied, every replica ran everything before
    await asyncio.gather(*(h.add(m, 1000) for m, h in enumerate(hs)))
    logs = [ledger(g).entries for g in groups]
    assert logs[0] == logs[1] == logs[2] and len(logs[0]) == 24 + 24 + 6 + 3

    in_flight = asyncio.ensure_future(hs[0].add(0, 555))  # a survivor's call, under way
    doomed = asyncio.ensure_future(hs[2].add(2, 777))
    await asyncio.sleep(0)
    crashed_at = loop.time()
    crash_group(net, groups[2])
    driver = groups[2]._driver
    assert driver is not None
    steps_at_crash = driver.steps
    with pytest.raises(da.GroupClosed):
        await doomed
    with pytest.raises(da.GroupClosed):
        await hs[2].add(2, 1)
    async with asyncio.timeout(30.0):
        while any(2 in g.view.members for g in groups[:2]):
            await asyncio.sleep(0.01)
    detected_after = loop.time() - crashed_at
    # found by heartbeats going silent (the network reports nothing), in virtual time
    assert (SUSPECT_MS - 2 * HEARTBEAT_MS) / 1000 <= detected_after < 5.0
    assert [g.view.members for g in groups[:2]] == [(0, 1), (0, 1)]
    assert driver.steps == steps_at_crash  # the crashed member neither ticked nor stepped
    assert groups[2].view.members == (0, 1, 2)  # nor learned anything
    first = await in_flight
    assert {0, 1} <= set(first)
    after = await hs[1].add(1, 2000)
    assert set(after) == {0, 1}
    assert ledger(groups[0]).entries == ledger(groups[1]).entries
    assert ledger(groups[0]).entries[-1] == "add 1:2000"
    ran = {g.member_id: list(ledger(g).ran) for g in groups}
    for g in groups:
        await g.leave()  # the crashed one: nothing more happens
    return Outcome(list(net.trace), dict(net.counts), ran, loop.time(), 0.0)


async def join_scenario(seed: int) -> Outcome:
    loop = asyncio.get_running_loop()
    net = network(seed)
    groups = list(await asyncio.gather(*(join(net, m) for m in range(3))))
    hs = [g.subgroup(Ledger) for g in groups]
    stop = asyncio.Event()
    sent = [0, 0]

    async def pump(m: int) -> None:
        while not stop.is_set():
            await hs[m].note.cast(m, sent[m])
            sent[m] += 1
            await asyncio.sleep(0.002)

    pumps = [asyncio.ensure_future(pump(m)) for m in (0, 1)]
    await asyncio.sleep(0.2)
    before = min(sent)
    assert before > 10
    joined_at = loop.time()
    newcomer = await join(net, 3)
    assert newcomer.view.members == (0, 1, 2, 3)
    assert all(s > before for s in sent)  # traffic kept flowing during the join
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*pumps)
    everyone = await hs[2].add(2, 9999)
    assert set(everyone) == {0, 1, 2, 3}
    logs = [ledger(g).entries for g in [*groups, newcomer]]
    assert logs[0] == logs[1] == logs[2] == logs[3]
    assert len(logs[0]) == sum(sent) + 1
    # the newcomer got the state from before its join by snapshot, and ran the rest itself
    assert 0 < len(ledger(newcomer).ran) < len(logs[0])
    assert all(t > joined_at for t, _ in ledger(newcomer).ran)
    ran = {g.member_id: list(ledger(g).ran) for g in [*groups, newcomer]}
    for g in [*groups, newcomer]:
        await g.leave()
    return Outcome(list(net.trace), dict(net.counts), ran, loop.time(), 0.0)


def _faults_were_exercised(outcome: Outcome) -> None:
    assert outcome.counts["split"] > 0  # some pushes landed in pieces
    assert outcome.counts["landed"] == sum(e.event in ("push", "msg") for e in outcome.trace)


def test_crash_is_detected_and_survivors_go_on_in_virtual_time() -> None:
    first = run_scenario(crash_scenario, seed=7)
    views = first.views()
    assert (0, (0, 0, 1, 2)) in [(m, info) for _, m, info in views]
    new_view = [(t, m) for t, m, info in views if info == (1, 0, 1)]
    assert sorted(m for _, m in new_view) == [0, 1]
    assert first.counts["dropped"] > 0  # the crash cut traffic
    _faults_were_exercised(first)
    assert first.virtual_s > 0.5 and first.wall_s < 1.0
    second = run_scenario(crash_scenario, seed=7)
    assert second.replay_key() == first.replay_key()
    assert run_scenario(crash_scenario, seed=8).replay_key() != first.replay_key()


def test_join_while_traffic_flows_replays_exactly() -> None:
    first = run_scenario(join_scenario, seed=3)
    views = first.views()
    assert sorted(m for _, m, info in views if info == (1, 0, 1, 2, 3)) == [0, 1, 2, 3]
    _faults_were_exercised(first)
    assert first.wall_s < 1.0
    second = run_scenario(join_scenario, seed=3)
    assert second.replay_key() == first.replay_key()
