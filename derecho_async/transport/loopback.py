# Theory of operation
# -------------------
# An in-process transport family for tests and embedding. A ``LoopbackFabric`` is a registry of
# ``LoopbackTransport`` endpoints keyed by member id. A push or message is copied once at the
# sender (the caller may reuse its buffer right away) and scheduled on the receiver's event loop
# with ``call_soon`` (``call_soon_threadsafe`` when the receiver runs another loop). Callbacks
# run in the order they were scheduled, so every (sender, receiver) link is FIFO across pushes
# and messages. Traffic for an endpoint that exists but has not started yet is kept and replayed
# when it starts. Sending to an endpoint that does not exist or was closed reports
# ``on_failure`` at the sender (from a loop callback, never re-entrantly). Incoming pushes go
# through the same ``PushGate`` as the real transports, so validation behaves identically.
"""In-process loopback transport: deterministic FIFO delivery through the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from derecho_async.errors import UsageError
from derecho_async.transport.base import Transport, TransportHandler, check_member_id, log

if TYPE_CHECKING:
    from derecho_async.config import Config

__all__ = ["LoopbackFabric", "LoopbackTransport", "fabric_of", "from_config", "use_fabric"]


class LoopbackFabric:
    """Creates and connects :class:`LoopbackTransport` endpoints of one in-process group."""

    def __init__(self) -> None:
        self._members: dict[int, LoopbackTransport] = {}

    def transport(self, member_id: int) -> LoopbackTransport:
        """A new endpoint for ``member_id`` on this fabric (ids are unique while open)."""
        return LoopbackTransport(self, member_id)

    @property
    def members(self) -> tuple[int, ...]:
        """Ids of the endpoints currently registered (not closed)."""
        return tuple(sorted(self._members))

    def _register(self, t: LoopbackTransport) -> None:
        if t.member_id in self._members:
            raise UsageError(f"member {t.member_id} already exists on this fabric")
        self._members[t.member_id] = t

    def _unregister(self, t: LoopbackTransport) -> None:
        if self._members.get(t.member_id) is t:
            del self._members[t.member_id]

    def _lookup(self, member_id: int) -> LoopbackTransport | None:
        return self._members.get(member_id)


class LoopbackTransport(Transport):
    """One member's endpoint on a :class:`LoopbackFabric`; make it with ``fabric.transport(id)``."""

    def __init__(self, fabric: LoopbackFabric, member_id: int) -> None:
        super().__init__(member_id)
        self._fabric = fabric
        self._early: list[Callable[[], None]] = []
        fabric._register(self)

    async def start(self, handler: TransportHandler) -> None:
        """Start delivering to ``handler``; replays traffic that arrived before."""
        loop = self._begin_start(handler)
        early, self._early = self._early, []
        for fn in early:
            loop.call_soon(fn)

    def add_peer(self, member_id: int, address: object) -> None:
        """Nothing to learn: every endpoint of the fabric is reachable by id."""
        check_member_id(member_id)

    def push(
        self, view_id: int, offset: int, data: bytes | memoryview, targets: Sequence[int]
    ) -> None:
        """Schedule ``data`` for table offset ``offset`` of ``view_id`` at every target."""
        mv, remote = self._check_push(view_id, offset, data, targets)
        if not remote:
            return
        copy = bytes(mv)
        me = self.member_id

        def arrive(r: LoopbackTransport) -> None:
            r._gate.push_arrived(view_id, me, offset, copy)

        for t in remote:
            self._post(t, arrive)

    def send(self, to: int, payload: bytes) -> None:
        """Schedule ``payload`` for ``to``'s ``on_message``."""
        self._check_usable()
        check_member_id(to, "to")
        if to == self.member_id:
            self._send_to_self(payload)
            return
        copy = bytes(payload)
        me = self.member_id
        self._post(to, lambda r: r._deliver_message(me, copy))

    async def drain(self) -> None:
        """Loopback hands everything to the event loop at once: nothing to wait for."""
        self._check_usable()
        await asyncio.sleep(0)

    async def close(self) -> None:
        """Leave the fabric; traffic already scheduled for this endpoint is discarded."""
        if self._closed:
            return
        self._closed = True
        self._fabric._unregister(self)
        self._early.clear()
        self._gate.clear()

    def _post(self, to: int, action: Callable[[LoopbackTransport], None]) -> None:
        target = self._fabric._lookup(to)
        assert self._loop is not None
        if target is None or target._closed:
            reason = f"member {to} is not reachable on this loopback fabric"
            log.info("member %d: %s", self.member_id, reason)
            self._loop.call_soon(self._report_failure, to, reason)
            return
        fn = _Bound(target, action)
        if not target._started:
            target._early.append(fn)
        elif target._loop is self._loop:
            target._loop.call_soon(fn)
        else:
            assert target._loop is not None
            target._loop.call_soon_threadsafe(fn)


class _Bound:
    """A scheduled delivery; does nothing if the receiver closed in between."""

    __slots__ = ("action", "target")

    def __init__(
        self, target: LoopbackTransport, action: Callable[[LoopbackTransport], None]
    ) -> None:
        self.target = target
        self.action = action

    def __call__(self) -> None:
        if not self.target._closed:
            self.action(self.target)


_FABRICS: dict[str, LoopbackFabric] = {}
"""In-process fabrics of ``transport="sim"`` groups, by group name."""


def fabric_of(group: str) -> LoopbackFabric:
    """The in-process fabric of the ``transport="sim"`` group ``group`` (made on first use)."""
    return _FABRICS.setdefault(group, LoopbackFabric())


def use_fabric(group: str, fabric: LoopbackFabric | None) -> None:
    """Connect the ``transport="sim"`` members of ``group`` through ``fabric`` (a fabric of a
    test's own making); None forgets the group's fabric."""
    if fabric is None:
        _FABRICS.pop(group, None)
    else:
        _FABRICS[group] = fabric


def from_config(config: Config) -> LoopbackTransport:
    """The ``sim`` transport of the member ``config`` describes (see ``transport.registry``)."""
    return fabric_of(config.group).transport(config.member_id)
