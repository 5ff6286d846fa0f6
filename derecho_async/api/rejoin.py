"""A member restarted with its files rejoins a running group with the calls its files lack.

Theory of operation (docs/DESIGN.md §7.14): a member that starts with files holds, in its
actors, everything its files hold. Until it is in a view it sends its RECOVER_INFO (how far each
subgroup's log reaches) to every member of its last view (:mod:`.restart`); a running member
keeps the latest such *offer* per member, and claims it when a view admits that member (if it
is at most :data:`_FRESH_S` old). The sponsor of its join, once its runners are fenced, asks :meth:`LogSuffixes.suffixes` for each offered subgroup's calls
after that version and before the joiner's view. Where its own log holds that version and
what follows is short (``snapshot_every`` calls, :data:`_MAX_BYTES`), those calls travel in the
state transfer instead of the actor's snapshot; anything else falls back to the snapshot. The
joiner's :meth:`LogSuffixes.apply` checks that each suffix begins where its own files end,
runs the calls on its actors, and its base snapshot then makes them durable as any joiner's
state is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from derecho_async.api.logged_calls import version_from_wire

if TYPE_CHECKING:
    from derecho_async.api.durable import Durable
    from derecho_async.api.logged_calls import Version

__all__ = ["LogSuffixes"]

_FRESH_S = 1.0
"""An offer older than this when its member is admitted is not used (a restarting member
repeats it every 0.1 s until then)."""
_MAX_BYTES = 64 << 20
"""Bytes of calls, at most, a suffix carries instead of a snapshot."""
_MAX_OFFERS = 64
"""Offers kept at once (they come from strangers too: bounded)."""


class LogSuffixes:
    """Both ends of log-suffix rejoins for one durable member (see the module header); the
    state transfer's ``StateLog``."""

    def __init__(self, durable: Durable, max_calls: int) -> None:
        self._durable = durable
        self._max_calls = max_calls
        self._offers: dict[int, tuple[float, dict[str, Version]]] = {}
        self._claimed: dict[int, dict[str, Version]] = {}  # joiners of the view installed last

    def offered(self, member: int, durable: list[Any]) -> None:
        """``member`` restarting with files says how far they reach: the rows of its
        RECOVER_INFO, ``[subgroup, view_id, seq + 1, ...]`` (validated by the envelope)."""
        if member not in self._offers and len(self._offers) >= _MAX_OFFERS:
            self._offers.pop(next(iter(self._offers)))
        versions = {}
        for name, view_id, seq1, *_acked in durable:
            version = version_from_wire(view_id, seq1)
            if version is not None:
                versions[name] = version
        self._offers[member] = (asyncio.get_running_loop().time(), versions)

    def joined(self, members: Iterable[int]) -> None:
        """A view was installed that these members joined: a fresh offer of theirs is what a
        sponsor of that view uses; older ones are spent."""
        now = asyncio.get_running_loop().time()
        self._claimed = {}
        for m in members:
            offer = self._offers.pop(m, None)
            if offer is not None and now - offer[0] <= _FRESH_S:
                self._claimed[m] = offer[1]

    async def suffixes(self, joiner: int, view_id: int) -> dict[str, object]:
        """At a fenced sponsor: per subgroup, ``[view_id, seq, calls]`` for ``joiner`` of view
        ``view_id`` (the calls after that version, packed), where a suffix can stand for the
        snapshot."""
        offer = self._claimed.pop(joiner, None)
        if offer is None:
            return {}
        out: dict[str, object] = {}
        for name, since in offer.items():
            data = await self._durable.log_suffix(name, since, view_id, self._max_calls,
                                                  _MAX_BYTES)
            if data is not None:
                out[name] = [since[0], since[1], data]
        return out

    async def apply(self, suffixes: object) -> dict[str, int]:
        """At the joiner: run each subgroup's suffix on its actor; the calls run per subgroup.
        ValueError saying why a suffix cannot be used (the join fails)."""
        if not isinstance(suffixes, dict):
            raise ValueError("the log suffixes are not a map")
        done = {}
        for name, entry in suffixes.items():
            if not (isinstance(name, str) and isinstance(entry, list | tuple) and len(entry) == 3
                    and type(entry[0]) is int and type(entry[1]) is int
                    and isinstance(entry[2], bytes)):
                raise ValueError(f"the log suffix of {name!r} is malformed")
            done[name] = await self._durable.replay_suffix(name, (entry[0], entry[1]), entry[2])
        return done
