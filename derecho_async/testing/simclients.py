# Theory of operation
# -------------------
# The external clients of an actor schedule (actorsim.py, knob ``clients``): three clients, each
# with a fixed id and its own numbering, whose calls to SimLog go through the relay of a live
# member (``Relay.submit``, what a client's connection reaches) and are sent again, with the
# same number, through the next live member whenever the relay fails or is slow to answer
# (0.3 virtual s), sometimes through two relays at once. Their draws come from a random stream
# of their own, so schedules without clients stay as they were. Check (k) (actorcheck.py) holds
# the members to running each such call once.
"""External clients of the actor-level schedules."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from derecho_async import wire
from derecho_async.api import Group
from derecho_async.errors import GroupClosed, PartitionedError, QueueFull
from derecho_async.testing.simlog import (
    OK,
    RAISE_AFTER,
    RAISE_BEFORE,
    SURROGATE_AFTER,
    WEIRD_AFTER,
)

__all__ = ["ClientCall", "SimClients"]


@dataclass(frozen=True, slots=True)
class ClientCall:
    """One call a client makes: who, its number, what it runs, how it is sent."""

    who: int  # the client's index
    cid: int
    seq: int
    mode: int
    kind: str  # "client" (replied) or "client_cast"
    body: bytes
    doubled: bool  # a second copy at once, through another relay


class SimClients:
    """The clients of schedule ``seed`` (see the module header)."""

    def __init__(self, seed: int, p_raise: float) -> None:
        self._rng = random.Random(f"clients-calls-{seed}")
        # which exception a RAISE_AFTER call raises (a stream of its own: the draws above stay)
        self._raise_rng = random.Random(f"clients-raise-{seed}")
        self._p_raise = p_raise
        self.ids = [hashlib.sha256(b"client %d %d" % (seed, i)).digest()[:16]
                    for i in range(3)]
        self._seqs = [0, 0, 0]

    def burst(self) -> int:
        """How many client calls to make at this step (mostly none)."""
        rng = self._rng
        return rng.choice([1, 1, 3]) if rng.random() < 0.3 else 0

    def draw(self, cid: int) -> ClientCall:
        """The next client call, carrying call id ``cid``."""
        rng = self._rng
        who = rng.randrange(len(self.ids))
        seq = self._seqs[who]
        self._seqs[who] += 1
        mode = OK if rng.random() >= self._p_raise else rng.choice([RAISE_BEFORE, RAISE_AFTER])
        if mode == RAISE_AFTER:
            mode = self._raise_rng.choice([RAISE_AFTER, WEIRD_AFTER, SURROGATE_AFTER])
        kind = "client_cast" if rng.random() < 0.3 else "client"
        name = "SimLog.add.cast" if kind == "client_cast" else "SimLog.add"
        body = wire.encode_call(name, (cid, mode), {})
        return ClientCall(who, cid, seq, mode, kind, body, rng.random() < 0.3)

    async def send(self, call: ClientCall, groups: Mapping[int, Group],
                   live: set[int]) -> tuple[bool, object]:
        """Send ``call`` through live members' relays until one answers (20 virtual s at
        most): ``(True, its outcome)``, or ``(False, GroupClosed)``."""
        loop = asyncio.get_running_loop()
        attempts: list[asyncio.Future[Any]] = []
        tries = 0
        deadline = loop.time() + 20.0
        while loop.time() < deadline:
            relays = sorted(live)
            if relays:
                for k in range(2 if call.doubled and tries == 0 else 1):
                    m = relays[(call.cid + tries + k) % len(relays)]
                    with contextlib.suppress(GroupClosed, PartitionedError, QueueFull):
                        attempts.append(asyncio.ensure_future(groups[m].relay.submit(
                            self.ids[call.who], "SimLog", call.seq, call.body)))
                tries += 1
            if not attempts:
                await asyncio.sleep(0.05)
                continue
            done, _ = await asyncio.wait(attempts, timeout=0.3,
                                         return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                attempts.remove(fut)
                if not fut.cancelled() and fut.exception() is None:
                    for rest in attempts:
                        rest.cancel()  # (only this client's wait: the call may still run)
                    return True, fut.result()
        return False, GroupClosed("no relay answered")
