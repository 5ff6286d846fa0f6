"""The README's replicated log: three member processes on this host over shared memory.

Run: python examples/replicated_log.py
"""

from __future__ import annotations

import asyncio
import sys

import derecho_async as da


class Log(da.Actor):
    def __init__(self) -> None:
        self.items: list[bytes] = []

    @da.ordered  # multicast; runs at every member in the same order
    async def append(self, item: bytes) -> int:
        self.items.append(item)
        return len(self.items)

    @da.p2p  # runs at one chosen member, unordered, read-only
    async def size(self) -> int:
        return len(self.items)

    def snapshot(self) -> bytes:  # state for joiners
        return b"\n".join(self.items)

    def restore(self, state: bytes) -> None:
        self.items = state.split(b"\n") if state else []


async def wait_for_items(log: Log, n: int) -> None:
    while len(log.items) < n:
        await asyncio.sleep(0.01)


async def main(config: da.Config) -> None:
    me = config.member_id
    async with da.Group(config, actors=[Log]) as group:  # joins; leaves on exit
        log = group.subgroup(Log)
        mine = group.local(Log)  # this member's own replica: a Log
        replies = await log[Log.append](b"hello from %d" % me)  # {member_id: log length there}
        await wait_for_items(mine, 3)  # every member's hello is in
        peer = (me + 1) % 3
        n = await log[Log.size].at(peer)()  # p2p call to the next member: an int
        line = (
            f"member {me}: my append is #{replies[me]} at version {replies.version}, "
            f"answered by {sorted(replies)}; member {peer} holds {n}; log {mine.items[:3]}"
        )
        sys.stdout.write(line + "\n")  # one write: lines of the 3 processes do not interleave
        sys.stdout.flush()
        await log[Log.append](b"done")
        await wait_for_items(mine, 6)  # nobody leaves before everyone made its p2p call


if __name__ == "__main__":  # launch_local spawns fresh processes that import this module
    codes = da.launch_local(3, main, transport="shm", timeout=60)
    print("exit codes:", codes)
