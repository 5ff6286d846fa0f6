"""Comparison benchmarks of derecho_async against its peers, in one command.

Usage: python benchmarks/compare.py [--quick] [--only derecho,pyzmq,pysyncobj] [--tables 1,...,8]
                                   [--out DIR]
       python benchmarks/compare.py --large [--quick]
       python benchmarks/compare.py --profile [--quick]

Prints eight tables (markdown), each headed by the core count and the command line; every ratio
is computed from figures measured in the same run:

1. Throughput, 3 members, 1 KB: derecho_async ordered calls (shm and tcp; all senders and one
   sender; replied calls, then one-way calls, ``handle.method.cast``) vs PySyncObj (Raft, 3 nodes on loopback, one writer) vs pyzmq PUB -> 2 SUB (tcp
   loopback, no ordering).
2. Latency of one ordered call, closed loop (depth 1), one sender, 3 members over shm, with a
   histogram in ``DIR/latency_hist.png`` (matplotlib).
3. Message sizes 64 B - 64 KB (shm, 3 members, all senders), and large host payloads (numpy
   arrays, 1-256 MB, one sender, MB/s delivered at the receivers) over shm (3b) and tcp (3c)
   beside a numpy memcpy of the same size. ``--large`` runs only these two tables.
4. Scaling: 2, 3, 5, 8 members (shm, 1 KB, all senders).
5. Idle CPU of a formed group (the measurement of benchmarks/idle_cpu.py).
6. Durability (benchmarks/bench_durable.py; not in the default set): one-way throughput with and
   without ``data_dir`` beside PySyncObj with its file journal, and the time to ``persisted()``.
7. External clients (benchmarks/bench_clients.py; not in the default set): a client's ordered
   1 KB calls through a relay beside the relay's own calls, throughput and latency.
8. Sharded actors (benchmarks/bench_shards.py; not in the default set): one-way throughput of
   1, 2 and 4 shards of 3 replicas, all shards together.

derecho_async msgs/s is messages delivered per second at the slowest member, timed from a
barrier (an ordered call of every member) to the delivery of the phase's last message; every
group first plays an unreported warm-up phase. ``--quick`` shrinks every run (the smoke test);
the full run also writes ``DIR/results.md``. ``--profile`` instead profiles member 0 of a shm
throughput run with cProfile (CPU time) and writes the top entries to ``DIR/profile.txt``. Processes and
shared-memory segments are cleaned up after every run; the exit status is 1 if any run failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import io
import os
import platform
import shlex
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import bench_clients
import bench_durable
import bench_members as bm
import bench_peers as bp
import bench_shards

HERE = os.path.dirname(os.path.abspath(__file__))
T = TypeVar("T")
SYSTEMS = ("derecho", "pyzmq", "pysyncobj")


@dataclass(frozen=True)
class Scale:
    """Message counts of every run (per sender where senders vary)."""

    warm: int
    shm_all: int
    shm_one: int
    tcp_all: int
    tcp_one: int
    zmq: int
    syncobj: int
    syncobj_windows: tuple[int, ...]
    latency: int
    sizes: int
    large: tuple[tuple[int, int], ...]  # (MB, count)
    scaling: int
    idle_s: float
    repeats: int


FULL = Scale(
    warm=1000,
    shm_all=20000,
    shm_one=50000,
    tcp_all=10000,
    tcp_one=30000,
    zmq=500000,
    syncobj=50000,
    syncobj_windows=(1000, 10000),
    latency=20000,
    sizes=8000,
    large=((1, 16), (16, 8), (64, 4), (256, 2)),
    scaling=8000,
    idle_s=10.0,
    repeats=3,
)
QUICK = Scale(
    warm=100,
    shm_all=600,
    shm_one=1500,
    tcp_all=400,
    tcp_one=1000,
    zmq=40000,
    syncobj=4000,
    syncobj_windows=(1000,),
    latency=300,
    sizes=200,
    large=((1, 2), (16, 1), (64, 1)),
    scaling=200,
    idle_s=1.5,
    repeats=1,
)
SIZES = (64, 256, 1024, 4096, 16384, 65536)
SCALING = (2, 3, 5, 8)
DEPTH = 32
# Table 1 also runs the shm 3-sender stream with each sender keeping a whole slot window
# outstanding (Config.window, 64 by default): the peers run with 1000 (PySyncObj) and unbounded
# (pyzmq, HWM off) messages outstanding, the DEPTH rows with 3 x 32.
WINDOW_DEPTH = 64


class Report:
    """Collects the printed tables (for results.md) and whether any run failed."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.parts: list[str] = []
        self.failed = False
        #: the figures the goals table (table_goals) judges, by name, as the tables measure them
        self.figures: dict[str, float] = {}

    def emit(self, text: str = "") -> None:
        print(text, flush=True)
        self.parts.append(text)

    def table(self, title: str, rows: list[list[str]], notes: str = "", left: int = 1) -> None:
        self.emit(f"### {title}")
        self.emit(f"cores: {os.cpu_count()}; command: `{self.command}`")
        self.emit()
        self.emit(md_table(rows, left))
        if notes:
            self.emit()
            self.emit(notes)
        self.emit()

    def attempt(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """Run ``fn(*args)``; on an exception, report it on stderr and return None."""
        try:
            return fn(*args)
        except Exception as exc:  # one failed run must not hide the others
            self.failed = True
            print(f"[{what}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            if os.environ.get("BENCH_TRACEBACK"):
                traceback.print_exc()
            return None


def md_table(rows: list[list[str]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for j, r in enumerate(rows):
        cells = [
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("| " + " | ".join(cells) + " |")
        if j == 0:
            marks = [
                ":" + "-" * (w + 1) if i < left else "-" * (w + 1) + ":"
                for i, w in enumerate(widths)
            ]
            out.append("|" + "|".join(marks) + "|")
    return "\n".join(out)


def num(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def ratio(x: float | None, base: float | None) -> str:
    if x is None or not base:
        return "-"
    return f"{x / base:.3g}x"


def min_rate(reports: dict[int, dict[str, Any]], key: str = "msgs_per_s") -> float:
    return min(float(r[key]) for r in reports.values())


def plan_stream(senders: list[int], count: int, size: int, depth: int, **extra: Any) -> bm.Phase:
    return {
        "kind": "stream",
        "senders": senders,
        "count": count,
        "size": size,
        "depth": depth,
        **extra,
    }


def warmup(members: int, scale: Scale) -> bm.Phase:
    return plan_stream(list(range(members)), scale.warm, 1024, DEPTH)


Phases = list[dict[int, dict[str, Any]] | None]


def run_group(
    rep: Report,
    what: str,
    members: int,
    transport: str,
    plan: list[bm.Phase],
    scale: Scale,
    timeout: float = 300.0,
    stall: float = 60.0,
) -> Phases:
    """Play ``[warm-up] + plan``; per phase of ``plan``, every member's report, or None for a
    phase that did not complete (the failure is reported on stderr and fails the command)."""
    try:
        results = bm.GroupRun(members, transport, [warmup(members, scale), *plan]).run(
            timeout, stall
        )
    except Exception as exc:
        rep.failed = True
        print(f"[{what}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        results = getattr(exc, "results", None) or [{} for _ in range(len(plan) + 1)]
    return [r if len(r) == members else None for r in results[1:]]


# ------------------------------------------------------------------------------------ tables


def table_throughput(rep: Report, scale: Scale, only: set[str]) -> None:
    # Each repetition runs every system once, interleaved, so that drift in the machine's load
    # touches all of them alike; the table gives the median and the range.
    rows = [
        [
            "system",
            "configuration",
            "msgs/s (median)",
            "range",
            "ratio vs pyzmq",
            "ratio vs PySyncObj",
        ]
    ]
    order: list[tuple[str, str]] = []
    rates: dict[tuple[str, str], list[float]] = {}
    why: dict[tuple[str, str], str] = {}

    def add(key: tuple[str, str], rate: float | None, reason: str | None = None) -> None:
        if key not in rates:
            order.append(key)
            rates[key] = []
        if rate is not None:
            rates[key].append(rate)
        elif reason is not None:
            why.setdefault(key, reason)

    sync_key = zmq_key = ("", "")
    for _ in range(scale.repeats):
        for transport, n_all, n_one in (
            ("shm", scale.shm_all, scale.shm_one),
            ("tcp", scale.tcp_all, scale.tcp_one),
        ):
            # replied rows (every member replies to every call), then one-way rows (.cast)
            labels = [
                f"{kind}, {transport}, {x}, depth {DEPTH}"
                for kind in ("ordered", "ordered one-way (.cast)")
                for x in ("3 senders", "1 sender")
            ]
            plan = [
                plan_stream([0, 1, 2], n_all, 1024, DEPTH),
                plan_stream([0], n_one, 1024, DEPTH),
                plan_stream([0, 1, 2], n_all, 1024, DEPTH, one_way=True),
                plan_stream([0], n_one, 1024, DEPTH, one_way=True),
            ]
            if transport == "shm":  # each sender's whole window outstanding (WINDOW_DEPTH)
                labels += [f"{kind}, shm, 3 senders, depth {WINDOW_DEPTH} (a full window)"
                           for kind in ("ordered", "ordered one-way (.cast)")]
                plan += [plan_stream([0, 1, 2], n_all, 1024, WINDOW_DEPTH),
                         plan_stream([0, 1, 2], n_all, 1024, WINDOW_DEPTH, one_way=True)]
            keys = [("derecho_async", label) for label in labels]
            if "derecho" not in only:
                for key in keys:
                    add(key, None, "skipped (--only)")
                continue
            res = run_group(rep, f"derecho {transport}", 3, transport, plan, scale)
            for key, got in zip(keys, res, strict=True):
                add(key, None if got is None else min_rate(got), "failed")
        for w in scale.syncobj_windows:
            key = ("PySyncObj", f"Raft, 3 nodes, tcp loopback, 1 writer (leader), {w} outstanding")
            sync_key = sync_key if sync_key[0] else key
            reason = bp.missing("pysyncobj") if "pysyncobj" in only else "skipped (--only)"
            if reason is not None:
                add(key, None, reason)
                continue
            rate = rep.attempt(f"pysyncobj {w}", bp.syncobj_commits, scale.syncobj, 1024, 3, w)
            add(key, rate, "failed")
        zmq_key = ("pyzmq", "PUB -> 2 SUB processes, tcp loopback, no order, HWM off")
        reason = bp.missing("zmq") if "pyzmq" in only else "skipped (--only)"
        if reason is not None:
            add(zmq_key, None, reason)
        else:
            add(zmq_key, rep.attempt("pyzmq", bp.zmq_pubsub, scale.zmq, 1024, 2), "failed")

    def median(key: tuple[str, str]) -> float | None:
        got = sorted(rates.get(key, []))
        return statistics.median(got) if got else None

    zmq_rate, sync_base = median(zmq_key), median(sync_key)
    for name, label in (
        ("oneway_3_d32", f"ordered one-way (.cast), shm, 3 senders, depth {DEPTH}"),
        ("oneway_3_d64", f"ordered one-way (.cast), shm, 3 senders, depth {WINDOW_DEPTH} "
                         "(a full window)"),
        ("replied_3_d32", f"ordered, shm, 3 senders, depth {DEPTH}"),
    ):
        rate = median(("derecho_async", label))
        if rate is not None:
            rep.figures[name] = rate
    if zmq_rate is not None:
        rep.figures["pyzmq"] = zmq_rate
    for key in order:
        vals = rates[key]
        rate = median(key)
        if rate is None:
            rows.append([*key, why.get(key, "failed"), "-", "-", "-"])
            continue
        spread = f"{num(min(vals))}-{num(max(vals))}" if len(vals) > 1 else "-"
        if len(vals) < scale.repeats:
            spread += f" ({scale.repeats - len(vals)} failed)"
        rows.append([*key, num(rate), spread, ratio(rate, zmq_rate), ratio(rate, sync_base)])
    rep.table(
        "1. Throughput: 3 members on one host, 1 KB messages "
        f"({scale.repeats} repetition{'s' if scale.repeats > 1 else ''})",
        rows,
        "msgs/s: derecho_async, ordered calls delivered per second at the slowest member "
        "(total order + stability); in the `ordered` rows every member replies to the caller "
        "and a call completes with all replies, in the `ordered one-way (.cast)` rows nobody "
        "replies and a call completes when the caller delivers it (stable: every member holds "
        f"it). Depth: calls each sender keeps outstanding ({WINDOW_DEPTH}: its whole slot "
        "window, Config.window). PySyncObj, commits/s "
        "seen by the writer's callbacks; pyzmq, messages/s received by the slower subscriber. "
        f"Median and range of {scale.repeats} interleaved repetitions; ratios are of medians, "
        f"against the first PySyncObj row ({scale.syncobj_windows[0]} outstanding, the "
        "reference configuration) and the pyzmq row of this run.",
        left=2,
    )


def table_latency(rep: Report, scale: Scale, out: str) -> None:
    plan = [
        plan_stream([0], scale.latency, 1024, 1, keep_latencies=True),
        plan_stream([0], scale.latency, 1024, 1, keep_latencies=True, one_way=True),
    ]
    results = run_group(rep, "derecho latency", 3, "shm", plan, scale)
    rows = [["system", "configuration", "calls", "p50 µs", "p99 µs", "p99.9 µs", "mean µs"]]
    confs = (
        "ordered, shm, 3 members, 1 sender, depth 1, 1 KB",
        "ordered one-way (.cast), shm, 3 members, 1 sender, depth 1, 1 KB",
    )
    hist_note = ""
    for conf, res in zip(confs, results, strict=True):
        if res is None:
            rows.append(["derecho_async", conf, "failed", "-", "-", "-", "-"])
            continue
        lat: list[float] = res[0]["latencies_us"]
        pct = [bm.percentile(lat, q) for q in (0.5, 0.99, 0.999)]
        kind = "oneway" if "one-way" in conf else "replied"
        rep.figures[f"{kind}_p50"], rep.figures[f"{kind}_p99"] = pct[0], pct[1]
        rows.append(
            ["derecho_async", conf, str(len(lat)), *(num(p) for p in pct), num(sum(lat) / len(lat))]
        )
        if not hist_note:  # the histogram is of the replied call
            path = os.path.join(out, "latency_hist.png")
            hist_note = write_histogram(lat, pct, path, rep.command)
    rep.table(
        "2. Latency of one ordered call, closed loop",
        rows,
        "Latency: from the call to the replies of all 3 members (the call is delivered "
        "everywhere only once stable); one-way: from the call to its delivery at the caller "
        "(stable: every member holds it), no replies. " + hist_note,
        left=2,
    )


def write_histogram(lat: list[float], pct: list[float], path: str, command: str) -> str:
    try:
        import matplotlib
    except ImportError:
        return "Histogram not written: matplotlib not installed (pip install matplotlib)."
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    lo, hi = max(min(lat), 1.0), max(lat)
    bins = np.logspace(np.log10(lo), np.log10(hi * 1.01), 80)
    ax.hist(lat, bins=bins.tolist(), color="#4477aa")
    ax.set_xscale("log")
    for p, name, style in zip(pct, ("p50", "p99", "p99.9"), ("-", "--", ":"), strict=True):
        ax.axvline(p, color="#cc3311", linestyle=style, label=f"{name} {p:,.0f} µs")
    ax.set_xlabel("ordered call latency (µs, log scale)")
    ax.set_ylabel("calls")
    ax.set_title(
        f"derecho_async ordered call, shm, 3 members, depth 1, 1 KB ({os.cpu_count()} cores)"
    )
    ax.legend()
    fig.text(0.01, 0.01, command, fontsize=7, color="gray")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"Histogram: `{shown(path)}`."


def shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def memcpy_mb_s(nbytes: int, repeat: int = 5) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(max(repeat, 2)):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e6


def table_sizes(rep: Report, scale: Scale, quick: bool) -> None:
    # each size twice, interleaved: a bytes argument, then a numpy uint8 array of the same size
    plan = []
    for s in SIZES:
        plan.append(plan_stream([0, 1, 2], scale.sizes, s, DEPTH))
        plan.append(plan_stream([0, 1, 2], scale.sizes, s, DEPTH, kind="blob"))
    res = run_group(rep, "derecho sizes", 3, "shm", plan, scale)
    rows = [["size", "bytes msgs/s", "bytes MB/s", "numpy msgs/s", "numpy / bytes"]]
    for k, s in enumerate(SIZES):
        got, arr = res[2 * k], res[2 * k + 1]
        cells = [fmt_size(s)]
        cells += (["failed", "-"] if got is None
                  else [num(min_rate(got)), num(min_rate(got, "mb_per_s"))])
        cells.append("failed" if arr is None else num(min_rate(arr)))
        cells.append("-" if got is None or arr is None
                     else f"{min_rate(arr) / min_rate(got):.2f}")
        rows.append(cells)
    rep.table(
        "3a. Message sizes: ordered, shm, 3 members, all senders",
        rows,
        f"{scale.sizes} calls per sender per size and kind, depth {DEPTH}; rates at the slowest "
        "member. `bytes`: the argument is a bytes object; `numpy`: a uint8 array of the same "
        "size (copied into the slot while the call fits one, 8 KB by default; beyond that out of "
        "band on the shm data plane).",
    )
    table_large(rep, scale, quick, ("shm", "tcp"))


def table_large(
    rep: Report, scale: Scale, quick: bool, transports: tuple[str, ...], members: int = 3
) -> None:
    """Large host payloads on the data plane of each transport, beside memcpy of the size."""
    copies = {mb: rep.attempt("memcpy", memcpy_mb_s, mb << 20) for mb, _ in scale.large}
    for t, transport in enumerate(transports):
        # Each timed phase follows one unreported message of its size: pool segments and
        # receive buffers are made (and page-faulted) on first use, then reused.
        plan = [
            {"kind": "blob", "senders": [0], "count": n, "size": mb << 20, "depth": 1}
            for mb, c in scale.large
            for n in (1, c)
        ]
        blob_warm = {"kind": "blob", "senders": [0], "count": 2, "size": 1 << 20, "depth": 1}
        big = sum(mb * (c + 1) for mb, c in scale.large)
        res = run_group(
            rep,
            f"derecho large {transport}",
            members,
            transport,
            [blob_warm, *plan],
            scale,
            120.0 + big / 5,
            120.0,
        )[1:]
        rows = [
            [
                "payload",
                "messages",
                "derecho MB/s (receiver)",
                "numpy memcpy MB/s",
                "derecho / memcpy",
            ]
        ]
        for k, (mb, count) in enumerate(scale.large):
            copy = copies[mb]
            got = res[2 * k + 1]
            if got is None:
                rows.append([f"{mb} MB", str(count), "failed", num(copy), "-"])
                continue
            recv = {m: r for m, r in got.items() if m != 0}
            rate = min_rate(recv, "mb_per_s")
            rows.append([f"{mb} MB", str(count), num(rate), num(copy), ratio(rate, copy)])
        skipped = "" if not quick else " (--quick: 256 MB left out, fewer messages)"
        plane = {
            "shm": "the shm pool: written once into the sender's shared segment, copied out "
            "once by each receiver",
            "tcp": "the tcp chain: 1 MiB blocks, sender -> member 1 -> member 2, relayed as "
            "they arrive",
        }.get(transport, "host staging")
        rep.table(
            f"3{'bcdefg'[t]}. Large host payloads: one sender, {members - 1} receivers, "
            f"{transport}, vs numpy memcpy" + skipped,
            rows,
            f"derecho: numpy uint8 arrays as ordered-call arguments on {plane}; one outstanding "
            "call; MB/s delivered at the slower receiver from the phase barrier to the last "
            "delivery, after one unreported message of the same size (first-use costs: pool "
            "segments and receive buffers are created and page-faulted once, then reused). memcpy: `np.copyto` of the same size in this process, best of 5 (1 MB = "
            "2^20 B; MB/s = 10^6 B/s).",
        )


def fmt_size(s: int) -> str:
    return f"{s >> 10} KB" if s >= 1024 else f"{s} B"


def table_scaling(rep: Report, scale: Scale) -> None:
    rows = [["members", "msgs/s", "MB/s", "vs 2 members", "one-way msgs/s", "one-way vs 3"]]
    base: float | None = None
    oneway: dict[int, float] = {}
    for n in SCALING:
        plan = [plan_stream(list(range(n)), scale.scaling, 1024, DEPTH),
                plan_stream(list(range(n)), scale.scaling, 1024, DEPTH, one_way=True)]
        got, got_oneway = run_group(rep, f"derecho {n} members", n, "shm", plan, scale)
        if got_oneway is not None:
            oneway[n] = min_rate(got_oneway)
        one = [num(oneway[n]) if n in oneway else "failed",
               ratio(oneway.get(n), oneway.get(3)) if 3 in oneway else "-"]
        if got is None:
            rows.append([str(n), "failed", "-", "-", *one])
            continue
        rate = min_rate(got)
        base = rate if base is None else base
        rows.append([str(n), num(rate), num(min_rate(got, "mb_per_s")), ratio(rate, base), *one])
    if 3 in oneway and 8 in oneway:
        rep.figures["scaling_8_vs_3"] = oneway[8] / oneway[3]
    rep.table(
        "4. Scaling: ordered, shm, 1 KB, all members send",
        rows,
        f"{scale.scaling} calls per sender, depth {DEPTH}, replied and then one-way in the same "
        "group; delivered msgs/s at the slowest member (every member delivers every message). "
        f"{os.cpu_count()} cores are shared by all members.",
    )


def table_idle(rep: Report, scale: Scale) -> None:
    from idle_cpu import cpu_seconds

    from derecho_async.localrun import LocalRun

    rows = [["transport", "members", "window s", "CPU % of a core, per member"]]
    for transport in ("shm", "tcp"):

        def measure(transport: str = transport) -> tuple[float, list[float]]:
            members = 3
            run = LocalRun(members, transport, 0, 16, 1, 0, 50.0, 500.0, linger=scale.idle_s + 30)
            try:
                deadline = time.monotonic() + 30
                while len(run.views) < members and time.monotonic() < deadline:
                    run.poll(0.1)
                if len(run.views) < members:
                    raise bm.RunFailed(f"idle group did not form: {run.errors}", [])
                time.sleep(1.0)  # let start-up work settle, as idle_cpu.py does
                pids = {m: p.pid for m, p in run.procs.items()}
                before = {m: cpu_seconds(pid) for m, pid in pids.items()}
                t0 = time.monotonic()
                time.sleep(scale.idle_s)
                dt = time.monotonic() - t0
                after = {m: cpu_seconds(pid) for m, pid in pids.items()}
            finally:
                for p in run.procs.values():
                    p.kill()
                run.finish(5)
            return dt, [100 * (after[m] - before[m]) / dt for m in sorted(pids)]

        got = rep.attempt(f"idle {transport}", measure)
        if got is None:
            rows.append([transport, "3", "-", "failed"])
        else:
            dt, shares = got
            rows.append([transport, "3", f"{dt:.1f}", ", ".join(f"{s:.2f}" for s in shares)])
            rep.figures["idle_pct"] = max(rep.figures.get("idle_pct", 0.0), *shares)
    rep.table(
        "5. Idle CPU: a formed group, nothing sent, heartbeat 50 ms",
        rows,
        "User + system CPU time from /proc/<pid>/stat over the window (benchmarks/idle_cpu.py's "
        "measurement), after 1 s of settling.",
    )


# ------------------------------------------------------------------------------------- goals

# The speed goals (issue 30): (measure, machine it is set for, figure names, how the figure is
# shown, goal, floor, True when lower is better). A latency row judges p50 and p99 together.
_Goal = tuple[str, str, tuple[str, ...], str, tuple[float, ...], tuple[float, ...], bool]
GOALS: tuple[_Goal, ...] = (
    ("one-way ordered 1 KB call, 3 members, shm, closed loop: p50 / p99", "16 cores",
     ("oneway_p50", "oneway_p99"), "µs", (20, 100), (60, 200), True),
    ("replied ordered call, same: p50 / p99", "16 cores",
     ("replied_p50", "replied_p99"), "µs", (40, 150), (100, 300), True),
    ("one-way 1 KB throughput, 3 senders (depth 32), vs pyzmq PUB/SUB", "16 cores",
     ("oneway_3_d32",), "x pyzmq", (1.0,), (0.5,), False),
    ("same with 8 members, vs the 3-member rate (table 4, one-way)", "16 cores",
     ("scaling_8_vs_3",), "x", (0.7,), (0.5,), False),
    ("one-way, 3 senders, depth 64, vs pyzmq", "2 cores",
     ("oneway_3_d64",), "x pyzmq", (1.2,), (0.6,), False),
    ("replied, 3 senders, depth 32, vs pyzmq", "2 cores",
     ("replied_3_d32",), "x pyzmq", (0.6,), (0.3,), False),
    ("idle 3-member group, CPU per member (table 5, busiest member)", "any",
     ("idle_pct",), "% of a core", (1.0,), (2.0,), True),
)


def _goal_values(figures: dict[str, float], names: tuple[str, ...], unit: str) -> list[float]:
    """The figures of a goal row in its unit (throughputs as ratios to pyzmq), [] if missing."""
    if any(n not in figures for n in names):
        return []
    values = [figures[n] for n in names]
    if unit == "x pyzmq":
        if "pyzmq" not in figures:
            return []
        values = [v / figures["pyzmq"] for v in values]
    return values


def _meets(values: list[float], limits: tuple[float, ...], lower: bool) -> bool:
    return all(v <= x if lower else v >= x for v, x in zip(values, limits, strict=True))


def table_goals(rep: Report) -> None:
    """Every row of the speed goals with what this run measured and whether it meets the goal
    or the floor. Rows are set for a machine (16 or 2 cores); each row says so, and the table
    says this machine's core count."""
    rows = [["measure", "set for", "goal", "floor", "measured", "status"]]

    def show(values: tuple[float, ...] | list[float], unit: str) -> str:
        fmt = "{:.2f}" if unit.startswith("x") or unit.startswith("%") else "{:.0f}"
        return " / ".join(fmt.format(v) for v in values) + f" {unit}"

    for measure, machine, names, unit, goal, floor, lower in GOALS:
        values = _goal_values(rep.figures, names, unit)
        if not values:
            rows.append([measure, machine, show(goal, unit), show(floor, unit), "-",
                         "not measured (tables 1, 2, 4, 5 with pyzmq)"])
            continue

        status = ("goal met" if _meets(values, goal, lower) else
                  "floor met" if _meets(values, floor, lower) else "below floor")
        rows.append([measure, machine, show(goal, unit), show(floor, unit), show(values, unit),
                     status])
    rep.table(
        "Speed goals (issue 30)",
        rows,
        f"This machine has {os.cpu_count()} cores: the rows set for another machine are shown "
        "for reference. Figures from this run's tables 1, 2, 4 and 5; ratios against this "
        "run's pyzmq.",
    )


# ----------------------------------------------------------------------------------- profile


def profile(out: str, scale: Scale, command: str) -> int:
    import pstats

    prof_path = os.path.join(out, "profile.prof")
    count = scale.shm_all
    plan = [plan_stream([0, 1, 2], count, 1024, DEPTH, profile=True)]
    results = bm.GroupRun(3, "shm", [warmup(3, scale), *plan], profile=prof_path).run(300)
    rate = min_rate(results[1])
    buf = io.StringIO()
    stats = pstats.Stats(prof_path, stream=buf)
    stats.strip_dirs().sort_stats("tottime").print_stats(15)
    total = stats.total_tt  # type: ignore[attr-defined]
    cum = io.StringIO()
    pstats.Stats(prof_path, stream=cum).strip_dirs().sort_stats("cumulative").print_stats(12)
    cum_lines = [ln for ln in cum.getvalue().splitlines() if ln.strip()]
    cum_table = cum_lines[next(i for i, ln in enumerate(cum_lines) if "ncalls" in ln) :]
    text = "\n".join(
        [
            f"# cProfile (CPU time, time.process_time) of member 0, derecho_async ordered "
            f"throughput run (shm, 3 members, all senders, 1 KB, depth {DEPTH}, {count} calls "
            "per sender)",
            f"# cores: {os.cpu_count()}; command: {command}; {rate:,.0f} msgs/s under the "
            f"profiler; profiled time {total:.2f} s",
            "# top 15 by tottime (own time, excluding callees)",
            buf.getvalue().strip(),
            "",
            "# for context: top 12 by cumulative time (including callees)",
            *cum_table,
            "",
        ]
    )
    with open(os.path.join(out, "profile.txt"), "w") as f:
        f.write(text)
    with contextlib.suppress(OSError):
        os.unlink(prof_path)
    print(text)
    return 0


# ------------------------------------------------------------------------------------- main


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    versions = []
    for pkg in ("derecho_async", "pyzmq", "pysyncobj", "numpy", "uvloop"):
        try:
            versions.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{pkg} not installed")
    return (
        f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}; " + ", ".join(versions)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small runs (smoke test, ~1-2 min)")
    parser.add_argument(
        "--only",
        default=",".join(SYSTEMS),
        help="comma-separated systems to run: derecho, pyzmq, pysyncobj (default: all)",
    )
    parser.add_argument("--out", default=os.path.join(HERE, "out"), help="output directory")
    parser.add_argument(
        "--results",
        default=None,
        help="markdown file for the tables (default: OUT/results.md for a full run, "
        "none for --quick)",
    )
    parser.add_argument("--profile", action="store_true", help="profile a shm run instead")
    parser.add_argument(
        "--large",
        action="store_true",
        help="run only the large-payload tables (3b, 3c: shm and tcp data planes)",
    )
    parser.add_argument(
        "--tables",
        default="1,2,3,4,5",
        help="comma-separated tables to run: 1 throughput, 2 latency, 3 sizes and large "
        "payloads, 4 scaling, 5 idle CPU, 6 durability, 7 external clients, 8 shards (default: 1-5)",
    )
    parser.add_argument(
        "--spin-us",
        type=float,
        default=None,
        help="Config.spin_us of every derecho_async member (default: the automatic choice: "
        "200 on 8 or more cores, else 0)",
    )
    parser.add_argument(
        "--send-batch",
        type=int,
        default=None,
        help="Config.send_batch of every derecho_async member (default: automatic, 8 on 8 or "
        "more cores, else 0; 0 writes a whole window per step)",
    )
    args = parser.parse_args(argv)
    if args.spin_us is not None:
        bm.CONFIG_OVERRIDES["spin_us"] = args.spin_us
    if args.send_batch is not None:
        bm.CONFIG_OVERRIDES["send_batch"] = args.send_batch
    tables = {t.strip() for t in args.tables.split(",") if t.strip()}
    if tables - {"1", "2", "3", "4", "5", "6", "7", "8"}:
        parser.error(f"--tables: choose from 1,...,8, not {args.tables!r}")
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - set(SYSTEMS)
    if unknown:
        parser.error(f"--only: unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    scale = QUICK if args.quick else FULL
    command = shlex.join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    os.makedirs(args.out, exist_ok=True)
    if args.profile:
        return profile(args.out, scale, command)
    rep = Report(command)
    started = time.monotonic()
    rep.emit(f"## derecho_async comparison benchmarks ({'quick' if args.quick else 'full'} run)")
    rep.emit()
    rep.emit(f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}")
    rep.emit(f"- machine: {machine()}")
    rep.emit(f"- command: `{command}`")
    rep.emit()
    if args.large:
        table_large(rep, scale, args.quick, ("shm", "tcp"))
        tables = set()
    if "1" in tables:
        table_throughput(rep, scale, only)
    if "derecho" in only:
        if "2" in tables:
            table_latency(rep, scale, args.out)
        if "3" in tables:
            table_sizes(rep, scale, args.quick)
        if "4" in tables:
            table_scaling(rep, scale)
        if "5" in tables:
            table_idle(rep, scale)
    if "6" in tables:
        bench_durable.table_durability(rep, args.quick, only)
        if "derecho" in only:
            bench_durable.table_restart(rep, args.quick)
    if "7" in tables and "derecho" in only:
        bench_clients.table_clients(rep, args.quick)
    if "8" in tables and "derecho" in only:
        bench_shards.table_shards(rep, args.quick)
    if rep.figures:
        table_goals(rep)
    rep.emit(f"total time: {time.monotonic() - started:.0f} s")
    results = args.results or (None if args.quick else os.path.join(args.out, "results.md"))
    if results:
        with open(results, "w") as f:
            f.write("\n".join(rep.parts) + "\n")
        print(f"wrote {shown(results)}")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
