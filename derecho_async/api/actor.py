"""Replicated actors: the :class:`Actor` base class and the ``@ordered`` / ``@p2p`` decorators.

Theory of operation: an actor class declares its replicated methods with decorators. ``@ordered``
methods are invoked by an ordered multicast to the actor's subgroup and run at every member, one
at a time, in delivery order; ``@p2p`` methods are read-only calls to one chosen member,
unordered. The decorators only mark the functions; :func:`actor_spec` collects the marks once
per class into an :class:`ActorSpec` (name, ordered and p2p method tables) that the group uses
to dispatch calls by name. Method names travel on the wire as ``"<Actor>.<method>"``. See
docs/DESIGN.md §7.2.

Typing: at run time a decorator returns the function itself, marked. To a type checker it
returns an :class:`OrderedDef` or :class:`P2PDef`: a protocol the marked function satisfies (the
same ``__get__`` and ``__call__``), which also records the actor, the parameters and the result
type, so that ``handle[KV.put]`` (:mod:`.handles`) is typed from the handler's signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import (
    Any,
    Concatenate,
    Literal,
    ParamSpec,
    Protocol,
    Self,
    TypeVar,
    cast,
    overload,
)

from derecho_async.errors import UsageError

__all__ = ["Actor", "ActorSpec", "OrderedDef", "P2PDef", "actor_spec", "ordered", "p2p"]

A = TypeVar("A", bound="Actor")
A_contra = TypeVar("A_contra", bound="Actor", contravariant=True)
P = ParamSpec("P")
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

_KIND_ATTR = "__derecho_async_kind__"


class OrderedDef(Protocol[A_contra, P, T_co]):
    """What ``@ordered`` gives a type checker: the method, on actor ``A_contra``, with
    parameters ``P`` (``self`` left out) returning ``T_co`` (a coroutine for an ``async def``).

    On the actor and its instances it is the plain method: ``KV.put`` is this object,
    ``kv_replica.put(...)`` a plain call. A handle turns it into a call to the subgroup:
    ``handle[KV.put]`` (:class:`~derecho_async.api.handles.SubgroupHandle`). Contravariant in
    the actor, so a subclass's handle takes its base class's methods."""

    @property
    def __derecho_async_kind__(self) -> Literal["ordered"]: ...

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None, /) -> Self: ...
    @overload
    def __get__(self, obj: A_contra, owner: type[Any] | None = None, /) -> Callable[P, T_co]: ...

    def __call__(self, actor: A_contra, /, *args: P.args, **kwargs: P.kwargs) -> T_co: ...


class P2PDef(Protocol[A_contra, P, T_co]):
    """What ``@p2p`` gives a type checker: as :class:`OrderedDef`, for a p2p method
    (``handle[KV.get].at(m)(...)``)."""

    @property
    def __derecho_async_kind__(self) -> Literal["p2p"]: ...

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None, /) -> Self: ...
    @overload
    def __get__(self, obj: A_contra, owner: type[Any] | None = None, /) -> Callable[P, T_co]: ...

    def __call__(self, actor: A_contra, /, *args: P.args, **kwargs: P.kwargs) -> T_co: ...


def ordered(fn: Callable[Concatenate[A, P], T]) -> OrderedDef[A, P, T]:
    """Mark an actor method as an ordered call: multicast, run at every member in total order.

    The method may be ``async`` (it may await; the next delivery waits for it) or plain. The
    function itself is returned, marked; typed as an :class:`OrderedDef`.
    """
    setattr(fn, _KIND_ATTR, "ordered")
    return cast("OrderedDef[A, P, T]", fn)


def p2p(fn: Callable[Concatenate[A, P], T]) -> P2PDef[A, P, T]:
    """Mark an actor method as a point-to-point call: run at one chosen member, unordered.

    Call it as ``handle[KV.method].at(member_id)(*args)`` (or ``.any()``). It should only read
    the actor's state. The function itself is returned, marked; typed as a :class:`P2PDef`.
    """
    setattr(fn, _KIND_ATTR, "p2p")
    return cast("P2PDef[A, P, T]", fn)


class Actor:
    """Base class of replicated actors.

    Subclasses define ``@ordered`` and ``@p2p`` methods, and may override :meth:`snapshot` and
    :meth:`restore` so that joiners receive the state (state transfer).
    """

    def snapshot(self) -> object:
        """The state a joining member restores; the default carries no state.

        Any value the codec carries (bytes, numpy or CuPy arrays, nested lists and dicts of
        them...); no size bound but memory. It is taken at the cut (every call delivered before
        the joiner's view has finished, none after has started), streamed to the joiner in
        chunks, and frozen first: arrays are copied before later handlers run, ``bytes`` are
        sent as they are. Raising aborts the join (the joiner is told why; this member stays).
        """
        return b""

    def restore(self, state: Any) -> None:
        """Replace this replica's state with ``state``: the value :meth:`snapshot` gave at the
        sponsor, decoded (any value the codec carries; no size bound but memory). Raising
        fails the join."""


@dataclass(frozen=True, slots=True)
class ActorSpec:
    """An actor class's wire name and its replicated methods."""

    name: str
    cls: type[Actor]
    ordered: frozenset[str]
    p2p: frozenset[str]

    def kind_of(self, method: str) -> str | None:
        """``"ordered"`` or ``"p2p"``: how ``method`` is called; None if it is neither."""
        if method in self.ordered:
            return "ordered"
        if method in self.p2p:
            return "p2p"
        return None

    def name_of(self, method: object) -> str:
        """The name of ``method``, an ``@ordered`` or ``@p2p`` method of this actor as the class
        gives it (``KV.put``: ``"put"``); UsageError if it is not one."""
        name = getattr(method, "__name__", None)
        mro = self.cls.__mro__
        if not (isinstance(name, str) and any(vars(c).get(name) is method for c in mro)):
            name = next((n for c in mro for n, v in vars(c).items() if v is method), None)
        kind = None if name is None else self.kind_of(name)
        if name is None or kind is None or getattr(method, _KIND_ATTR, None) != kind:
            raise UsageError(f"a handle of {self.name} takes one of its @ordered or @p2p "
                             f"methods (handle[{self.name}.method]), not {method!r}")
        return name


def actor_spec(cls: type[Actor]) -> ActorSpec:
    """Collect ``cls``'s decorated methods; ``UsageError`` if it is not a usable actor class."""
    if not (inspect.isclass(cls) and issubclass(cls, Actor)):
        raise UsageError(f"{cls!r} is not a subclass of derecho_async.Actor")
    ordered_names: set[str] = set()
    p2p_names: set[str] = set()
    for name in dir(cls):
        if name.startswith("__"):
            continue
        kind = getattr(getattr(cls, name, None), _KIND_ATTR, None)
        if kind == "ordered":
            ordered_names.add(name)
        elif kind == "p2p":
            p2p_names.add(name)
    if not ordered_names and not p2p_names:
        raise UsageError(f"actor {cls.__name__} has no @ordered or @p2p methods")
    return ActorSpec(cls.__name__, cls, frozenset(ordered_names), frozenset(p2p_names))
