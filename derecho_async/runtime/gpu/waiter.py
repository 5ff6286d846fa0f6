"""What hands GPU work back to the event loop from outside it: waiter threads, region owners.

Theory of operation (DESIGN.md §6.6). A :class:`Waiter` is a daemon thread that sleeps in
``cudaEventSynchronize`` (the GIL released) and wakes the loop when an event completes; it is
not a CUDA host-function callback, which would stall its stream until it got the GIL while the
loop, holding the GIL, might make a CUDA call that waits for that stream. A
:class:`RegionOwner` gives a pool region back when the array over it is garbage-collected: it
only queues the region, because a finalizer may run in a CUDA callback or inside a collection
the pool itself set off; the loop reclaims it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["RegionOwner", "Waiter"]

log = logging.getLogger("derecho_async.gpuplane")


class Waiter:
    """A daemon thread that waits for one sender's stream events, then calls back on the loop.

    It sleeps in ``cudaEventSynchronize`` (CuPy releases the GIL there) on blocking-sync events,
    so it costs no CPU while it waits. A stream stalled on a dead sender's event keeps it waiting
    for good: one parked thread per such sender, never a stalled loop.
    """

    def __init__(self, rt: Any, device: int, loop: asyncio.AbstractEventLoop) -> None:
        self._rt = rt
        self._device = device
        self._loop = loop
        self._queue: queue.SimpleQueue[tuple[int, Callable[[], None], bool] | None] = (
            queue.SimpleQueue())
        threading.Thread(target=self._run, name="derecho-gpu-waiter", daemon=True).start()

    def wait(self, event: int, fn: Callable[[], None], *, destroy: bool = True) -> None:
        """Call ``fn`` on the loop once ``event`` completes; then destroy the event unless
        ``destroy`` is false (it stays its owner's, who must not re-record it until ``fn``
        ran)."""
        self._queue.put((event, fn, destroy))

    def stop(self) -> None:
        """End the thread after the waits already queued."""
        self._queue.put(None)

    def _run(self) -> None:
        import cupy

        cupy.cuda.Device(self._device).use()
        while (item := self._queue.get()) is not None:
            event, fn, destroy = item
            try:
                self._rt.eventSynchronize(event)
                if destroy:
                    self._rt.eventDestroy(event)
            except Exception as exc:  # a broken context: wake the loop anyway
                log.debug("waiting on a copy's event: %r", exc)
            try:
                self._loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop is closed: nobody to tell
                return


class RegionOwner:
    """The object whose collection returns a pool region (see ``IpcPlane._array_over``): the
    CuPy memory over the region holds it, and its ``__del__`` queues the region for reclaiming
    (a ``__del__`` costs less per array than ``weakref.finalize``)."""

    __slots__ = ("_give_back", "_off", "_seg")

    def __init__(self, give_back: Callable[[int, int], None], seg: int, off: int) -> None:
        self._give_back = give_back
        self._seg = seg
        self._off = off

    def __del__(self) -> None:
        self._give_back(self._seg, self._off)
