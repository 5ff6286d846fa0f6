"""The tcp transport: members on several hosts, over authenticated streams (mutual TLS optional).

Theory of operation (DESIGN.md §5.3), by module: :mod:`.handshake` (mutual proof of the group's
secret, ids and listen addresses), :mod:`.identity` (member ids bound to TLS certificates),
:mod:`.framing` (the frames a stream carries and the check of a received header), :mod:`.limits`
(what connections not admitted may cost: caps, deadline, rate-limited logs), :mod:`.beacon`
(liveness datagrams from a native thread), :mod:`.streams`
(streams, links and the state the sides share), :mod:`.dialling` and :mod:`.accepting` (the two
sides of a stream's start) and :mod:`.transport` (:class:`TcpTransport`: one stream per pair,
admission, sending, reading). The registry (``transport.registry``) names :func:`from_config`."""

from __future__ import annotations

from derecho_async.transport.tcp.limits import TcpLimits
from derecho_async.transport.tcp.transport import (
    TcpTransport,
    beacon_settings,
    from_config,
    security,
)

__all__ = ["TcpLimits", "TcpTransport", "beacon_settings", "from_config", "security"]
