"""CPU used by an idle group: N members formed, nothing sent, measured from /proc.

Usage: python benchmarks/idle_cpu.py [--members 3] [--seconds 10] [--transport shm]

Each member process's user+system CPU time is read from /proc/<pid>/stat at the start and the end
of the window (after the group formed); the table gives the share of one core per member.
"""

from __future__ import annotations

import argparse
import os
import time

from derecho_async.cli import _table
from derecho_async.localrun import LocalRun


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--transport", choices=["shm", "tcp"], default="shm")
    parser.add_argument("--heartbeat-ms", type=float, default=50.0)
    args = parser.parse_args()
    run = LocalRun(
        args.members,
        args.transport,
        0,
        16,
        1,
        0,
        args.heartbeat_ms,
        500.0,
        linger=args.seconds + 10,
    )
    try:
        deadline = time.monotonic() + 30
        while len(run.views) < args.members and time.monotonic() < deadline:
            run.poll(0.1)
        time.sleep(1.0)  # let start-up work settle
        pids = {m: p.pid for m, p in run.procs.items()}
        before = {m: cpu_seconds(pid) for m, pid in pids.items()}
        t0 = time.monotonic()
        time.sleep(args.seconds)
        dt = time.monotonic() - t0
        after = {m: cpu_seconds(pid) for m, pid in pids.items()}
    finally:
        for p in run.procs.values():
            p.kill()
        run.finish(5)
    rows = [["member", "CPU s", "window s", "% of a core"]]
    for m in sorted(pids):
        used = after[m] - before[m]
        rows.append([str(m), f"{used:.3f}", f"{dt:.1f}", f"{100 * used / dt:.2f}"])
    print(
        f"idle group: {args.members} members over {args.transport}, heartbeat "
        f"{args.heartbeat_ms} ms, {os.cpu_count()} cores"
    )
    print(_table(rows))


if __name__ == "__main__":
    main()
