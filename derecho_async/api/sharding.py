"""Sharded actors: ``da.Sharded(KV, shards=4, replicas=3)`` and the policy that places members.

Theory of operation (docs/DESIGN.md §7.17): a sharded actor is a subgroup of ``shards`` shards;
each shard is an independent replicated actor, ordered among its own replicas only. Which
members host which shard is a pure function of the view's members (the core calls it at every
view: :class:`~derecho_async.core.SubgroupSpec` ``policy``): the application's ``layout``, or
:func:`home_policy`, which keeps members where they are as the view changes: every member has a
home shard (its id modulo ``shards``), and members are placed in rank order (survivors first,
in their old order; joiners after), each into its home shard while that has fewer than
``replicas``, else into the shard with the fewest (the lowest first), while any has room.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from derecho_async.api.actor import Actor
from derecho_async.errors import UsageError

__all__ = ["Layout", "Sharded", "home_policy"]

Layout = Callable[[tuple[int, ...]], Sequence[Sequence[int]]]
"""A layout function: the view's members (rank order) -> each shard's members (disjoint)."""


def home_policy(shards: int, replicas: int) -> Layout:
    """The default placement (see the module header)."""

    def place(members: tuple[int, ...]) -> list[tuple[int, ...]]:
        dealt: list[list[int]] = [[] for _ in range(shards)]
        for m in members:
            home = dealt[m % shards]
            if len(home) < replicas:
                home.append(m)
                continue
            room = min(range(shards), key=lambda s: (len(dealt[s]), s))
            if len(dealt[room]) < replicas:
                dealt[room].append(m)
        return [tuple(d) for d in dealt]

    return place


@dataclass(frozen=True, slots=True)
class Sharded:
    """``cls`` as ``shards`` shards of up to ``replicas`` members each (pass it in
    ``Group(config, actors=[...])``). A view in which a shard would hold fewer than
    ``min_replicas`` members is inadequate: ordered calls wait for a view that is not.
    ``layout``, if given, places the members instead of :func:`home_policy`: a pure function
    of the view's members (rank order) to each shard's members, disjoint. ``cls`` must define
    ``snapshot()`` and ``restore()``: a shard's state moves with them."""

    cls: type[Actor]
    shards: int
    replicas: int
    min_replicas: int = 1
    layout: Layout | None = None

    def __post_init__(self) -> None:
        for name in ("shards", "replicas", "min_replicas"):
            value: Any = getattr(self, name)
            if type(value) is not int or value < 1:
                raise UsageError(f"Sharded {name} must be a positive int, got {value!r}")
        if self.min_replicas > self.replicas:
            raise UsageError(f"Sharded min_replicas ({self.min_replicas}) is above replicas "
                             f"({self.replicas})")
        if self.layout is not None and not callable(self.layout):
            raise UsageError(f"Sharded layout must be a function, got {self.layout!r}")
        if not isinstance(self.cls, type) or not issubclass(self.cls, Actor):
            raise UsageError(f"Sharded needs an Actor subclass, got {self.cls!r}")
        if self.cls.snapshot is Actor.snapshot or self.cls.restore is Actor.restore:
            raise UsageError(f"{self.cls.__name__} must define snapshot() and restore() to be "
                             "sharded: a shard's state moves with them when members change")

    def policy(self) -> Layout:
        """What places the members (the core's subgroup policy)."""
        return self.layout if self.layout is not None else home_policy(self.shards,
                                                                       self.replicas)


def shard_of(assigned: Sequence[Sequence[int]], member: int) -> int | None:
    """The shard ``member`` hosts in an assignment (None: none)."""
    for shard, members in enumerate(assigned):
        if member in members:
            return shard
    return None
