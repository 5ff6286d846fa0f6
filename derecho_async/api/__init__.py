"""The user API: the :class:`Group` facade, replicated actors, calls, replies and handles.

Theory of operation: :mod:`.group` is the facade and the driver's host; it holds a
:class:`~.calls.CallTable` (this member's own calls), a :class:`~.delivery.Dispatcher`
(delivered calls run here) and a :class:`~.p2pcalls.P2PServer` (p2p calls), which share only
the member's :class:`~.membership.Membership`. :mod:`.actor` declares actors, :mod:`.handles`
the objects calls are made through. See docs/DESIGN.md §7.2.
"""

from __future__ import annotations

from derecho_async.api.actor import Actor, ActorSpec, OrderedDef, P2PDef, actor_spec, ordered, p2p
from derecho_async.api.calls import HandlerError, Replies
from derecho_async.api.client import (
    Client,
    ClientHandle,
    ClientOrderedMethod,
    ClientP2PCall,
    ClientP2PMethod,
)
from derecho_async.api.group import Group
from derecho_async.api.handles import OrderedMethod, P2PCall, P2PMethod, SubgroupHandle
from derecho_async.api.logged_calls import HistoryEntry
from derecho_async.api.p2pcalls import Versioned
from derecho_async.api.sharding import Sharded

__all__ = [
    "Actor",
    "ActorSpec",
    "Client",
    "ClientHandle",
    "ClientOrderedMethod",
    "ClientP2PCall",
    "ClientP2PMethod",
    "Group",
    "HandlerError",
    "HistoryEntry",
    "OrderedDef",
    "OrderedMethod",
    "P2PCall",
    "P2PDef",
    "P2PMethod",
    "Replies",
    "Sharded",
    "SubgroupHandle",
    "Versioned",
    "actor_spec",
    "ordered",
    "p2p",
]
