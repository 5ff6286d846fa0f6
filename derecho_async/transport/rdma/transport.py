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

import asyncio
import contextlib
import random
import socket
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from derecho_async.errors import ConfigError, UsageError
from derecho_async.transport.base import (
    GROUP_MESSAGE_LIMIT,
    Transport,
    TransportHandler,
    log,
)
from derecho_async.transport.rdma import verbs
from derecho_async.transport.rdma.bulk import (
    piece_end,
)
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
    encode_reset,
)
from derecho_async.transport.rdma.completions import (
    RECV_WR,
    WcEvent,
    classify_wc,
)
from derecho_async.transport.rdma.endpoint import Device, Endpoint, Link
from derecho_async.transport.rdma.rings import (
    IMM_NOOP,
    R_BULK,
    R_PAD,
    R_PUSH,
    REC,
    RF_FINAL,
    Placement,
    RingError,
    imm_credit,
    imm_doorbell,
)
from derecho_async.transport.tcp import TcpTransport

if TYPE_CHECKING:
    from derecho_async.config import Config

__all__ = ["ConnectInfo", "RdmaTransport", "from_config"]

_U64 = 1 << 64


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
        self._links: dict[int, Link] = {}
        self._dirty: set[Endpoint] = set()
        self._flush_scheduled = False
        self._draining = 0
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._rng = random.SystemRandom()
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
        self._begin_start(handler)
        try:
            pv = self._device.open()
            await self._tcp.start(_ChannelHandler(self))
        except BaseException:
            self._closed = True
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
        for link in self._links.values():
            ep = link.ep
            if ep is not None and ep.paired and not ep.dead:
                with contextlib.suppress(Exception):
                    self._tcp.send(link.peer, encode_reset(ep.id, ep.peer_ep, "closed", True))
            if ep is not None:
                self._destroy(ep)
            link.ep = None
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()
        self._dirty.clear()
        with contextlib.suppress(Exception):
            await self._tcp.close()
        self._gate.clear()
        self._device.close()

    async def drain(self) -> None:
        """Wait until every push was written and completed locally (or its link failed) and
        the channel's buffers are empty."""
        self._check_usable()
        assert self._loop is not None
        self._draining += 1
        try:
            while True:
                pending = [
                    link.ep
                    for link in self._links.values()
                    if link.ep is not None and not self._drained(link.ep)
                ]
                if not pending or self._closed:
                    break
                for ep in pending:
                    self._mark_dirty(ep)
                    if ep.tx is not None and not ep.signaled and ep.tx.done < ep.tx.posted:
                        self._post_imm_send(ep, IMM_NOOP, signal=True)
                fut: asyncio.Future[None] = self._loop.create_future()
                self._drain_waiters.append(fut)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(fut, 0.5)
        finally:
            self._draining -= 1
        if not self._closed:
            await self._tcp.drain()

    def _drained(self, ep: Endpoint) -> bool:
        if ep.dead:
            return True
        if ep.backlog or ep.bulk_posts:
            return False
        tx = ep.tx
        return tx is None or (tx.staged == tx.posted and tx.done >= tx.posted)

    def _wake_drainers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

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
            self._revoke(peer, view_id)

    def _revoke(self, peer: int, view_id: int) -> None:
        """Close the link to ``peer`` quietly (it left the view): a graceful RESET, no failure
        report; a later message or push to it builds a fresh endpoint with fresh keys."""
        link = self._links.get(peer)
        ep = link.ep if link is not None else None
        if link is None or ep is None or ep.dead:
            return
        if ep.paired:
            with contextlib.suppress(Exception):
                why = f"not in view {view_id}"
                self._tcp.send(peer, encode_reset(ep.id, ep.peer_ep, why, True))
        self._fail(ep, f"member {peer} left the view", report=False, tell=False)
        link.quiet_until = 0.0
        log.debug(
            "member %d: rdma link to member %d closed (view %d)", self.member_id, peer, view_id
        )

    def add_peer(self, member_id: int, address: object) -> None:
        """Learn the tcp listen address of ``member_id`` (None keeps what is known)."""
        self._tcp.add_peer(member_id, address)

    def _link(self, peer: int) -> Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = Link(peer)
        return link

    # -- sending -----------------------------------------------------------------------------
    def push(
        self, view_id: int, offset: int, data: bytes | memoryview, targets: Sequence[int]
    ) -> None:
        """Write ``data`` at table offset ``offset`` of view ``view_id`` at every target."""
        mv, remote = self._check_push(view_id, offset, data, targets)
        for t in remote:
            ep = self._endpoint_for(t)
            if ep is None:
                continue
            ep.pushes_issued += 1
            mb = ep.msgs_sent
            if ep.backlog or ep.tx is None or not self._stage(ep, view_id, offset, mv, mb):
                self._to_backlog(ep, view_id, offset, mv, mb)
            self._mark_dirty(ep)

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
            ep = self._endpoint_for(to, force=n > tcp_limit)
            if ep is not None and not ep.dead:
                info = ep.peer_info
                if info is None and n > tcp_limit:
                    self._queue_bulk(ep, payload, mv)  # checked against the peer on pairing
                    return
                if info is not None and info.bslots:
                    if n > info.bmax:
                        raise UsageError(
                            f"message of {n} bytes exceeds member {to}'s bulk limit {info.bmax}"
                        )
                    self._queue_bulk(ep, payload, mv)
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
        link = self._links.get(to)
        ep = link.ep if link is not None else None
        if ep is not None and not ep.dead:
            hdr = CHAN.pack(K_USER, ep.id, ep.pushes_issued)
            ep.msgs_sent += 1
        else:
            hdr = CHAN.pack(K_USER, 0, 0)
        self._tcp.send(to, b"".join((hdr, mv)))

    def _queue_bulk(self, ep: Endpoint, payload: object, mv: memoryview) -> None:
        """Queue a bulk message behind the link's pushes; it counts as one push for the order
        between the two channels."""
        n = len(mv)
        if ep.bulk_backlog_bytes + n > self.max_bulk_backlog_bytes:
            self._fail(
                ep,
                f"rdma link to member {ep.peer} not draining: more than "
                f"{self.max_bulk_backlog_bytes} bytes of bulk messages waiting",
            )
            return
        data = mv if isinstance(payload, bytes) else memoryview(bytes(mv))  # immutable only
        ep.pushes_issued += 1
        ep.backlog.append((-1, 0, data, ep.msgs_sent))
        ep.bulk_backlog_bytes += n
        self._mark_dirty(ep)

    def _to_backlog(
        self, ep: Endpoint, view_id: int, offset: int, mv: memoryview, mb: int
    ) -> None:
        if ep.backlog_bytes + len(mv) > self.max_backlog_bytes:
            self._fail(
                ep,
                f"rdma link to member {ep.peer} not draining: more than "
                f"{self.max_backlog_bytes} bytes of pushes waiting",
            )
            return
        data = memoryview(bytes(mv))
        ep.backlog.append((view_id, offset, data, mb))
        ep.backlog_bytes += len(data)

    def _stage(self, ep: Endpoint, view_id: int, offset: int, mv: memoryview, mb: int) -> bool:
        """Copy one whole push into the mirror if it fits entirely; False otherwise."""
        tx = ep.tx
        assert tx is not None and ep.mirror is not None
        n = len(mv)
        chunk = tx.max_payload
        if (n <= chunk and (offset + n - 1) // chunk == offset // chunk) or n == 0:
            place = tx.place(n)
            if place is None:
                return False
            self._write_record(ep, place, RF_FINAL, view_id, offset, mv, mb)
            return True
        # several pieces: stage only if all fit, else the backlog splits it as space frees
        saved = tx.staged
        pos, pieces = offset, []
        while pos < offset + n:
            end = piece_end(pos, offset + n - pos, chunk)
            place = tx.place(end - pos)
            if place is None:
                tx.staged = saved
                return False
            pieces.append((place, pos, end))
            pos = end
        for place, start, end in pieces:
            flags = RF_FINAL if end == offset + n else 0
            self._write_record(
                ep, place, flags, view_id, start, mv[start - offset : end - offset], mb
            )
        return True

    def _write_record(
        self,
        ep: Endpoint,
        place: Placement,
        flags: int,
        view_id: int,
        offset: int,
        data: memoryview,
        mb: int,
    ) -> None:
        assert ep.mirror is not None
        mm = ep.mirror.mm
        if place.pad_at is not None:
            REC.pack_into(mm, place.pad_at, R_PAD, 0, place.pad_len, 0, 0, 0)
        REC.pack_into(mm, place.at, R_PUSH, flags, len(data), view_id, offset, mb)
        if len(data):
            start = place.at + REC.size
            mm[start : start + len(data)] = data

    def _drain_backlog(self, ep: Endpoint) -> None:
        """Stage backlog pushes (splitting as needed) while space lasts."""
        tx = ep.tx
        if tx is None:
            return
        chunk = tx.max_payload
        while ep.backlog:
            view_id, offset, data, mb = ep.backlog[0]
            if view_id < 0:
                if not self._stage_bulk(ep, offset, data, mb):
                    return
                continue
            n = len(data)
            end = offset + n if n == 0 else piece_end(offset, n, chunk)
            place = tx.place(end - offset)
            if place is None:
                return
            last = end == offset + n
            self._write_record(
                ep, place, RF_FINAL if last else 0, view_id, offset, data[: end - offset], mb
            )
            if last:
                ep.backlog.popleft()
            else:
                ep.backlog[0] = (view_id, end, data[end - offset :], mb)
            ep.backlog_bytes -= end - offset

    def _stage_bulk(self, ep: Endpoint, sent: int, data: memoryview, mb: int) -> bool:
        """Stage blocks of the bulk message at the head of the backlog while slots and ring
        space last; True when it was staged whole (and left the backlog)."""
        tx, btx, stage, mirror = ep.tx, ep.btx, ep.bstage, ep.mirror
        assert tx is not None and mirror is not None
        n = len(data)
        if btx is None or stage is None:
            info = ep.peer_info
            limit = info.bmax if info is not None else 0
            self._fail(
                ep,
                f"member {ep.peer} grants no rdma bulk region for a message of {n} bytes "
                f"(its bulk limit: {limit})",
            )
            return False
        if ep.peer_info is not None and n > ep.peer_info.bmax:
            self._fail(ep, f"message of {n} bytes exceeds member {ep.peer}'s bulk limit")
            return False
        btx.release(min(tx.credit, tx.done))
        mm, smm = mirror.mm, stage.mm
        while sent < n:
            if not btx.free():
                break
            place = tx.place(0)
            if place is None:
                break
            length = min(btx.block, n - sent)
            final = sent + length == n
            if place.pad_at is not None:
                REC.pack_into(mm, place.pad_at, R_PAD, 0, place.pad_len, 0, 0, 0)
            REC.pack_into(mm, place.at, R_BULK, RF_FINAL if final else 0, length, n, sent, mb)
            at = btx.place(tx.staged)
            smm[at : at + length] = data[sent : sent + length]
            ep.bulk_posts.append((at, length, tx.staged))
            sent += length
            ep.bulk_backlog_bytes -= length
        if sent < n:
            ep.backlog[0] = (-1, sent, data, mb)
            return False
        ep.backlog.popleft()
        return True

    def _mark_dirty(self, ep: Endpoint) -> None:
        self._dirty.add(ep)
        if not self._flush_scheduled and self._loop is not None and not self._closed:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush_all)

    def _flush_all(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, set()
        for ep in dirty:
            if not ep.dead:
                self._flush(ep)
        self._wake_drainers()

    def _flush(self, ep: Endpoint) -> None:
        """Post staged bytes (one WRITE per span, the last WITH_IMM) and any due credit."""
        tx = ep.tx
        if tx is None or ep.dead:
            return
        self._drain_backlog(ep)
        pv = self._device.pv
        assert pv is not None and ep.peer_info is not None and ep.mirror_mr is not None
        if tx.staged > tx.posted:
            try:
                # each bulk block: its WRITE into the peer's region, then the ring up to and
                # including its record, with a doorbell asking for credit (frees the slot)
                while ep.bulk_posts:
                    if ep.sq_seq - ep.sq_done + 5 > self.send_depth:
                        break
                    at, length, rec_end = ep.bulk_posts.popleft()
                    self._post_bulk_block(ep, at, length)
                    self._post_ring(ep, rec_end, True)
                if ep.bulk_posts or ep.sq_seq - ep.sq_done + 3 > self.send_depth:
                    ep.flush_wanted = True  # resumes on a send completion
                elif tx.staged > tx.posted:
                    self._post_ring(ep, None, tx.free() < tx.size // 2 or bool(ep.backlog))
            except pv.any_error as exc:
                self._fail(ep, f"rdma post to member {ep.peer} failed: {exc}")
                return
        self._maybe_return_credit(ep)
        if self.busy_poll:
            self._start_spin(ep)

    def _post_ring(self, ep: Endpoint, upto: int | None, want: bool) -> None:
        """Post the staged ring bytes (up to ``upto``) as one WRITE per contiguous span, the
        last one WITH_IMM carrying the new head. Raises pyverbs errors."""
        pv, tx, info, mirror = self._device.pv, ep.tx, ep.peer_info, ep.mirror
        assert pv is not None and tx is not None and info is not None and mirror is not None
        e = pv.enums
        end = tx.posted  # ring position each write ends at (for local completion)
        spans = tx.take_unposted(upto)
        lkey = ep.mirror_mr.lkey
        for i, (off, n) in enumerate(spans):
            last = i == len(spans) - 1
            signal = ep.unsignaled + 1 >= self.signal_every or (
                last and (want or self._draining > 0)
            )
            sge = pv.wr.SGE(mirror.address + off, n, lkey)
            wr = pv.wr.SendWR(
                wr_id=ep.sq_seq + 1,
                opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM if last else e.IBV_WR_RDMA_WRITE,
                num_sge=1,
                sg=[sge],
                imm_data=socket.htonl(imm_doorbell(tx.posted, want)) if last else 0,
                send_flags=int(e.IBV_SEND_SIGNALED) if signal else 0,
            )
            wr.set_wr_rdma(info.rkey, info.addr + off)
            end += n
            self._post(ep, wr, signal, end)

    def _post_bulk_block(self, ep: Endpoint, at: int, length: int) -> None:
        """One plain RDMA WRITE of a staged block into the same slot of the peer's region."""
        pv, tx, info, stage = self._device.pv, ep.tx, ep.peer_info, ep.bstage
        assert pv is not None and tx is not None and info is not None and stage is not None
        e = pv.enums
        signal = ep.unsignaled + 1 >= self.signal_every
        sge = pv.wr.SGE(stage.address + at, length, ep.bstage_mr.lkey)
        wr = pv.wr.SendWR(
            wr_id=ep.sq_seq + 1,
            opcode=e.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[sge],
            send_flags=int(e.IBV_SEND_SIGNALED) if signal else 0,
        )
        wr.set_wr_rdma(info.brkey, info.baddr + at)
        self._post(ep, wr, signal, tx.posted)

    def _post(self, ep: Endpoint, wr: Any, signal: bool, pos: int) -> None:
        ep.qp.post_send(wr, None)
        ep.sq_seq += 1
        if signal:
            ep.unsignaled = 0
            ep.signaled.append((ep.sq_seq, pos))
        else:
            ep.unsignaled += 1

    def _post_imm_send(self, ep: Endpoint, imm: int, *, signal: bool = False) -> bool:
        """A zero-length SEND_WITH_IMM (credit or no-op); False when the SQ is full."""
        pv = self._device.pv
        if pv is None or ep.dead or not ep.paired:
            return False
        if ep.sq_seq - ep.sq_done + 1 > self.send_depth:
            return False
        e = pv.enums
        signal = signal or ep.unsignaled + 1 >= self.signal_every
        wr = ep.imm_wr
        if wr is None:
            sge = pv.wr.SGE(ep.inbox.address + self.inbox_bytes, 0, ep.scratch_mr.lkey)
            wr = ep.imm_wr = pv.wr.SendWR(
                wr_id=0, opcode=e.IBV_WR_SEND_WITH_IMM, num_sge=1, sg=[sge], send_flags=0
            )
        wr.wr_id = ep.sq_seq + 1
        wr.imm_data = socket.htonl(imm)
        wr.send_flags = int(e.IBV_SEND_SIGNALED) if signal else 0
        try:
            self._post(ep, wr, signal, ep.tx.posted if ep.tx is not None else 0)
        except pv.any_error as exc:
            self._fail(ep, f"rdma post to member {ep.peer} failed: {exc}")
            return False
        return True

    def _maybe_return_credit(self, ep: Endpoint) -> None:
        rx = ep.rx
        consumed = rx.tail - ep.returned
        if consumed <= 0 or not ep.paired:
            return
        if ep.credit_wanted or consumed >= rx.size // 4:
            if self._post_imm_send(ep, imm_credit(rx.tail)):
                ep.returned = rx.tail
                ep.credit_wanted = False
            else:
                ep.flush_wanted = True

    # -- endpoints ---------------------------------------------------------------------------
    def _endpoint_for(self, peer: int, force: bool = False) -> Endpoint | None:
        """The current endpoint to ``peer``, creating one (and sending CONNECT) if needed;
        None during the back-off after a failure, unless ``force``."""
        link = self._link(peer)
        ep = link.ep
        if ep is not None and not ep.dead:
            return ep
        if not force and time.monotonic() < link.quiet_until:
            link.dropped += 1
            if link.dropped == 1:
                log.info(
                    "member %d: dropping pushes to member %d while its rdma link is down",
                    self.member_id,
                    peer,
                )
            return None
        ep = self._new_endpoint(link)
        if ep is not None:
            self._send_connect(ep, 0)
        return ep

    def _new_endpoint(self, link: Link) -> Endpoint | None:
        """A fresh endpoint for ``link``, watched for completions; None (reported, back-off)
        when the device cannot make one."""
        device = self._device
        errors = device.errors()
        assert self._loop is not None
        ep: Endpoint | None = None
        try:
            ep = device.create(link.peer, self._rng.randrange(1, _U64), self._rng.randrange(0, 1 << 24))
            if ep.fd is not None:
                self._loop.add_reader(ep.fd, self._on_cq_event, ep)
            else:
                ep.spinning = True  # no fd found: poll from the loop
                self._loop.call_soon(self._spin, ep, True)
        except errors as exc:
            if ep is not None:
                device.release(ep)
            reason = f"cannot create an rdma endpoint for member {link.peer}: {exc}"
            log.error("member %d: %s", self.member_id, reason)
            link.quiet_until = time.monotonic() + self.reconnect_backoff
            self._loop.call_soon(self._report_failure, link.peer, reason)
            return None
        link.ep = ep
        link.dropped = 0
        return ep

    def _send_connect(self, ep: Endpoint, dst: int) -> None:
        body = self._device.connect_info(ep, dst).encode()
        try:
            self._tcp.send(ep.peer, CHAN.pack(K_CONNECT, ep.id, 0) + body)
        except Exception as exc:  # the channel refused (closed): the endpoint is useless
            self._fail(ep, f"cannot send CONNECT to member {ep.peer}: {exc}", report=False)

    def _pair(self, ep: Endpoint, info: ConnectInfo) -> None:
        """Connect ``ep`` to the peer endpoint ``info`` describes; what waited for the pairing
        is flushed."""
        try:
            self._device.connect(ep, info)
        except self._device.errors() as exc:
            self._fail(ep, f"cannot connect the rdma queue pair to member {ep.peer}: {exc}")
            return
        log.debug(
            "member %d: rdma link to member %d up (qpn %d -> %d)",
            self.member_id,
            ep.peer,
            ep.qp.qp_num,
            info.qpn,
        )
        self._mark_dirty(ep)

    def _fail(self, ep: Endpoint, reason: str, *, report: bool = True, tell: bool = True) -> None:
        """Tear ``ep`` down (once); report ``reason`` as a failure of its peer."""
        if ep.dead:
            return
        link = self._links.get(ep.peer)
        if tell and ep.paired and not self._closed:
            with contextlib.suppress(Exception):
                self._tcp.send(ep.peer, encode_reset(ep.id, ep.peer_ep, reason, False))
        held = self._destroy(ep)
        if link is not None and link.ep is ep:
            link.ep = None
            link.quiet_until = time.monotonic() + self.reconnect_backoff
        self._wake_drainers()
        if self._closed or self._loop is None:
            return
        # never call the handler from inside a call the driver made: defer, in order
        if held and link is not None:
            self._loop.call_soon(self._deliver_held, link, ep.peer_ep, held)
        if report:
            log.warning("member %d: %s", self.member_id, reason)
            self._loop.call_soon(self._report_failure, ep.peer, reason)

    def _deliver_held(self, link: Link, tag: int, held: list[bytes]) -> None:
        """Messages that waited for pushes of a torn-down endpoint (those pushes are lost)."""
        for payload in held:
            self._deliver_user(link, tag, payload)

    def _destroy(self, ep: Endpoint) -> list[bytes]:
        """Release the endpoint's resources; returns the messages that waited for its pushes."""
        if ep.dead:
            return []
        ep.dead = True
        self._dirty.discard(ep)
        if ep.fd is not None and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(ep.fd)
        self._device.release(ep)
        if ep.brx is not None:
            if ep.brx.partial:
                log.info(
                    "member %d: partially received bulk message from member %d discarded",
                    self.member_id,
                    ep.peer,
                )
            ep.brx.discard()
        ep.bulk_posts.clear()
        ep.bulk_backlog_bytes = 0
        ep.backlog.clear()
        ep.backlog_bytes = 0
        held = [payload for _, payload in ep.held]
        ep.held.clear()
        ep.held_bytes = 0
        return held

    # -- completions -------------------------------------------------------------------------
    def _on_cq_event(self, ep: Endpoint) -> None:
        """The completion channel is readable: collect events, ack in batches, re-arm, drain."""
        if ep.dead:
            return
        pv = self._device.pv
        assert pv is not None
        try:
            # One-shot notification: at most one event is pending per arm, and the CQ is
            # re-armed only below, so one read empties the channel (EAGAIN: nothing pending).
            try:
                ep.channel.get_cq_event(ep.cq)
                ep.unacked += 1
            except pv.rdma_error as exc:
                if not verbs.is_eagain(pv, exc):
                    raise
            if ep.unacked >= 32:
                ep.cq.ack_events(ep.unacked)
                ep.unacked = 0
            ep.cq.req_notify()
        except pv.any_error as exc:
            self._fail(ep, f"rdma completion channel of member {ep.peer} failed: {exc}")
            return
        if self._drain_cq(ep) and self.busy_poll:
            self._start_spin(ep)

    def _start_spin(self, ep: Endpoint) -> None:
        ep.spin_until = time.monotonic() + self.busy_poll_window
        if not ep.spinning and self._loop is not None:
            ep.spinning = True
            self._loop.call_soon(self._spin, ep, False)

    def _spin(self, ep: Endpoint, forever: bool) -> None:
        """Busy-poll ``ep``'s CQ while completions keep coming (``forever``: no channel fd)."""
        if ep.dead or self._closed:
            ep.spinning = False
            return
        if self._drain_cq(ep):
            ep.spin_until = time.monotonic() + self.busy_poll_window
        if forever or time.monotonic() < ep.spin_until:
            assert self._loop is not None
            if forever and time.monotonic() >= ep.spin_until:
                self._loop.call_later(0.001, self._spin, ep, True)
            else:
                self._loop.call_soon(self._spin, ep, forever)
        else:
            ep.spinning = False

    def _drain_cq(self, ep: Endpoint) -> bool:
        """Poll every completion of ``ep`` and act on them; True if there were any."""
        pv, codes = self._device.pv, self._device.codes
        assert pv is not None and codes is not None
        got = False
        doorbell = False
        reposts = []
        while not ep.dead:
            try:
                n, wcs = ep.cq.poll(32)
            except pv.any_error as exc:
                self._fail(ep, f"polling the rdma CQ for member {ep.peer} failed: {exc}")
                return got
            if not n:
                break
            got = True
            for wc in wcs:
                ev = classify_wc(
                    codes,
                    status=int(wc.status),
                    opcode=int(wc.opcode),
                    wr_id=int(wc.wr_id),
                    imm=socket.ntohl(int(wc.imm_data)) if int(wc.status) == codes.success else 0,
                    byte_len=int(wc.byte_len),
                    flags=int(wc.wc_flags),
                )
                if not self._apply(ep, ev):
                    return got
                if ev.kind in ("doorbell", "credit", "noop"):
                    reposts.append(ev.wr_id & ~RECV_WR)
                    doorbell = doorbell or ev.kind == "doorbell"
            if n < 32:
                break
        if ep.dead:
            return got
        try:
            for i in reposts:
                self._device.post_recv(ep, i)
        except pv.any_error as exc:
            self._fail(ep, f"reposting rdma receives for member {ep.peer} failed: {exc}")
            return got
        if doorbell or ep.held:
            self._pump(ep)
        owed = ep.rx.tail - ep.returned
        if not ep.dead and (
            ep.flush_wanted
            or ep.backlog
            or (owed > 0 and (ep.credit_wanted or owed >= ep.rx.size // 4))
        ):
            ep.flush_wanted = False
            self._mark_dirty(ep)
        if got:
            self._wake_drainers()
        return got

    def _apply(self, ep: Endpoint, ev: WcEvent) -> bool:
        """Act on one completion; False when the endpoint was torn down."""
        if ev.kind == "send_done":
            while ep.signaled and ep.signaled[0][0] <= ev.wr_id:
                seq, pos = ep.signaled.popleft()
                ep.sq_done = seq
                if ep.tx is not None:
                    ep.tx.on_done(pos)
            return True
        if ev.kind == "doorbell":
            try:
                ep.rx.on_doorbell(ev.units)
            except RingError as exc:
                self._violation(ep, str(exc))
                return False
            if ev.flag:
                ep.credit_wanted = True
            return True
        if ev.kind == "credit":
            if ep.tx is None:
                self._violation(ep, "credit before the link was paired")
                return False
            try:
                ep.tx.on_credit(ev.units)
            except RingError as exc:
                self._violation(ep, str(exc))
                return False
            return True
        if ev.kind == "noop":
            return True
        if ev.kind == "flushed":
            self._fail(ep, f"rdma queue pair to member {ep.peer} is in the error state")
            return False
        detail = ev.detail
        if "RETRY_EXC" in detail:
            detail += " (retries exhausted: member unreachable over rdma)"
        elif "REM_ACCESS" in detail or "REM_INV" in detail:
            detail += " (remote access rejected)"
        self._fail(ep, f"rdma link to member {ep.peer} failed: {detail}")
        return False

    def _violation(self, ep: Endpoint, why: str) -> None:
        self._fail(ep, f"protocol violation by member {ep.peer}: {why}")

    # -- receiving ---------------------------------------------------------------------------
    def _pump(self, ep: Endpoint) -> None:
        """Deliver inbox records and held messages of ``ep`` in their link order."""
        link = self._link(ep.peer)
        mm = ep.inbox.mm
        while not ep.dead and not self._closed:
            while ep.held and ep.held[0][0] <= ep.pushes_consumed:
                _, payload = ep.held.popleft()
                ep.held_bytes -= len(payload)
                self._deliver_user(link, ep.peer_ep, payload)
            try:
                rec = ep.rx.peek(mm)
            except RingError as exc:
                self._violation(ep, str(exc))
                return
            if rec is None:
                break
            seen = link.rx_count if link.rx_tag == ep.peer_ep else 0
            if rec.msgs_before > seen:
                break  # a message sent before this push is still on its way
            if rec.bulk:
                brx, region = ep.brx, ep.bulk
                if brx is None or region is None:
                    self._violation(ep, "bulk record but no bulk region was granted")
                    return
                try:
                    msg = brx.land(region.mm, rec.view_id, rec.offset, rec.length, rec.final)
                except RingError as exc:
                    self._violation(ep, str(exc))
                    return
                ep.rx.consume(rec)
                if msg is not None:
                    ep.pushes_consumed += 1
                    self._deliver_message(ep.peer, msg)
                continue
            data = mm[rec.data_at : rec.data_at + rec.length]
            ep.rx.consume(rec)
            if rec.final:
                ep.pushes_consumed += 1
            self._gate.push_arrived(rec.view_id, ep.peer, rec.offset, data)
        if not ep.dead:
            self._maybe_return_credit(ep)

    # -- the tcp channel ---------------------------------------------------------------------
    def _on_channel(self, sender: int, payload: bytes) -> None:
        if self._closed:
            return
        if len(payload) < CHAN.size:
            self._channel_violation(sender, f"channel message of {len(payload)} bytes")
            return
        kind, ep_id, count = CHAN.unpack_from(payload)
        body = payload[CHAN.size :]
        if kind == K_USER:
            self._on_user_message(sender, ep_id, count, body)
        elif kind == K_CONNECT:
            try:
                info = ConnectInfo.decode(body)
                if info.ep != ep_id or count:
                    raise Malformed("CONNECT header and body disagree")
            except Malformed as exc:
                self._channel_violation(sender, str(exc))
                return
            self._on_connect(sender, info)
        elif kind == K_RESET:
            try:
                dst, why, graceful = decode_reset(body)
            except Malformed as exc:
                self._channel_violation(sender, str(exc))
                return
            self._on_reset(sender, ep_id, dst, why, graceful)
        else:
            self._channel_violation(sender, f"unknown channel message kind {kind}")

    def _channel_violation(self, sender: int, why: str) -> None:
        reason = f"protocol violation by member {sender}: {why}"
        log.warning("member %d: %s", self.member_id, reason)
        link = self._links.get(sender)
        if link is not None and link.ep is not None:
            self._fail(link.ep, reason, report=False)
        self._report_failure(sender, reason)

    def _on_user_message(self, sender: int, tag: int, pushes_before: int, body: bytes) -> None:
        link = self._link(sender)
        ep = link.ep
        if (
            ep is not None
            and not ep.dead
            and tag != 0
            and ep.peer_ep == tag
            and (ep.held or pushes_before > ep.pushes_consumed)
        ):
            if ep.held_bytes + len(body) > self.max_held_bytes:
                ep.held.append((pushes_before, body))
                self._violation(ep, "too many messages waiting for pushes that do not arrive")
                return
            ep.held.append((pushes_before, body))
            ep.held_bytes += len(body)
            return
        self._deliver_user(link, tag, body)
        if ep is not None and not ep.dead and tag != 0 and ep.peer_ep == tag:
            self._pump(ep)  # pushes may have waited for this message

    def _deliver_user(self, link: Link, tag: int, body: bytes) -> None:
        if tag:
            if link.rx_tag != tag:
                link.rx_tag, link.rx_count = tag, 0
            link.rx_count += 1
        self._deliver_message(link.peer, body)

    def _on_connect(self, sender: int, info: ConnectInfo) -> None:
        link = self._link(sender)
        ep = link.ep
        if ep is not None and ep.dead:
            ep = None
        if info.dst == 0:
            if ep is not None and ep.peer_ep == info.ep:
                return  # duplicate
            if ep is not None and ep.paired:
                self._fail(
                    ep,
                    f"member {sender} replaced its rdma endpoint (pushes in flight may be lost)",
                    tell=False,
                )
                ep = None
            if ep is None:
                ep = self._new_endpoint(link)
                if ep is None:
                    return
            self._pair(ep, info)
            if not ep.dead:
                self._send_connect(ep, info.ep)
            return
        if ep is None or ep.id != info.dst:
            log.debug("member %d: stale CONNECT from member %d ignored", self.member_id, sender)
            return
        if ep.paired:
            if ep.peer_ep != info.ep:
                log.warning(
                    "member %d: member %d sent a CONNECT for an already paired endpoint",
                    self.member_id,
                    sender,
                )
            return
        self._pair(ep, info)

    def _on_reset(self, sender: int, ep_id: int, dst: int, why: str, graceful: bool) -> None:
        link = self._links.get(sender)
        ep = link.ep if link is not None else None
        if ep is None or ep.dead or ep.id != dst or ep.peer_ep != ep_id:
            return
        if graceful:
            self._fail(ep, f"member {sender} closed its rdma endpoint", report=False, tell=False)
            if link is not None:
                link.quiet_until = 0.0
        else:
            self._fail(ep, f"member {sender} reset the rdma link: {why}", tell=False)

    def _on_channel_failure(self, member: int, reason: str) -> None:
        link = self._links.get(member)
        if link is not None and link.ep is not None:
            self._fail(link.ep, reason, report=False, tell=False)
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
