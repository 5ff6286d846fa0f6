"""Ordered multicast of GPU-resident payloads: delivered bandwidth per receiver vs a raw copy.

Usage (on a machine with a GPU and CuPy): python benchmarks/gpu_bandwidth.py
    [--members 2 4 8] [--sizes 4K 64K 1M 16M 64M 256M 1G] [--seconds 0.3] [--out DIR]

For each member count, one group of member processes sharing the GPU runs every size: member 0
makes ``reps`` pipelined ordered calls (``out`` of them outstanding at once) carrying one
device array, first allocated in its CUDA IPC pool with ``group.device_buffer`` (sent in
place), then as a plain CuPy array (staged: one extra device copy into the pool). Every other
member receives it as a device array copied into its own pool. The time from the first send
until every member has replied to the last call gives the delivered bandwidth per receiver. A
third run sends in place with one-way calls (``.cast``: no replies), timed until the sender
delivered the last one (delivery means stable: every receiver holds its bytes; receivers run the
handler as they deliver).

Each run is preceded by two warm-up pipelines of ``out`` calls: the first lets every member's
pool grow to what the size needs (a new segment costs a cudaMalloc and an announcement), and the
second's rate sets ``reps`` to about ``--seconds`` of calls (at least ``_reps``). So the runs
measure the steady state, and one hiccup does not decide a run.

In the same command the parent times a raw device-to-device copy of the same size (CUDA events;
the faster of ``cudaMemcpyAsync``, which the plane uses, and CuPy's elementwise copy). Around the one-way run every member reads its CPU clock in the total order (an ordered
call), which gives each member's CPU time per message. That time includes polling
(``--spin-us``, and the GPU plane's busy poll, ``--gpu-busy-poll-us``); with both at 0
it is the work per message, and beside the raw copy's time per message it shows whether the
copies or a member's CPU bound the rate. All receivers copy out of the same GPU's memory at once,
so the table also gives the aggregate (receivers x per-receiver) beside the raw copy. A second
table compares the closed-loop latency of a small GPU message (staged, and in place from a buffer
whose writes have finished) with a host message of the same size.
The table is printed and a PNG plot of bandwidth against size is written to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import derecho_async as da
from derecho_async.workload import pipelined


class Sink(da.Actor):
    @da.ordered
    def take(self, x: Any) -> int:
        return int(x.nbytes)

    @da.ordered
    def take_bytes(self, b: bytes) -> int:
        return len(b)

    @da.ordered
    def cpu(self) -> float:
        """This process's CPU seconds so far, read in the total order: between two such calls a
        member spent the difference on the calls ordered between them."""
        return time.process_time()


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _reps(size: int) -> int:
    """The fewest calls a measured run makes."""
    return max(16, min(200, (8 << 30) // size))


_MAX_REPS = 50_000  # the most calls a measured run makes


def _in_flight(size: int, receivers: int) -> int:
    """Calls outstanding at once: enough to overlap one call's overheads with other calls'
    copies (up to the window, 64), few enough that the receivers' pools together hold at most
    16 GiB of payload in flight."""
    return max(4, min(64, (16 << 30) // (size * max(1, receivers))))


async def bench_member(config: da.Config) -> None:


    sizes = [int(s) for s in os.environ["DA_BENCH_SIZES"].split(",")]
    profile_dir = os.environ.get("DA_BENCH_PROFILE")
    if profile_dir:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
        try:
            await _bench_member(config, sizes)
        finally:
            prof.disable()
            prof.dump_stats(f"{profile_dir}/member{config.member_id}.prof")
    else:
        await _bench_member(config, sizes)


def _repeat(call: Callable[[Any], Awaitable[object]], x: Any) -> Callable[[int], Awaitable[object]]:
    """``call(x)`` for every index of a :func:`pipelined` run."""
    def one(_: int) -> Awaitable[object]:
        return call(x)
    return one


async def _bench_member(config: da.Config, sizes: list[int]) -> None:
    import asyncio

    import cupy

    async with da.Group(config, actors=[Sink]) as group:
        sink = group.subgroup(Sink)
        if config.member_id != 0:
            while 0 in group.view.members:
                await asyncio.sleep(0.05)
            return
        results: dict[str, Any] = {"bandwidth": [], "latency": {},
                                   "ipc": group.device_pool_stats() is not None}
        seconds = float(os.environ.get("DA_BENCH_SECONDS", "0.3"))
        for size in sizes:
            reps = 0  # set from the first mode's warm-up: about `seconds` of calls
            in_flight = _in_flight(size, config.initial_members - 1)
            row: dict[str, Any] = {"size": size, "in_flight": in_flight}
            for mode in ("inplace", "staged", "oneway"):
                if mode != "staged":
                    x = group.device_buffer((size // 4,), "float32")
                    x.fill(1.0)
                else:
                    x = cupy.ones(size // 4, dtype=cupy.float32)
                cupy.cuda.Device().synchronize()
                # one-way calls are done when delivered here: stable, so every member holds them
                call = sink.take.cast if mode == "oneway" else sink.take
                # Warm up with two full pipelines: the first grows every member's pool to what
                # this size and depth need (a cold pool costs each new segment a cudaMalloc and
                # an announcement); the second, timed, sizes the measured run.
                await pipelined(_repeat(call, x), in_flight, in_flight)
                t0 = time.perf_counter()
                await pipelined(_repeat(call, x), in_flight, in_flight)
                if not reps:
                    rate = in_flight / max(time.perf_counter() - t0, 1e-6)
                    reps = max(_reps(size), min(_MAX_REPS, int(rate * seconds)))
                    row["reps"] = reps
                cpu0 = await sink.cpu() if mode == "oneway" else None
                t0 = time.perf_counter()
                await pipelined(_repeat(call, x), reps, in_flight)
                row[mode] = time.perf_counter() - t0
                if cpu0 is not None:  # CPU per message of each member over the one-way run
                    cpu1 = await sink.cpu()
                    row["cpu_us"] = {str(m): (_seconds(cpu1[m]) - _seconds(cpu0[m])) / reps * 1e6
                                     for m in cpu1 if m in cpu0}
                del x
            results["bandwidth"].append(row)
            print(f"member 0: {size} bytes done", file=sys.stderr, flush=True)
        host = b"x" * 4096
        await pipelined(lambda _: sink.take_bytes(host), 100, 64)
        t0 = time.perf_counter()
        await pipelined(lambda _: sink.take_bytes(host), 2000, 64)
        results["host_rate"] = 2000 / (time.perf_counter() - t0)
        for mode in ("gpu staged", "gpu in place", "host"):
            if mode == "gpu in place":
                x = group.device_buffer((1024,), "float32")
                x.fill(1.0)
                cupy.cuda.Device().synchronize()
            else:
                x = cupy.ones(1024, dtype=cupy.float32)
            host = b"x" * 4096
            lat = []
            for i in range(220):
                s = time.perf_counter()
                await (sink.take(x) if mode != "host" else sink.take_bytes(host))
                if i >= 20:
                    lat.append(time.perf_counter() - s)
            results["latency"][mode] = lat
        results["pool"] = group.device_pool_stats()
        with open(os.environ["DA_BENCH_OUT"], "w") as f:
            json.dump(results, f)


def raw_copy_gbps(size: int) -> float:
    """The faster of two raw device-to-device copies of ``size`` bytes in this process, in GB/s
    (median of 10, CUDA events): ``cudaMemcpyAsync`` (what the IPC plane issues) and CuPy's
    elementwise copy (``y[...] = x``)."""
    import cupy

    x = cupy.ones(size // 4, dtype=cupy.float32)
    y = cupy.empty_like(x)
    stream = cupy.cuda.get_current_stream()

    def memcpy() -> None:
        cupy.cuda.runtime.memcpyAsync(y.data.ptr, x.data.ptr, size, 3, stream.ptr)

    def kernel() -> None:
        y[...] = x

    best = 0.0
    for copy in (memcpy, kernel):
        for _ in range(3):
            copy()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(10):
            start.record()
            copy()
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / 1000)
        best = max(best, size / statistics.median(times) / 1e9)
    return best


def run(members: int, sizes: list[int], spin_us: float | None,
        send_batch: int | None, gpu_busy_poll_us: float | None = None) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "result.json"
    os.environ.update(DA_BENCH_SIZES=",".join(map(str, sizes)), DA_BENCH_OUT=str(out))
    codes = da.launch_local(members, bench_member, group=f"gbw{os.getpid()}-{members}",
                            timeout=900, max_payload=8192, gpu_pool_mb=1024, spin_us=spin_us,
                            **({} if send_batch is None else {"send_batch": send_batch}),
                            **({} if gpu_busy_poll_us is None
                               else {"gpu_busy_poll_us": gpu_busy_poll_us}))
    if codes[0] != 0 or not out.exists():
        return {"error": f"exit codes {codes}"}
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _seconds(value: object) -> float:
    """A member's reply to ``Sink.cpu``."""
    if not isinstance(value, float):
        raise RuntimeError(f"a member answered the CPU probe with {value!r}")
    return value


