"""p2p calls: made to one member, served there on the actor's runner between ordered handlers.

Theory of operation: ``handle.method.at(m)(...)`` sends a P2P_REQ to member ``m`` (or runs the
handler here when ``m`` is this member) and awaits its P2P_RESP. The member that serves it
queues the handler on the actor's :class:`~derecho_async.runtime.runner.SerialRunner`, so it
runs between ordered handlers, never while one is suspended, and reads the state after every
call delivered before the request arrived; it answers with that state's version (the last call
delivered per subgroup, which the dispatcher records here). Requests that arrive before this
member's first view wait for it. See docs/DESIGN.md §7.8.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Mapping
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from derecho_async import wire
from derecho_async.api.calls import decode_result, encode_error
from derecho_async.errors import GroupClosed, MemberFailed, ProtocolViolation, UsageError
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.api.actor import Actor, ActorSpec
    from derecho_async.api.delivery import Hosted
    from derecho_async.api.membership import Membership
    from derecho_async.core import ViewInstalled

__all__ = ["P2PServer", "Versioned", "read_only"]

_MAX_EARLY_P2P = 1024  # p2p requests held before this member's first view, at most

Answer = Callable[[bool, object, tuple[int, int]], None]
"""``answer(ok, value_or_exception, version)``: a p2p handler's outcome and the state it read."""


R_co = TypeVar("R_co", covariant=True)


class Versioned(NamedTuple, Generic[R_co]):
    """A p2p call's result and the version of the replica state it read.

    ``version`` is the ``(view_id, seq)`` of the last ordered call of the actor's subgroup that
    member had applied when the p2p handler ran (the same version :attr:`Replies.version` gives
    the caller of that call); ``(view_id, -1)`` when it had applied none of view ``view_id``'s
    calls yet: the state that view began with.
    """

    value: R_co
    version: tuple[int, int]


