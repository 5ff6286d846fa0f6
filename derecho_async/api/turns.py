"""Calls waiting for room at a member, handed out in turns: one call of each waiting lane.

Theory of operation (docs/DESIGN.md §7.6): a call that finds no room (backpressure) waits in
its lane: this member's own calls in :data:`OWN`, each external client's connection in a lane of
its own (a call forwarded here: its client's). Lanes that hold calls take turns: the lane whose
turn it is gives its oldest call and, if it holds more, goes to the back of the turns; a lane
that had none joins at the back. So each lane's calls keep their order, and a call waits behind
at most one call of each other lane per call ahead of it in its own, however many calls another
lane holds. With one lane (a member without clients) this is the plain FIFO it replaces.

The queue counts its calls and their weight (encoded size plus a fixed overhead), so the
caller bounds them, and drops a lane's calls at once (its connection closed).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Final

from derecho_async.runtime.dataplane import OutOfBand

__all__ = ["OVERHEAD", "OWN", "Parked", "Turns"]

OWN: Final = None
"""The lane of this member's own calls."""
OVERHEAD: Final = 256
"""Bytes a waiting call weighs beyond its encoding."""


@dataclass(slots=True)
class Parked:
    """An encoded call waiting for room: sent in its lane's order, in its lane's turn."""

    subgroup: str
    payload: bytes | OutOfBand
    size: int
    future: asyncio.Future[Any]
    one_way: bool
    lane: Hashable = OWN

    @property
    def weight(self) -> int:
        """What it weighs while it waits (against ``max_queued_mb``)."""
        return self.size + OVERHEAD


class Turns:
    """Waiting calls by lane, handed out in turns (see the module header)."""

    __slots__ = ("_lanes", "_order", "bytes", "count")

    def __init__(self) -> None:
        self._lanes: dict[Hashable, deque[Parked]] = {}  # lanes holding calls, oldest first
        self._order: deque[Hashable] = deque()  # the same lanes: whose turn it is first
        self.count = 0
        """Calls waiting."""
        self.bytes = 0
        """Their weight."""

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Parked]:
        for calls in self._lanes.values():
            yield from calls

    def push(self, call: Parked) -> None:
        """``call`` waits last in its lane."""
        lane = call.lane
        calls = self._lanes.get(lane)
        if calls is None:
            calls = self._lanes[lane] = deque()
            self._order.append(lane)
        calls.append(call)
        self.count += 1
        self.bytes += call.weight

    def head(self) -> Parked:
        """The call whose turn it is (the queue must hold one)."""
        return self._lanes[self._order[0]][0]

    def pop(self) -> Parked:
        """Take the call whose turn it is; its lane goes to the back of the turns."""
        lane = self._order[0]
        calls = self._lanes[lane]
        call = calls.popleft()
        if calls:
            self._order.rotate(-1)
        else:
            self._order.popleft()
            del self._lanes[lane]
        self.count -= 1
        self.bytes -= call.weight
        return call

    def drop(self, lane: Hashable) -> list[Parked]:
        """Take every call of ``lane`` (none: an empty list)."""
        calls = self._lanes.pop(lane, None)
        if calls is None:
            return []
        self._order.remove(lane)
        self.count -= len(calls)
        self.bytes -= sum(call.weight for call in calls)
        return list(calls)

    def clear(self) -> list[Parked]:
        """Take every call."""
        calls = list(self)
        self._lanes.clear()
        self._order.clear()
        self.count = self.bytes = 0
        return calls
