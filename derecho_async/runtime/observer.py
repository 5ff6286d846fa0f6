"""What a :class:`~derecho_async.api.group.Group` tells an observer (testing kits, checkers).

A group made with ``observer=`` calls these at the points the actor-level contract is about:
each run of delivered ordered calls (in order, before any handler of the run starts), each
view it installs, the state a sponsor took at the cut for a joiner, and the state a joiner
restored. The methods do nothing here; an observer overrides those it needs. They are called on
the group's event loop and must not raise or block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from derecho_async.core import Delivered, ViewInstalled

__all__ = ["GroupObserver"]


class GroupObserver:
    """Hooks a group calls (see the module header); every one is a no-op here."""

    def delivered(self, member: int, events: Sequence[Delivered]) -> None:
        """``events`` were delivered at ``member``, in this order."""

    def view_installed(self, member: int, event: ViewInstalled) -> None:
        """``member`` installed ``event.view``."""

    def snapshot_taken(self, member: int, view_id: int, joiner: int,
                       state: Mapping[str, object]) -> None:
        """``member`` took ``state`` (actor name -> ``Actor.snapshot()`` value) at the cut of
        view ``view_id`` for ``joiner``."""

    def restored(self, member: int, view_id: int, state: Mapping[str, object]) -> None:
        """``member`` joined in view ``view_id`` and restored ``state`` (as above)."""

    def handler_finished(self, member: int, subgroup: str, version: tuple[int, int],
                         ok: bool, value: object) -> None:
        """An ordered call's handler finished at ``member`` with this outcome."""
