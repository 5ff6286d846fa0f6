"""Table 6d of benchmarks/compare.py: how long a 3-member group takes to restart after a total
failure, with a given number of calls in its logs.

Three members over shm with ``data_dir`` stream 1 KB one-way calls (3 senders, 64 in flight,
keys cycling over 1,000 so the state stays small) until ``calls`` are persisted at every
member; then every member is SIGKILLed at once. The same three restart from their files; the
restart time runs from spawning them to the last one returning from ``Group.join`` (the
restart rule, the suffix exchange and the new view included; each member's Python start and
imports too, which the second figure, the join alone inside each member, leaves out).

Run alone: ``python benchmarks/bench_restart.py --calls 1000000``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import derecho_async as da
from derecho_async.launch import run_member
from derecho_async.transport import registry

__all__ = ["restart_after_total_failure"]

N = 3
KEYS = 1000


class Store(da.Actor):
    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}

    @da.ordered
    def put(self, key: int, value: bytes) -> None:
        self.data[key] = value

    def snapshot(self) -> dict[int, bytes]:
        return dict(self.data)

    def restore(self, state: dict[int, bytes]) -> None:
        self.data = dict(state)


async def fill(config: da.Config) -> None:
    out = Path(os.environ["BENCH_RESTART_OUT"])
    calls = int(os.environ["BENCH_RESTART_CALLS"]) // N
    value = b"v" * 1000
    async with da.Group(config, actors=[Store]) as group:
        kv = group.subgroup(Store)
        inflight: list[asyncio.Future[tuple[int, int]]] = []
        last = (0, 0)
        for i in range(calls):
            inflight.append(kv.put.cast((config.member_id * calls + i) % KEYS, value))
            if len(inflight) >= 64:
                last = max(last, await inflight.pop(0))
        for fut in inflight:
            last = max(last, await fut)
        await kv.persisted(last)
        (out / f"filled-{config.member_id}").touch()
        await asyncio.sleep(3600)  # until killed


async def restart(config: da.Config) -> None:
    out = Path(os.environ["BENCH_RESTART_OUT"])
    t0 = time.perf_counter()
    group = await da.Group.join(config, actors=[Store], timeout=300)
    join_s = time.perf_counter() - t0
    store = group.local(Store)
    (out / f"back-{config.member_id}.json").write_text(json.dumps(
        {"at": time.time(), "join_s": join_s, "keys": len(store.data),
         "view": group.view.view_id}))
    while not all((out / f"back-{m}.json").exists() for m in range(N)):
        await asyncio.sleep(0.01)
    await group.leave()


def _spawn(main: Any, fields: dict[str, Any]) -> list[Any]:
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for i in range(N):
        p = ctx.Process(target=run_member, args=(main, {**fields, "member_id": i}))
        p.start()
        procs.append(p)
    return procs


def restart_after_total_failure(calls: int) -> dict[str, Any]:
    """Fill the logs with ``calls`` calls, kill every member, restart them; the figures."""
    out = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    data = out / "data"
    os.environ["BENCH_RESTART_OUT"] = str(out)
    os.environ["BENCH_RESTART_CALLS"] = str(calls)
    group = f"restart{os.getpid()}"
    fields = {"group": group, "initial_members": N, "transport": "shm", "data_dir": str(data)}
    try:
        t_fill = time.perf_counter()
        procs = _spawn(fill, fields)
        deadline = time.monotonic() + 1800
        while not all((out / f"filled-{m}").exists() for m in range(N)):
            if time.monotonic() > deadline or any(not p.is_alive() for p in procs):
                raise RuntimeError("the group did not log its calls")
            time.sleep(0.05)
        fill_s = time.perf_counter() - t_fill
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join()
        registry.kind("shm").clean(group)
        on_disk = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
        t0 = time.time()
        procs = _spawn(restart, fields)
        for p in procs:
            p.join(600)
        registry.kind("shm").clean(group)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"restart exit codes {[p.exitcode for p in procs]}")
        backs = [json.loads((out / f"back-{m}.json").read_text()) for m in range(N)]
        return {"calls": calls, "fill_s": fill_s, "on_disk_mb": on_disk / 2**20,
                "restart_s": max(b["at"] for b in backs) - t0,
                "join_s": max(b["join_s"] for b in backs),
                "keys": backs[0]["keys"], "view": backs[0]["view"]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    args = parser.parse_args()
    print(json.dumps(restart_after_total_failure(args.calls)))


if __name__ == "__main__":
    main()
