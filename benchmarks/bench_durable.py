"""Table 6 of benchmarks/compare.py (``--tables 6``): what durable actors (``Config.data_dir``)
cost, measured beside the same group without ``data_dir`` and beside PySyncObj with its file
journal, all in one run.

- 6a. Throughput: 3 members over shm, each sending 1 KB one-way ordered calls (``.cast``) with 32
  outstanding (table 1's one-way row), without ``data_dir`` and with it (a fresh temporary
  directory on the local disk per group). With ``data_dir`` two figures: delivered msgs/s at
  the slowest member (table 1's measure: delivery never waits for the disk), and persisted
  msgs/s (the phase's calls over the time from the barrier until the last call is persisted at
  every member, ``handle.persisted(version)``, the slowest member's view). PySyncObj (3 Raft
  nodes, tcp loopback, the leader writes with 1000 outstanding) runs with its in-memory log and
  with ``journalFile=`` per node in a fresh temporary directory.
- 6b. The ratios issue 27 sets floors and goals for, from the medians of 6a.
- 6d. Restart after total failure with 1 million logged calls (``bench_restart.py``).
- 6c. Time from a call to ``persisted()``: member 0 of the 3 makes one-way calls, each followed
  by ``await handle.persisted(version)``, in a closed loop (depth 1) and with 32 workers (depth
  32); p50/p99 of the time to delivery (the cast) and to persisted, and beside them the time of
  one 1 KB append + fsync on the same disk (the floor a persisted call pays once per flush).

The groups are the benchmark members of benchmarks/bench_members.py (spawned processes on
uvloop), as in table 1. Each repetition runs every system once, interleaved (the derecho pair in
alternating order); the tables give medians and ranges.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import bench_members as bm
import bench_peers as bp
import bench_restart

__all__ = ["FULL", "QUICK", "DurableScale", "table_durability"]

T = TypeVar("T")
DEPTH = 32
SIZE = 1024
SYNCOBJ_WINDOW = 1000  # table 1's reference PySyncObj configuration
# issue 27: (floor, goal) of each ratio
FLOOR_VS_PLAIN = (0.5, 0.8)
FLOOR_VS_SYNCOBJ = (10.0, 30.0)


@dataclass(frozen=True)
class DurableScale:
    """Message counts of table 6 (per sender)."""

    warm: int
    stream: int  # one-way calls per sender, 3 senders (6a)
    syncobj: int  # PySyncObj commits (6a)
    closed: int  # persisted calls, depth 1 (6c)
    deep: int  # persisted calls, depth 32 (6c)
    fsyncs: int  # appends + fsync of the disk probe (6c)
    repeats: int


FULL = DurableScale(
    warm=1000, stream=20000, syncobj=50000, closed=2000, deep=20000, fsyncs=500, repeats=3
)
QUICK = DurableScale(warm=100, stream=600, syncobj=4000, closed=100, deep=600, fsyncs=50, repeats=1)


class Reporter(Protocol):
    """What table 6 needs of compare.py's Report."""

    failed: bool

    def table(self, title: str, rows: list[list[str]], notes: str = "", left: int = 1) -> None: ...

    def attempt(self, what: str, fn: Callable[..., T], *args: Any) -> T | None: ...


def _num(x: float | None) -> str:  # compare.num
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _stream(senders: list[int], count: int, depth: int, **extra: Any) -> bm.Phase:
    return {"kind": "stream", "senders": senders, "count": count, "size": SIZE, "depth": depth,
            "one_way": True, **extra}


