# Theory of operation
# -------------------
# Members on hosts with RDMA NICs (or Soft-RoCE). Two channels per pair of members:
#
# * the control/message channel is a composed ``TcpTransport`` (same listen address, peers and
#   shared-secret authentication). It carries the user's messages (those below the bulk
#   threshold, or sent before the link's queue pair is paired) and the rdma control messages
#   (CONNECT, RESET); every payload on it starts with a 17-byte header (kind u8, endpoint u64,
#   count u64).
# * pushes, and messages of at least ``bulk_threshold`` bytes (the data plane's DATA frames),
#   travel over one RC queue pair per peer as RDMA WRITEs.
#
# Inboxes. For every peer a member registers a private *inbox*: a ring of ``inbox_bytes`` in its
# own memory region with remote-write access, whose address and rkey are sent to that peer only
# (in its CONNECT). A peer can therefore write nothing but its own inbox: the NIC rejects any
# other address (the writer's and the owner's queue pairs both go to the error state, which is
# reported as a failure of the writer). A push is written into the receiver's inbox as a record
# (32-byte header: type, flags, length, view_id, table offset, messages-before; then the bytes,
# padded to 8) and handed to ``on_push`` after the receiver validated the header and passed the
# push through the ``PushGate``, which confines it to the sender's row of that view. Rows are not
# written in place: a later push to the same bytes would overwrite an earlier one before the
# receiver read it, and the transport contract delivers every push, whole and in order.
#
# Sending. The sender keeps a registered staging mirror of the peer's inbox: ``push`` copies
# header and bytes into the mirror at the ring position they will occupy remotely, and a flush
# (once per loop iteration) posts the new bytes as one RDMA WRITE per contiguous span. The last
# write of a flush is WRITE_WITH_IMM; its immediate value (bit 31 clear) carries the new ring
# head in 8-byte units (mod 2**30) and bit 30 "please return credit". A record never wraps: a PAD
# record fills the end of the ring (or, when fewer than 32 bytes are left, both sides skip them).
# Pushes larger than a quarter of the inbox are split at 8-byte aligned table offsets.
#
# Credit. The receiver consumes records in order and returns its consumed position to the sender
# as a zero-length SEND_WITH_IMM (bit 31 set) when a quarter of the ring was consumed since the
# last return, or after consuming data the sender flagged. The sender reuses ring space only
# when it is credited *and* its own writes covering it completed (signalled completions; every
# 16th work request, and every flagged doorbell, is signalled). Pushes that do not fit wait in a
# backlog (FIFO, bounded); posted receives are reposted as they complete; an empty receive queue
# only delays the peer (RNR retry is infinite).
#
# Bulk messages. With each endpoint a member also registers a *bulk region* of ``bulk_slots``
# blocks of ``bulk_block`` bytes (remote write), granted like the inbox to that one peer (its
# address, rkey, block size, slot count and the largest message accepted travel in CONNECT). A
# message of at least ``bulk_threshold`` bytes, once the link is paired, is queued behind the
# link's pushes; when it reaches the head it is cut into full blocks (the last one shorter).
# Block k of the link (counted over all its bulk messages) goes to slot k mod slots: the sender
# copies it into a registered staging copy of the region, stages a BULK record in the ring
# (type 3; length = block length, view_id = message length, offset = block offset, the usual
# messages-before; no ring payload), and the flush posts, per block, a plain RDMA WRITE of the
# block into the slot and then the ring up to that record with a WRITE_WITH_IMM doorbell asking
# for credit. On an RC queue pair the block is placed before the doorbell's completion, so the
# receiver, reading the record in ring order, copies the block out of its slot into the message
# being assembled, consumes the record and returns credit; a slot is reused only once the ring
# credit covers its record. Up to ``bulk_slots`` blocks are in flight (pipelined: credit for the
# first returns while the others are written). The receiver checks every record against the
# message in progress (first block at offset 0, total within its limit and unchanged, offsets
# consecutive, full blocks except the final one, final flag exactly at the end): any mismatch is
# a protocol violation of that peer (the link is torn down and reported), never a crash. A
# completed message is handed to ``on_message`` and counts, for the order between the channels,
# as one *push* of the link (a later small message waits for it; it waits for earlier small
# messages like any push). A link torn down mid-transfer discards the partial message and the
# queued ones, and reports the failure. Until a link is paired, large messages that fit a tcp
# frame go over tcp (same order guarantees); larger ones wait for the pairing. GPU payloads are
# staged through host memory by the data plane before they reach the transport (the dma-buf
# registration in verbs.py is unverified and unused; the start-up line says which path holds).
#
# Order between the two channels. Each (sender, receiver) link is FIFO across pushes and
# messages: a message carries the number of pushes the sender issued before it on its current
# endpoint, a push record the number of messages; the receiver delivers a message only after
# that many pushes, and a push only after that many messages. Messages overtake pushes that the
# sender could not transmit yet (no endpoint paired, e.g. for a view the peer has not installed).
#
# Endpoints. An endpoint (queue pair, completion queue on its own completion channel, inbox,
# mirror) has a random 64-bit id. Creating one sends CONNECT(src=id, dst=0); a member answering
# a dst=0 CONNECT pairs with it and replies CONNECT(src=its id, dst=the peer's id); a CONNECT for
# an endpoint that no longer exists is ignored, one from a peer endpoint that replaced the paired
# one resets the link. Every received field (QP number, PSN, GID, address, rkey, size, bulk
# region) is validated before use; nothing is unpickled or evaluated.
#
# Views. Connection data is exchanged per link when the link is first used -- at bootstrap, and
# for a joiner when the first push or large message of the view that admits it goes out; the
# joiner itself connects the same way. ``set_view`` closes the links to members of the previous
# view that are not in the new one (graceful RESET, no failure report): their queue pairs are
# destroyed and the regions granted to them deregistered, so a member that left keeps no rkey
# into this member's memory; talking to it again builds a fresh endpoint with fresh keys.
#
# Completions. Each completion channel's fd is non-blocking and registered with
# ``loop.add_reader``; the reader collects the channel's events, acknowledges them in batches,
# re-arms the CQ, then drains it. With ``busy_poll`` the CQs are also polled from the loop
# (``call_soon``) for as long as completions keep arriving. Completion errors, queue-pair errors
# and retry exhaustion tear the endpoint down and report ``on_failure(peer, reason)``; the next
# push after a short back-off builds a fresh endpoint. A lost tcp link also tears the endpoint
# down (the counters that order the two channels are per endpoint).
"""RDMA transport: pushes as RDMA WRITEs into per-peer inboxes, messages over tcp."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from derecho_async.errors import ConfigError, UsageError
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
from derecho_async.transport.tcp import TcpTransport

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

    ``listen``, ``secret``, ``peers``, ``ssl_server``, ``ssl_client`` and ``max_frame`` are those
    of the composed :class:`TcpTransport` (peers are addressed by their tcp listen address).
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
        secret: bytes,
        peers: Mapping[int, tuple[str, int] | str] = {},
        device: str | None = None,
        port: int = 1,
        gid_index: int | None = None,
        busy_poll: bool = False,
        inbox_bytes: int = 512 << 10,
        ssl_server: ssl.SSLContext | None = None,
        ssl_client: ssl.SSLContext | None = None,
        max_frame: int = 64 << 20,
        bulk_threshold: int = 256 << 10,
        bulk_block: int = 1 << 20,
        bulk_slots: int = 8,
        bulk_max_message: int = 1 << 30,
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
            peers=peers,
            ssl_server=ssl_server,
            ssl_client=ssl_client,
            max_frame=max_frame,
        )
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

    def _on_channel_failure(self, member: int, reason: str) -> None:
        link = self._conns.links.get(member)
        if link is not None and link.ep is not None:
            self._conns.fail(link.ep, reason, report=False, tell=False)
        self._report_failure(member, reason)


def from_config(config: Config) -> RdmaTransport:
    """The rdma transport of the member ``config`` describes (see ``transport.registry``)."""
    from derecho_async.config import parse_hostport

    assert config.secret is not None  # Config requires it (the channel is authenticated tcp)
    return RdmaTransport(
        config.member_id,
        parse_hostport(config.listen, "listen"),
        secret=config.secret.encode(),
        peers={m: parse_hostport(a, "peers") for m, a in config.peers.items()},
        device=config.rdma_device,
        port=config.rdma_port,
        gid_index=config.rdma_gid_index,
        max_frame=GROUP_MESSAGE_LIMIT,  # large messages take tcp while a link is not paired
    )