class P2PServer:
    """This member's p2p calls, made and served (see the module header).

    ``last_delivered`` maps a subgroup to the version of the last call delivered here (the
    dispatcher writes it at every run of deliveries): what a p2p read queued now reports."""

    __slots__ = ("_calls", "_early", "_hosted", "_ids", "_specs", "_state", "base_version",
                 "last_delivered")

    def __init__(self, state: Membership, specs: Mapping[str, ActorSpec],
                 hosted: Mapping[str, Hosted]) -> None:
        self._state = state
        self._specs = specs
        self._hosted = hosted
        self._ids = itertools.count(1)
        # my p2p calls awaiting an answer: request id -> (member asked, future)
        self._calls: dict[int, tuple[int, asyncio.Future[Versioned[Any]]]] = {}
        # The last call delivered per subgroup (the version a p2p call queued now reads), and
        # the version of a state no call of which was delivered yet (a joiner's restored one).
        # (versions only: an event would keep its payload, device arrays included, alive)
        self.last_delivered: dict[str, tuple[int, int]] = {}
        self.base_version = (0, -1)
        # p2p requests that came before this member's first view: served once it is installed
        # (after its state restore is queued), in arrival order
        self._early: list[tuple[int, int, str, str, bytes]] = []

    @property
    def me(self) -> int:
        """This member's id."""
        return self._state.me

    # -- calls made here -------------------------------------------------------------------
    async def call(
        self,
        member: int,
        spec: ActorSpec,
        method: str,
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> Versioned[Any]:
        """Call p2p method ``method`` of ``spec``'s actor at ``member``."""
        state = self._state
        driver = state.check_open()
        view = state.view
        assert view is not None
        if member not in view.members:
            raise MemberFailed(member, "is not a member of the current view")
        loop = asyncio.get_running_loop()
        if member == state.me:
            mine: asyncio.Future[Versioned[Any]] = loop.create_future()

            def answer(ok: bool, value: object, version: tuple[int, int]) -> None:
                if mine.done():
                    return
                if ok:
                    mine.set_result(Versioned(value, version))
                else:
                    assert isinstance(value, BaseException)
                    mine.set_exception(value)

            self.run(spec, method, args, kwargs, answer)
            return await mine
        req = next(self._ids)
        fut: asyncio.Future[Versioned[Any]] = loop.create_future()
        self._calls[req] = (member, fut)
        body = wire.encode_call(f"{spec.name}.{method}", args, kwargs)
        driver.transport.send(member, env.encode(env.P2P_REQ, req, spec.name, method, body))
        return await fut

    def on_response(self, sender: int, req: int, ok: bool, body: bytes, view_id: int,
                    seq: int) -> None:
        """A P2P_RESP: ``sender``'s answer to my request ``req``, read at ``(view_id, seq)``."""
        entry = self._calls.pop(req, None)
        if entry is None or entry[0] != sender or entry[1].done():
            return
        result = decode_result(sender, ok, body)
        if ok:
            entry[1].set_result(Versioned(result, (view_id, seq)))
        else:
            assert isinstance(result, BaseException)
            entry[1].set_exception(result)

    # -- calls served here -----------------------------------------------------------------
    def run(self, spec: ActorSpec, method: str, args: tuple[object, ...],
            kwargs: dict[str, object], answer: Answer) -> None:
        """Run a p2p handler on its actor's runner, between ordered handlers: it reads the state
        after every call delivered so far (the version it answers with), never a half-applied
        call. With ``check_p2p_reads`` a handler that changes the replica is undone and fails."""
        name = spec.name
        _spec, runner, actor, _methods = self._hosted[name]
        version = self.last_delivered.get(name, self.base_version)
        fn: Callable[..., object] = getattr(actor, method)
        if self._state.config.check_p2p_reads:
            fn = read_only(actor, f"{name}.{method}", fn)

        def done(ok: bool, value: object) -> None:
            answer(ok, value, version)

        if runner.stopped:
            done(False, GroupClosed("this member is leaving the group"))
            return
        runner.submit_call(fn, args, kwargs, done)

    def serve(self, sender: int, req: int, actor_name: str, method: str, body: bytes) -> None:
        """A P2P_REQ from ``sender``: run it (once this member is in a view) and answer."""
        state = self._state
        spec = self._specs.get(actor_name)
        driver = state.driver
        if driver is None:
            return

        def answer(ok: bool, value: object, version: tuple[int, int] = (0, -1)) -> None:
            try:
                data = wire.encode(value) if ok else encode_error(value)
            except (TypeError, ValueError, OverflowError) as exc:
                ok, data = False, encode_error(exc)
            view_id, seq = version
            if state.closed is None:
                driver.transport.send(
                    sender, env.encode(env.P2P_RESP, req, ok, data, view_id, seq + 1))

        if spec is None or method not in spec.p2p:
            answer(False, UsageError(f"no p2p method {actor_name}.{method}"))
            return
        if state.view is None:  # a caller in the view admitting me: run it once I am in it
            if len(self._early) >= _MAX_EARLY_P2P:
                answer(False, UsageError("too many p2p calls before this member's first view"))
                return
            self._early.append((sender, req, actor_name, method, body))
            return
        try:
            _name, args, kwargs = wire.decode_call(body)
        except ProtocolViolation as exc:
            answer(False, exc)
            return
        self.run(spec, method, args, kwargs, answer)

    def _serve_early(self) -> None:
        early, self._early = self._early, []
        for request in early:
            self.serve(*request)

    # -- views and failures ----------------------------------------------------------------
    def joined(self, ev: ViewInstalled) -> None:
        """This member joined in view ``ev``: its state (restored) is that view's start."""
        self.base_version = (ev.view.view_id, -1)
        self.last_delivered.clear()

    def serve_early_soon(self) -> None:
        """A view is installed: serve the requests that came before it, after this step (once
        the state transfer holds the runners)."""
        if self._early:
            asyncio.get_running_loop().call_soon(self._serve_early)

    def on_departed(self, gone: set[int]) -> None:
        """Members ``gone`` departed: my calls to them get :class:`MemberFailed`."""
        for req, (member, fut) in list(self._calls.items()):
            if member in gone and not fut.done():
                fut.set_exception(MemberFailed(member, "left the group before replying"))
                del self._calls[req]

    def fail_all(self, exc: BaseException) -> None:
        """This member is out: my calls awaiting answers fail with ``exc``."""
        for _member, fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        self._calls.clear()


def read_only(actor: Actor, label: str, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` checked not to change ``actor``'s replica (``check_p2p_reads``): its snapshot is
    compared before and after; a change is undone (the snapshot before is restored) and the call
    fails with :class:`UsageError`."""

    def check(before: bytes) -> None:
        if wire.encode(actor.snapshot()) != before:
            state: Any = wire.decode(before)
            actor.restore(state)
            raise UsageError(f"p2p handler {label} changed the replica (p2p handlers may only "
                             f"read; the change was undone)")

    def run(*args: object, **kwargs: object) -> object:
        before = wire.encode(actor.snapshot())
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            check(before)
            raise
        if type(result) is not CoroutineType:
            check(before)
            return result

        async def finish(coro: Any = result) -> object:
            try:
                value = await coro
            except BaseException:
                check(before)
                raise
            check(before)
            return value

        return finish()

    return run
