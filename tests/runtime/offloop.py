"""What the off-loop copy tests of the bulk planes share: an executor that holds each copy until
the test lets it go, a wait for a condition, a call large enough to be copied off the loop, and
a view installation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np


class GatedExecutor(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor in these tests: each job waits until ``open`` is set, so a
    test can act while a copy is in flight."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self.open = threading.Event()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        def gated() -> Any:
            self.open.wait(20)
            return fn(*args, **kwargs)

        return super().submit(gated)


@contextlib.contextmanager
def gated_executor() -> Iterator[GatedExecutor]:
    """A GatedExecutor as the running loop's default executor while the block runs."""
    loop = asyncio.get_running_loop()
    gate = GatedExecutor()
    loop.set_default_executor(gate)
    try:
        yield gate
    finally:
        gate.open.set()
        gate.shutdown(wait=True)
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor())


async def wait_until(cond: Any, timeout: float = 10.0) -> None:
    """Poll until ``cond()`` holds, failing the test after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def big_call(fill: int = 7) -> Any:
    """A call whose one array (a byte string's, as it travels) is over OFF_LOOP_BYTES."""
    from derecho_async.runtime.dataplane import OFF_LOOP_BYTES, OutOfBand

    return OutOfBand(b"big", (np.full(OFF_LOOP_BYTES, fill, np.uint8),))


def view_installed(view_id: int, members: tuple[int, ...]) -> Any:
    """The ViewInstalled event of view ``view_id`` of ``members``, as a plane is told of it."""
    from derecho_async.core import View, ViewInstalled

    return ViewInstalled(View(view_id, members), (), (), True)
