# Theory of operation
# -------------------
# ``run_shard_schedule(seed)`` runs 3-7 real Groups hosting a sharded log, ``ShardLog`` (2-3
# shards of 1-3 replicas), on a seeded SimNetwork in virtual time, and drives them from one
# ``random.Random(seed)``: replied and one-way calls from random members to random shards (a
# member outside a shard forwards its call to a host), p2p reads of a shard, crashes (also right
# after a burst of calls, so some are in flight at the crashed host), joins and leaves, each of
# which may move shards' members (half the schedules use a layout that moves members on every
# change, the others the home policy). The end lets every call finish, then makes one replied
# barrier call per shard, and records each live member's shard and log.
#
# ``check_shard_run(run)`` checks (raising InvariantViolation naming the seed and the replay
# command):
#   (s1) the hosts of a shard in the final view hold the same log, and no member's log holds a
#        call meant for another shard;
#   (s2) every call its caller saw succeed is in its shard's log exactly once, and no call is in
#        any log twice (forwarded calls retried through other hosts included);
#   (s3) every call of a member that survived finished (unless the final view is inadequate:
#        then calls wait) and none failed (but one whose caller moved to another shard before
#        it was delivered: that GroupClosed says so).
"""Seeded schedules of real Groups hosting a sharded actor, and their checks."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

from derecho_async.api import Actor, Group, Sharded, ordered, p2p
from derecho_async.config import Config
from derecho_async.errors import DerechoError, GroupClosed, PartitionedError
from derecho_async.logsetup import logger_level
from derecho_async.testing.checker import InvariantViolation
from derecho_async.testing.simnet import SimNetwork, crash_group
from derecho_async.testing.vloop import run_virtual

__all__ = ["ShardLog", "ShardRun", "check_shard_run", "run_shard_schedule"]

GROUP = "shardsim"


class ShardLog(Actor):
    """A shard's log of call ids."""

    def __init__(self) -> None:
        self.log: list[int] = []
        self.running = 0  # handlers begun and not ended (the end waits for them)

    @ordered
    async def add(self, cid: int, shard: int, delay: float) -> int:
        self.running += 1
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            self.log.append(cid * 8 + shard)  # (which shard it was meant for travels with it)
            return len(self.log)
        finally:
            self.running -= 1

    @p2p
    def read(self) -> list[int]:
        return list(self.log)

    def snapshot(self) -> list[int]:
        return self.log

    def restore(self, state: list[int]) -> None:
        self.log = list(state)


@dataclass(slots=True)
class ShardCall:
    """A call a member made to a shard, and what it got."""

    caller: int
    shard: int
    cid: int
    one_way: bool
    ok: bool | None = None
    value: object = None


@dataclass
class ShardRun:
    """What a shard schedule did and saw."""

    seed: int
    knobs: dict[str, Any]
    calls: list[ShardCall] = field(default_factory=list)
    fates: dict[int, str] = field(default_factory=dict)
    shard_of: dict[int, int | None] = field(default_factory=dict)  # survivors' hosted shard
    logs: dict[int, list[int]] = field(default_factory=dict)  # survivors' logs
    adequate: bool = True  # whether the final view is (calls wait in one that is not)
    log: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def survivors(self) -> list[int]:
        return sorted(m for m, fate in self.fates.items() if fate == "live")


