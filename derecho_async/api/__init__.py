"""The user API: the group facade, replicated actors, calls, replies and handles.

See docs/DESIGN.md §7.2.
"""

from __future__ import annotations

from derecho_async.api.actor import Actor, ActorSpec, actor_spec, ordered, p2p
from derecho_async.api.group import Group, HandlerError, Replies, SubgroupHandle, Versioned

__all__ = [
    "Actor",
    "ActorSpec",
    "Group",
    "HandlerError",
    "Replies",
    "SubgroupHandle",
    "Versioned",
    "actor_spec",
    "ordered",
    "p2p",
]
