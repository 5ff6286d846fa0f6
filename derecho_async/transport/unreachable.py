"""How loudly a transport logs a peer it cannot reach: WARNING once per interval, DEBUG between.

Theory of operation (README "Joining: what fails and how fast"; DESIGN.md §5.2, §5.3): a
joiner retries a contact that is not up for as long as ``join_timeout_s``, and every retry round
that gives up (tcp: a round of dials; shm: a ring whose consumer's doorbell stays unbound) is
reported. The first report of a peer is a WARNING, the following ones within
:data:`UNREACHABLE_LOG_S` are DEBUG; once the peer was reached, its next outage is a WARNING
again. The record is per peer, bounded: past :data:`_KEEP` peers, records older than the
interval are dropped (and all of them should every one be fresh).
"""

from __future__ import annotations

import logging
import time

__all__ = ["UNREACHABLE_LOG_S", "UnreachableLog"]

UNREACHABLE_LOG_S = 30.0
"""A peer that stays unreachable is logged at WARNING at most once per this many seconds (the
retry rounds between are logged at DEBUG)."""

_KEEP = 1024  # peers remembered before records older than the interval are pruned


class UnreachableLog:
    """When each peer was last logged unreachable at WARNING (see the module header)."""

    def __init__(self) -> None:
        self._warned: dict[int, float] = {}  # peer -> time.monotonic() of its last WARNING

    def level(self, peer: int) -> int:
        """The level to log ``peer`` being unreachable at now (WARNING is then noted)."""
        now = time.monotonic()
        last = self._warned.get(peer)
        if last is not None and now - last < UNREACHABLE_LOG_S:
            return logging.DEBUG
        if last is None and len(self._warned) >= _KEEP:
            self._warned = {p: t for p, t in self._warned.items()
                            if now - t < UNREACHABLE_LOG_S}
            if len(self._warned) >= _KEEP:  # (that many fresh outages: forget them all)
                self._warned.clear()
        self._warned[peer] = now
        return logging.WARNING

    def reached(self, peer: int) -> None:
        """``peer`` was reached: a later outage is logged at WARNING at once."""
        if self._warned:
            self._warned.pop(peer, None)
