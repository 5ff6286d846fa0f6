"""Calls to a shard this member does not host: forwarded to a member that does, exactly once.

Theory of operation (docs/DESIGN.md §7.17): an ordered call to shard ``k`` of a sharded actor,
made at a member outside it (or by a client whose relay is outside it), goes as a FORWARD
channel message to a host of ``k``, which multicasts it in the shard as an external client's
call would be (``Relay.submit``: tagged with the caller's id and number, so the shard applies it
once however many hosts it reached). The host answers FORWARDED: the outcome, or "retry" when
it could not see the call through (it no longer hosts the shard, it is leaving, its queue is
full), or the error that refuses it. A forwarded call not answered when its host departs or no
longer hosts the shard (a view change), or answered "retry", is sent again, with the same
number, to a host of the shard in the current view. A member's own forwarded calls carry its
own random id and its numbering per shard; a client's carry the client's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from derecho_async import wire
from derecho_async.api.calls import CAST, Replies
from derecho_async.api.client_wire import encode_outcomes, outcomes_of
from derecho_async.api.once import Numbering
from derecho_async.errors import (
    DerechoError,
    GroupClosed,
    PartitionedError,
    ProtocolViolation,
    QueueFull,
    UsageError,
)
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.api.actor import ActorSpec
    from derecho_async.core import View

__all__ = ["Forwarder"]

log = logging.getLogger("derecho_async.shards")

_RETRY_S: Final = 0.05
DONE: Final = 0  # FORWARDED codes
RETRY: Final = 1
REFUSED: Final = 2
_ERRORS: Final[dict[str, type[DerechoError]]] = {
    "UsageError": UsageError, "ProtocolViolation": ProtocolViolation,
}

Hosts = Callable[[str, int], tuple[int, ...]]


@dataclass(slots=True)
class _Forwarded:
    frame: tuple[object, ...]  # FORWARD's fields after the kind
    actor: str
    shard: int
    one_way: bool
    future: asyncio.Future[Any]
    target: int | None = None


class Forwarder:
    """This member's forwarded calls, made and served (see the module header)."""

    def __init__(self, me: int, send: Callable[[int, bytes], None], hosts: Hosts) -> None:
        self._me = me
        self._send = send
        self._hosts = hosts  # (actor, shard) -> the shard's members now, rank order
        self.client_id = os.urandom(wire.CLIENT_ID_BYTES)
        """The id this member's own forwarded calls carry."""
        self._numbers: dict[tuple[str, int], Numbering] = {}
        self._calls: dict[int, _Forwarded] = {}
        self._ids = itertools.count(1)
        self.serve: Callable[[bytes, str, int, int, bytes], asyncio.Future[Any]] | None = None
        """Set by the group: multicast a forwarded call in a shard this member hosts (the
        relay's submit); raises when it cannot."""
        self.closed: BaseException | None = None

    # -- calls made here -------------------------------------------------------------------
    async def call(self, spec: ActorSpec, shard: int, method: str, one_way: bool,
                   args: tuple[object, ...], kwargs: dict[str, object]) -> Any:
        """This member's own ordered call to ``shard``, which it does not host."""
        if self.closed is not None:
            raise self.closed
        name = f"{spec.name}.{method}{CAST if one_way else ''}"
        body = wire.encode_call(name, args, kwargs)
        key = (spec.name, shard)
        numbers = self._numbers.get(key)
        if numbers is None:
            numbers = self._numbers[key] = Numbering()
        seq = await numbers.take()
        try:
            return await self.forward(self.client_id, spec.name, shard, seq, body, one_way)
        finally:
            numbers.answered(seq)

    def forward(self, client: bytes, actor: str, shard: int, seq: int, body: bytes,
                one_way: bool) -> asyncio.Future[Any]:
        """Send a call numbered ``seq`` by ``client`` to a host of ``shard``; the future of
        its :class:`Replies` (a one-way call's: its version)."""
        if self.closed is not None:
            raise self.closed
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call = _Forwarded((rid, actor, shard, client, seq, body), actor, shard, one_way, fut)
        self._calls[rid] = call
        fut.add_done_callback(lambda _f: self._calls.pop(rid, None))
        self._dispatch(call)
        return fut

    def _dispatch(self, call: _Forwarded) -> None:
        if call.future.done() or self.closed is not None:
            return
        hosts = [m for m in self._hosts(call.actor, call.shard) if m != self._me]
        if not hosts:  # (no host now: the view is inadequate, or this member hosts it now)
            if self._me in self._hosts(call.actor, call.shard) and self.serve is not None:
                self._serve_here(call)
                return
            call.target = None
            return  # sent again at the next view
        call.target = hosts[int(call.frame[0]) % len(hosts)]  # type: ignore[call-overload]
        self._send(call.target, env.encode(env.FORWARD, *call.frame))

    def _serve_here(self, call: _Forwarded) -> None:
        """This member hosts the shard now (a view changed): multicast it itself."""
        assert self.serve is not None
        _rid, actor, shard, client, seq, body = call.frame
        try:
            inner = self.serve(client, actor, shard, seq, body)  # type: ignore[arg-type]
        except (GroupClosed, PartitionedError, QueueFull):
            asyncio.get_running_loop().call_later(_RETRY_S, self._dispatch, call)
            return
        except DerechoError as exc:
            call.future.set_exception(exc)
            return
        inner.add_done_callback(lambda f: self._inner_done(call, f))

    def _inner_done(self, call: _Forwarded, inner: asyncio.Future[Any]) -> None:
        failed = inner.cancelled() or inner.exception() is not None  # (retrieved, either way)
        if call.future.done():
            return
        if failed:
            asyncio.get_running_loop().call_later(_RETRY_S, self._dispatch, call)
            return
        call.future.set_result(inner.result())

    def on_answer(self, sender: int, msg: list[Any]) -> None:
        """FORWARDED from ``sender``."""
        _, rid, code, view_id, seq, items, type_name, message = msg
        call = self._calls.get(rid)
        if call is None or call.future.done() or call.target != sender:
            return
        if code == DONE:
            if call.one_way:
                call.future.set_result((view_id, seq))
            else:
                call.future.set_result(Replies(outcomes_of(items), (view_id, seq)))
        elif code == RETRY:
            asyncio.get_running_loop().call_later(_RETRY_S, self._dispatch, call)
        else:
            error = _ERRORS.get(type_name, DerechoError)
            call.future.set_exception(error(f"member {sender}: {type_name}: {message}"))

    def on_view(self, view: View) -> None:
        """A view is installed: calls whose host departed or no longer hosts the shard, or
        that had none, go (again) to a host now."""
        for call in list(self._calls.values()):
            target = call.target
            if target is None or target not in view.members or target not in self._hosts(
                    call.actor, call.shard):
                self._dispatch(call)

    def close(self, exc: BaseException) -> None:
        """This member is out: every forwarded call not answered fails with ``exc``."""
        self.closed = exc
        for call in list(self._calls.values()):
            if not call.future.done():
                call.future.set_exception(exc)

    # -- calls served here -----------------------------------------------------------------
    def on_forward(self, sender: int, msg: list[Any]) -> None:
        """FORWARD from ``sender``: multicast it in the shard, answer when it is done."""
        _, rid, actor, shard, client, seq, body = msg
        if len(client) != wire.CLIENT_ID_BYTES:
            raise ProtocolViolation("a forwarded call's client id is not 16 bytes")

        def answer(code: int, version: tuple[int, int] = (0, 0), items: list[Any] | None = None,
                   exc: BaseException | None = None) -> None:
            self._send(sender, env.encode(
                env.FORWARDED, rid, code, version[0], version[1], items or [],
                type(exc).__name__ if exc is not None else "",
                str(exc)[:500] if exc is not None else ""))

        if self.serve is None or self._me not in self._hosts(actor, shard):
            answer(RETRY)
            return
        try:
            fut = self.serve(client, actor, shard, seq, body)
        except (GroupClosed, PartitionedError, QueueFull):
            answer(RETRY)
            return
        except DerechoError as exc:
            answer(REFUSED, exc=exc)
            return

        def done(f: asyncio.Future[Any]) -> None:
            if f.cancelled() or f.exception() is not None:
                answer(RETRY)
                return
            result = f.result()
            if isinstance(result, Replies):
                answer(DONE, result.version, encode_outcomes(result))
            else:
                answer(DONE, result)

        fut.add_done_callback(done)
