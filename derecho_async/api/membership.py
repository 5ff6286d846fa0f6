"""This member's standing in its group, the one piece of state the API layer's parts share.

Theory of operation: the :class:`~derecho_async.api.group.Group` facade and its parts (the
:class:`~derecho_async.api.calls.CallTable`, the :class:`~derecho_async.api.delivery.Dispatcher`
and the :class:`~derecho_async.api.p2pcalls.P2PServer`) each own their own tables; what they all
need to know of the member itself (its driver once started, the view it is in, why it is out,
whether a handler made it leave) lives in one :class:`Membership` that the Group writes and
every part reads. See docs/DESIGN.md §7.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from derecho_async.errors import UsageError

if TYPE_CHECKING:
    from derecho_async.config import Config
    from derecho_async.core import View
    from derecho_async.runtime.driver import Driver

__all__ = ["Membership"]


@dataclass(slots=True, eq=False)
class Membership:
    """What every part of a group reads of this member; written by the Group (``driver`` when
    it starts, ``view`` at each install, ``closed`` once it is out) and by the dispatcher
    (``exiting``, when a handler raised ``SystemExit`` or ``KeyboardInterrupt``)."""

    config: Config
    me: int
    driver: Driver | None = None
    view: View | None = None
    closed: BaseException | None = None
    exiting: BaseException | None = None

    def check_open(self) -> Driver:
        """The driver of an open group: raises why this member is out, or ``UsageError``
        before it is in its first view."""
        if self.closed is not None:
            raise self.closed
        if self.driver is None or self.driver.core is None or self.view is None:
            raise UsageError("the group is not started")
        return self.driver
