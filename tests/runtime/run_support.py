"""Helpers for tests that drive real member processes through the CLI's ``_Run``."""

from __future__ import annotations

import time
from collections.abc import Callable

from derecho_async.cli import _Run


def wait_for(run: _Run, cond: Callable[[], object], timeout: float) -> None:
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