def _blocks(replicas: int, shards: int) -> Any:
    def place(members: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [members[s * replicas : (s + 1) * replicas] for s in range(shards)]
    return place


def run_shard_schedule(seed: int, **knobs: Any) -> ShardRun:
    """Run shard schedule ``seed`` (see the module header); knobs: ``steps``, ``shards``,
    ``replicas``, ``moving`` (the layout that moves members), ``log_level``."""
    rng = random.Random(seed)
    drawn: dict[str, Any] = {
        "shards": rng.choice([2, 3]),
        "replicas": rng.choice([1, 2, 3]),
        "steps": rng.randint(20, 50),
        "moving": rng.random() < 0.5,
        "log_level": "CRITICAL",
    }
    for k in knobs:
        if k not in drawn:
            raise TypeError(f"run_shard_schedule: unknown knob {k!r}")
    drawn.update(knobs)
    drawn["members"] = rng.randint(max(3, drawn["shards"]), 7)
    run = ShardRun(seed, drawn)
    wall = time.perf_counter()
    with logger_level(str(drawn["log_level"])):
        run_virtual(lambda: _schedule(rng, run), max_virtual_s=120.0)
    run.wall_s = time.perf_counter() - wall
    return run


async def _schedule(rng: random.Random, run: ShardRun) -> None:
    knobs = run.knobs
    loop = asyncio.get_running_loop()
    n, shards, replicas = int(knobs["members"]), int(knobs["shards"]), int(knobs["replicas"])
    ids = n + 6
    net = SimNetwork(rng, max_delay_s=rng.choice([0.0005, 0.002]))
    sharded = Sharded(ShardLog, shards=shards, replicas=replicas,
                      layout=_blocks(replicas, shards) if knobs["moving"] else None)
    groups: dict[int, Group] = {}
    live: set[int] = set()
    tasks: list[asyncio.Future[Any]] = []
    next_id, next_cid = n, 1
    ended = False  # (outcomes after the end are the end's crashes: not recorded)

    def say(text: str) -> None:
        run.log.append(f"{loop.time():9.4f} {text}")

    def config(member: int) -> Config:
        return Config(group=GROUP, member_id=member, initial_members=n, transport="sim",
                      peers={m: f"sim{m}:1" for m in range(ids)}, heartbeat_ms=10,
                      suspect_after_ms=100, send_batch=0, state_chunk_kb=4,
                      state_stall_s=5.0, fence_timeout_s=5.0, log_level=knobs["log_level"])

    async def start(member: int) -> None:
        g = groups[member] = Group(config(member), [sharded], transport=net.transport(member))
        try:
            await g.start(timeout=5.0)
        except (GroupClosed, PartitionedError) as exc:
            run.fates[member] = f"not admitted: {exc}"
            return
        run.fates[member] = "live"
        live.add(member)
        say(f"member {member} in view {g.view.view_id} {list(g.view.members)}")

    def refresh() -> None:
        for m in sorted(live):
            fut = groups[m].closed
            if fut.done():
                live.discard(m)
                run.fates[m] = f"closed: {fut.exception()}"
                say(f"member {m} closed: {fut.exception()}")

    def settled() -> bool:
        members = tuple(sorted(live))
        return all(tuple(sorted(groups[m].view.members)) == members for m in live)

    def draw_call(caller: int, shard: int | None = None, one_way: bool | None = None) -> None:
        nonlocal next_cid
        cid = next_cid
        next_cid += 1
        shard = rng.randrange(shards) if shard is None else shard
        one_way = rng.random() < 0.4 if one_way is None else one_way
        delay = rng.choice([0.0, 0.0, 0.001, 0.005])
        out = ShardCall(caller, shard, cid, one_way)
        run.calls.append(out)
        method = groups[caller].subgroup(ShardLog, shard=shard).add
        try:
            aw = method.cast(cid, shard, delay) if one_way else method(cid, shard, delay)
        except DerechoError as exc:
            out.ok, out.value = False, exc
            return

        async def wait() -> None:
            try:
                value = await aw
            except BaseException as exc:
                if not ended:
                    out.ok, out.value = False, exc
                return
            if not ended:
                out.ok, out.value = True, value

        tasks.append(asyncio.ensure_future(wait()))

    await asyncio.gather(*(start(m) for m in range(n)))
    for _ in range(int(knobs["steps"])):
        await asyncio.sleep(rng.choice([0.0, 0.001, 0.005, 0.02]))
        refresh()
        if not live:
            break
        alive = sorted(live)
        # a member may go only if its shard keeps a host: a shard none of whose hosts survive
        # starts empty (the layout's choice: replicas), which the checks would call lost
        held = {m: groups[m].hosted_shard(ShardLog) for m in alive}
        spare = [m for m in alive if held[m] is None
                 or any(held[o] == held[m] for o in alive if o != m)]
        r = rng.random()
        if r < 0.15:
            kind = rng.choice(["join", "join", "crash", "crash_burst", "leave"])
            if kind == "join" and next_id < ids:
                say(f"join {next_id}")
                tasks.append(asyncio.ensure_future(start(next_id)))
                next_id += 1
            elif kind in ("crash", "crash_burst") and len(alive) >= 3 and settled() and spare:
                member = rng.choice(spare)
                if kind == "crash_burst":  # calls in flight at it, forwarded ones included
                    for _ in range(rng.randint(1, 5)):
                        draw_call(rng.choice([m for m in alive if m != member]))
                    await asyncio.sleep(rng.choice([0.0, 0.0005, 0.002]))
                live.discard(member)
                run.fates[member] = "crashed"
                say(f"crash {member}")
                crash_group(net, groups[member])
            elif kind == "leave" and len(alive) >= 3 and settled() and spare:
                member = rng.choice(spare)
                live.discard(member)
                run.fates[member] = "left"
                say(f"leave {member}")
                tasks.append(asyncio.ensure_future(groups[member].leave()))
        else:
            for _ in range(rng.choice([1, 2, 4])):
                draw_call(rng.choice(alive))
    if tasks:
        await asyncio.wait(tasks, timeout=20.0)
    refresh()
    for _ in range(500):
        if not live or settled():
            break
        await asyncio.sleep(0.01)
        refresh()
    while live and next_id < ids and not groups[min(live)].layout.assign(
            groups[min(live)].view.members).adequate:  # joiners, until every shard has hosts
        say(f"join {next_id}")
        await start(next_id)
        next_id += 1
        for _ in range(500):
            if settled():
                break
            await asyncio.sleep(0.01)
            refresh()
    if live:  # a barrier per shard, so every host has run everything before it
        caller = min(live)
        for shard in range(shards):
            draw_call(caller, shard, one_way=False)
        await asyncio.wait(tasks, timeout=20.0)
        for _ in range(500):
            if all(groups[m].queued_calls == 0 and groups[m].local(ShardLog).running == 0
                   for m in live):
                break
            await asyncio.sleep(0.01)
    refresh()
    if live:
        run.adequate = groups[min(live)].layout.assign(groups[min(live)].view.members).adequate
    ended = True
    for m in sorted(live):
        g = groups[m]
        run.shard_of[m] = g.hosted_shard(ShardLog)
        actor = g.local(ShardLog)
        run.logs[m] = list(actor.log)
    for m in sorted(live):
        crash_group(net, groups[m])


def check_shard_run(run: ShardRun) -> None:
    """Check (s1)-(s3) over ``run`` (see the module header)."""
    def fail(check: str, text: str) -> InvariantViolation:
        return InvariantViolation(
            f"shard seed {run.seed}, check ({check}): {text}\nreplay: python -c 'from "
            f"derecho_async.testing.shardsim import *; r = run_shard_schedule({run.seed}); "
            f"print(*r.log, sep=chr(10)); check_shard_run(r)'")

    survivors = set(run.survivors)
    by_shard: dict[int, list[int]] = {}
    for m, shard in run.shard_of.items():
        log = run.logs[m]
        if len(set(log)) != len(log):
            dup = next(x for x in log if log.count(x) > 1)
            raise fail("s2", f"member {m} applied call {dup // 8} twice")
        if shard is None:
            if log:
                raise fail("s1", f"member {m} hosts no shard but holds a log of {len(log)}")
            continue
        wrong = [x // 8 for x in log if x % 8 != shard]
        if wrong:
            raise fail("s1", f"member {m} of shard {shard} holds calls {wrong[:5]} meant for "
                             "another shard")
        first = by_shard.setdefault(shard, log)
        if first != log:
            i = next((i for i, (a, b) in enumerate(zip(first, log, strict=False)) if a != b),
                     min(len(first), len(log)))
            raise fail("s1", f"hosts of shard {shard} differ (member {m}) at position {i}: "
                             f"{[x // 8 for x in first[i:i + 4]]} vs "
                             f"{[x // 8 for x in log[i:i + 4]]}")
    for call in run.calls:
        if call.ok is None:
            if call.caller in survivors and run.adequate:
                raise fail("s3", f"call {call.cid} of survivor {call.caller} never finished")
            continue
        if not call.ok:
            if call.caller in survivors and not (
                    isinstance(call.value, GroupClosed) and "moved" in str(call.value)):
                raise fail("s3", f"call {call.cid} of survivor {call.caller} to shard "
                                 f"{call.shard} failed: {call.value!r}")
            continue
        shard_log = by_shard.get(call.shard)
        if shard_log is None:
            continue  # no survivor hosts that shard
        if shard_log.count(call.cid * 8 + call.shard) != 1:
            raise fail("s2", f"call {call.cid} to shard {call.shard} succeeded but is "
                             f"{shard_log.count(call.cid * 8 + call.shard)} times in its log")


def main(argv: list[str] | None = None) -> int:
    """``python -m derecho_async.testing.shardsim --count N [--start S]`` sweeps schedules;
    ``--seed S`` replays one with its log."""
    import argparse

    parser = argparse.ArgumentParser(description="Seeded sharded-actor schedules, checked.")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    args = parser.parse_args(argv)
    if args.seed is not None:
        run = run_shard_schedule(args.seed)
        print(f"knobs: {run.knobs}", *run.log, sep="\n")
        check_shard_run(run)
        print(f"seed {args.seed}: {len(run.calls)} calls, fates {run.fates}: ok")
        return 0
    failed = 0
    began = time.perf_counter()
    for i, seed in enumerate(range(args.start, args.start + args.count), 1):
        try:
            check_shard_run(run_shard_schedule(seed))
        except InvariantViolation as exc:
            failed += 1
            print(f"FAIL {exc}")
        if i % 50 == 0 or i == args.count:
            print(f"{i}/{args.count} schedules, {failed} failed, "
                  f"{(time.perf_counter() - began) / i * 1000:.1f} ms each", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
