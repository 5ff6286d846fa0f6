"""Damage at rest to the files of a durable group of member processes over shm (issue 41, rows
7 and 8): every member is SIGKILLed mid-stream, their files are damaged, and they restart.

- Every member's log cut at half: the restart is refused at every member with ``DataLost``
  naming the gap (the frontiers the members acknowledged are kept apart from the logs), at once
  rather than after a timeout, instead of restarting silently without acknowledged calls.
- A byte flipped in member 0's log: member 0 stops with ``LogCorrupted``; members 1 and 2, an
  intact majority, restart the group without it (the lowest running member plans the restart);
  ``derecho-async repair`` cuts member 0's log at the damage and member 0 rejoins, with every
  acknowledged call at every member.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from derecho_async.transport import registry
from tests.runtime import durable_apps
from tests.runtime.test_durable_processes import N, _acked, _start, _wait_files

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml


def _fill(out: Path, group: str, seconds: float) -> dict[str, object]:
    """Run the group's stream for ``seconds``, then SIGKILL every member; the fields."""
    os.environ["DA_DURABLE_OUT"] = str(out)
    fields: dict[str, object] = dict(
        group=group, initial_members=N, transport="shm", data_dir=str(out / "data"),
        heartbeat_ms=20, suspect_after_ms=400, snapshot_every=1_000_000)
    procs = _start(durable_apps.stream, fields)
    try:
        _wait_files(out, "up", 60)
        time.sleep(seconds)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    registry.kind("shm").clean(group)
    return fields


def _segments(out: Path, group: str, member: int) -> list[Path]:
    return sorted((out / "data" / group / f"member-{member}" / "Store" / "log").glob("*.log"))


def _wait_json(path: Path, timeout: float) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} within {timeout} s")
        time.sleep(0.02)
    time.sleep(0.05)  # (written whole: json.loads fails on a torn read)
    data: dict[str, object] = json.loads(path.read_text())
    return data


def _join_all(procs: list[BaseProcess], timeout: float = 60) -> list[int | None]:
    codes = []
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    return codes


def test_logs_cut_short_at_every_member_refuse_the_restart_and_say_why(tmp_path: Path) -> None:
    group = f"cut{os.getpid()}"
    fields = _fill(tmp_path, group, 1.0)
    acked = _acked(tmp_path)
    assert len(acked) > 100, "the stream acknowledged too little to cut"
    for m in range(N):  # cut each member's log at half its bytes
        segments = _segments(tmp_path, group, m)
        sizes = [s.stat().st_size for s in segments]
        left = sum(sizes) // 2
        for seg, size in zip(segments, sizes, strict=True):
            if left >= size:
                left -= size
            elif left > 0:
                os.truncate(seg, left)
                left = 0
            else:
                seg.unlink()
    procs = _start(durable_apps.join_or_report_error, fields)
    try:
        errors = [_wait_json(tmp_path / f"error-{m}.json", 60) for m in range(N)]
    finally:
        _join_all(procs)
        registry.kind("shm").clean(group)
    print("refusals:", [(e["type"], round(float(e["seconds"]), 2)) for e in errors])  # type: ignore[arg-type]
    for e in errors:
        assert e["type"] == "DataLost", e
        assert "acknowledged calls up to" in str(e["message"]) and "Store" in str(e["message"])
        assert float(e["seconds"]) < 15, e  # type: ignore[arg-type]
    assert not any((tmp_path / f"joined-{m}.json").exists() for m in range(N))


def test_a_damaged_member_0_leaves_the_restart_to_the_majority_and_rejoins_once_repaired(
        tmp_path: Path) -> None:
    group = f"flip{os.getpid()}"
    fields = _fill(tmp_path, group, 1.0)
    acked = set(_acked(tmp_path))
    (seg,) = _segments(tmp_path, group, 0)[:1]
    data = bytearray(seg.read_bytes())
    where = len(data) * 2 // 5
    data[where] ^= 0xFF  # damage at rest, with valid records after it
    seg.write_bytes(bytes(data))
    procs = _start(durable_apps.join_or_report_error, fields)
    try:
        error = _wait_json(tmp_path / "error-0.json", 60)
        assert error["type"] == "LogCorrupted", error
        joined = [_wait_json(tmp_path / f"joined-{m}.json", 60) for m in (1, 2)]
        for j in joined:
            assert j["view"][1] == [1, 2], j  # type: ignore[index]
            assert float(j["seconds"]) < 15, j  # type: ignore[arg-type]
        print("the majority restarted in", [round(float(j["seconds"]), 2) for j in joined],  # type: ignore[arg-type]
              "s, view", joined[0]["view"])
        repaired = subprocess.run(
            [sys.executable, "-m", "derecho_async.cli", "repair",
             str(tmp_path / "data" / group / "member-0")],
            capture_output=True, text=True, timeout=60)
        assert repaired.returncode == 0, repaired.stderr
        assert "cut at offset" in repaired.stdout, repaired.stdout
        print(repaired.stdout)
        procs[0].join(10)
        procs[0:1] = _start(durable_apps.serve_until_stopped, fields, range(0, 1))
        rejoined = _wait_json(tmp_path / "joined-0.json", 60)
        assert sorted(rejoined["view"][1]) == [0, 1, 2], rejoined  # type: ignore[index]
        (tmp_path / "barrier").write_text(json.dumps([0, 1, 2]))
        reports = [_wait_json(tmp_path / f"report-{m}.json", 60) for m in range(N)]
        (tmp_path / "stop").touch()
        codes = _join_all(procs)
    finally:
        (tmp_path / "stop").touch()
        _join_all(procs)
        registry.kind("shm").clean(group)
    assert codes == [0] * N, codes
    assert len({r["digest"] for r in reports}) == 1, "the states differ"
    lost = acked - set(reports[0]["data"])  # type: ignore[call-overload]
    assert not lost, f"acknowledged calls lost: {sorted(lost)[:5]} ({len(lost)})"
