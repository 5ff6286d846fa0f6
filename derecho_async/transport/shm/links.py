"""The two ends of a ring as :class:`~derecho_async.transport.shm.transport.ShmTransport` holds
them: its ring to a peer (:class:`OutLink`, it produces) and a peer's ring to it (:class:`InLink`,
it consumes). See docs/DESIGN.md §5.2.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from derecho_async.transport.shm.ring import Record, Ring

__all__ = ["InLink", "OutLink"]


@dataclass(eq=False)
class OutLink:
    """My ring to one peer (I produce)."""

    peer: int
    ring: Ring
    head: int = 0
    backlog: collections.deque[Record] = field(default_factory=collections.deque)
    enqueued: int = 0  # bytes of records ever queued on this link
    written: int = 0  # bytes of records ever written into the ring
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)
    owed: bool = False  # a doorbell must be (re)sent
    refused_since: float | None = None  # the peer's doorbell has been unreachable since
    dead: bool = False


@dataclass(eq=False)
class InLink:
    """A peer's ring to me (I consume)."""

    peer: int
    ring: Ring
    inc: int
    tail: int = 0
    alive: int = 0  # the producer's W_PALIVE count last seen
    parts: list[bytes] | None = None  # fragments of the message being reassembled
    total: int = 0
    got: int = 0
