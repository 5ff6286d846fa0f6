"""Where the time of one closed-loop ordered call goes: a merged timeline of the member processes.

Usage: python benchmarks/latency_timeline.py [--calls N] [--members M] [--spin-us US] [--plain]

Member 0 makes ``N`` one-way 1 KB calls one at a time (``put.cast``, closed loop) in a group of
``M`` members over shm. Each process time-stamps (``time.perf_counter``, one clock for every
process of the host) the entry of the runtime functions a call passes through: the call
(``CallTable.cast``), each driver step (entry and exit), the core's poll (entry and exit), the
step's pushes (``Driver._put_out``, ``ShmTransport._enqueue``), records taken in from a ring
(``ShmTransport._consume``, when it took some), doorbells rung (``ShmTransport._ring_data``),
deliveries (``Driver._report_delivered``, which hands them to the group) and the caller's
resumption. The parent merges the logs and prints the call's latency (p50, p99), each member's
CPU time per call, the merged timeline of the call whose latency is the median, the median time
from a call to the first event of each kind at each member, and the median length of a step and
of the core's poll. ``--plain`` leaves the functions alone (the latency without the stamps, which
cost about a microsecond each).

The wrappers are instrumentation of this script only: they wrap the classes' methods in the
member processes it starts, nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import derecho_async as da
from derecho_async.workload import percentile

Log = list[tuple[float, str]]


class Sink(da.Actor):
    """Counts the calls it is given."""

    def __init__(self) -> None:
        self.n = 0

    @da.ordered
    def put(self, item: bytes) -> None:
        self.n += 1

    @da.ordered
    def cpu(self) -> float:
        return time.process_time()


def _stamp(log: Log) -> None:
    """Wrap the functions a call passes through so that each entry (or exit) is logged."""
    from derecho_async.api import calls as calls_module
    from derecho_async.core import member as member_module
    from derecho_async.runtime import driver as driver_module
    from derecho_async.transport import shm as shm_module

    clock = time.perf_counter

    def wrap(cls: type, name: str, tag: str, *, after: bool = False,
             when: Callable[[Any], bool] | None = None) -> None:
        original = getattr(cls, name)

        def stamped(*args: Any, **kwargs: Any) -> Any:
            if not after:
                log.append((clock(), tag))
            result = original(*args, **kwargs)
            if after and (when is None or when(result)):
                log.append((clock(), tag))
            return result

        setattr(cls, name, stamped)

    wrap(calls_module.CallTable, "cast", "call")
    wrap(driver_module.Driver, "_step", "step")
    wrap(driver_module.Driver, "_step", "step end", after=True)
    wrap(member_module.Member, "poll", "core poll")
    wrap(member_module.Member, "poll", "core poll end", after=True)
    wrap(driver_module.Driver, "_put_out", "put out")
    wrap(shm_module.ShmTransport, "_enqueue", "ring record")
    wrap(shm_module.ShmTransport, "_consume", "took records", after=True, when=bool)
    wrap(shm_module.ShmTransport, "_ring_data", "doorbell")
    wrap(driver_module.Driver, "_report_delivered", "delivered")


async def _member(config: da.Config) -> None:
    calls = int(os.environ["TIMELINE_CALLS"])
    out = os.environ["TIMELINE_OUT"]
    plain = os.environ.get("TIMELINE_PLAIN") == "1"
    log: Log = []
    async with da.Group(config, actors=[Sink]) as group:
        sink = group.subgroup(Sink)
        if config.member_id != 0:
            if not plain:
                _stamp(log)
            while 0 in group.view.members:
                await asyncio.sleep(0.05)
            with open(os.path.join(out, f"m{config.member_id}.json"), "w") as f:
                json.dump({"log": log}, f)
            return
        payload = b"x" * 1024
        for _ in range(min(500, calls)):  # warm up
            await sink.put.cast(payload)
        if not plain:
            _stamp(log)
        before: dict[int, float] = await sink.cpu()
        latencies = []
        clock = time.perf_counter
        for _ in range(calls):
            t = clock()
            await sink.put.cast(payload)
            done = clock()
            log.append((done, "caller resumed"))
            latencies.append(done - t)
        after: dict[int, float] = await sink.cpu()
        cpu = {m: (after[m] - before[m]) / calls for m in after}
        with open(os.path.join(out, "m0.json"), "w") as f:
            json.dump({"log": log, "latencies": latencies, "cpu": cpu}, f)
        await asyncio.sleep(0.3)


def report(out: str, members: int, show: int = 1) -> str:
    """The text summary of the logs in ``out`` (one JSON file per member)."""
    data = []
    for m in range(members):
        with open(os.path.join(out, f"m{m}.json")) as f:
            data.append(json.load(f))
    logs: dict[int, Log] = {m: [(t, tag) for t, tag in d["log"]] for m, d in enumerate(data)}
    latencies: list[float] = data[0]["latencies"]
    lines = [
        f"{len(latencies)} calls: p50 {percentile(latencies, 0.5) * 1e6:.0f} µs, "
        f"p99 {percentile(latencies, 0.99) * 1e6:.0f} µs",
        "CPU per call, µs: " + ", ".join(
            f"member {m} {float(c) * 1e6:.0f}" for m, c in sorted(data[0]["cpu"].items())),
    ]
    merged = sorted((t, m, tag) for m, lg in logs.items() for t, tag in lg)
    starts = [t for t, tag in logs[0] if tag == "call"]
    if len(starts) < 3:
        return "\n".join([*lines, "(no time stamps: --plain)"])
    spans = list(zip(starts, [*starts[1:], float("inf")], strict=True))[:-1]
    # the timeline of the call(s) nearest the median latency (span i is call i's)
    median = percentile(latencies, 0.5)
    middle = sorted(range(len(spans)), key=lambda i: abs(latencies[i] - median))[:show]
    for i in middle:
        t0, t1 = spans[i]
        lines.append(f"\ntimeline of call {i} (µs from the call):")
        lines += [f"  {(t - t0) * 1e6:8.1f}  member {m}  {tag}"
                  for t, m, tag in merged if t0 <= t < t1]
    firsts: dict[tuple[int, str], list[float]] = {}
    for t0, t1 in spans:
        seen = set()
        for t, m, tag in merged:
            if t0 <= t < t1 and (m, tag) not in seen:
                seen.add((m, tag))
                firsts.setdefault((m, tag), []).append((t - t0) * 1e6)
    lines.append("\nfirst event of each kind, median µs from the call (in how many calls):")
    for (m, tag), xs in sorted(firsts.items(), key=lambda kv: statistics.median(kv[1])):
        lines.append(f"  {statistics.median(xs):8.1f}  member {m}  {tag} ({len(xs)})")
    lines.append("\nlengths, median (p90) µs:")
    for start, end in (("step", "step end"), ("core poll", "core poll end")):
        for m, lg in logs.items():
            lengths = []
            opened = None
            for t, tag in lg:
                if tag == start:
                    opened = t
                elif tag == end and opened is not None:
                    lengths.append((t - opened) * 1e6)
                    opened = None
            if lengths:
                lines.append(f"  member {m} {start}: {statistics.median(lengths):.1f} "
                             f"({percentile(lengths, 0.9):.1f}), {len(lengths)} of them")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--spin-us", type=float, default=None,
                        help="Config.spin_us of every member (default: the automatic choice)")
    parser.add_argument("--plain", action="store_true", help="no time stamps")
    parser.add_argument("--show", type=int, default=1, help="timelines of calls to print")
    args = parser.parse_args()
    if args.calls < 10 or not 2 <= args.members <= 8:
        parser.error("--calls must be at least 10 and --members 2 to 8")
    with tempfile.TemporaryDirectory() as out:
        os.environ["TIMELINE_CALLS"] = str(args.calls)
        os.environ["TIMELINE_OUT"] = out
        os.environ["TIMELINE_PLAIN"] = "1" if args.plain else "0"
        extra: dict[str, Any] = {} if args.spin_us is None else {"spin_us": args.spin_us}
        codes = da.launch_local(args.members, _member, timeout=300, transport="shm", **extra)
        if any(codes):
            print(f"members exited with {codes}", file=sys.stderr)
            return 1
        print(f"# {' '.join(sys.argv)}  (cores: {os.cpu_count()})")
        print(report(out, args.members, args.show))
    return 0


if __name__ == "__main__":
    sys.exit(main())
