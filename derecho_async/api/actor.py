"""Replicated actors: the :class:`Actor` base class and the ``@ordered`` / ``@p2p`` decorators.

Theory of operation: an actor class declares its replicated methods with decorators. ``@ordered``
methods are invoked by an ordered multicast to the actor's subgroup and run at every member, one
at a time, in delivery order; ``@p2p`` methods are read-only calls to one chosen member,
unordered. The decorators only mark the functions; :func:`actor_spec` collects the marks once
per class into an :class:`ActorSpec` (name, ordered and p2p method tables) that the group uses
to dispatch calls by name. Method names travel on the wire as ``"<Actor>.<method>"``. See
docs/DESIGN.md §7.2.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from derecho_async.errors import UsageError

__all__ = ["Actor", "ActorSpec", "actor_spec", "ordered", "p2p"]

F = TypeVar("F", bound=Callable[..., Any])

_KIND_ATTR = "__derecho_async_kind__"


def ordered(fn: F) -> F:
    """Mark an actor method as an ordered call: multicast, run at every member in total order.

    The method may be ``async`` (it may await; the next delivery waits for it) or plain.
    """
    setattr(fn, _KIND_ATTR, "ordered")
    return fn


def p2p(fn: F) -> F:
    """Mark an actor method as a point-to-point call: run at one chosen member, unordered.

    Call it as ``handle.method.at(member_id)(*args)``. It should only read the actor's state.
    """
    setattr(fn, _KIND_ATTR, "p2p")
    return fn


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
