"""The shm transport's beacon: a native thread's count in each of a member's rings.

Theory of operation (DESIGN.md §4.4, §5.2): a member's beacon thread (``hotpath.beacon_start``)
stores a growing count into the ``alive`` word (``W_PALIVE``) of every ring it produces, and the
member writes the view it installed last into each ring's ``view`` word (``W_PVIEW``). At each
tick a consumer compares both words of every ring it reads: a peer whose count moved, in the
consumer's own view, is alive whatever its event loop does. The thread stops counting once the
loop has not ticked for ``hold_s``, and dies with the process.
"""

from __future__ import annotations

from collections.abc import Iterable

from derecho_async import hotpath
from derecho_async.errors import ConfigError
from derecho_async.transport.shm.links import InLink, OutLink
from derecho_async.transport.shm.ring import W_PALIVE, W_PVIEW

__all__ = ["RingBeacon"]


class RingBeacon:
    """One member's beacon over its rings: ``period_s`` 0 means none (every call is a no-op
    and :meth:`tick` finds nobody)."""

    def __init__(self, period_s: float, hold_s: float) -> None:
        if isinstance(period_s, bool) or not isinstance(period_s, (int, float)) or not (
            period_s == 0 or 0.001 <= period_s <= 3600
        ):
            raise ConfigError("beacon_s", "0 or seconds from 0.001 to 3600", period_s)
        self.period_s = float(period_s)
        self.hold_s = float(hold_s)
        self._handle: object | None = None  # the thread (hotpath.beacon_start)
        self.view_id = 0  # the view this member installed last

    @property
    def on(self) -> bool:
        """Whether the thread runs (from :meth:`start` to :meth:`stop`)."""
        return self._handle is not None

    def start(self) -> None:
        """Start the thread (the transport starts)."""
        if self.period_s and self._handle is None:
            self._handle = hotpath.beacon_start(self.period_s, self.hold_s)

    def stop(self) -> None:
        """End the thread and unpin every ring (before they are unmapped)."""
        if self._handle is not None:
            hotpath.beacon_stop(self._handle)
            self._handle = None

    def produce(self, link: OutLink) -> None:
        """A new ring of mine: my view into it, and my count from now on."""
        link.ring.words[W_PVIEW] = self.view_id
        if self._handle is not None:
            hotpath.beacon_add(self._handle, id(link), (link.ring.mm, W_PALIVE * 8))

    def drop(self, link: OutLink) -> None:
        """A ring of mine goes (before it is unmapped): no more counting into it."""
        if self._handle is not None:
            hotpath.beacon_remove(self._handle, id(link))

    def set_view(self, view_id: int, links: Iterable[OutLink]) -> None:
        """I installed ``view_id``: every ring of mine says so."""
        if view_id > self.view_id:
            self.view_id = view_id
            for link in links:
                link.ring.words[W_PVIEW] = view_id

    def tick(self, links: Iterable[InLink]) -> list[int]:
        """The loop runs (the thread counts for ``hold_s`` from now); the producers of
        ``links`` whose count moved since the last call, in my view."""
        if self._handle is not None:
            hotpath.beacon_touch(self._handle)
        moved = []
        for inl in links:
            w = inl.ring.words
            count = w[W_PALIVE]
            if count != inl.alive:
                inl.alive = count
                if w[W_PVIEW] == self.view_id:
                    moved.append(inl.peer)
        return moved
