"""RDMA transport: pushes as RDMA WRITEs into per-peer inboxes, messages over tcp."""

from __future__ import annotations

from derecho_async.transport.rdma.transport import ConnectInfo, RdmaTransport, from_config
from derecho_async.transport.rdma.verbs import RdmaUnavailable

__all__ = ["ConnectInfo", "RdmaTransport", "RdmaUnavailable", "from_config"]
