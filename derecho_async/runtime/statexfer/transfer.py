"""Both ends of one member's state transfer, wired to its driver: :class:`StateTransfer`.

Theory of operation: the driver hands this object the STATE_* channel messages, the landings
and failures of data keys with :data:`.wire.STATE_TAG`, and every core event but deliveries;
:class:`Group` asks it for the ticket of each Welcome and awaits :meth:`restored`. It routes
each to the :class:`Sponsor` (transfers this member sponsors) or the :class:`Joiner` (the one
that brings this member its state), keeps the few state messages that arrive before this member
has a view, and runs one timer for stalls and progress lines. See docs/DESIGN.md §7.7.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from derecho_async.core import Evicted, Left, Partitioned, ViewInstalled
from derecho_async.runtime.statexfer.context import Context, ReplicatedTable, StateLog
from derecho_async.runtime.statexfer.joiner import Joiner
from derecho_async.runtime.statexfer.sponsor import Sponsor
from derecho_async.runtime.statexfer.wire import split_msg_no
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.api.actor import Actor
    from derecho_async.runtime.driver import Driver
    from derecho_async.runtime.observer import GroupObserver
    from derecho_async.runtime.runner import SerialRunner

__all__ = ["StateTransfer"]

_MAX_EARLY = 16  # state messages kept while this member has no view yet
_TICK_S = 1.0


class StateTransfer:
    """Both ends of state transfer for one member (see the module docstring)."""

    def __init__(
        self,
        driver: Driver,
        actors: Mapping[str, Actor],
        runners: Mapping[str, SerialRunner],
        observer: GroupObserver | None = None,
        state_log: StateLog | None = None,
        tables: Mapping[str, ReplicatedTable] | None = None,
    ) -> None:
        self.driver = driver
        self.ctx = Context(driver, actors, runners, observer, self._tick_soon, state_log,
                           tables)
        #: the transfers this member sponsors
        self.sponsor = Sponsor(self.ctx)
        #: the transfer that brings this member its state (if it joined a running group)
        self.joiner = Joiner(self.ctx)
        self._in_view = False
        self._early: list[tuple[int, list[Any]]] = []
        self._ticker: asyncio.TimerHandle | None = None
        self._closed = False
        driver.statexfer = self
        for kind in (env.STATE_BEGIN, env.STATE_READY, env.STATE_ACK, env.STATE_ABORT):
            driver.receivers[kind] = self.receive

    @property
    def chunk_hook(self) -> Callable[[int, Any], Any] | None:
        """Test hook: ``hook(index, chunk) -> chunk``, applied at the sponsor after hashing."""
        return self.sponsor.chunk_hook

    @chunk_hook.setter
    def chunk_hook(self, hook: Callable[[int, Any], Any] | None) -> None:
        self.sponsor.chunk_hook = hook

    async def restored(self) -> None:
        """Return once this member's state is restored (at once for a founding member, whose
        first view carries no ticket); :class:`GroupClosed` naming why it failed."""
        await self.joiner.restored()

    def ticket(self, view_id: int, joiner: int) -> bytes | None:
        """The state of a Welcome of view ``view_id`` to ``joiner``: a ticket for a transfer that
        starts now (the fence goes into every runner), or None while one to ``joiner`` runs."""
        if self._closed:
            return None
        return self.sponsor.ticket(view_id, joiner)

    # -- messages and events -------------------------------------------------------------------
    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        """A STATE_* channel message (the driver's receiver for those kinds)."""
        if self._closed:
            return
        if not self._in_view:
            if len(self._early) < _MAX_EARLY:
                self._early.append((sender, msg))
            return
        self._dispatch(sender, msg)

    def _dispatch(self, sender: int, msg: list[Any]) -> None:
        kind = msg[0]
        if kind == env.STATE_BEGIN:
            self.joiner.on_begin(sender, msg)
            return
        if kind == env.STATE_ABORT and self.joiner.on_abort(sender, msg[1], msg[2]):
            return
        self.sponsor.receive(kind, sender, msg)

    def landed(self, key: tuple[int, int, int], payload: object) -> None:
        """A state chunk landed here (the driver routes keys with :data:`.wire.STATE_TAG`)."""
        self.joiner.landed(key, payload)

    def on_event(self, event: object) -> None:
        """Every core event but deliveries, in order (the driver calls this after the host)."""
        if isinstance(event, ViewInstalled):
            first = not self._in_view
            self._in_view = True
            self.ctx.view = event.view
            members = set(event.view.members)
            if first and event.state is not None:
                if self.joiner.expect(event):
                    early, self._early = self._early, []
                    for sender, msg in early:
                        self._dispatch(sender, msg)
            elif first:
                self._early.clear()
            if not first:
                self.joiner.on_view(members, event.view.view_id)
            self.sponsor.on_view(members, event.view.view_id)
        elif isinstance(event, Evicted | Left | Partitioned):
            why = type(event).__name__.lower()
            self.joiner.fail(f"this member is out of the group ({why})")
            self.sponsor.abort_all(f"the sponsor is out of the group ({why})", tell=False)

    def landing_failed(self, key: tuple[int, int, int], exc: BaseException) -> None:
        """A state chunk could not land here: the join fails if it was this member's."""
        xfer_id, index = split_msg_no(key[2])
        self.joiner.landing_failed(xfer_id, index, key[1], exc)

    def staging_failed(self, key: tuple[int, int, int], exc: BaseException) -> None:
        """A state chunk could not be sent from here: its transfer is aborted."""
        xfer_id, index = split_msg_no(key[2])
        self.sponsor.staging_failed(xfer_id, index, exc)

    def close(self) -> None:
        """This member closes: every transfer ends, the joiner's with a failed join."""
        self._closed = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        self.sponsor.abort_all("this member closed", tell=True)
        self.joiner.fail("this member closed")

    # -- stall detection and progress ---------------------------------------------------------
    def _tick_soon(self) -> None:
        if self._ticker is None and not self._closed:
            self._ticker = self.ctx.loop.call_later(_TICK_S, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        now = self.ctx.now()
        self.sponsor.tick(now)
        self.joiner.tick(now)
        if self.sponsor.transfers or self.joiner.active():
            self._tick_soon()
