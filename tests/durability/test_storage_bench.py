"""benchmarks/storage.py runs and prints its table and the corruption outcomes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_storage_benchmark_prints_both_tables(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "storage.py"), "--dir", str(tmp_path / "b"),
         "--seconds", "0.02", "--rounds", "1", "--size", "256"],
        capture_output=True, text=True, timeout=60, check=True)
    lines = proc.stdout.splitlines()
    assert sum(line.startswith(("| 1 |", "| 16 |", "| 256 |")) for line in lines) == 3
    outcomes = [line for line in lines if line.startswith("| Log segment")]
    assert len(outcomes) == 2 and all("LogCorrupted" in line for line in outcomes)
    assert not (tmp_path / "b").exists()
