"""Layout: how a view's members map onto named subgroups and shards.

Theory of operation: a :class:`Layout` is a list of :class:`SubgroupSpec`. For a view it computes
a :class:`ShardAssignment`: each subgroup's members (the view's members in rank order, capped at
``max_members``) are dealt round-robin over its shards, or given to them by the subgroup's
``policy`` (a function of those members to each shard's members, disjoint), and each shard's
senders are its first ``senders`` members (all of them by default). The assignment is a pure
function of the view, so every member computes the same one. A view whose members cannot give every shard
``min_per_shard`` members is *inadequate*: it is installed (membership is agreed) but carries no
subgroup traffic until a later view is adequate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from derecho_async.errors import UsageError

__all__ = ["DEFAULT_SUBGROUP", "Layout", "ShardAssignment", "ShardInfo", "SubgroupSpec"]

DEFAULT_SUBGROUP = "default"


@dataclass(frozen=True, slots=True)
class SubgroupSpec:
    """One subgroup: ``shards`` shards of at least ``min_per_shard`` members each.

    ``policy``, if given, assigns the members: called with the view's members (rank order,
    capped at ``max_members``), it returns each shard's members, ``shards`` disjoint sequences
    of them (a shard may be empty); it must be a pure function of its argument, since every
    member calls it. Without one, members are dealt round-robin by rank."""

    name: str
    shards: int = 1
    min_per_shard: int = 1
    max_members: int | None = None
    senders: int | None = None
    policy: Callable[[tuple[int, ...]], Sequence[Sequence[int]]] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise UsageError("a subgroup needs a non-empty name")
        if self.shards < 1 or self.min_per_shard < 1:
            raise UsageError(f"subgroup {self.name!r}: shards and min_per_shard must be >= 1")
        if self.max_members is not None and self.max_members < self.shards * self.min_per_shard:
            raise UsageError(f"subgroup {self.name!r}: max_members below shards * min_per_shard")
        if self.senders is not None and self.senders < 1:
            raise UsageError(f"subgroup {self.name!r}: senders must be >= 1 or None (all)")


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """Shard ``shard`` of ``subgroup``: its members and senders (member ids, in rank order).

    ``index`` is the shard's position in the table's shard areas.
    """

    index: int
    subgroup: str
    shard: int
    members: tuple[int, ...]
    senders: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShardAssignment:
    """Every shard of a view, in table order, and whether the view is adequate."""

    shards: tuple[ShardInfo, ...]
    adequate: bool

    def find(self, subgroup: str, shard: int = 0) -> ShardInfo | None:
        for info in self.shards:
            if info.subgroup == subgroup and info.shard == shard:
                return info
        return None

    def shards_of(self, member: int) -> list[ShardInfo]:
        return [s for s in self.shards if member in s.members]


@dataclass(frozen=True, slots=True)
class Layout:
    """The subgroups of a group, in a fixed order."""

    subgroups: tuple[SubgroupSpec, ...] = (SubgroupSpec(DEFAULT_SUBGROUP),)

    def __post_init__(self) -> None:
        names = [s.name for s in self.subgroups]
        if len(set(names)) != len(names):
            raise UsageError(f"duplicate subgroup names in {names}")
        if not names:
            raise UsageError("a layout needs at least one subgroup")

    @property
    def n_shards(self) -> int:
        return sum(s.shards for s in self.subgroups)

    def assign(self, members: tuple[int, ...]) -> ShardAssignment:
        """The shard assignment for a view with ``members`` (rank order)."""
        shards: list[ShardInfo] = []
        adequate = True
        index = 0
        for spec in self.subgroups:
            pool = members if spec.max_members is None else members[: spec.max_members]
            dealt = _by_policy(spec, pool) if spec.policy is not None else None
            for s in range(spec.shards):
                mine = pool[s :: spec.shards] if dealt is None else dealt[s]
                if len(mine) < spec.min_per_shard:
                    adequate = False
                senders = mine if spec.senders is None else mine[: spec.senders]
                shards.append(ShardInfo(index, spec.name, s, tuple(mine), tuple(senders)))
                index += 1
        return ShardAssignment(tuple(shards), adequate)


def _by_policy(spec: SubgroupSpec, pool: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Each shard's members as ``spec.policy`` gives them, checked: UsageError naming what is
    wrong (the policy is the application's)."""
    assert spec.policy is not None
    got = spec.policy(pool)
    if isinstance(got, str | bytes) or len(got) != spec.shards:
        raise UsageError(f"subgroup {spec.name!r}: its layout policy gave {got!r} for members "
                         f"{list(pool)}, not {spec.shards} shards")
    dealt: list[tuple[int, ...]] = []
    seen: set[int] = set()
    for shard in got:
        members = tuple(shard)
        for m in members:
            if m not in pool or m in seen:
                raise UsageError(
                    f"subgroup {spec.name!r}: its layout policy gave member {m!r} "
                    f"{'twice' if m in seen else 'which is not in the view'} (members "
                    f"{list(pool)}, shards {[list(s) for s in got]})")
            seen.add(m)
        dealt.append(members)
    return dealt
