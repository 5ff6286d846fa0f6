"""Table 7 of benchmarks/compare.py (``--tables 7``): an external client's ordered calls
through a relay beside a member's own calls, in one run.

Three members over shm (spawned processes on uvloop) host a sink actor and serve clients on
loopback tcp (``client_listen``). In each repetition, in alternating order:

- member 0 makes 1 KB replied ordered calls to the sink, 32 outstanding (throughput) and one at
  a time (latency, closed loop), timed at member 0 from the first call to the last reply;
- a ``da.Client`` in this process makes the same calls through member 0 as its relay, timed
  the same way at the client.

Throughput is calls answered per second at the caller (every member's reply in); latency is
from the call to its replies. The table gives medians (and ranges) and the ratio client/member.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from bench_files import publish

import derecho_async as da
from derecho_async.launch import run_member

__all__ = ["table_clients"]

T = TypeVar("T")
SIZE = 1024
DEPTH = 32


class Sink(da.Actor):
    """Counts the calls it runs."""

    def __init__(self) -> None:
        self.calls = 0
        self.request: list[int] | None = None  # [phase, count, depth]: member 0 runs it

    @da.ordered
    def put(self, _data: bytes) -> None:
        self.calls += 1

    @da.ordered
    def own(self, phase: int, count: int, depth: int) -> None:
        self.request = [phase, count, depth]


class Reporter(Protocol):
    """What table 7 needs of compare.py's Report."""

    failed: bool

    def table(self, title: str, rows: list[list[str]], notes: str = "", left: int = 1) -> None: ...


async def _calls(call: Callable[[bytes], Any], count: int, depth: int) -> tuple[float, list[float]]:
    """``count`` calls, ``depth`` outstanding: (calls per second, latencies in µs)."""
    data = os.urandom(SIZE)
    lat: list[float] = []
    todo = iter(range(count))

    async def worker() -> None:
        for _ in todo:
            t0 = time.perf_counter()
            await call(data)
            lat.append((time.perf_counter() - t0) * 1e6)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(depth)))
    return count / (time.perf_counter() - start), lat


async def _member(config: da.Config) -> None:
    out = Path(os.environ["DA_BENCH_CLIENTS"])
    async with da.Group(config, actors=[Sink]) as group:
        publish(out / f"member-{config.member_id}", str(group.client_address))
        sink = group.local(Sink)
        handle = group.subgroup(Sink)
        stop = out / "stop"
        while not stop.exists():  # the parent's word, once its client is done and closed
            await asyncio.sleep(0.005)
            req, sink.request = sink.request, None
            if req is None:
                continue
            phase, count, depth = req
            if config.member_id == 0:
                rate, lat = await _calls(handle.put, count, depth)
                publish(out / f"own-{phase}.json", json.dumps([rate, lat]))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


async def _measure(out: Path, group: str, secret: str, peers: dict[int, str], count: int,
                   lat_count: int, repeats: int) -> dict[str, list[Any]]:
    got: dict[str, list[Any]] = {"member": [], "client": [], "member_lat": [], "client_lat": []}
    async with await da.Client.connect(group=group, peers={0: peers[0]}, secret=secret) as c:
        sink = c.subgroup(Sink)
        await _calls(sink.put, 2000, DEPTH)  # warm-up (both paths: the members' calls too)
        phase = 0

        async def own(count: int, depth: int) -> tuple[float, list[float]]:
            nonlocal phase
            phase += 1
            path = out / f"own-{phase}.json"
            await sink.own(phase, count, depth)
            while not path.exists():
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.01)
            rate, lat = json.loads(path.read_text())
            return float(rate), list(lat)

        await own(2000, DEPTH)
        for r in range(repeats):
            order = ("member", "client") if r % 2 == 0 else ("client", "member")
            for who in order:
                if who == "member":
                    got["member"].append((await own(count, DEPTH))[0])
                    got["member_lat"] += (await own(lat_count, 1))[1]
                else:
                    got["client"].append((await _calls(sink.put, count, DEPTH))[0])
                    got["client_lat"] += (await _calls(sink.put, lat_count, 1))[1]
    return got


def table_clients(rep: Reporter, quick: bool) -> None:
    """Run and print table 7."""
    count, lat_count, repeats = (2000, 300, 1) if quick else (20000, 2000, 3)
    secret = da.new_secret()  # the clients' (`client_secret`)
    group = f"bench-clients-{os.getpid()}"
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DA_BENCH_CLIENTS"] = tmp
        fields = dict(group=group, initial_members=3, transport="shm", client_secret=secret,
                      client_listen="127.0.0.1:0", max_client_calls=DEPTH * 2)
        procs = [ctx.Process(target=run_member, args=(_member, {**fields, "member_id": m}))
                 for m in range(3)]
        for p in procs:
            p.start()
        try:
            files = [Path(tmp) / f"member-{m}" for m in range(3)]
            deadline = time.monotonic() + 60
            while not all(f.exists() for f in files):
                if time.monotonic() > deadline:
                    raise RuntimeError("the members did not start within 60 s")
                time.sleep(0.05)
            peers = {m: files[m].read_text() for m in range(3)}
            import uvloop

            got = uvloop.run(_measure(Path(tmp), group, secret, peers, count, lat_count,
                                      repeats))
        except Exception as exc:
            rep.failed = True
            print(f"[clients] failed: {type(exc).__name__}: {exc}")
            return
        finally:
            # The members leave only now: a stop call would let them leave while its own reply
            # was still on its way to the client, which then found no relay for 30 s.
            publish(Path(tmp) / "stop", "")
            for p in procs:
                p.join(20)
                if p.is_alive():
                    p.kill()
                    p.join()
    member = statistics.median(got["member"])
    client = statistics.median(got["client"])
    rows = [["caller", "replied 1 KB calls/s, depth 32 (median)", "range", "p50 µs", "p99 µs",
             "vs member"]]
    for name, rates, lat in (("member 0 (its own calls)", got["member"], got["member_lat"]),
                             ("client through member 0", got["client"], got["client_lat"])):
        rows.append([name, _num(statistics.median(rates)),
                     f"{_num(min(rates))} - {_num(max(rates))}", _num(_pct(lat, 0.5)),
                     _num(_pct(lat, 0.99)),
                     f"{statistics.median(rates) / member:.2f}x"])
    rep.table(
        "7. External clients: calls through a relay vs a member's own",
        rows,
        f"3 members over shm; the client (this process) reaches member 0 over loopback tcp. "
        f"{count} calls per run, {repeats} runs in alternating order; latency: closed loop, "
        f"{lat_count} calls per run. Client/member throughput: {client / member:.2f}x.",
    )
