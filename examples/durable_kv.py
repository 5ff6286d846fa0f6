"""A durable replicated map: run it, let it stop, run it again: every run resumes from the files.

Run: python examples/durable_kv.py [DATA_DIR]   (default: ./durable-kv-data)

Three member processes over shared memory, each with its files under
DATA_DIR/durable-kv/member-<id>/. Each run every member writes one key and waits until every
member has it on disk (``persisted``); the next run restores the map from the files first.
"""

from __future__ import annotations

import asyncio
import sys

import derecho_async as da

MEMBERS = 3


class KV(da.Actor):
    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    @da.ordered
    def put(self, key: str, value: str) -> None:
        self.data[key] = value

    @da.p2p
    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def snapshot(self) -> dict[str, str]:  # for joiners and for the snapshots on disk
        return dict(self.data)

    def restore(self, state: dict[str, str]) -> None:
        self.data = dict(state)


async def wait_for(store: KV, keys: list[str]) -> None:
    while not all(k in store.data for k in keys):
        await asyncio.sleep(0.01)


async def main(config: da.Config) -> None:
    me = config.member_id
    async with da.Group(config, actors=[KV]) as group:  # resumes from the files, if any
        kv = group.subgroup(KV)
        store = group.local(KV)
        run = 1 + sum(k.startswith("run") for k in store.data) // MEMBERS
        version = await kv[KV.put].cast(f"run{run}-member{me}", f"written by member {me}")
        await kv.persisted(version)  # on disk at every member of the view
        await wait_for(store, [f"run{run}-member{m}" for m in range(MEMBERS)])
        logged = [e async for e in kv.history()]
        written = sorted(k for k in store.data if k.startswith("run"))
        sys.stdout.write(
            f"member {me}: run {run} in view {group.view.view_id}: {len(written)} keys written "
            f"so far, durable everywhere through {kv.persisted_frontier}, {len(logged)} calls "
            f"in my log\n")
        sys.stdout.flush()
        await kv[KV.put].cast(f"done{run}-member{me}", "")
        await wait_for(store, [f"done{run}-member{m}" for m in range(MEMBERS)])


if __name__ == "__main__":  # launch_local spawns fresh processes that import this module
    data_dir = sys.argv[1] if len(sys.argv) > 1 else "durable-kv-data"
    codes = da.launch_local(MEMBERS, main, group="durable-kv", transport="shm",
                            data_dir=data_dir, timeout=60)
    print("exit codes:", codes)
