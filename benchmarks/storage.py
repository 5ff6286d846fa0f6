"""The durable log's storage against SQLite in WAL mode: durable appends, and one flipped byte.

Usage: python benchmarks/storage.py [--dir DIR] [--seconds 2] [--rounds 3] [--size 1024]

Appends records of ``--size`` bytes in batches of 1, 16 and 256 with one durable write per
batch: ``Log.append`` + ``Log.sync`` (one fsync), against an SQLite table in WAL mode with
``synchronous=FULL`` and one transaction per batch (``executemany`` + ``commit``: one fsync of
the WAL). Each configuration runs for ``--seconds`` in a fresh directory under ``--dir`` (on the
disk under test: the default is benchmarks/out/storage, on the repository's disk); the two
stores alternate over ``--rounds`` rounds and the median records/s is printed, with the median
and range of the per-round ratio (the disk's speed may drift between rounds).

Then the corruption experiment: 1000 records, written in synced batches of 16, then one byte in
the middle of each store's file is flipped and the store reopened and read in full; it prints
what each reports. A byte in the middle may land in slack space, so each store is also tried
with the flipped byte inside the body of record 500. For SQLite the WAL is tried too: that of a
copy taken while the connection was open (what a crash leaves), with checkpoints off.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sqlite3
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from derecho_async.durability import Log, LogRecord
from derecho_async.errors import LogCorrupted

BATCHES = (1, 16, 256)


def _body(i: int, size: int) -> bytes:
    return (i.to_bytes(8, "little") * (size // 8 + 1))[:size]


def _log_rate(directory: Path, batch: int, size: int, seconds: float) -> float:
    log = Log.open(directory)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        log.append([LogRecord((0, n + i), time.time_ns(), _body(n + i, size))
                    for i in range(batch)])
        log.sync()
        n += batch
    elapsed = time.perf_counter() - t0
    log.close()
    return n / elapsed


def _sqlite_open(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None)
    assert db.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS log (view INTEGER, seq INTEGER, time_ns INTEGER, "
               "body BLOB)")  # rowid order is append order: SQLite's cheapest layout
    return db


def _sqlite_append(db: sqlite3.Connection, first: int, batch: int, size: int) -> None:
    db.execute("BEGIN")
    db.executemany("INSERT INTO log VALUES (?, ?, ?, ?)",
                   [(0, first + i, time.time_ns(), _body(first + i, size))
                    for i in range(batch)])
    db.execute("COMMIT")


def _sqlite_rate(directory: Path, batch: int, size: int, seconds: float) -> float:
    directory.mkdir(parents=True)
    db = _sqlite_open(directory / "log.db")
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _sqlite_append(db, n, batch, size)
        n += batch
    elapsed = time.perf_counter() - t0
    db.close()
    return n / elapsed


def _flip(path: Path, inside: bytes | None = None) -> int:
    """Flips the byte in the middle of ``path``, or in the middle of the first place it holds
    ``inside``; returns its offset."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if inside is None else data.find(inside) + len(inside) // 2
    assert at >= 0
    data[at] ^= 0xFF
    path.write_bytes(data)
    return at


