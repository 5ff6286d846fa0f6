"""A sharded KV store: two shards of three replicas over six member processes.

Run: python examples/sharded_kv.py

Six members over shared memory host ``da.Sharded(KV, shards=2, replicas=3)``: shard 0 on
members 0, 2, 4 and shard 1 on 1, 3, 5 (each member's home shard is its id modulo 2). Member 0
writes ten keys, a key's shard chosen by its hash; the writes to shard 1 are forwarded to a
member that hosts it. Then member 2 is SIGKILLed and member 6 (home shard 0) joins in its
place: it receives shard 0's state from a surviving host before it runs any call, and the next
write to shard 0 reaches it. Every member prints the keys its shard holds.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import zlib
from pathlib import Path

import derecho_async as da
from derecho_async.launch import run_member

SHARDS = 2


class KV(da.Actor):
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.done = False

    @da.ordered
    def put(self, key: str, value: str) -> None:
        self.data[key] = value

    @da.ordered
    def finish(self) -> None:
        self.done = True

    @da.p2p
    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def snapshot(self) -> dict[str, str]:
        return dict(self.data)

    def restore(self, state: dict[str, str]) -> None:
        self.data = dict(state)


def shard_of(key: str) -> int:
    return zlib.crc32(key.encode()) % SHARDS


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


async def member(config: da.Config) -> None:
    me = config.member_id
    out = Path(os.environ["SHARDED_KV_DIR"])
    async with da.Group(config, actors=[da.Sharded(KV, shards=SHARDS, replicas=3)]) as group:
        (out / f"up-{me}").write_text("")
        if me == 0:
            say(f"member 0: shards {group.shards(KV)}")
            for i in range(10):
                key = f"key{i}"
                await group.subgroup(KV, shard=shard_of(key))[KV.put](key, f"v{i}")
            say("member 0: wrote key0..key9")
            (out / "written").write_text("")
            while not (out / "joined").exists():  # the others kill member 2 and add member 6
                await asyncio.sleep(0.05)
            while 6 not in group.view.members:
                await asyncio.sleep(0.05)
            say(f"member 0: shards now {group.shards(KV)}")
            key = next(k for k in (f"late{i}" for i in range(9)) if shard_of(k) == 0)
            replies = await group.subgroup(KV, shard=0)[KV.put](key, "after the join")
            say(f"member 0: {key} -> replies from {sorted(replies)}")
            got = await group.subgroup(KV, shard=0)[KV.get].at(6)(
                "key0" if shard_of("key0") == 0 else "key1")
            say(f"member 0: member 6 reads {got!r} from the state it received")
            for shard in range(SHARDS):
                await group.subgroup(KV, shard=shard)[KV.finish]()
        kv = group.local(KV)
        while not kv.done and not group.closed.done():
            await asyncio.sleep(0.05)
        say(f"member {me}: shard {group.hosted_shard(KV)} holds {sorted(kv.data)}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SHARDED_KV_DIR"] = tmp
        fields = dict(group=f"sharded-{os.getpid()}", initial_members=6, transport="shm",
                      heartbeat_ms=20, suspect_after_ms=500)
        ctx = multiprocessing.get_context("spawn")

        def start(m: int) -> multiprocessing.process.BaseProcess:
            p = ctx.Process(target=run_member, args=(member, {**fields, "member_id": m}))
            p.start()
            return p

        def wait(name: str) -> None:
            deadline = time.monotonic() + 60
            while not (Path(tmp) / name).exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} did not come within 60 s")
                time.sleep(0.05)

        procs = {m: start(m) for m in range(6)}
        wait("written")
        os.kill(procs[2].pid, signal.SIGKILL)  # type: ignore[arg-type]
        say("SIGKILLed member 2 (shard 0)")
        procs[6] = start(6)
        wait("up-6")
        (Path(tmp) / "joined").write_text("")
        for p in procs.values():
            p.join(60)
        say(f"exit codes: {[p.exitcode for p in procs.values()]}")


if __name__ == "__main__":
    main()
