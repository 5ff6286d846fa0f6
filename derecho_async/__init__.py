"""derecho_async: group communication in the Derecho model for asyncio.

Members of a group multicast to a (sub)group; every member delivers the same messages in the same
total order, only once they are stable; crashes and joins are agreed as views with virtual
synchrony. The protocol core (:mod:`derecho_async.core`) is pure and deterministic; the public
simulated cluster lives in :mod:`derecho_async.testing`.
"""

from __future__ import annotations

from derecho_async.errors import (
    ConfigError,
    DerechoError,
    GroupClosed,
    MemberFailed,
    PartitionedError,
    ProtocolViolation,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DerechoError",
    "GroupClosed",
    "MemberFailed",
    "PartitionedError",
    "ProtocolViolation",
    "UsageError",
    "__version__",
]
