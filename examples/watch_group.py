"""Being told instead of polling: a member follows its group's views and an actor's calls.

Run: python examples/watch_group.py

Three member processes over shared memory. Member 0's application subscribes to the KV actor's
deliveries (``group.subscribe``) and to the group's views (``group.views``) and prints both as
they come. Every member writes two keys; member 2 then leaves, and members 0 and 1 write one
more key each in the view without it. At the end member 0 leaves too, and its ``group.closed``
future says why it is out.
"""

from __future__ import annotations

import asyncio
import sys

import derecho_async as da

MEMBERS = 3


class KV(da.Actor):
    def __init__(self) -> None:
        self.data: dict[str, int] = {}

    @da.ordered
    def put(self, key: str, value: int) -> None:
        self.data[key] = value

    def snapshot(self) -> dict[str, int]:
        return dict(self.data)

    def restore(self, state: dict[str, int]) -> None:
        self.data = dict(state)


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def watch(group: da.Group) -> list[asyncio.Task[None]]:
    """Member 0's watchers: both are registered now, so nothing from here on is missed."""
    views = group.views()
    calls = group.subscribe(KV)

    async def follow_views() -> None:
        async for view in views:
            say(f"member 0: view {view.view_id} installed: members {list(view.members)}")

    async def follow_calls() -> None:
        async for d in calls:
            say(f"member 0: delivered {d.method}{d.args} at version {d.version}")

    return [asyncio.create_task(follow_views()), asyncio.create_task(follow_calls())]


async def main(config: da.Config) -> None:
    me = config.member_id
    group = await da.Group.join(config, actors=[KV], timeout=60)
    watchers = await watch(group) if me == 0 else []
    kv = group.subgroup(KV)
    store = group.local(KV)
    for i in range(2):
        await kv[KV.put](f"m{me}-{i}", me)  # replied: every member has run it when this returns
    while len(store.data) < 2 * MEMBERS:
        await asyncio.sleep(0.01)
    if me == 2:
        await group.leave()
        return
    while 2 in group.view.members:  # the others go on in a view without member 2
        await asyncio.sleep(0.01)
    await kv[KV.put](f"m{me}-after", me)
    while len(store.data) < 2 * MEMBERS + 2:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # (member 0's watchers print what they hold)
    await group.leave()
    try:
        await group.closed
    except da.GroupClosed as exc:
        if me == 0:
            say(f"member 0: closed: {exc}")
    await asyncio.gather(*watchers)  # both iterations ended with the member


if __name__ == "__main__":  # launch_local spawns fresh processes that import this module
    codes = da.launch_local(MEMBERS, main, group="watch-group", transport="shm", timeout=60)
    print("exit codes:", codes)
