"""The 3-member 1 KB stream of shm_stream.py, with every member in this one process.

Usage: python benchmarks/sim_stream.py [--count N] [--depth CALLS] [--replied] [--repeat R]

The members run on one event loop over ``transport="sim"`` (the in-process loopback fabric):
the real protocol core, driver, group and codec, without processes, rings, doorbells or the
scheduler between them. Each sender keeps ``--depth`` one-way calls (``.cast``; ``--replied``:
calls that await every member's reply) outstanding, all three send. Prints the CPU time
(``time.process_time``) per delivered message, all members together, and msgs/s. Against
shm_stream.py's figure this splits the per-message cost into what the runtime's Python costs
and what crossing processes adds; and with one process and no hand-offs it scatters far less
between runs, so it is the quicker A/B check for a change to the per-message path::

    for t in A B; do PYTHONPATH=/tmp/$t python benchmarks/sim_stream.py; done
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

import uvloop
from latency_timeline import Sink  # counts its put calls

import derecho_async as da

_names = itertools.count()

async def _run(count: int, depth: int, replied: bool) -> tuple[float, float]:
    name = f"simstream{next(_names)}"
    configs = [da.Config(group=name, member_id=i, initial_members=3, transport="sim")
               for i in range(3)]
    groups = await asyncio.gather(*(da.Group.join(c, actors=[Sink], timeout=10)
                                    for c in configs))
    try:
        payload = b"x" * 1024

        async def send(g: da.Group) -> None:
            put = g.subgroup(Sink).put
            call: Callable[[bytes], Awaitable[object]] = put if replied else put.cast
            issued = 0

            async def worker() -> None:
                nonlocal issued
                while issued < count:
                    issued += 1
                    await call(payload)

            await asyncio.gather(*(worker() for _ in range(depth)))

        sinks: list[Sink] = [g.local(Sink) for g in groups]
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.gather(*(send(g) for g in groups))
        while min(s.n for s in sinks) < 3 * count:
            await asyncio.sleep(0)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await asyncio.gather(*(g.leave() for g in groups))
    return cpu / (3 * count) * 1e6, 3 * count / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=20000, help="calls per sender")
    parser.add_argument("--depth", type=int, default=32, help="outstanding calls per sender")
    parser.add_argument("--replied", action="store_true",
                        help="calls that return every member's reply (default: one-way)")
    parser.add_argument("--repeat", type=int, default=1, help="runs, each with a new group")
    args = parser.parse_args()
    if args.count < 1 or args.depth < 1 or args.repeat < 1:
        parser.error("--count, --depth and --repeat must be at least 1")
    mode = "replied" if args.replied else "one-way"
    for _ in range(args.repeat):
        cpu_us, rate = uvloop.run(_run(args.count, args.depth, args.replied))
        print(f"sim (one process), 3 members, 3 senders, 1 KB, {mode}, depth {args.depth}: "
              f"{rate:,.0f} msgs/s; CPU {cpu_us:.2f} us per delivered message")


if __name__ == "__main__":
    main()
