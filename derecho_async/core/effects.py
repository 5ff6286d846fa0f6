"""What the core asks its driver to do, as data.

A :class:`Ready` lists the pushes to perform (in order: a link delivers them in the order
issued), channel messages to send, data-plane transfers to start, and the ordered *events* the
application sees (deliveries, installed views, suspicions, errors). The driver takes it, calls
``Member.advance(ready)`` (what the core adds meanwhile belongs to the next Ready), then carries
it all out, events in list order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from derecho_async.core.messages import Message
from derecho_async.core.view import View

__all__ = [
    "DataKey",
    "Delivered",
    "Event",
    "Evicted",
    "Left",
    "Partitioned",
    "Persisted",
    "Push",
    "Ready",
    "Send",
    "SendFailed",
    "Suspected",
    "Transfer",
    "ViewInstalled",
]


class DataKey(NamedTuple):
    """Names one large message's bytes on the data plane: unique per view, sender and message.

    The per-message records of the large-message path (this, :class:`Push`, :class:`Transfer`)
    are named tuples for the reason :class:`Delivered` gives; a data plane may
    use a key as the plain ``(view_id, sender, msg_no)`` tuple it equals.
    """

    view_id: int
    sender: int
    msg_no: int


class Push(NamedTuple):
    """Copy ``data`` into table offset ``offset`` of view ``view_id`` at each of ``targets``."""

    view_id: int
    offset: int
    data: bytes
    targets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``message`` to member ``to`` on the reliable channel.

    When ``attach_state`` is set the message is a :class:`Welcome` whose ``state`` the driver
    fills with a state-transfer ticket, made after every earlier event of the same Ready (the
    state itself streams after the fence; see ``runtime.statexfer``).
    """

    to: int
    message: Message
    attach_state: bool = False


class Transfer(NamedTuple):
    """Start moving a large payload (``nbytes`` long) to ``targets`` on the data plane."""

    key: DataKey
    payload: object
    nbytes: int
    targets: tuple[int, ...]


class Delivered(NamedTuple):
    """An ordered message, stable and delivered with version ``(view_id, seq)``.

    Immutable like the other events, but a named tuple rather than a frozen dataclass: one is
    made per delivered message at every member, and a tuple is built in one step where a frozen
    dataclass sets each field through ``object.__setattr__`` (about 4% of a member's time in the
    3-member throughput benchmark).
    """

    subgroup: str
    shard: int
    view_id: int
    seq: int
    sender: int
    msg_no: int
    payload: object


@dataclass(frozen=True, slots=True)
class ViewInstalled:
    """A new view is installed. ``state`` is what the Welcome that admitted this joiner carried
    (a snapshot, or the runtime's ticket for a state it streams), before its first delivery; None
    for members that were already in the group. ``sponsor`` is the member whose Welcome that was.
    ``adequate`` is False when the layout cannot be satisfied by these members: the view stands,
    but no subgroup traffic flows until a later view is adequate."""

    view: View
    joined: tuple[int, ...]
    departed: tuple[int, ...]
    adequate: bool
    state: bytes | None = None
    sponsor: int | None = None


@dataclass(frozen=True, slots=True)
class Suspected:
    """This member now suspects ``member`` (its row is frozen; a view change follows).

    ``cause`` says why: ``"silent"`` (no heartbeat within the suspicion timeout), ``"link"`` (the
    transport lost it), ``"violation"`` (it broke the protocol), ``"peer"`` (another member
    suspects it) or ``"left"`` (it left)."""

    member: int
    cause: str = "silent"


@dataclass(frozen=True, slots=True)
class Partitioned:
    """This member lost a majority of view ``view_id`` and wedged for good."""

    view_id: int


@dataclass(frozen=True, slots=True)
class Evicted:
    """The rest of the group removed this member from view ``view_id``."""

    view_id: int


@dataclass(frozen=True, slots=True)
class Left:
    """This member left the group: asked to by the application, or (``reason`` says why) because
    a message could not land here and would otherwise hold the others up for good."""

    view_id: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class SendFailed:
    """Message ``msg_no`` can no longer be delivered (its subgroup no longer has this member as
    a sender, or this member left the group)."""

    subgroup: str
    msg_no: int
    reason: str


@dataclass(frozen=True, slots=True)
class Persisted:
    """The persistence frontier of one shard rose: every member of the shard in view ``view_id``
    published a ``persisted`` word of at least ``mark`` (the column's encoding: 1 = everything
    delivered before this view is durable at every member; ``k + 1`` = that, and every seq
    below ``k`` of this view). Emitted only where some member publishes the column."""

    subgroup: str
    shard: int
    view_id: int
    mark: int


Event = (
    Delivered | ViewInstalled | Suspected | Partitioned | Evicted | Left | SendFailed | Persisted
)


@dataclass(slots=True)
class Ready:
    """Everything the driver must carry out (it calls ``advance`` when it takes it)."""

    pushes: list[Push] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.pushes
            or self.sends
            or self.transfers
            or self.events
            or self.violations
        )
