"""derecho_async: group communication in the Derecho model for asyncio.

Members of a group host replicated actors. An ordered call is multicast to the actor's subgroup;
every member delivers the same calls in the same total order, only once they are stable, and
returns its result to the caller. Crashes, joins and leaves are agreed as views with virtual
synchrony. The protocol core (:mod:`derecho_async.core`) is pure and deterministic; the public
simulated cluster lives in :mod:`derecho_async.testing`.
"""

from __future__ import annotations

import logging
from importlib import metadata

from derecho_async.api import (
    Actor,
    Client,
    Group,
    HandlerError,
    HistoryEntry,
    Replies,
    Sharded,
    SubgroupHandle,
    Versioned,
    ordered,
    p2p,
)
from derecho_async.config import Config
from derecho_async.config.strength import new_secret
from derecho_async.core.view import View
from derecho_async.errors import (
    AuthenticationError,
    ConfigError,
    DataLost,
    DerechoError,
    GroupClosed,
    JoinRefused,
    LogCorrupted,
    MemberFailed,
    PartitionedError,
    ProtocolViolation,
    QueueFull,
    SubscriptionDropped,
    UsageError,
)
from derecho_async.launch import launch_local

# A library's manners: records go nowhere until the application configures logging.
logging.getLogger("derecho_async").addHandler(logging.NullHandler())

try:  # the one source of the version is pyproject.toml, through the installed metadata
    __version__: str = metadata.version("derecho_async")
except metadata.PackageNotFoundError:  # (imported from a source tree that was never installed)
    __version__ = "0+unknown"

__all__ = [
    "Actor",
    "AuthenticationError",
    "Client",
    "Config",
    "ConfigError",
    "DataLost",
    "DerechoError",
    "Group",
    "GroupClosed",
    "HandlerError",
    "HistoryEntry",
    "JoinRefused",
    "LogCorrupted",
    "MemberFailed",
    "PartitionedError",
    "ProtocolViolation",
    "QueueFull",
    "Replies",
    "Sharded",
    "SubgroupHandle",
    "SubscriptionDropped",
    "UsageError",
    "Versioned",
    "View",
    "__version__",
    "launch_local",
    "new_secret",
    "ordered",
    "p2p",
]
