"""An external client: a process that uses a group's KV actor without joining the group.

Run: python examples/kv_client.py

Three member processes over shared memory host KV and serve clients on loopback tcp
(``client_listen``). This process connects as a ``da.Client`` with the clients' secret, writes
and reads keys, follows the deliveries, then SIGKILLs the member relaying its calls: the next
calls go on through another member, and every call is applied exactly once. A last ordered
call tells the members to leave.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import derecho_async as da
from derecho_async.launch import run_member

MEMBERS = 3


class KV(da.Actor):
    def __init__(self) -> None:
        self.data: dict[str, int] = {}
        self.writes = 0
        self.closing = False

    @da.ordered
    def put(self, key: str, value: int) -> int:
        self.data[key] = value
        self.writes += 1
        return self.writes

    @da.ordered
    def close(self) -> None:
        self.closing = True

    @da.p2p
    def get(self, key: str) -> int | None:
        return self.data.get(key)

    def snapshot(self) -> list[object]:
        return [self.data, self.writes]

    def restore(self, state: list[object]) -> None:
        data, writes = state
        assert isinstance(data, dict) and isinstance(writes, int)
        self.data, self.writes = dict(data), writes


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def member(config: da.Config) -> None:
    """A member: serve until a client calls close(), then leave."""
    async with da.Group(config, actors=[KV]) as group:
        where = Path(os.environ["KV_CLIENT_DIR"]) / f"member-{config.member_id}"
        where.write_text(str(group.client_address))
        kv = group.local(KV)
        while not kv.closing and not group.closed.done():
            await asyncio.sleep(0.05)
        say(f"member {config.member_id}: {kv.writes} writes applied, leaving")


async def client(group: str, secret: str, addresses: dict[int, str],
                 procs: Mapping[int, multiprocessing.process.BaseProcess]) -> None:
    async with await da.Client.connect(group=group, peers=addresses, secret=secret) as c:
        kv = c.subgroup(KV)
        say(f"client: connected through member {c.relay}, view {c.view}")
        follow = c.subscribe(KV)
        first = asyncio.ensure_future(anext(follow))
        await asyncio.sleep(0.1)  # (the subscription is open at the relay)
        replies = await kv[KV.put]("a", 1)
        say(f"client: put a=1 -> writes per member {dict(replies)}, version {replies.version}")
        version = await kv[KV.put].cast("b", 2)
        say(f"client: put b=2 one-way, delivered at {version}")
        say(f"client: get a at member 2 -> {await kv[KV.get].at(2)('a')}, "
            f"b anywhere -> {await kv[KV.get].any()('b')}")
        entry = await first
        say(f"client: followed {entry.method}{entry.args} at {entry.version}")
        victim = c.relay
        assert victim is not None
        os.kill(procs[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
        say(f"client: SIGKILLed member {victim}, the relay")
        for i in range(20):
            replies = await kv[KV.put](f"k{i}", i)
        say(f"client: 20 more puts through member {c.relay}; the last -> {dict(replies)}")
        await kv[KV.close]()


def main() -> None:
    secret = da.new_secret()  # what clients prove (`client_secret`); shm members need none
    group = f"kvclient-{os.getpid()}"
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KV_CLIENT_DIR"] = tmp
        fields = dict(group=group, initial_members=MEMBERS, transport="shm",
                      client_secret=secret, client_listen="127.0.0.1:0", heartbeat_ms=20,
                      suspect_after_ms=500)
        ctx = multiprocessing.get_context("spawn")
        procs = {m: ctx.Process(target=run_member, args=(member, {**fields, "member_id": m}))
                 for m in range(MEMBERS)}
        for p in procs.values():
            p.start()
        deadline = time.monotonic() + 60
        files = [Path(tmp) / f"member-{m}" for m in range(MEMBERS)]
        while not all(f.exists() for f in files):
            if time.monotonic() > deadline:
                raise SystemExit("the members did not start within 60 s")
            time.sleep(0.05)
        addresses = {m: files[m].read_text() for m in range(MEMBERS)}
        asyncio.run(client(group, secret, addresses, procs))
        for p in procs.values():
            p.join(30)
        say(f"exit codes: {[p.exitcode for p in procs.values()]}")


if __name__ == "__main__":
    main()
