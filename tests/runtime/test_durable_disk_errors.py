"""A member whose disk refuses writes (issue 41, row 10): under a file size limit its log's
writes fail (EFBIG: a full disk's ENOSPC takes the same path). The member logs it once, leaves
the group with ``GroupClosed`` naming the disk error (it can no longer keep ``persisted()``'s
promise) and nothing more: no error per delivery, no "Task exception was never retrieved". The
others go on, and their calls are persisted without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from derecho_async.transport import registry
from tests.runtime import durable_apps
from tests.runtime.test_durable_processes import N, _start, _wait_files

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

_RING_TOO_BIG = """
import asyncio, resource, sys, time
import derecho_async as da
from derecho_async.workload import ReplicatedLog
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
async def main():
    t0 = time.monotonic()
    try:
        await da.Group.join(da.Config(group=sys.argv[1], member_id=1, initial_members=2,
                                      transport="shm"), actors=[ReplicatedLog], timeout=30)
    except da.GroupClosed as exc:
        print(f"refused after {time.monotonic() - t0:.2f} s: {exc}")
asyncio.run(main())
"""


def test_a_member_whose_disk_fails_says_so_once_and_leaves(tmp_path: Path) -> None:
    # above the shm rings (4 MiB and a page), below what the log reaches in a second or two
    os.environ.update(DA_DURABLE_OUT=str(tmp_path), DA_FSIZE_MEMBER="2",
                      DA_FSIZE_BYTES=str((4 << 20) + (256 << 10)))
    group = f"fsize{os.getpid()}"
    fields: dict[str, object] = dict(
        group=group, initial_members=N, transport="shm", data_dir=str(tmp_path / "data"),
        heartbeat_ms=20, suspect_after_ms=400, snapshot_every=1_000_000)
    procs = _start(durable_apps.persist_until_stopped, fields)
    try:
        _wait_files(tmp_path, "up", 60)
        deadline = time.monotonic() + 60
        while not (tmp_path / "closed-2.json").exists():
            assert time.monotonic() < deadline, "member 2 did not leave"
            time.sleep(0.05)
        time.sleep(1.0)  # the others go on without it
        (tmp_path / "stop").touch()
        for p in procs:
            p.join(60)
    finally:
        (tmp_path / "stop").touch()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        registry.kind("shm").clean(group)
    closed = json.loads((tmp_path / "closed-2.json").read_text())
    assert "durable log failed" in closed["message"] and "File too large" in closed["message"]
    lines = (tmp_path / "log-2.txt").read_text().splitlines()
    errors = [line for line in lines if "durable log failed" in line]
    assert len(errors) == 1, lines[:20]
    assert not any("never retrieved" in line for line in lines), lines[:20]
    for m in (0, 1):
        done = json.loads((tmp_path / f"done-{m}.json").read_text())
        assert done["view"] == [0, 1], done
        assert done["persisted_without"] > 0, done


def test_a_file_size_limit_below_the_rings_fails_the_join_at_once() -> None:
    """Row 10: under ``RLIMIT_FSIZE`` a member logged an ERROR every 100 ms for as long as it
    tried to join (its ring to the contact could never be made); now its join fails at once,
    saying why, and says it once."""
    group = f"fsz{os.getpid()}"
    r = subprocess.run([sys.executable, "-c", _RING_TOO_BIG, group], capture_output=True,
                       text=True, timeout=60)
    registry.kind("shm").clean(group)
    assert "refused after" in r.stdout and "RLIMIT_FSIZE" in r.stdout, r.stdout + r.stderr
    took = float(r.stdout.split("refused after ")[1].split(" s")[0])
    assert took < 5, r.stdout
    assert r.stderr.count("cannot create ring") <= 1, r.stderr[-2000:]
