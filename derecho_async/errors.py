"""The exceptions derecho_async raises.

Every error the library raises on purpose derives from :class:`DerechoError`. The split follows
who is at fault: :class:`ConfigError` and :class:`UsageError` mean the caller misused the library;
:class:`ProtocolViolation` means a peer broke the protocol; :class:`PartitionedError`,
:class:`MemberFailed` and :class:`GroupClosed` report what happened to the group;
:class:`LogCorrupted` reports damaged stable storage; :class:`SubscriptionDropped` ends a
subscriber that fell too far behind. Anything else is a bug in derecho_async.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "DataLost",
    "DerechoError",
    "GroupClosed",
    "JoinRefused",
    "LogCorrupted",
    "MemberFailed",
    "PartitionedError",
    "ProtocolViolation",
    "QueueFull",
    "SubscriptionDropped",
    "UsageError",
]


class DerechoError(Exception):
    """Base class of every error derecho_async raises on purpose."""


class UsageError(DerechoError):
    """The caller used the API in a way it does not allow (wrong state, bad argument)."""


class QueueFull(DerechoError):
    """This member's queues of calls are full (``max_queued_calls`` / ``max_queued_mb``) and
    ``when_queue_full`` is ``"error"``, or the calls parked waiting for room reached
    ``max_queued_mb``: the call was not made. Retry once earlier calls completed."""


class ConfigError(DerechoError, ValueError):
    """A configuration value is missing or malformed.

    ``key`` names the offending setting and ``expected`` the form it must take.
    """

    def __init__(self, key: str, expected: str, got: object = None) -> None:
        self.key = key
        self.expected = expected
        self.got = got
        super().__init__(f"config key {key!r}: expected {expected}, got {got!r}")


class ProtocolViolation(DerechoError):
    """A peer broke the protocol: a write outside its own row, a malformed frame, a bad length.

    ``member`` is the id of the offending peer when known.
    """

    def __init__(self, message: str, member: int | None = None) -> None:
        self.member = member
        prefix = f"member {member}: " if member is not None else ""
        super().__init__(prefix + message)


class PartitionedError(DerechoError):
    """This member lost contact with a majority of its view and wedged for good.

    With partition safety on (the default) a minority never installs a new view, so no split
    brain can happen; every caller waiting on this member gets this error.
    """


class MemberFailed(DerechoError):
    """A member failed (or left) before it replied to an ordered call.

    Appears as a *value* in a reply mapping, not raised, so one failed member does not hide the
    replies of the others.
    """

    def __init__(self, member: int, reason: str = "failed before replying") -> None:
        self.member = member
        self.reason = reason
        super().__init__(f"member {member} {reason}")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, MemberFailed)
            and other.member == self.member
            and other.reason == self.reason
        )

    def __hash__(self) -> int:
        return hash((MemberFailed, self.member, self.reason))


class AuthenticationError(DerechoError):
    """A member refused this process's proof of the group's secret (or did not prove it
    itself), or it serves another group: permanent, not retried."""


class JoinRefused(DerechoError):
    """A member refused this one for good while it joined (its member id is in use by a live
    member, its certificate names another member): permanent, with the member's reason."""


class GroupClosed(DerechoError):
    """The group (or this member's place in it) has been closed; no further calls are possible."""


class LogCorrupted(DerechoError):
    """Stable storage holds a damaged record that is not a torn tail left by a crash.

    ``path`` is the damaged file, ``offset`` the byte offset of the damaged record in it and
    ``why`` what was wrong. Raised instead of dropping data that may have been acknowledged.
    """

    def __init__(self, path: Path, offset: int, why: str) -> None:
        self.path = path
        self.offset = offset
        self.why = why
        super().__init__(f"{path}: damaged record at offset {offset}: {why}")


class DataLost(DerechoError):
    """A restart after total failure would lose calls a member acknowledged as durable: no
    restarted member's files hold them (logs cut short or lost at rest). The group does not
    restart below what it acknowledged; the message names the subgroup and the gap. Restore
    the files, or accept the loss with ``derecho-async repair --accept-loss``."""


class SubscriptionDropped(DerechoError):
    """A subscriber (``group.subscribe``) fell more deliveries behind than its ``max_backlog``:
    the member dropped it rather than hold more. Subscribe again (``since=`` the last version
    taken, with a ``data_dir``, to miss nothing)."""