def _cpu_cells(cpu_us: dict[str, float]) -> str:
    """The sender's (member 0) and the busiest receiver's CPU µs per one-way message."""
    sender = cpu_us.get("0")
    receivers = [v for m, v in cpu_us.items() if m != "0"]
    cells = [f"{sender:>7.1f}" if sender is not None else f"{'-':>7}",
             f"{max(receivers):>7.1f}" if receivers else f"{'-':>7}"]
    return " ".join(cells)


def _fmt(size: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return str(size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--members", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--sizes", nargs="+",
                        default=["4K", "64K", "1M", "16M", "64M", "256M", "1G"])
    parser.add_argument("--out", default=".")
    parser.add_argument("--profile", metavar="DIR",
                        help="profile every member (cProfile) and print the top entries of "
                        "members 0 and 1")
    parser.add_argument("--spin-us", type=float, default=None,
                        help="Config.spin_us of the members (default: automatic)")
    parser.add_argument("--seconds", type=float, default=0.3,
                        help="about how long each measured run lasts (default 0.3; its number "
                        "of calls comes from the warm-up's rate)")
    parser.add_argument("--send-batch", type=int, default=None,
                        help="Config.send_batch of the members (default: automatic)")
    parser.add_argument("--gpu-busy-poll-us", type=float, default=None,
                        help="Config.gpu_busy_poll_us of the members (default: 2000)")
    args = parser.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ["DA_BENCH_PROFILE"] = os.path.abspath(args.profile)
    sizes = [_parse_size(s) for s in args.sizes]
    os.environ["DA_BENCH_SECONDS"] = str(args.seconds)
    raw = {size: raw_copy_gbps(size) for size in sizes}
    rows: list[tuple[int, int, float, float, float]] = []
    print(f"# {' '.join(sys.argv)}  (cores: {os.cpu_count()})")
    print("GB/s per receiver; ratio = delivered / raw copy of the same size; aggregate = "
          "receivers x delivered / raw; in place and staged: replied calls; one-way: .cast "
          "from the pool, timed until the sender delivered the last (stable: every receiver "
          "holds it); calls/s in place and one-way; copy µs: the raw copy's time for one "
          "message; CPU µs and rcv µs: CPU time per one-way message of the sender and of the "
          "busiest receiver, polling included (with --spin-us 0 and "
          "--gpu-busy-poll-us 0, the work per message: a member whose work exceeds "
          "the copy's time bounds the rate)")
    print(f"{'members':>7} {'size':>6} {'reps':>5} {'out':>4} {'raw copy':>9} {'in place':>9} {'ratio':>6} "
          f"{'aggr':>6} {'staged':>9} {'ratio':>6} {'one-way':>9} {'ratio':>6} {'aggr':>6} "
          f"{'calls/s':>8} {'1w c/s':>8} {'copy µs':>8} {'CPU µs':>7} {'rcv µs':>7}")
    latencies: dict[str, list[float]] = {}
    for n in args.members:
        r = run(n, sizes, args.spin_us, args.send_batch, args.gpu_busy_poll_us)
        if "error" in r:
            print(f"{n:>7} failed: {r['error']}", flush=True)
            continue
        if not r.get("ipc"):
            print(f"{n:>7} (the CUDA IPC plane was not active: host staging)")
        for row in r["bandwidth"]:
            size, reps = row["size"], row["reps"]
            inplace = size * reps / row["inplace"] / 1e9
            staged = size * reps / row["staged"] / 1e9
            oneway = size * reps / row["oneway"] / 1e9
            rows.append((n, size, inplace, staged, oneway))
            print(f"{n:>7} {_fmt(size):>6} {reps:>5} {row['in_flight']:>4} {raw[size]:>9.1f} {inplace:>9.2f} "
                  f"{inplace / raw[size]:>6.3f} {inplace * (n - 1) / raw[size]:>6.3f} "
                  f"{staged:>9.2f} {staged / raw[size]:>6.3f} {oneway:>9.2f} "
                  f"{oneway / raw[size]:>6.3f} {oneway * (n - 1) / raw[size]:>6.3f} "
                  f"{reps / row['inplace']:>8.0f} {reps / row['oneway']:>8.0f} "
                  f"{size / raw[size] / 1e3:>8.1f} {_cpu_cells(row.get('cpu_us', {}))}",
                  flush=True)
        print(f"{n:>7} host 4 KB bytes, same pipeline (64 outstanding): "
              f"{r['host_rate']:.0f} msgs/s (the protocol's own message rate)", flush=True)
        if n == args.members[0]:
            latencies = r["latency"]
    if args.profile:
        import pstats

        for m in (0, 1):
            path = Path(args.profile) / f"member{m}.prof"
            if path.exists():
                print(f"\nprofile of member {m} ({args.members[-1]} members; own time)")
                pstats.Stats(str(path)).sort_stats("tottime").print_stats(18)
    print(f"\nsmall-message latency, closed loop, {args.members[0]} members (µs)")
    for mode, lat in latencies.items():
        lat = sorted(lat)
        print(f"{mode + ' 4 KB':>17}: p50 {lat[len(lat) // 2] * 1e6:8.0f}  "
              f"p99 {lat[int(len(lat) * 0.99)] * 1e6:8.0f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for n in args.members:
            for col, style, what in ((2, "o-", "in place"), (3, "x:", "staged"),
                                     (4, "s--", "one-way, in place")):
                pts = [(r[1], r[col]) for r in rows if r[0] == n]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                            label=f"{n} members, {what}")
        ax.plot(sizes, [raw[s] for s in sizes], "k--", label="raw D2D copy")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("payload bytes")
        ax.set_ylabel("GB/s per receiver")
        ax.set_title("derecho_async ordered GPU multicast (CUDA IPC plane), one GPU")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = Path(args.out) / "gpu_bandwidth.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        print(f"plot: {path}")
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
