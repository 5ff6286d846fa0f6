"""Ordered multicast of GPU-resident payloads: delivered bandwidth per receiver vs a raw copy.

Usage (on a machine with a GPU, CuPy and torch): python benchmarks/gpu_bandwidth.py
    [--members 2 4] [--sizes 4K 1M 64M 256M] [--out DIR]

For each member count and payload size, member 0 makes ``reps`` ordered calls carrying one CuPy
array; the others (sharing the GPU) receive it as a device array. The time from the first send
until every member has replied to the last call gives the delivered bandwidth per receiver. In the
same run the parent times a raw CuPy device-to-device copy of the same size (CUDA events). A second
table compares the closed-loop latency of a small GPU message with a host message of the same
size. The table is printed and a PNG plot of bandwidth against size is written to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import derecho_async as da


class Sink(da.Actor):
    @da.ordered
    def take(self, x: Any) -> int:
        return int(x.nbytes)

    @da.ordered
    def take_bytes(self, b: bytes) -> int:
        return len(b)


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


async def bench_member(config: da.Config) -> None:
    import asyncio

    import cupy

    size = int(os.environ["DA_BENCH_SIZE"])
    reps = int(os.environ["DA_BENCH_REPS"])
    mode = os.environ["DA_BENCH_MODE"]
    async with da.Group(config, actors=[Sink]) as group:
        sink = group.subgroup(Sink)
        if config.member_id == 0:
            x = cupy.ones(size // 4, dtype=cupy.float32)
            host = b"x" * size
            cupy.cuda.Device().synchronize()
            lat: list[float] = []
            t0 = time.perf_counter()
            if mode == "bandwidth":
                await asyncio.gather(*(sink.take(x) for _ in range(reps)))
            else:
                for _ in range(reps):
                    s = time.perf_counter()
                    await (sink.take(x) if mode == "gpu-latency" else sink.take_bytes(host))
                    lat.append(time.perf_counter() - s)
            elapsed = time.perf_counter() - t0
            with open(os.environ["DA_BENCH_OUT"], "w") as f:
                json.dump({"elapsed": elapsed, "lat": lat}, f)
            await sink.take_bytes(b"done")
        else:
            done = asyncio.Event()

            async def watch() -> None:
                while True:
                    await asyncio.sleep(0.05)
                    if 0 not in group.view.members:
                        done.set()
                        return

            task = asyncio.ensure_future(watch())
            await done.wait()
            task.cancel()
        await asyncio.sleep(0.5)


def raw_copy_gbps(size: int) -> float:
    import cupy

    x = cupy.ones(size // 4, dtype=cupy.float32)
    y = cupy.empty_like(x)
    for _ in range(3):
        y[...] = x
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(10):
        start.record()
        y[...] = x
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1000)
    return size / statistics.median(times) / 1e9


def run(members: int, size: int, reps: int, mode: str) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "result.json"
    os.environ.update(DA_BENCH_SIZE=str(size), DA_BENCH_REPS=str(reps), DA_BENCH_MODE=mode,
                      DA_BENCH_OUT=str(out))
    codes = da.launch_local(members, bench_member, group=f"gbw{os.getpid()}{members}{size}{mode}",
                            timeout=300, max_payload=8192)
    if codes[0] != 0 or not out.exists():
        return {"error": f"exit codes {codes}"}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--members", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", nargs="+", default=["4K", "256K", "4M", "64M", "256M"])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    sizes = [_parse_size(s) for s in args.sizes]
    rows = []
    print(f"# {' '.join(sys.argv)}  (cores: {os.cpu_count()})")
    print(f"{'members':>7} {'size':>10} {'reps':>5} {'delivered GB/s':>15} {'raw copy GB/s':>14} "
          f"{'ratio':>7}")
    for n in args.members:
        for size in sizes:
            reps = max(2, min(200, (512 << 20) // size))
            r = run(n, size, reps, "bandwidth")
            raw = raw_copy_gbps(size)
            if "error" in r:
                print(f"{n:>7} {size:>10} {reps:>5} {'failed: ' + r['error']:>30}")
                continue
            gbps = size * reps / r["elapsed"] / 1e9
            rows.append((n, size, gbps, raw))
            print(f"{n:>7} {size:>10} {reps:>5} {gbps:>15.3f} {raw:>14.1f} {gbps / raw:>7.4f}",
                  flush=True)
    print("\nsmall-message latency, closed loop, 2 members (µs)")
    for mode in ("gpu-latency", "host-latency"):
        r = run(2, 4096, 200, mode)
        if r.get("lat"):
            lat = sorted(r["lat"])
            print(f"{mode:>13}: p50 {lat[len(lat) // 2] * 1e6:8.0f}  "
                  f"p99 {lat[int(len(lat) * 0.99)] * 1e6:8.0f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for n in args.members:
            pts = [(s, g) for m, s, g, _ in rows if m == n]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{n} members")
        raws = sorted({(s, r) for _, s, _, r in rows})
        ax.plot([p[0] for p in raws], [p[1] for p in raws], "k--", label="raw D2D copy")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("payload bytes")
        ax.set_ylabel("GB/s per receiver")
        ax.set_title("derecho_async GPU payloads (host staging plane)")
        ax.legend()
        fig.tight_layout()
        path = Path(args.out) / "gpu_bandwidth.png"
        fig.savefig(path, dpi=120)
        print(f"plot: {path}")
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
