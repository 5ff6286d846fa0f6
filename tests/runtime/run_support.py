"""Helpers for tests that drive real member processes through the CLI's ``LocalRun``."""

from __future__ import annotations

import time
from collections.abc import Callable

from derecho_async.localrun import LocalRun
from derecho_async.transport.shm import ShmTransport


def wait_for(run: LocalRun, cond: Callable[[], object], timeout: float) -> None:
    """Poll ``run`` until ``cond()`` holds; fail with the run's progress after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run.poll(0.1)
        if cond():
            return
    raise AssertionError(
        f"timed out; progress {run.progress}, views {run.views}, "
        f"errors {run.errors}, reports {sorted(run.reports)}"
    )


def assert_survivors_consistent(run: LocalRun, survivors: set[int], victim: int, count: int) -> None:
    """After a member was killed: the survivors' logs are identical, in a view of their own, with
    every one of their ``count`` appends once and at most ``count`` of the victim's; no ring is
    left behind."""
    reports = [run.reports[m] for m in sorted(survivors)]
    assert len({r["digest"] for r in reports}) == 1, "survivors' logs differ"
    for r in reports:
        assert r["members"] == sorted(survivors)
        assert len(r["views"]) >= 2
        for m in survivors:
            assert r["per_sender"][m] == count, f"member {m}'s appends lost or duplicated"
        assert r["per_sender"].get(victim, 0) <= count
    assert ShmTransport.segments(run.group) == []
