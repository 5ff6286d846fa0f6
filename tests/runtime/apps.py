"""Member programs for launch_local tests (importable by spawned children)."""

from __future__ import annotations

import asyncio

import derecho_async as da
from derecho_async.workload import ReplicatedLog, log_digest


async def append_and_check(config: da.Config) -> None:
    """20 appends per member; then every member's log must be the same."""
    async with da.Group(config, actors=[ReplicatedLog]) as group:
        log = group.subgroup(ReplicatedLog)
        members = set(group.view.members)
        for i in range(20):
            replies = await log.append(b"%d-%d" % (config.member_id, i))
            assert set(replies) == members
        total = 20 * len(members)
        for m in sorted(members):  # wait until every replica holds every append
            while await log.size.at(m)() < total:
                await asyncio.sleep(0.02)
        mine = log_digest(group.local(ReplicatedLog).items)  # type: ignore[attr-defined]
        for m in sorted(members):
            assert await log.digest.at(m)() == mine
        await asyncio.sleep(1.0)  # let the others finish their checks before anyone leaves


async def fail(config: da.Config) -> None:
    raise SystemExit(7 if config.member_id == 1 else 0)


async def one_leaves_early(config: da.Config) -> None:
    """Member 2 makes 5 appends and leaves; the others see the smaller view and go on."""
    import json
    import os

    async with da.Group(config, actors=[ReplicatedLog]) as group:
        log = group.subgroup(ReplicatedLog)
        for i in range(5):
            await log.append(b"%d-%d" % (config.member_id, i))
        if config.member_id == 2:
            return  # leaves on exiting the block
        while 2 in group.view.members:
            await asyncio.sleep(0.02)
        replies = await log.append(b"after-%d" % config.member_id)
        mine = group.local(ReplicatedLog).items  # type: ignore[attr-defined]
        while len(mine) < 17:  # 3 x 5 appends + one "after" from each of 0 and 1
            await asyncio.sleep(0.02)
        with open(os.path.join(os.environ["DA_TEST_OUT"], f"m{config.member_id}.json"), "w") as f:
            json.dump(
                {
                    "view": list(group.view.members),
                    "replies": sorted(replies),
                    "digest": log_digest(mine),
                    "n": len(mine),
                },
                f,
            )
        await asyncio.sleep(0.5)
