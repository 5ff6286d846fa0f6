# Theory of operation
# -------------------
# ``RdmaTransport`` is the Transport API over the parts of this package. It validates its
# settings (the parts read them when used), opens the device, starts the composed tcp channel
# and parses what arrives there (user messages, CONNECT, RESET); it hands each push to the send
# path of the peer's current endpoint, and sends each message over tcp or, from
# ``bulk_threshold`` bytes on, down the bulk path; ``set_view`` revokes the links of members
# that left the view. See docs/DESIGN.md §5.4.
"""The rdma transport: the Transport API over the link table and the send and receive paths."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from derecho_async.errors import ConfigError, DerechoError, UsageError
from derecho_async.transport.base import (
    GROUP_MESSAGE_LIMIT,
    Transport,
    TransportHandler,
    log,
)
from derecho_async.transport.rdma import verbs
from derecho_async.transport.rdma.codec import (
    CHAN,
    K_CONNECT,
    K_RESET,
    K_USER,
    MAX_BULK_BLOCK,
    MAX_BULK_MESSAGE,
    MAX_BULK_REGION,
    MAX_BULK_SLOTS,
    MAX_INBOX,
    MIN_BULK_BLOCK,
    MIN_INBOX,
    ConnectInfo,
    Malformed,
    decode_reset,
)
from derecho_async.transport.rdma.connections import Connections
from derecho_async.transport.rdma.endpoint import Device
from derecho_async.transport.tcp import TcpTransport, beacon_settings, security

if TYPE_CHECKING:
    from derecho_async.config import Config

__all__ = ["ConnectInfo", "RdmaTransport", "from_config"]


class _ChannelHandler:
    """The composed tcp transport's handler: forwards into the rdma transport."""

    def __init__(self, outer: RdmaTransport) -> None:
        self._outer = outer

    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        # never set_view on the channel, so pushes over it are held and bounded there
        log.warning("member %d: push over the rdma control channel ignored", sender)

    def on_message(self, sender: int, payload: bytes) -> None:
        self._outer._on_channel(sender, payload)

    def on_failure(self, member: int, reason: str) -> None:
        self._outer._on_channel_failure(member, reason)


