"""A view: a numbered, agreed membership of the group."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["View"]


@dataclass(frozen=True, slots=True)
class View:
    """View ``view_id`` of the group, with its ``members`` in rank order.

    A member's rank is its index in ``members``; members surviving from the previous view keep
    their relative order and joiners follow them, so rank 0 is always a survivor.
    """

    view_id: int
    members: tuple[int, ...]

    def rank_of(self, member: int) -> int:
        """The rank of ``member`` in this view; ``ValueError`` when it is not a member."""
        return self.members.index(member)

    def __contains__(self, member: object) -> bool:
        return member in self.members
