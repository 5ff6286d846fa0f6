"""No shared-memory litter (issue 26, finding 4), with real member processes and /dev/shm.

Survivors of a view change remove every segment owned by or paired with the members it removed,
the ring pair between two dead members included; ``derecho-async status`` tells which owners
are alive, and ``status --clean`` removes the segments of dead owners only, never those of a
live group.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from derecho_async.cli import main
from derecho_async.localrun import LocalRun
from derecho_async.transport.shm import ShmTransport
from derecho_async.transport.shm.pool import MIN_CAPACITY, create_pool_segment, pool_segments
from derecho_async.transport.shm.ring import create_ring, ring_path, ring_segments
from tests.runtime.run_support import assert_survivors_consistent, wait_for

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

BIG = (3 << 20) // 2  # 1.5 MiB payloads: they go through the shm data plane's pools


def _of(group: str, members: set[int]) -> list[str]:
    """Names of the segments of ``group`` owned by or paired with one of ``members``."""
    rings = [f"{s}.{r}" for _, s, r in ring_segments(group) if s in members or r in members]
    pools = [f"{o}.pool{k}" for _, o, k in pool_segments(group) if o in members]
    return sorted(rings + pools)


def _names(group: str) -> set[str]:
    return {os.path.basename(p) for p in ShmTransport.segments(group)}


def test_survivors_remove_every_segment_of_two_killed_members() -> None:
    # fails before issue 26: the rings between the two dead members (4 MiB each) stayed, and so
    # did the dead members' rings to the survivors until those closed
    count = 4000
    run = LocalRun(5, "shm", count, 200, 8, 5, heartbeat_ms=25, suspect_after_ms=1000,
               use_uvloop=True, linger=600.0)
    dead, survivors = {3, 4}, {0, 1, 2}
    try:
        wait_for(run, lambda: len(run.progress) == 5 and min(run.progress.values()) >= 200, 60)
        assert not run.reports, "the run ended before the kill: raise count"
        assert {"3.4", "4.3", "0.3", "3.0"} <= set(_of(run.group, dead))
        for m in sorted(dead):
            run.kill(m)
        # the survivors installed a view without either (and are still running: linger)
        wait_for(run, lambda: all(run.views.get(m, (0, []))[1] == sorted(survivors)
                                  for m in survivors), 60)
        # removed at the install, or (if a killed process was still exiting then) at the next
        # sweep of the transport, which re-probes every second
        deadline = time.monotonic() + 10
        while _of(run.group, dead) and time.monotonic() < deadline:
            run.poll(0.1)
        assert _of(run.group, dead) == []
        wait_for(run, lambda: survivors <= run.reports.keys(), 60)
        assert _of(run.group, dead) == []
        # the survivors' own rings are all still there (nothing of a live member was touched)
        assert {f"{s}.{r}" for _, s, r in ring_segments(run.group)} == {
            f"{s}.{r}" for s in survivors for r in survivors if s != r}
    finally:
        run.release()
        run.finish(15)
    assert_survivors_consistent(run, survivors, 3, count)
    assert all(run.reports[m]["per_sender"].get(4, 0) <= count for m in survivors)


@pytest.mark.parametrize("size", [200, BIG], ids=["rings", "dataplane"])
def test_status_tells_a_killed_group_is_dead_and_clean_removes_it(
    size: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # fails before issue 26: status could not tell dead owners and had no --clean
    count = 4000 if size < BIG else 64
    run = LocalRun(3, "shm", count, size, 8 if size < BIG else 2, 3, heartbeat_ms=25,
               suspect_after_ms=1000, use_uvloop=True, linger=600.0)
    group = run.group
    try:
        wait_for(run, lambda: len(run.progress) == 3 and min(run.progress.values()) >= 6, 90)
        if size == BIG:
            wait_for(run, lambda: {o for _, o, _ in pool_segments(group)} == {0, 1, 2}, 60)
        for m in range(3):
            run.kill(m)
        for p in run.procs.values():
            p.join(30)
        left = _names(group)
        assert {f"derecho_async.{group}.{s}.{r}" for s in range(3) for r in range(3) if s != r
                } <= left
        assert (size == BIG) == any(".pool" in n for n in left)
        mib = sum(os.stat(f"/dev/shm/{n}").st_size for n in left) / (1 << 20)

        assert main(["status", group]) == 0
        out = capsys.readouterr().out
        assert f"group {group}: {len(left)} segments, {mib:.1f} MiB; " \
            "owners alive: none; dead: 0, 1, 2" in out, out
        assert out.count("(dead)") == len(left)
        assert _names(group) == left  # listing removes nothing

        assert main(["status", "--clean", group]) == 0
        out = capsys.readouterr().out
        assert f"removed {len(left)} segments of dead owners 0, 1, 2: {mib:.1f} MiB" in out, out
        assert _names(group) == set()
        assert main(["status", group]) == 0
        assert f"no derecho_async shared-memory segments on this host of {group}" in \
            capsys.readouterr().out
    finally:
        run.finish(10)


def test_status_clean_never_touches_a_live_group(capsys: pytest.CaptureFixture[str]) -> None:
    # fails before issue 26: there was no --clean (and nothing could remove the dead group)
    count = 3000
    run = LocalRun(3, "shm", count, 200, 8, 3, heartbeat_ms=25, suspect_after_ms=1000,
               use_uvloop=True, linger=600.0)
    live = run.group
    dead = f"litter-{os.getpid()}"  # what a group of two killed members left: rings, a pool
    for s, r in ((5, 6), (6, 5)):
        create_ring(ring_path(dead, s, r), s, r, 64 << 10, 1).close()
    create_pool_segment(dead, 5, 0, MIN_CAPACITY).close()
    try:
        wait_for(run, lambda: len(run.progress) == 3 and min(run.progress.values()) >= 200, 60)
        assert not run.reports, "the run ended before the clean: raise count"
        before = _names(live)
        assert len(before) == 6
        at_clean = dict(run.progress)

        assert main(["status", "--clean", live, dead]) == 0
        out = capsys.readouterr().out
        assert "owners alive: 0, 1, 2; dead: none" in out, out
        assert "removed 3 segments of dead owners 5, 6" in out, out
        assert _names(dead) == set()
        assert before <= _names(live)

        # the live group goes on delivering, to the end, without a view change
        wait_for(run, lambda: len(run.reports) == 3, 90)
        assert before <= _names(live)
    finally:
        run.release()
        run.finish(15)
        ShmTransport.cleanup_group(dead)
    assert not run.errors
    assert all(run.reports[m]["delivered"] > at_clean[m] for m in range(3))
    assert len({r["digest"] for r in run.reports.values()}) == 1
    for rep in run.reports.values():
        assert rep["views"] == [0] and rep["per_sender"] == {0: count, 1: count, 2: count}


def test_status_json_clean_spares_a_live_group_and_removes_a_killed_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # fails before issue 29: status had no --json
    count = 3000
    live = LocalRun(2, "shm", count, 200, 8, 2, heartbeat_ms=25, suspect_after_ms=1000,
                use_uvloop=True, linger=600.0)
    dead = LocalRun(2, "shm", count, 200, 8, 2, heartbeat_ms=25, suspect_after_ms=1000,
                use_uvloop=True, linger=600.0)
    try:
        wait_for(live, lambda: len(live.progress) == 2 and min(live.progress.values()) >= 50, 60)
        wait_for(dead, lambda: len(dead.progress) == 2 and min(dead.progress.values()) >= 50, 60)
        for m in range(2):
            dead.kill(m)
        for p in dead.procs.values():
            p.join(30)
        left, before = _names(dead.group), _names(live.group)
        assert left and before

        assert main(["status", "--json", live.group, dead.group]) == 0
        listed = {g["group"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
        assert listed[live.group]["owners_alive"] == [0, 1]
        assert listed[dead.group]["owners_dead"] == [0, 1]
        assert {f["name"] for f in listed[dead.group]["files"]} == left
        assert {f["alive"] for f in listed[dead.group]["files"]} == {False}
        assert _names(dead.group) == left  # listing removes nothing

        assert main(["status", "--json", "--clean", live.group, dead.group]) == 0
        cleaned = json.loads(capsys.readouterr().out)
        by_group = {g["group"]: g for g in cleaned["groups"]}
        assert cleaned["clean"] is True and cleaned["removed"] == len(left)
        assert by_group[live.group]["owners_alive"] == [0, 1]
        assert by_group[live.group]["owners_dead"] == []
        assert by_group[live.group]["removed"] == []
        assert set(by_group[dead.group]["removed"]) == left
        assert _names(dead.group) == set()
        assert before <= _names(live.group)

        # the live group is unharmed: it ends in its first view with identical logs
        wait_for(live, lambda: len(live.reports) == 2, 90)
        assert before <= _names(live.group)
    finally:
        live.release()
        live.finish(15)
        dead.finish(10)
    assert not live.errors
    assert len({r["digest"] for r in live.reports.values()}) == 1
    for rep in live.reports.values():
        assert rep["views"] == [0] and rep["per_sender"] == {0: count, 1: count}
