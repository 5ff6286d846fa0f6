"""The pure protocol core: shared-state table, ordered multicast, membership and views.

Nothing in this package performs I/O, reads a clock, draws random numbers or starts threads
(DESIGN.md §3; ``tests/test_core_purity.py`` enforces it). Time enters through
:meth:`Member.tick`, remote writes through :meth:`Member.receive_push`, channel messages through
:meth:`Member.receive_message`; every effect leaves as data in a :class:`Ready`.
"""

from __future__ import annotations

from derecho_async.core.effects import (
    DataKey,
    Delivered,
    Evicted,
    Left,
    Partitioned,
    Persisted,
    Push,
    Ready,
    Send,
    SendFailed,
    Suspected,
    Transfer,
    ViewInstalled,
)
from derecho_async.core.layout import Layout, ShardAssignment, SubgroupSpec
from derecho_async.core.member import CoreConfig, Member, MemberState
from derecho_async.core.messages import (
    JoinRequest,
    Message,
    Welcome,
    decode_message,
    encode_message,
)
from derecho_async.core.view import View

__all__ = [
    "CoreConfig",
    "DataKey",
    "Delivered",
    "Evicted",
    "JoinRequest",
    "Layout",
    "Left",
    "Member",
    "MemberState",
    "Message",
    "Partitioned",
    "Persisted",
    "Push",
    "Ready",
    "Send",
    "SendFailed",
    "ShardAssignment",
    "SubgroupSpec",
    "Suspected",
    "Transfer",
    "View",
    "ViewInstalled",
    "Welcome",
    "decode_message",
    "encode_message",
]