class RdmaTransport(Transport):
    """Transport over RDMA (pyverbs): pushes as RDMA WRITEs, messages over authenticated tcp.

    ``listen``, ``secret``, ``group``, ``peers``, ``ssl_server``, ``ssl_client``, ``cert_ids``,
    ``admission`` and ``max_frame`` are those of the composed :class:`TcpTransport` (peers are
    addressed by their tcp listen address; the views this transport is given admit their
    members on it).
    ``device``/``port``/``gid_index`` choose the RDMA port (None: first device with an active
    ``port``; a RoCE v2 IPv4 GID). ``inbox_bytes`` is the ring each peer writes into (also the
    size of this member's staging mirror per peer). ``busy_poll`` polls the completion queues
    from the event loop while completions keep arriving, instead of waiting for every wakeup.

    Bulk path: a message of at least ``bulk_threshold`` bytes (0: never) is written by RDMA into
    a region of ``bulk_slots`` blocks of ``bulk_block`` bytes that the receiver registered for
    this sender only, pipelined (up to ``bulk_slots`` blocks in flight); smaller messages go
    over tcp. ``bulk_max_message`` is the largest bulk message this member accepts.
    """

    #: queue depths per queue pair
    send_depth: int = 256
    recv_depth: int = 256
    #: RC attributes: ack timeout exponent (4.096 us * 2**timeout), retries, RNR timer code
    qp_timeout: int = 14
    qp_retry_cnt: int = 7
    qp_rnr_retry: int = 7  # 7 = retry forever on receiver-not-ready
    min_rnr_timer: int = 12
    #: signal at least every this many work requests
    signal_every: int = 16
    #: after an endpoint failed, pushes to that peer are dropped for this long (seconds)
    reconnect_backoff: float = 0.5
    #: bounds on pushes waiting for an endpoint / space, and on messages waiting for pushes
    max_backlog_bytes: int = 256 << 20
    max_held_bytes: int = 1 << 30
    #: busy polling keeps going this long after the last completion (seconds)
    busy_poll_window: float = 0.002
    #: bound on bulk messages queued per peer (they are referenced, not copied, when bytes)
    max_bulk_backlog_bytes: int = 4 << 30

    def __init__(
        self,
        member_id: int,
        listen: tuple[str, int],
        *,
        secret: bytes | None,
        group: str = "",
        peers: Mapping[int, tuple[str, int] | str] = {},
        device: str | None = None,
        port: int = 1,
        gid_index: int | None = None,
        busy_poll: bool = False,
        inbox_bytes: int = 512 << 10,
        ssl_server: ssl.SSLContext | None = None,
        ssl_client: ssl.SSLContext | None = None,
        cert_ids: bool = False,
        admission: bool = False,
        max_frame: int = 64 << 20,
        bulk_threshold: int = 256 << 10,
        bulk_block: int = 1 << 20,
        bulk_slots: int = 8,
        bulk_max_message: int = 1 << 30,
        beacon_s: float = 0.0,
        hold_s: float = 0.0,
    ) -> None:
        super().__init__(member_id)
        if device is not None and (not isinstance(device, str) or not device):
            raise ConfigError("rdma_device", "None or an RDMA device name", device)
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 255:
            raise ConfigError("rdma_port", "an integer from 1 to 255", port)
        if gid_index is not None and (
            isinstance(gid_index, bool) or not isinstance(gid_index, int) or gid_index < 0
        ):
            raise ConfigError("rdma_gid_index", "None or a non-negative integer", gid_index)
        if (
            isinstance(inbox_bytes, bool)
            or not isinstance(inbox_bytes, int)
            or not MIN_INBOX <= inbox_bytes <= MAX_INBOX
            or inbox_bytes % 8
        ):
            raise ConfigError(
                "inbox_bytes", f"a multiple of 8 from {MIN_INBOX} to {MAX_INBOX}", inbox_bytes
            )

        def _int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not _int(bulk_threshold) or bulk_threshold < 0:
            raise ConfigError(
                "bulk_threshold", "a non-negative integer (0: no bulk path)", bulk_threshold
            )
        if (
            not _int(bulk_block)
            or not MIN_BULK_BLOCK <= bulk_block <= MAX_BULK_BLOCK
            or bulk_block % 8
        ):
            raise ConfigError(
                "bulk_block",
                f"a multiple of 8 from {MIN_BULK_BLOCK} to {MAX_BULK_BLOCK}",
                bulk_block,
            )
        if (
            not _int(bulk_slots)
            or not 1 <= bulk_slots <= MAX_BULK_SLOTS
            or bulk_slots * bulk_block > MAX_BULK_REGION
        ):
            raise ConfigError(
                "bulk_slots",
                f"from 1 to {MAX_BULK_SLOTS}, with bulk_slots * bulk_block <= {MAX_BULK_REGION}",
                bulk_slots,
            )
        if not _int(bulk_max_message) or not 1 <= bulk_max_message <= MAX_BULK_MESSAGE:
            raise ConfigError(
                "bulk_max_message", f"an integer from 1 to {MAX_BULK_MESSAGE}", bulk_max_message
            )
        self.bulk_threshold = bulk_threshold
        self.bulk_block = bulk_block
        self.bulk_slots = bulk_slots
        self.bulk_max_message = bulk_max_message
        self._tcp = TcpTransport(
            member_id,
            listen,
            secret=secret,
            group=group,
            peers=peers,
            ssl_server=ssl_server,
            ssl_client=ssl_client,
            cert_ids=cert_ids,
            admission=admission,
            max_frame=max_frame,
            beacon_s=beacon_s,
            hold_s=hold_s,
        )
        self._tcp.on_refused = self._channel_refused  # (its failure comes on_failure)
        self.busy_poll = bool(busy_poll)
        self.inbox_bytes = inbox_bytes
        self._device = Device(device, port, gid_index, self)
        self._conns = Connections(
            member_id,
            self._device,
            self,
            channel=self._tcp.send,
            report=self._report_failure,
            deliver=self._deliver_message,
            push_arrived=self._gate.push_arrived,
        )
        self._send = self._conns.send
        self._recv = self._conns.recv
        self._view_id = -1  # newest view installed, and its members
        self._view_members: frozenset[int] | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        """The tcp listen address peers use to reach this member."""
        return self._tcp.address

    @property
    def local(self) -> verbs.DevicePort | None:
        """The RDMA port in use (None before start)."""
        return self._device.local

    async def start(self, handler: TransportHandler) -> None:
        """Open the RDMA device, then start the tcp channel."""
        loop = self._begin_start(handler)
        self._conns.start(loop)
        try:
            pv = self._device.open()
            await self._tcp.start(_ChannelHandler(self))
        except BaseException:
            self._closed = True
            self._conns.close()
            self._device.close()
            raise
        local = self._device.local
        assert local is not None
        log.info(
            "member %d: rdma on %s port %d gid index %d (pyverbs from %s); bulk path: %s; "
            "GPU payloads: %s",
            self.member_id,
            local.device,
            local.port,
            local.gid_index,
            pv.origin,
            (
                f"messages >= {self.bulk_threshold} bytes in {self.bulk_slots} x "
                f"{self.bulk_block}-byte blocks"
                if self.bulk_threshold
                else "off"
            ),
            verbs.gpu_path_summary(pv),
        )

    async def close(self) -> None:
        """Tell paired peers, tear every endpoint down, close the channel and the device."""
        if self._closed:
            return
        self._closed = True
        self._conns.close()
        with contextlib.suppress(Exception):
            await self._tcp.close()
        self._gate.clear()
        self._device.close()

    async def drain(self) -> None:
        """Wait until every push was written and completed locally (or its link failed) and
        the channel's buffers are empty."""
        self._check_usable()
        await self._conns.drain()
        if not self._closed:
            await self._tcp.drain()

    # -- peers -------------------------------------------------------------------------------
    def set_view(self, view_id: int, members: Sequence[int], row_bytes: int) -> None:
        """Install ``view_id``; links to members of the previous view that are not in this one
        are closed (their queue pairs destroyed, the regions granted to them deregistered)."""
        super().set_view(view_id, members, row_bytes)
        self._tcp.admit_view(view_id, members)
        self._tcp.beacon_view(view_id)
        if view_id <= self._view_id:
            return
        old, new = self._view_members, frozenset(members)
        self._view_id, self._view_members = view_id, new
        for peer in sorted((old or frozenset()) - new - {self.member_id}):
            self._conns.revoke(peer, view_id)

    def add_peer(self, member_id: int, address: object) -> None:
        """Learn the tcp listen address of ``member_id`` (None keeps what is known)."""
        self._tcp.add_peer(member_id, address)

    # -- sending -----------------------------------------------------------------------------
    def push(
        self, view_id: int, offset: int, data: bytes | memoryview, targets: Sequence[int]
    ) -> None:
        """Write ``data`` at table offset ``offset`` of view ``view_id`` at every target."""
        mv, remote = self._check_push(view_id, offset, data, targets)
        for t in remote:
            ep = self._conns.endpoint_for(t)
            if ep is not None:
                self._send.push(ep, view_id, offset, mv)

    def send(self, to: int, payload: bytes) -> None:
        """Send ``payload`` to ``to``, ordered with pushes on the link: over the tcp channel,
        or, from ``bulk_threshold`` bytes on, by RDMA into the peer's bulk region."""
        tcp_limit = self._tcp.max_frame - CHAN.size
        bulk = self.bulk_threshold > 0
        limit = max(tcp_limit, self.bulk_max_message) if bulk else tcp_limit
        mv = self._check_send(
            to,
            payload,
            limit,
            f"max_frame={self._tcp.max_frame} minus the {CHAN.size}-byte rdma header"
            + (f" and bulk_max_message={self.bulk_max_message}" if bulk else ""),
        )
        if mv is None:
            return
        n = len(mv)
        if bulk and n >= self.bulk_threshold:
            # a message only the bulk path can carry does not wait out the reconnect back-off
            ep = self._conns.endpoint_for(to, force=n > tcp_limit)
            if ep is not None and not ep.dead:
                info = ep.peer_info
                if info is None and n > tcp_limit:
                    self._send.queue_bulk(ep, payload, mv)  # checked against the peer on pairing
                    return
                if info is not None and info.bslots:
                    if n > info.bmax:
                        raise UsageError(
                            f"message of {n} bytes exceeds member {to}'s bulk limit {info.bmax}"
                        )
                    self._send.queue_bulk(ep, payload, mv)
                    return
                if n > tcp_limit:
                    raise UsageError(
                        f"message of {n} bytes to member {to} needs the rdma bulk path, "
                        f"and member {to} grants none"
                    )
            elif n > tcp_limit:
                reason = f"no rdma link to member {to} for a message of {n} bytes (dropped)"
                log.warning("member %d: %s", self.member_id, reason)
                assert self._loop is not None
                self._loop.call_soon(self._report_failure, to, reason)
                return
        link = self._conns.links.get(to)
        ep = link.ep if link is not None else None
        if ep is not None and not ep.dead:
            hdr = CHAN.pack(K_USER, ep.id, ep.pushes_issued)
            ep.msgs_sent += 1
        else:
            hdr = CHAN.pack(K_USER, 0, 0)
        self._tcp.send(to, b"".join((hdr, mv)))

    # -- the tcp channel ---------------------------------------------------------------------
    def _on_channel(self, sender: int, payload: bytes) -> None:
        """One message of the tcp channel: a user message, CONNECT or RESET (validated)."""
        if self._closed:
            return
        if len(payload) < CHAN.size:
            self._channel_violation(sender, f"channel message of {len(payload)} bytes")
            return
        kind, ep_id, count = CHAN.unpack_from(payload)
        body = payload[CHAN.size :]
        if kind == K_USER:
            self._recv.on_user_message(sender, ep_id, count, body)
        elif kind == K_CONNECT:
            try:
                info = ConnectInfo.decode(body)
                if info.ep != ep_id or count:
                    raise Malformed("CONNECT header and body disagree")
            except Malformed as exc:
                self._channel_violation(sender, str(exc))
                return
            self._conns.on_connect(sender, info)
        elif kind == K_RESET:
            try:
                dst, why, graceful = decode_reset(body)
            except Malformed as exc:
                self._channel_violation(sender, str(exc))
                return
            self._conns.on_reset(sender, ep_id, dst, why, graceful)
        else:
            self._channel_violation(sender, f"unknown channel message kind {kind}")

    def _channel_violation(self, sender: int, why: str) -> None:
        reason = f"protocol violation by member {sender}: {why}"
        log.warning("member %d: %s", self.member_id, reason)
        link = self._conns.links.get(sender)
        if link is not None and link.ep is not None:
            self._conns.fail(link.ep, reason, report=False)
        self._report_failure(sender, reason)

    @property
    def beacon_on(self) -> bool:
        """Whether the tcp channel's beacon thread runs (see TcpTransport)."""
        return self._tcp.beacon_on

    def beacon_tick(self) -> Sequence[int]:
        """The peers whose beacon datagrams arrived (the tcp channel's beacon)."""
        return self._tcp.beacon_tick()

    def known_addresses(self) -> dict[int, tuple[str, int]]:
        """The tcp channel's addresses (see TcpTransport)."""
        return self._tcp.known_addresses()

    def learn_address(self, member_id: int, address: tuple[str, int]) -> None:
        """For the tcp channel (see TcpTransport)."""
        self._tcp.learn_address(member_id, address)

    async def identify(self, address: object, timeout: float) -> int:
        """The member at ``address`` (the ``contact`` key), through the tcp channel."""
        return await self._tcp.identify(address, timeout)

    def _channel_refused(self, member: int, error: DerechoError) -> None:
        if self.on_refused is not None:
            self.on_refused(member, error)

    def _on_channel_failure(self, member: int, reason: str) -> None:
        link = self._conns.links.get(member)
        if link is not None and link.ep is not None:
            self._conns.fail(link.ep, reason, report=False, tell=False)
        self._report_failure(member, reason)


def from_config(config: Config) -> RdmaTransport:
    """The rdma transport of the member ``config`` describes (see ``transport.registry``); its
    tcp channel is secured as the tcp transport's streams are (:func:`.tcp.transport.security`)."""
    from derecho_async.config import parse_hostport

    beacon_s, hold_s = beacon_settings(config)
    return RdmaTransport(
        config.member_id,
        parse_hostport(config.listen, "listen"),
        group=config.group,
        peers={m: parse_hostport(a, "peers") for m, a in config.peers.items()},
        device=config.rdma_device,
        port=config.rdma_port,
        gid_index=config.rdma_gid_index,
        max_frame=GROUP_MESSAGE_LIMIT,  # large messages take tcp while a link is not paired
        admission=True,
        beacon_s=beacon_s,
        hold_s=hold_s,
        **security(config),
    )