def _run(rep: Reporter, what: str, plan: list[bm.Phase], scale: DurableScale,
         data_dir: str | None) -> list[dict[int, dict[str, Any]] | None]:
    """Play a warm-up and ``plan`` on 3 shm members; per phase of ``plan`` every member's report,
    or None for a phase that did not complete (reported on stderr; the command fails)."""
    warm = {"kind": "stream", "senders": [0, 1, 2], "count": scale.warm, "size": SIZE,
            "depth": DEPTH}
    try:
        results = bm.GroupRun(3, "shm", [warm, *plan], data_dir=data_dir).run(300.0, 60.0)
    except Exception as exc:
        rep.failed = True
        print(f"[{what}] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        if os.environ.get("BENCH_TRACEBACK"):
            traceback.print_exc()
        results = getattr(exc, "results", None) or [{} for _ in range(len(plan) + 1)]
    return [r if len(r) == 3 else None for r in results[1:]]


@contextlib.contextmanager
def _fresh_dir(prefix: str) -> Any:
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def filesystem(path: str) -> str:
    """``"<fstype> on <device>"`` of the mount holding ``path`` (from /proc/mounts)."""
    best, found = "", "unknown filesystem"
    real = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, found = mnt, f"{fstype} on {dev}"
    return found


def fsync_probe(directory: str, count: int) -> list[float]:
    """µs of each of ``count`` appends of 1 KB, each followed by an fsync of the file."""
    path = os.path.join(directory, "probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        block = b"x" * SIZE
        out = []
        for _ in range(count):
            t = time.perf_counter()
            os.write(fd, block)
            os.fsync(fd)
            out.append((time.perf_counter() - t) * 1e6)
        return out
    finally:
        os.close(fd)


def syncobj_journal_missing() -> str | None:
    """Why PySyncObj cannot run with a file journal here, or None."""
    reason = bp.missing("pysyncobj")
    if reason is not None:
        return reason
    from pysyncobj import SyncObjConf

    if not hasattr(SyncObjConf(), "journalFile"):
        return "this PySyncObj has no journalFile (pip install -U pysyncobj)"
    return None


def _pct(values: list[float], q: float) -> float:
    return bm.percentile(values, q)


def table_durability(rep: Reporter, quick: bool, only: set[str]) -> None:
    scale = QUICK if quick else FULL
    keys = ("plain", "delivered", "persisted", "sync_mem", "sync_file")
    rates: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    why: dict[str, str] = {}
    closed: dict[str, list[float]] = {"delivered": [], "persisted": []}
    deep: dict[str, list[float]] = {"delivered": [], "persisted": []}
    deep_rates: list[float] = []
    plain_closed: list[float] = []
    probe: list[float] = []
    where = filesystem(tempfile.gettempdir())

    def derecho_plain() -> None:
        plan = [_stream([0, 1, 2], scale.stream, DEPTH),
                _stream([0], scale.closed, 1, keep_latencies=True)]
        got, one = _run(rep, "derecho durability, no data_dir", plan, scale, None)
        if got is not None:
            rates["plain"].append(min(r["msgs_per_s"] for r in got.values()))
            cpu["plain"].append(_cpu_per_msg(got))
        if one is not None:
            plain_closed.extend(one[0]["latencies_us"])

    def derecho_durable() -> None:
        plan = [
            _stream([0, 1, 2], scale.stream, DEPTH, persist_end=True),
            _stream([0], scale.closed, 1, persisted=True, keep_latencies=True),
            _stream([0], scale.deep, DEPTH, persisted=True, keep_latencies=True),
        ]
        with _fresh_dir("derecho-durable-") as data_dir:
            got, one, many = _run(rep, "derecho durability, data_dir", plan, scale, data_dir)
            if not probe:
                probe.extend(fsync_probe(data_dir, scale.fsyncs))
        if got is not None:
            total = sum(r["delivered"] for r in got.values()) / 3
            rates["delivered"].append(min(r["msgs_per_s"] for r in got.values()))
            rates["persisted"].append(total / max(r["persisted_elapsed"] for r in got.values()))
            cpu["delivered"].append(_cpu_per_msg(got))
        for res, into in ((one, closed), (many, deep)):
            if res is None:
                continue
            into["persisted"].extend(res[0]["latencies_us"])
            into["delivered"].extend(res[0]["delivered_us"])
        if many is not None:
            deep_rates.append(scale.deep / many[0]["calls_elapsed"])

    sync_reason = None if "pysyncobj" in only else "skipped (--only)"
    sync_reason = sync_reason or syncobj_journal_missing()
    for r in range(scale.repeats):
        if "derecho" in only:
            for run in (derecho_plain, derecho_durable)[:: 1 if r % 2 == 0 else -1]:
                run()
        if sync_reason is None:
            got_mem = rep.attempt("pysyncobj", bp.syncobj_commits, scale.syncobj, SIZE, 3,
                                  SYNCOBJ_WINDOW)
            if got_mem is not None:
                rates["sync_mem"].append(got_mem)
            with _fresh_dir("pysyncobj-journal-") as jdir:
                got_file = rep.attempt("pysyncobj journal", bp.syncobj_commits, scale.syncobj,
                                       SIZE, 3, SYNCOBJ_WINDOW, 180.0, jdir)
            if got_file is not None:
                rates["sync_file"].append(got_file)
    if "derecho" not in only:
        for k in ("plain", "delivered", "persisted"):
            why[k] = "skipped (--only)"
    if sync_reason is not None:
        why["sync_mem"] = why["sync_file"] = sync_reason

    def median(key: str) -> float | None:
        return statistics.median(rates[key]) if rates[key] else None

    conf = f"one-way (.cast), shm, 3 senders, depth {DEPTH}, 1 KB"
    sync_conf = f"Raft, 3 nodes, tcp loopback, 1 writer, {SYNCOBJ_WINDOW} outstanding"
    labels = {
        "plain": ("derecho_async", f"{conf}, no data_dir (msgs/s delivered)"),
        "delivered": ("derecho_async", f"{conf}, data_dir (msgs/s delivered)"),
        "persisted": ("derecho_async", f"{conf}, data_dir (msgs/s persisted at every member)"),
        "sync_mem": ("PySyncObj", f"{sync_conf}, log in memory (commits/s)"),
        "sync_file": ("PySyncObj", f"{sync_conf}, journalFile per node (commits/s)"),
    }
    plain = median("plain")
    rows = [["system", "configuration", "msgs/s (median)", "range", "CPU µs/msg, 3 members",
             "vs no data_dir"]]
    for k in keys:
        med = median(k)
        if med is None:
            rows.append([*labels[k], why.get(k, "failed"), "-", "-", "-"])
            continue
        vals = rates[k]
        spread = f"{_num(min(vals))}-{_num(max(vals))}" if len(vals) > 1 else "-"
        if len(vals) < scale.repeats:
            spread += f" ({scale.repeats - len(vals)} failed)"
        per_msg = _num(statistics.median(cpu[k])) if cpu.get(k) else "-"
        vs = f"{med / plain:.3g}x" if plain and k in ("delivered", "persisted") else "-"
        rows.append([*labels[k], _num(med), spread, per_msg, vs])
    rep.table(
        "6a. Durability: throughput with and without data_dir, beside PySyncObj's journal "
        f"({scale.repeats} repetition{'s' if scale.repeats > 1 else ''})",
        rows,
        f"derecho_async: 3 member processes over shm, each sending {scale.stream} one-way calls "
        f"of 1 KB, {DEPTH} outstanding. `delivered`: msgs/s delivered at the slowest member, "
        "from the phase barrier to its last delivery (table 1's measure; delivery does not wait "
        "for the disk). `persisted`: the phase's messages over the time from the barrier until "
        "the last one is durable (fsynced) at every member (`handle.persisted(version)`, the "
        f"slowest member's view). data_dir: a fresh temporary directory per group ({where}). "
        "CPU µs/msg: user + system CPU of the three member processes (their log threads "
        "included) per message delivered, from the barrier to the last delivery. PySyncObj: "
        f"{scale.syncobj} commits, commits/s seen by the leader's callbacks; `journalFile`: "
        "each node's Raft log in a file of a fresh temporary directory (PySyncObj writes its "
        "journal through mmap and does not fsync or msync it per entry, so its commits are not "
        "on the disk when they complete, where a derecho_async call that is persisted is). "
        f"Median and range of {scale.repeats} interleaved repetitions.",
        left=2,
    )

    def ratio_row(what: str, x: float | None, base: float | None,
                  bounds: tuple[float, float]) -> list[str]:
        if x is None or not base:
            return [what, "-", f"{bounds[0]:g}x", f"{bounds[1]:g}x", "not measured"]
        v = x / base
        verdict = ("meets the goal" if v >= bounds[1] else
                   "meets the floor, short of the goal" if v >= bounds[0] else
                   "BELOW THE FLOOR")
        return [what, f"{v:.3g}x", f"{bounds[0]:g}x", f"{bounds[1]:g}x", verdict]

    delivered, persisted, sync_file = median("delivered"), median("persisted"), median("sync_file")
    rep.table(
        "6b. Durability: ratios of 6a against issue 27's floors and goals",
        [
            ["ratio (medians of 6a)", "measured", "floor", "goal", "verdict"],
            ratio_row("data_dir / no data_dir, delivered", delivered, plain, FLOOR_VS_PLAIN),
            ratio_row("data_dir / no data_dir, persisted", persisted, plain, FLOOR_VS_PLAIN),
            ratio_row("data_dir persisted / PySyncObj journalFile", persisted, sync_file,
                      FLOOR_VS_SYNCOBJ),
            ratio_row("data_dir delivered / PySyncObj journalFile", delivered, sync_file,
                      FLOOR_VS_SYNCOBJ),
        ],
    )

    rows = [["configuration", "calls", "delivery p50 µs", "delivery p99 µs",
             "persisted p50 µs", "persisted p99 µs", "persisted p99.9 µs", "persisted calls/s"]]
    if plain_closed:
        rows.append(["no data_dir, closed loop, depth 1", str(len(plain_closed)),
                     _num(_pct(plain_closed, 0.5)), _num(_pct(plain_closed, 0.99)),
                     "-", "-", "-", "-"])
    for label, lat, rate in (
        ("data_dir, closed loop, depth 1", closed, None),
        (f"data_dir, stream, depth {DEPTH}", deep,
         statistics.median(deep_rates) if deep_rates else None),
    ):
        per, dl = lat["persisted"], lat["delivered"]
        if not per:
            rows.append([label, why.get("persisted", "failed"), *["-"] * 6])
            continue
        rows.append([
            label, str(len(per)), _num(_pct(dl, 0.5)), _num(_pct(dl, 0.99)),
            _num(_pct(per, 0.5)), _num(_pct(per, 0.99)), _num(_pct(per, 0.999)),
            _num(rate if rate is not None else len(per) / (sum(per) / 1e6)),
        ])
    if probe:
        rows.append(["1 KB append + fsync, same disk, no group (in the persisted columns)",
                     str(len(probe)), "-", "-", _num(_pct(probe, 0.5)), _num(_pct(probe, 0.99)),
                     _num(_pct(probe, 0.999)), "-"])
    rep.table(
        "6c. Durability: time from a one-way call to persisted()",
        rows,
        "derecho_async, 3 members over shm with data_dir, member 0 the only sender of 1 KB "
        "one-way calls; each call is `version = await kv.put.cast(...)` then `await "
        "kv.persisted(version)`, and the same worker's next call starts after that. Delivery: "
        "until the cast resolves (delivered at the caller, stable; the first row is the same "
        "closed loop in the group without data_dir, casts only); persisted: until persisted() "
        "resolves (fsynced at all 3 members); percentiles of all repetitions' calls pooled. "
        f"Persisted calls/s: depth 1, calls over their summed times; depth {DEPTH}, the "
        "phase's calls over the time from the barrier to the last one persisted. Last row: "
        f"{scale.fsyncs} appends of 1 KB to a file in the group's data_dir, each followed by "
        "os.fsync, in the parent process with no group running.",
        left=1,
    )


def table_restart(rep: Reporter, quick: bool) -> None:
    """6d: a 3-member group restarting after a total failure with many logged calls."""
    calls = 30_000 if quick else 1_000_000
    got = rep.attempt(f"restart after {calls:,} calls", bench_restart.restart_after_total_failure,
                      calls)
    rows = [["logged calls", "on disk, 3 members", "fill s", "restart s (spawn to all in view)",
             "Group.join s (slowest member)", "view"]]
    if got is None:
        rows.append([f"{calls:,}", *["failed"] * 5])
    else:
        rows.append([f"{calls:,}", f"{got['on_disk_mb']:,.0f} MiB", f"{got['fill_s']:.1f}",
                     f"{got['restart_s']:.2f}", f"{got['join_s']:.2f}", str(got["view"])])
    rep.table(
        "6d. Durability: restart after total failure",
        rows,
        "derecho_async, 3 members over shm with data_dir (snapshot_every 10,000), 3 senders of "
        "1 KB one-way calls (64 in flight, keys cycling over 1,000) until the calls are "
        "persisted at every member; every member SIGKILLed at once; the three restarted from "
        "their files. Restart: from spawning the three processes to the last one in the new "
        "view (Python start-up and imports included); Group.join: the same inside each member "
        "(restoring the newest snapshot, replaying the log after it, the restart rule and the "
        "new view). Command alone: python benchmarks/bench_restart.py --calls N.",
        left=1,
    )


def _cpu_per_msg(got: dict[int, dict[str, Any]]) -> float:
    delivered = int(max(r["delivered"] for r in got.values()))
    return float(sum(r["cpu_s"] for r in got.values())) / max(delivered, 1) * 1e6