def _corruption(root: Path, size: int) -> list[tuple[str, str]]:
    n, batch = 1000, 16
    results = []

    target = _body(500, size)[:64]  # in the middle of the body of record 500
    for variant, inside in (("middle of the file", None), ("inside record 500's body", target)):
        directory = root / f"log-{inside is None}"
        log = Log.open(directory)
        for first in range(0, n, batch):
            log.append([LogRecord((0, i), 0, _body(i, size))
                        for i in range(first, min(n, first + batch))])
            log.sync()
        log.close()
        (segment,) = sorted(directory.glob("*.log"))
        at = _flip(segment, inside)
        where = f"Log segment, {variant}: byte {at} of {segment.stat().st_size}"
        try:
            got = list(Log.open(directory).read())
            results.append((where, f"opened; {len(got)} of {n} records"))
        except LogCorrupted as exc:
            results.append((where, f"LogCorrupted: {exc.why}, offset {exc.offset}"))

    def sqlite_outcome(path: Path) -> str:
        try:
            db = sqlite3.connect(path)
            rows = db.execute("SELECT seq, body FROM log ORDER BY seq").fetchall()
            check = db.execute("PRAGMA integrity_check").fetchall()
            db.close()
        except sqlite3.DatabaseError as exc:
            return f"{type(exc).__name__}: {exc}"
        wrong = sum(1 for seq, body in rows if body != _body(seq, size))
        # a row whose body is wrong is data SQLite returned without noticing the damage
        verdict = "ok" if check == [("ok",)] else "; ".join(str(c[0]) for c in check[:2])
        return (f"opened, no error; {len(rows)} of {n} rows, {wrong} with a wrong body; "
                f"integrity_check: {verdict}")

    for variant, inside in (("middle of the file", None), ("inside row 500's body", target)):
        directory = root / f"db-{inside is None}"
        directory.mkdir()
        db = _sqlite_open(directory / "log.db")
        for first in range(0, n, batch):
            _sqlite_append(db, first, min(batch, n - first), size)
        db.close()
        path = directory / "log.db"
        at = _flip(path, inside)
        results.append((f"SQLite database after close, {variant}: byte {at} of "
                        f"{path.stat().st_size}", sqlite_outcome(path)))

    (root / "wal").mkdir()
    (root / "crash").mkdir()
    db = _sqlite_open(root / "wal" / "log.db")
    db.execute("PRAGMA wal_autocheckpoint=0")
    for first in range(0, n, batch):
        _sqlite_append(db, first, min(batch, n - first), size)
    for name in ("log.db", "log.db-wal"):
        shutil.copyfile(root / "wal" / name, root / "crash" / name)
    db.close()
    wal = root / "crash" / "log.db-wal"
    at = _flip(wal)
    results.append((f"SQLite WAL as a crash leaves it, middle of the file: byte {at} of "
                    f"{wal.stat().st_size}",
                    sqlite_outcome(root / "crash" / "log.db")))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path(__file__).parent / "out" / "storage")
    parser.add_argument("--seconds", type=float, default=2.0, help="per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=1024, help="bytes per record")
    args = parser.parse_args()
    root: Path = args.dir
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    print(f"# storage: {platform.node()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}, dir {root}")
    print(f"records of {args.size} B, one fsync per batch, median of {args.rounds} rounds of "
          f"{args.seconds} s\n")
    stores: dict[str, Callable[[Path, int, int, float], float]] = {
        "Log": _log_rate, "SQLite WAL FULL": _sqlite_rate}
    rates: dict[tuple[str, int], list[float]] = {}
    run = 0
    for _ in range(args.rounds):
        for batch in BATCHES:
            for name, fn in stores.items():
                run += 1
                rates.setdefault((name, batch), []).append(
                    fn(root / f"run{run}", batch, args.size, args.seconds))
                shutil.rmtree(root / f"run{run}")
    # the disk's speed drifts between rounds: the ratio is taken within each round (the two
    # stores ran back to back), then the median and range of those ratios are printed
    print("| batch | Log records/s | SQLite WAL records/s | Log / SQLite, median (range) |")
    print("|--:|--:|--:|--:|")
    for batch in BATCHES:
        ours, theirs = rates[("Log", batch)], rates[("SQLite WAL FULL", batch)]
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        print(f"| {batch} | {statistics.median(ours):,.0f} | {statistics.median(theirs):,.0f} | "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
    print("\ncorruption: one byte flipped in the middle of the file, then reopen and read all\n")
    print("| file | outcome |")
    print("|:--|:--|")
    for where, outcome in _corruption(root / "corruption", args.size):
        print(f"| {where} | {outcome} |")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
