# Theory of operation
# -------------------
# The transport layer moves one-sided row pushes and reliable messages between the members of a
# group (DESIGN.md §4.1, §5). ``base`` defines the interface every transport implements and the
# push validation they share; ``loopback`` (in-process), ``shm`` (one host, shared-memory rings)
# and ``tcp`` (several hosts, authenticated streams, optional TLS) implement it and pass one
# conformance suite (tests/transport); ``rdma`` (pyverbs RC queue pairs, loaded on demand so that
# importing this package never needs pyverbs) passes it on Soft-RoCE (scripts/rdma-tests.sh).
"""Transports: push byte ranges of my row to peers, plus a reliable message channel."""

from __future__ import annotations

from derecho_async.transport.base import Transport, TransportHandler
from derecho_async.transport.loopback import LoopbackFabric, LoopbackTransport
from derecho_async.transport.shm import ShmTransport
from derecho_async.transport.tcp import TcpTransport

__all__ = [
    "LoopbackFabric",
    "LoopbackTransport",
    "ShmTransport",
    "TcpTransport",
    "Transport",
    "TransportHandler",
]
