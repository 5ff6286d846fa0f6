# Theory of operation
# -------------------
# The transport layer moves one-sided row pushes and reliable messages between the members of a
# group (DESIGN.md §4.1, §5). ``base`` defines the interface every transport implements and the
# push validation they share; ``registry`` names every transport and the functions of its own
# module or package that build it, its bulk data plane and its clean-up. Each transport lives in
# a module or package of its own under this one, imported only when the registry (or a user)
# asks for it, so importing this package never loads a transport or its libraries. Import a
# transport's class from its own module (``derecho_async.transport.shm.ShmTransport``).
"""Transports: push byte ranges of my row to peers, plus a reliable message channel."""

from __future__ import annotations

from derecho_async.transport.base import Transport, TransportHandler

__all__ = [
    "Transport",
    "TransportHandler",
]
