# Theory of operation
# -------------------
# The stall faults of the actor schedules (actorsim.py): now and then a live member is stalled
# for 2, 3 or 5 suspicion timeouts (``SimNetwork.stall``: its links held both ways while its
# simulated beacon still reaches its peers), at most one at a time. Every draw comes from the
# schedule's own stall generator, so schedules without stalls replay as before. A stall that
# another fault touched (a partition under way or begun, any leave, its member's crash) is not
# judged; at the end of any other, the live members whose view no longer holds the member
# (itself included, if it was removed) are recorded for check (l).
"""Stall faults of the actor-level schedules: start, touch, end and record."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from derecho_async.testing.simnet import SimNetwork

__all__ = ["Stalls"]

P_STALL = 0.08  # the chance of a stall at each schedule step without one
LENGTHS = (2, 3, 5)  # suspicion timeouts a stall lasts


class Stalls:
    """The stall under way (none, or one member until a virtual time) and what touched it.

    ``record`` gets ``(member, end time, missing)`` for each judged stall; ``say`` logs to the
    schedule's log."""

    def __init__(self, net: SimNetwork, rng: random.Random, on: bool, suspect_s: float,
                 say: Callable[[str], None], record: list[tuple[int, float, list[int]]]) -> None:
        self.net = net
        self.rng = rng
        self.on = on
        self.suspect_s = suspect_s
        self.say = say
        self.record = record
        self.member: int | None = None
        self.until = 0.0
        self.touched = False

    def touch(self, member: int | None = None) -> None:
        """Another fault touched the stall under way (of ``member``; None: whoever's)."""
        if self.member is not None and (member is None or member == self.member):
            self.touched = True

    def step(self, now: float, live: set[int], partitioned: bool,
             view_of: Callable[[int], Sequence[int]], refresh: Callable[[], None]) -> None:
        """At a schedule step: end the stall if it is due, then maybe start one."""
        if self.member is not None and now >= self.until:
            self.end(now, live, view_of, refresh)
        if self.on and self.member is None and live and self.rng.random() < P_STALL:
            self.member = self.rng.choice(sorted(live))
            self.until = now + self.rng.choice(LENGTHS) * self.suspect_s
            self.touched = partitioned
            self.net.stall(self.member)
            self.say(f"stall {self.member}")

    def end(self, now: float, live: set[int], view_of: Callable[[int], Sequence[int]],
            refresh: Callable[[], None]) -> None:
        """End the stall under way, if any, and record it unless another fault touched it."""
        member = self.member
        if member is None:
            return
        self.net.unstall(member)
        self.say(f"unstall {member}")
        if not self.touched:
            refresh()
            missing = [m for m in sorted(live | {member})
                       if m not in live or member not in view_of(m)]
            self.record.append((member, now, missing))
        self.member = None
