"""Table 8 of benchmarks/compare.py (``--tables 8``): throughput of a sharded actor as shards
are added, 1, 2 and 4 shards of 3 replicas (3, 6 and 12 member processes over shm).

Every member sends 1 KB one-way ordered calls (``.cast``) to its own shard, 32 outstanding; a
shard's calls are ordered among its 3 members only, so shards proceed side by side. A run is
timed from a common start (all members up, then a go signal) to the moment each member has
delivered every call of its shard; the figure is all calls of all shards over the slowest
member's time. Scaling is that figure over the 1-shard figure of the same run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from bench_files import publish

import derecho_async as da
from derecho_async.launch import run_member

__all__ = ["table_shards"]

SIZE = 1024
DEPTH = 32
REPLICAS = 3
_runs = itertools.count()  # (a fresh group name per run: no segment of an earlier one is met)


class Sink(da.Actor):
    def __init__(self) -> None:
        self.calls = 0

    @da.ordered
    def put(self, _data: bytes) -> None:
        self.calls += 1

    def snapshot(self) -> int:
        return self.calls

    def restore(self, state: int) -> None:
        self.calls = state


class Reporter(Protocol):
    failed: bool

    def table(self, title: str, rows: list[list[str]], notes: str = "", left: int = 1) -> None: ...


async def _member(config: da.Config) -> None:
    out = Path(os.environ["DA_BENCH_SHARDS"])
    shards = int(os.environ["DA_BENCH_SHARD_COUNT"])
    count = int(os.environ["DA_BENCH_SHARD_CALLS"])
    me = config.member_id
    async with da.Group(config, actors=[da.Sharded(Sink, shards=shards,
                                                   replicas=REPLICAS)]) as group:
        shard = group.hosted_shard(Sink)
        assert shard is not None
        handle = group.subgroup(Sink, shard=shard)
        sink = group.local(Sink)
        (out / f"up-{me}").write_text("")
        while not (out / "go").exists():
            await asyncio.sleep(0.002)
        data = os.urandom(SIZE)
        start = time.perf_counter()
        room = asyncio.Semaphore(DEPTH)
        last: asyncio.Future[Any] | None = None
        for _ in range(count):
            await room.acquire()
            last = handle.put.cast(data)
            last.add_done_callback(lambda _f: room.release())
        assert last is not None
        await last
        total = count * len(group.shards(Sink)[shard])
        while sink.calls < total:
            await asyncio.sleep(0.001)
        elapsed = time.perf_counter() - start
        publish(out / f"done-{me}", json.dumps({"shard": shard, "s": elapsed}))
        while not (out / "stop").exists():
            await asyncio.sleep(0.01)


def _run(shards: int, count: int) -> float:
    """Calls per second of all shards together, one run."""
    n = shards * REPLICAS
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(DA_BENCH_SHARDS=tmp, DA_BENCH_SHARD_COUNT=str(shards),
                          DA_BENCH_SHARD_CALLS=str(count))
        fields = dict(group=f"bench-shards-{os.getpid()}-{next(_runs)}", initial_members=n,
                      transport="shm")
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=run_member, args=(_member, {**fields, "member_id": m}))
                 for m in range(n)]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + 120
            for name in ("up", "done"):
                while not all((Path(tmp) / f"{name}-{m}").exists() for m in range(n)):
                    if time.monotonic() > deadline or any(p.exitcode not in (None, 0)
                                                          for p in procs):
                        raise RuntimeError(f"{shards} shards: members did not finish")
                    time.sleep(0.01)
                if name == "up":
                    (Path(tmp) / "go").write_text("")
            worst = max(json.loads((Path(tmp) / f"done-{m}").read_text())["s"]
                        for m in range(n))
        finally:
            (Path(tmp) / "stop").write_text("")
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
    return float(n * count / worst)


def _num(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


def table_shards(rep: Reporter, quick: bool) -> None:
    """Run and print table 8."""
    count, repeats = (300, 1) if quick else (5000, 3)
    got: dict[int, list[float]] = {1: [], 2: [], 4: []}
    try:
        for _ in range(repeats):
            for shards in got:
                got[shards].append(_run(shards, count))
    except Exception as exc:
        rep.failed = True
        print(f"[shards] failed: {type(exc).__name__}: {exc}")
        return
    base = statistics.median(got[1])
    rows = [["shards x replicas", "members", "calls/s, all shards (median)", "range",
             "vs 1 shard"]]
    for shards, rates in got.items():
        med = statistics.median(rates)
        rows.append([f"{shards} x {REPLICAS}", str(shards * REPLICAS), _num(med),
                     f"{_num(min(rates))} - {_num(max(rates))}", f"{med / base:.2f}x"])
    rep.table(
        "8. Sharded actor: throughput as shards are added",
        rows,
        f"Every member sends {count} one-way 1 KB calls to its own shard, {DEPTH} "
        f"outstanding, over shm; all calls of all shards over the slowest member's time from "
        f"a common start to delivering its shard's last call. {repeats} runs per row.",
    )
