"""Notifications for a member's application: installed views and a subgroup's deliveries.

Theory of operation (docs/DESIGN.md §7.15): each ``group.views()`` iterator has a queue the group
puts every view it installs into; each ``group.subscribe(Actor)`` has a bounded backlog of that
subgroup's deliveries, taken from the dispatcher's run of deliveries before the handlers run
(so in delivery order, each once) and kept as delivered: the payload is decoded only when the
subscriber takes it. A subscriber that falls more than its ``max_backlog`` behind is dropped
with :class:`~derecho_async.errors.SubscriptionDropped`, so a slow reader never makes the member
hold more. A subscription ``since`` a version first replays the durable log after it
(``history``), then goes on with the live deliveries after the last one replayed, none twice
and none missed: its live backlog starts before the replay. When the member leaves the group,
every iterator ends after what it already holds.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from derecho_async import wire
from derecho_async.api.logged_calls import HistoryEntry, Version, entry_of, stamp_of
from derecho_async.core import View
from derecho_async.errors import SubscriptionDropped
from derecho_async.runtime.dataplane import OutOfBand

if TYPE_CHECKING:
    from derecho_async.api.durable import Durable
    from derecho_async.core import Delivered

__all__ = ["Notifier"]


class _Subscription:
    """One subscriber's backlog of a subgroup's deliveries."""

    __slots__ = ("after", "backlog", "dropped", "limit", "wake")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.backlog: deque[tuple[Version, int, bytes | OutOfBand]] = deque()  # (v, t, payload)
        self.wake = asyncio.Event()
        self.dropped: BaseException | None = None
        self.after: Version | None = None  # entries at or below it were replayed already


class Notifier:
    """The views and deliveries a member's application asked to be told of (see the module
    header); the group calls :meth:`on_view`, :meth:`on_run` and :meth:`close`."""

    def __init__(self, clock: Callable[[], int], rewire: Callable[[], None]) -> None:
        self._clock = clock
        self._rewire = rewire  # the dispatcher's run hook changes with the subscriptions
        self._view_queues: list[asyncio.Queue[View | None]] = []
        self._subs: dict[str, list[_Subscription]] = {}
        self._closed = False

    @property
    def subscribed(self) -> bool:
        """Whether any subscription wants the runs of deliveries."""
        return bool(self._subs)

    # -- the group's calls ----------------------------------------------------------------------
    def on_view(self, view: View) -> None:
        """A view was installed here."""
        for q in self._view_queues:
            q.put_nowait(view)

    def on_run(self, events: list[Delivered]) -> None:
        """A run of deliveries (before their handlers run)."""
        now = -1
        subs = self._subs
        for ev in events:
            wanting = subs.get(ev[0])
            if not wanting:
                continue
            payload = ev[6]
            if not isinstance(payload, bytes | OutOfBand):
                continue  # (the dispatcher refuses it: a protocol violation)
            at = stamp_of(payload)
            if at is None:
                if now < 0:
                    now = self._clock()
                at = now
            for sub in wanting:
                if sub.dropped is not None:
                    continue
                if len(sub.backlog) >= sub.limit:
                    sub.dropped = SubscriptionDropped(
                        f"a subscriber of {ev[0]} fell {sub.limit} deliveries behind "
                        "(max_backlog): dropped")
                    sub.backlog.clear()
                else:
                    sub.backlog.append(((ev[2], ev[3]), at, payload))
                sub.wake.set()

    def close(self) -> None:
        """This member is out of the group: every iterator ends after what it holds."""
        self._closed = True
        for q in self._view_queues:
            q.put_nowait(None)
        for subs in self._subs.values():
            for sub in subs:
                sub.wake.set()

    # -- the application's iterators (each registered when asked for, before its first step) --
    def views(self) -> AsyncIterator[View]:
        """Every view installed from now on, in order (see ``Group.views``)."""
        q: asyncio.Queue[View | None] = asyncio.Queue()
        self._view_queues.append(q)
        return self._views(q)

    async def _views(self, q: asyncio.Queue[View | None]) -> AsyncIterator[View]:
        try:
            if self._closed:
                return
            while (view := await q.get()) is not None:
                yield view
        finally:
            self._view_queues.remove(q)

    def subscribe(self, name: str, since: Version | None, durable: Durable | None,
                  max_backlog: int) -> AsyncIterator[HistoryEntry]:
        """``name``'s deliveries in order, from now on or after ``since`` (see
        ``Group.subscribe``)."""
        sub = _Subscription(max_backlog)
        self._subs.setdefault(name, []).append(sub)
        self._rewire()
        return self._deliveries(name, sub, since, durable)

    async def _deliveries(self, name: str, sub: _Subscription, since: Version | None,
                          durable: Durable | None) -> AsyncIterator[HistoryEntry]:
        try:
            if since is not None and durable is not None:
                sub.after = since
                async for entry in durable.history(name, since):
                    sub.after = entry.version
                    yield entry
            while True:
                while sub.backlog:
                    version, at, payload = sub.backlog.popleft()
                    if sub.after is not None and version <= sub.after:
                        continue  # (replayed from the log already)
                    if isinstance(payload, OutOfBand):  # its arrays as they were delivered
                        call = wire.decode_call(payload.call, buffers=list(payload.arrays))
                    else:
                        call = wire.decode_call(payload)
                    yield entry_of(version, at, *call)
                if sub.dropped is not None:
                    raise sub.dropped
                if self._closed:
                    return
                sub.wake.clear()
                await sub.wake.wait()
        finally:
            subs = self._subs[name]
            subs.remove(sub)
            if not subs:
                del self._subs[name]
            self._rewire()
