# Theory of operation
# -------------------
# Members on hosts with RDMA NICs (or Soft-RoCE). Two channels per pair of members: a composed
# tcp transport carries small messages and the control messages (CONNECT, RESET); one RC queue
# pair per peer carries pushes and large messages as RDMA WRITEs into an inbox ring (and a bulk
# region) that the receiver registered for that peer only. Counts carried on both channels keep
# each link FIFO across them. The parts: ``codec`` (control messages), ``rings`` (inbox records,
# immediate values), ``bulk`` (block bookkeeping), ``completions`` (work completions), ``verbs``
# (pyverbs), ``endpoint`` (an endpoint's verbs resources), ``connections`` (links, handshake,
# teardown), ``sendpath``, ``recvpath`` and ``transport`` (``RdmaTransport``). See
# docs/DESIGN.md §5.4.
"""RDMA transport: pushes as RDMA WRITEs into per-peer inboxes, messages over tcp."""

from __future__ import annotations

from derecho_async.transport.rdma.codec import ConnectInfo
from derecho_async.transport.rdma.transport import RdmaTransport, from_config
from derecho_async.transport.rdma.verbs import RdmaUnavailable

__all__ = ["ConnectInfo", "RdmaTransport", "RdmaUnavailable", "from_config"]
