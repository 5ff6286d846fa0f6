"""Handles: what ``group.subgroup(Actor)`` returns, and the method objects it hands out.

Theory of operation: ``handle.method`` is made on first use and kept on the handle, so the next
``handle.method(...)`` is a plain attribute read. An ``@ordered`` method's object knows its wire
names (``<Actor>.<method>`` and the one-way ``<Actor>.<method>.cast``) and submits straight to
the group's :class:`~derecho_async.api.calls.CallTable`; a ``@p2p`` method's object binds a
member (``.at(m)``) and calls through the group's
:class:`~derecho_async.api.p2pcalls.P2PServer`.

Typing: a handle is generic over its actor, ``SubgroupHandle[KV]``. ``handle.put`` is found by
``__getattr__``, which a type checker cannot type per name (Python's typing has no mapped or
proxy types), so it is ``Any``. ``handle[KV.put]`` is the same object, typed from the
handler's signature through the :class:`~derecho_async.api.actor.OrderedDef` /
:class:`~derecho_async.api.actor.P2PDef` the decorators give: ``OrderedMethod[P, R]`` or
``P2PMethod[P, R]``, an ``async def`` handler's coroutine unwrapped to its result.
See docs/DESIGN.md §7.2.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, cast, overload

from derecho_async.api.calls import CAST
from derecho_async.errors import UsageError

if TYPE_CHECKING:
    from derecho_async.api.actor import Actor, ActorSpec, OrderedDef, P2PDef
    from derecho_async.api.calls import CallTable, Replies
    from derecho_async.api.durable import Durable
    from derecho_async.api.forward import Forwarder
    from derecho_async.api.logged_calls import HistoryEntry, Version
    from derecho_async.api.p2pcalls import P2PServer, Versioned

__all__ = ["OrderedMethod", "P2PCall", "P2PMethod", "ShardMethod", "SubgroupHandle"]

P = ParamSpec("P")
R = TypeVar("R")
A_co = TypeVar("A_co", bound="Actor", covariant=True)
M = TypeVar("M")


class OrderedMethod(Generic[P, R]):
    """An ``@ordered`` method of a handle: ``await handle.method(...)`` gives every member's
    result (:class:`~derecho_async.api.calls.Replies`); :meth:`cast` makes the call one-way.
    ``P`` and ``R`` are the handler's parameters and result (``handle[KV.method]``)."""

    __slots__ = ("_calls", "_cast_wire", "_spec", "_wire")

    def __init__(self, calls: CallTable, spec: ActorSpec, name: str) -> None:
        self._calls = calls
        self._spec = spec
        # the wire names of the call and of its one-way form, made once per handle
        self._wire = f"{spec.name}.{name}"
        self._cast_wire = f"{spec.name}.{name}{CAST}"

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[Replies[R]]:
        return self._calls.ordered_call(self._spec, self._wire, args, kwargs)

    def cast(self, *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[tuple[int, int]]:
        """A one-way ordered call: multicast like ``handle.method(...)``, but no member replies.

        Every member runs the handler in the same total order as every other ordered call of
        the subgroup; results are dropped, and a handler's exception is logged at the member
        where it was raised. The returned future resolves to the call's version
        ``(view_id, seq)`` once the call is *delivered at this member*: delivery means
        stability, so every member of that view holds it, and (virtual synchrony) every member
        that survives into the next view delivers it too. It does not wait for any handler,
        this member's own included. On a view change before delivery the call is delivered in
        that view's ragged trim or, re-sent, in the next view (the sender survived), and the
        future resolves then; it fails with :class:`GroupClosed` / :class:`PartitionedError`
        when this member leaves, is removed or wedges first. Encoding errors and a closed group
        raise at once.
        """
        return self._calls.cast(self._spec, self._cast_wire, args, kwargs)


class P2PCall(Generic[P, R]):
    """A p2p method bound to one member: ``await call(*args)`` gives the handler's result,
    ``await call.versioned(*args)`` a :class:`Versioned` (result and the version it read)."""

    __slots__ = ("_member", "_name", "_p2p", "_spec")

    def __init__(self, p2p: P2PServer, spec: ActorSpec, name: str, member: int) -> None:
        self._p2p = p2p
        self._spec = spec
        self._name = name
        self._member = member

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        got: Versioned[R] = await self._p2p.call(self._member, self._spec, self._name, args,
                                                 kwargs)
        return got.value

    def versioned(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[Versioned[R]]:
        """The call, answered with the version of the state the handler read."""
        return self._p2p.call(self._member, self._spec, self._name, args, kwargs)


class P2PMethod(Generic[P, R]):
    """A ``@p2p`` method of a handle: bind it to a member with :meth:`at`, or to this member
    (or, for a shard it does not host, one that does) with :meth:`any`. It is not called
    itself (a type checker says so; at run time, :class:`UsageError` says how)."""

    __slots__ = ("_hosts", "_name", "_p2p", "_spec")

    def __init__(self, p2p: P2PServer, spec: ActorSpec, name: str,
                 hosts: Callable[[], tuple[int, ...]] | None = None) -> None:
        self._p2p = p2p
        self._spec = spec
        self._name = name
        self._hosts = hosts  # a sharded handle's: the members of its shard now

    if not TYPE_CHECKING:  # (to a type checker it is not callable at all)
        def __call__(self, *args: object, **kwargs: object) -> None:
            raise UsageError(p2p_usage(self._spec.name, self._name))

    def at(self, member: int) -> P2PCall[P, R]:
        """The call bound to ``member``: ``await handle.method.at(m)(*args)``, or
        ``await handle.method.at(m).versioned(*args)`` (see :class:`P2PCall`). For a shard's
        handle, ``member`` must host that shard (UsageError otherwise)."""
        if self._hosts is not None:
            hosts = self._hosts()
            if member not in hosts:
                raise UsageError(f"member {member} does not host this shard of "
                                 f"{self._spec.name} (its hosts: {list(hosts)})")
        return P2PCall(self._p2p, self._spec, self._name, member)

    def any(self) -> P2PCall[P, R]:
        """The call bound to this member, or (a shard it does not host) to the shard's
        lowest-ranked member."""
        me = self._p2p.me
        if self._hosts is not None:
            hosts = self._hosts()
            if me not in hosts:
                if not hosts:
                    raise UsageError(f"no member hosts this shard of {self._spec.name} now")
                me = hosts[0]
        return P2PCall(self._p2p, self._spec, self._name, me)


class ShardMethod(OrderedMethod[P, R]):
    """An ``@ordered`` method of a shard's handle: made here when this member hosts the shard
    (ordered among the shard's members), forwarded to a member that does otherwise
    (:mod:`~derecho_async.api.forward`: applied once)."""

    __slots__ = ("_forwarder", "_hosted", "_method", "_shard")

    def __init__(self, calls: CallTable, spec: ActorSpec, name: str, shard: int,
                 hosted: Callable[[], bool], forwarder: Forwarder) -> None:
        super().__init__(calls, spec, name)
        self._method = name
        self._shard = shard
        self._hosted = hosted
        self._forwarder = forwarder

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[Replies[R]]:
        if self._hosted():
            return self._calls.ordered_call(self._spec, self._wire, args, kwargs)
        return self._forwarder.call(self._spec, self._shard, self._method, False, args, kwargs)

    def cast(self, *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[tuple[int, int]]:
        """As :meth:`OrderedMethod.cast`, within the shard (forwarded: it resolves once
        delivered at the member it was forwarded to)."""
        if self._hosted():
            return self._calls.cast(self._spec, self._cast_wire, args, kwargs)
        return asyncio.ensure_future(self._forwarder.call(
            self._spec, self._shard, self._method, True, args, kwargs))


class SubgroupHandle(Generic[A_co]):
    """Calls into one actor's subgroup: ``await handle.method(...)`` for ``@ordered`` methods
    (every member's result), ``await handle.method.cast(...)`` for the same call one-way (no
    replies; it completes when the call is delivered here), ``await handle.method.at(member)(...)``
    for ``@p2p`` methods.

    ``handle[KV.method]`` is the same method object, typed from the handler's signature (see
    the module header): ``await handle[KV.put]("a", b"1")`` is a ``Replies[None]`` for
    ``def put(self, key: str, value: bytes) -> None``, ``await handle[KV.get].at(1)("a")`` the
    result of ``get``. ``handle.method`` is untyped (``Any``)."""

    def __init__(self, calls: CallTable, p2p: P2PServer, spec: ActorSpec,
                 durable: Durable | None = None, shard: int | None = None,
                 hosts: Callable[[], tuple[int, ...]] | None = None,
                 forwarder: Forwarder | None = None) -> None:
        self._calls = calls
        self._p2p = p2p
        self._spec = spec
        self._durable = durable
        self.shard = shard
        """The shard of a sharded actor this handle calls (None: the actor is not sharded)."""
        self._hosts = hosts
        self._forwarder = forwarder
        self._typed: dict[object, OrderedMethod[Any, Any] | P2PMethod[Any, Any]] = {}

    # -- durability (a group with ``data_dir``; README "Durability") ---------------------------
    def _durable_state(self) -> Durable:
        if self._durable is None:
            raise UsageError("durability needs the config key data_dir")
        return self._durable

    def persisted(self, version: tuple[int, int]) -> Awaitable[None]:
        """Wait until every member of the current view has this subgroup's log durable
        (fsynced) through ``version`` (a version a call returned, e.g. ``await m.cast(...)``).
        Fails with the group's error if this member leaves first."""
        version = check_version(version)
        return self._durable_state().persisted(self._spec.name, version)

    @property
    def persisted_frontier(self) -> tuple[int, int] | None:
        """The highest version known durable at every member of the view (None: none yet)."""
        return self._durable_state().frontier.get(self._spec.name)

    def history(self, since: tuple[int, int] | None = None) -> AsyncIterator[HistoryEntry]:
        """The delivered calls this member's log holds after ``since`` (all: None), in order,
        as :class:`~derecho_async.api.logged_calls.HistoryEntry` (version, time, method, args)."""
        durable = self._durable_state()
        return durable.history(self._spec.name, None if since is None else check_version(since))

    async def at_version(self, version: tuple[int, int]) -> A_co:
        """A new, detached replica of this actor holding every call up to ``version`` and none
        after (rebuilt from the newest snapshot before it and the log)."""
        version = check_version(version)
        replica = await self._durable_state().at_version(self._spec.name, version)
        return cast("A_co", replica)  # an instance of the handle's actor class

    async def at_time(self, t: float) -> A_co:
        """As :meth:`at_version`, for the last call logged at or before ``t`` (seconds since the
        epoch: the time a call's sender stamped it with, the same at every member)."""
        replica = await self._durable_state().at_time(self._spec.name, float(t))
        return cast("A_co", replica)

    # -- typed access (see the module header) --------------------------------------------------
    @overload
    def __getitem__(
        self, method: OrderedDef[A_co, P, Coroutine[Any, Any, R]]
    ) -> OrderedMethod[P, R]: ...
    @overload
    def __getitem__(self, method: OrderedDef[A_co, P, R]) -> OrderedMethod[P, R]: ...
    @overload
    def __getitem__(self, method: P2PDef[A_co, P, Coroutine[Any, Any, R]]) -> P2PMethod[P, R]: ...
    @overload
    def __getitem__(self, method: P2PDef[A_co, P, R]) -> P2PMethod[P, R]: ...

    def __getitem__(self, method: object) -> OrderedMethod[Any, Any] | P2PMethod[Any, Any]:
        """``handle[KV.method]``: ``handle.method``, typed from the handler's signature."""
        return typed_method(self, self._typed, self._spec, method)

    def __getattr__(self, name: str) -> Any:
        # Called only for names not yet in the instance: the method object made here is kept
        # there, so the next ``handle.method`` is a plain attribute read (a call per message).
        kind = self._spec.kind_of(name)
        method: OrderedMethod[Any, Any] | P2PMethod[Any, Any]
        if kind == "ordered":
            if self._hosts is None or self._forwarder is None or self.shard is None:
                method = OrderedMethod(self._calls, self._spec, name)
            else:
                method = ShardMethod(self._calls, self._spec, name, self.shard, self._hosted,
                                     self._forwarder)
        elif kind == "p2p":
            method = P2PMethod(self._p2p, self._spec, name, self._hosts)
        else:
            raise AttributeError(
                f"actor {self._spec.name} has no @ordered or @p2p method {name!r}")
        self.__dict__[name] = method
        return method

    def _hosted(self) -> bool:
        assert self._hosts is not None
        return self._p2p.me in self._hosts()


def typed_method(handle: object, typed: dict[object, M], spec: ActorSpec, method: object) -> M:
    """``handle[method]`` of a member's or a client's handle: ``handle.<name>``, ``method``
    checked (once) to be an ``@ordered`` or ``@p2p`` method of ``spec``'s actor."""
    got: M | None
    try:
        got = typed.get(method)
    except TypeError:  # unhashable: not a method
        got = None
    if got is None:
        got = typed[method] = getattr(handle, spec.name_of(method))
    return got


def p2p_usage(actor: str, method: str) -> str:
    """What a p2p method called like an ordered one says."""
    return (f"{actor}.{method} is a @p2p method: call it at one member, "
            f"handle.{method}.at(member)(...), or handle.{method}.any()(...) (this member, or "
            f"one that hosts the shard)")


def check_version(version: object) -> Version:
    if not (isinstance(version, tuple) and len(version) == 2
            and all(type(x) is int and 0 <= x < 1 << 63 for x in version)):
        raise UsageError(f"a version is a (view_id, seq) pair of ints, not {version!r}")
    return (version[0], version[1])
