"""Completions: GPU work on ordered streams, noticed without blocking the event loop.

Theory of operation (DESIGN.md §6.6). A :class:`Lane` is one stream whose work items complete in
order (a sending peer's copies in the CUDA IPC plane, a communicator's broadcasts in the NCCL
plane). :class:`Completions` records an event after each item and, while items complete, polls
those events from the loop (``call_soon``) for ``Config.gpu_busy_poll_us`` after the last
completion, at most once per ``Config.gpu_poll_interval_us`` while more than one item is in
flight; past that it hands the event of each busy lane's oldest item to that lane's
:class:`~.waiter.Waiter`, which wakes the loop as soon as that item is done, not the whole queue
behind it. The loop never waits on the GPU.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from derecho_async.runtime.gpu.waiter import Waiter

__all__ = ["Completions", "Lane"]

log = logging.getLogger("derecho_async.gpuplane")

_WAKE_EVENT_FLAGS = 0x1 | 0x2  # cudaEventBlockingSync | cudaEventDisableTiming: a sleeping wait


@dataclass(slots=True, eq=False)
class Lane:
    """One stream whose work items complete in order and are noticed without blocking the loop
    (a sending peer's copies in :mod:`.ipc`; a communicator's broadcasts in :mod:`.nccl`)."""

    stream: Any = None  # made by the owner (non-blocking), on first use
    # work in flight, oldest first: (event recorded after it, then, regions it writes into)
    inflight: collections.deque[tuple[int, Callable[[], None], list[tuple[int, int]]]] = field(
        default_factory=collections.deque)
    wakeup_armed: bool = False
    waiter: Waiter | None = None  # made on first need


class Completions:
    """Notices completed GPU work on :class:`Lane` streams: polled while busy, a waiter thread's
    wake-up when idle (see the module docstring). Every method runs on the event loop."""

    def __init__(self, rt: Any, device: int,
                 finished: Callable[[], None] | None = None, *,
                 busy_poll_us: float = 2000.0, poll_interval_us: float = 80.0) -> None:
        """``busy_poll_us``: how long to keep polling after the last completion before the
        waiter threads take over (0: never poll); ``poll_interval_us``: while more than one item
        is in flight, the least time between two polls (0: at every turn of the loop). Both are
        :class:`~derecho_async.config.Config` keys (``gpu_busy_poll_us``,
        ``gpu_poll_interval_us``)."""
        self._rt = rt
        self.device = device
        self._finished = finished  # called after a poll that finished work (see poll)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self._busy: dict[Lane, None] = {}  # lanes with work in flight (insertion order)
        self._spare_events: list[int] = []
        self._poll_handle: asyncio.Handle | None = None
        self._busy_since = 0.0
        self._busy_poll_s = busy_poll_us / 1e6
        # never longer than the busy poll itself (past that, waiter threads take over)
        self._poll_interval_s = min(poll_interval_us / 1e6, self._busy_poll_s)
        self._last_poll = 0.0  # when a stream of transfers was last looked at
        self._inflight = 0  # items tracked and not yet finished or forgotten, on every lane
        # Events a waiter thread sleeps on -> whether their item already finished here: one is
        # reused only once its waiter is done with it (a re-record under a sleeping wait would
        # move what that wait waits for).
        self._held: dict[int, bool] = {}

    def track(self, lane: Lane, done: Callable[[], None],
              regions: list[tuple[int, int]] | None = None) -> None:
        """Call ``done`` on the loop once everything now queued on ``lane.stream`` finished."""
        # blocking-sync, so that a waiter thread can sleep on it (see _arm)
        ev = self._spare_events.pop() if self._spare_events else int(
            self._rt.eventCreateWithFlags(_WAKE_EVENT_FLAGS)
        )
        self._rt.eventRecord(ev, lane.stream.ptr)
        if not self._busy:
            self._busy_since = time.monotonic()
        lane.inflight.append((ev, done, regions if regions is not None else []))
        self._inflight += 1
        self._busy[lane] = None
        self._arm()

    def busy(self) -> bool:
        """Whether any lane has work in flight."""
        return bool(self._busy)

    def poll(self) -> None:
        """Finish every tracked item that has completed; then, if any did, call ``finished``
        (once per poll, not per item)."""
        query = self._rt.eventQuery
        spare = self._spare_events
        finished = False
        for lane in list(self._busy):
            q = lane.inflight
            while q:
                ev, done, _ = q[0]
                if query(ev) != 0:  # cudaErrorNotReady
                    break
                q.popleft()
                if ev in self._held:
                    self._held[ev] = True
                else:
                    spare.append(ev)
                self._inflight -= 1
                finished = True
                try:
                    done()
                except Exception:  # one item's failure must not stall the others
                    log.exception("finishing completed GPU work failed")
            if not q:
                self._busy.pop(lane, None)
        if finished:
            self._busy_since = time.monotonic()
        if self._busy:
            self._arm()
        if finished and self._finished is not None:
            try:
                self._finished()
            except Exception:
                log.exception("after finishing completed GPU work")

    def forget(self, lane: Lane) -> tuple[list[tuple[int, int]], list[int]]:
        """Stop tracking ``lane``: its items will never be finished. Returns the regions they
        were writing and their events (give those back with :meth:`recycle` once the lane's
        stream has drained: see :meth:`after_stream`)."""
        self._busy.pop(lane, None)
        regions = [r for _, _, rs in lane.inflight for r in rs]
        events = [ev for ev, _, _ in lane.inflight]
        self._inflight -= len(lane.inflight)
        lane.inflight.clear()
        return regions, events

    def recycle(self, events: list[int]) -> None:
        """Reuse events of a drained stream (from :meth:`forget`)."""
        for ev in events:
            if ev in self._held:
                self._held[ev] = True
            else:
                self._spare_events.append(ev)

    def _waiter(self, lane: Lane) -> Waiter:
        if lane.waiter is None:
            lane.waiter = Waiter(self._rt, self.device, self.loop or asyncio.get_running_loop())
        return lane.waiter

    def after_stream(self, fn: Callable[[], None], lane: Lane) -> None:
        """Run ``fn`` on the loop once everything now queued on ``lane``'s stream has finished
        (by the lane's waiter thread; never, if the stream stalled for good)."""
        waiter = self._waiter(lane)
        ev = int(self._rt.eventCreateWithFlags(_WAKE_EVENT_FLAGS))
        self._rt.eventRecord(ev, lane.stream.ptr)
        waiter.wait(ev, fn)

    def _arm(self) -> None:
        if self._poll_handle is not None or self.closed:
            return
        loop = self.loop or asyncio.get_running_loop()
        self.loop = loop
        if time.monotonic() - self._busy_since < self._busy_poll_s:
            self._poll_handle = loop.call_soon(self._on_poll)
            return
        # Long work: stop spinning; let each busy stream's waiter wake us once its oldest item
        # is done (its own event: not one recorded at the stream's tail, which would hold back
        # every finished item until the last one queued is done too). Back on the loop, poll
        # finishes what is done and spins again for a while.
        for lane in self._busy:
            if not lane.wakeup_armed and lane.inflight:
                lane.wakeup_armed = True
                ev = lane.inflight[0][0]
                self._held[ev] = False

                def woken(lane: Lane = lane, ev: int = ev) -> None:
                    lane.wakeup_armed = False
                    if self._held.pop(ev):  # finished meanwhile: free to reuse
                        self._spare_events.append(ev)
                    self._busy_since = time.monotonic()
                    self.poll()

                self._waiter(lane).wait(ev, woken, destroy=False)

    def _on_poll(self) -> None:
        self._poll_handle = None
        if self._inflight > 1 and self._poll_interval_s:
            # A stream of transfers: look at most once per interval (each look queries an event
            # per busy lane, and it would run at every turn). A lone transfer, the latency
            # case, is looked at on every turn.
            now = time.monotonic()
            if now - self._last_poll < self._poll_interval_s:
                self._arm()
                return
            self._last_poll = now
        self.poll()

    def close(self) -> None:
        """Stop polling; forget everything in flight."""
        self.closed = True
        if self._poll_handle is not None:
            self._poll_handle.cancel()
            self._poll_handle = None
        self._busy.clear()
        self._inflight = 0

