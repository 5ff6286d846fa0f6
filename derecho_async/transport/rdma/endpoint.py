# Theory of operation
# -------------------
# An *endpoint* is one RC queue pair to one peer with everything registered for it: its CQ on
# its own completion channel, the inbox (and bulk region) granted to that peer only, and once
# paired the mirror (and bulk staging copy) of what the peer granted us. A *link* is per-peer
# state that outlives endpoints. :class:`Device` is the opened RDMA port: it builds, connects
# (INIT -> RTR -> RTS) and releases endpoints' verbs resources and raises on any failure; what a
# failure means (back-off, report) is decided by the link table (``connections.py``), which the
# send and receive paths reach through the small :class:`LinkOwner` protocol. See
# docs/DESIGN.md §5.4 (endpoints, views).
"""rdma endpoints and links, the tunables the parts read, and the verbs resources of a port."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from derecho_async.transport.rdma import verbs
from derecho_async.transport.rdma.bulk import BulkRx, BulkTx
from derecho_async.transport.rdma.codec import ConnectInfo
from derecho_async.transport.rdma.completions import RECV_WR, WcCodes
from derecho_async.transport.rdma.rings import RecvRing, SendRing

__all__ = ["Device", "Endpoint", "Link", "LinkOwner", "Tuning"]


class Tuning(Protocol):
    """The settings of :class:`~derecho_async.transport.rdma.RdmaTransport` that its parts
    read. They are read when used, so a change on the transport takes effect at once (tests
    shorten ``qp_timeout`` this way)."""

    inbox_bytes: int
    busy_poll: bool
    bulk_threshold: int
    bulk_block: int
    bulk_slots: int
    bulk_max_message: int
    send_depth: int
    recv_depth: int
    qp_timeout: int
    qp_retry_cnt: int
    qp_rnr_retry: int
    min_rnr_timer: int
    signal_every: int
    reconnect_backoff: float
    max_backlog_bytes: int
    max_held_bytes: int
    busy_poll_window: float
    max_bulk_backlog_bytes: int


@dataclass(eq=False)
class Endpoint:
    """One queue pair to one peer, with its CQ, channel, inbox and (once paired) mirror."""

    peer: int
    id: int
    qp: Any
    cq: Any
    channel: Any
    fd: int | None
    inbox: verbs.HostBuffer
    inbox_mr: Any
    scratch_mr: Any
    psn: int
    rx: RecvRing
    # set when paired
    peer_info: ConnectInfo | None = None
    mirror: verbs.HostBuffer | None = None
    mirror_mr: Any = None
    tx: SendRing | None = None
    # state
    dead: bool = False
    unacked: int = 0
    # sending
    backlog: collections.deque[tuple[int, int, memoryview, int]] = field(
        default_factory=collections.deque
    )
    backlog_bytes: int = 0
    pushes_issued: int = 0
    msgs_sent: int = 0
    sq_seq: int = 0
    sq_done: int = 0
    unsignaled: int = 0
    signaled: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    flush_wanted: bool = False
    # receiving
    pushes_consumed: int = 0
    returned: int = 0
    credit_wanted: bool = False
    held: collections.deque[tuple[int, bytes]] = field(default_factory=collections.deque)
    held_bytes: int = 0
    spin_until: float = 0.0
    spinning: bool = False
    # reusable work requests (post copies them; pyverbs objects are costly to build)
    recv_wr: Any = None
    imm_wr: Any = None
    # bulk path: the region this endpoint grants its peer, and (once paired) the staging copy
    # of the peer's region with the blocks written but not posted (slot offset, length, ring
    # end of the block's record)
    bulk: verbs.HostBuffer | None = None
    bulk_mr: Any = None
    brx: BulkRx | None = None
    bstage: verbs.HostBuffer | None = None
    bstage_mr: Any = None
    btx: BulkTx | None = None
    bulk_posts: collections.deque[tuple[int, int, int]] = field(default_factory=collections.deque)
    bulk_backlog_bytes: int = 0

    @property
    def paired(self) -> bool:
        """True once the peer's CONNECT connected the queue pair (and the mirror exists)."""
        return self.peer_info is not None

    @property
    def peer_ep(self) -> int:
        """The peer endpoint this one is paired with (0: none yet)."""
        return self.peer_info.ep if self.peer_info is not None else 0


@dataclass(eq=False)
class Link:
    """Per-peer state that outlives endpoints."""

    peer: int
    ep: Endpoint | None = None
    quiet_until: float = 0.0
    dropped: int = 0
    rx_tag: int = 0  # the peer endpoint id of the last tagged message delivered
    rx_count: int = 0  # messages delivered with that tag


class LinkOwner(Protocol):
    """What the send and receive paths ask of the link table that owns the endpoints."""

    member_id: int

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop (None before start)."""

    @property
    def closed(self) -> bool:
        """True once the transport is closing: nothing more is scheduled or delivered."""

    @property
    def draining(self) -> bool:
        """True while someone waits in ``drain``: every last write of a flush is signalled."""

    def link(self, peer: int) -> Link:
        """The link to ``peer`` (created on first use)."""

    def fail(self, ep: Endpoint, reason: str, *, report: bool = True, tell: bool = True) -> None:
        """Tear ``ep`` down (once); report ``reason`` as a failure of its peer."""

    def mark_dirty(self, ep: Endpoint) -> None:
        """``ep`` has something to post: flush it in a loop callback soon."""

    def wake_drainers(self) -> None:
        """Progress was made: let waiting ``drain`` calls look again."""


class Device:
    """One member's RDMA port and protection domain (pyverbs): builds, connects and releases
    the verbs resources of endpoints. Every method raises on failure (one of :meth:`errors`);
    what a failure means is for the caller to decide."""

    def __init__(
        self, name: str | None, port: int, gid_index: int | None, tuning: Tuning
    ) -> None:
        self._name = name
        self._port = port
        self._gid_index = gid_index
        self._tuning = tuning
        self.pv: verbs.Pyverbs | None = None
        self.local: verbs.DevicePort | None = None
        self.codes: WcCodes | None = None
        self._ctx: Any = None
        self._pd: Any = None

    def open(self) -> verbs.Pyverbs:
        """Load pyverbs, choose the port, allocate the protection domain. Raises
        :class:`~derecho_async.transport.rdma.verbs.RdmaUnavailable` naming the fix."""
        pv = verbs.load_pyverbs()
        ctx, local = verbs.choose_port(pv, self._name, self._port, self._gid_index)
        self.pv, self._ctx, self.local = pv, ctx, local
        self._pd = pv.pd.PD(ctx)
        self.codes = WcCodes.from_enums(pv.enums)
        return pv

    def close(self) -> None:
        """Release the protection domain and the device context (endpoints first)."""
        for obj in (self._pd, self._ctx):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        self._pd = self._ctx = None

    def errors(self) -> tuple[type[BaseException], ...]:
        """The exceptions building or connecting an endpoint may raise."""
        assert self.pv is not None
        return (self.pv.any_error, OSError, ValueError)

    def create(self, peer: int, ep_id: int, psn: int) -> Endpoint:
        """A fresh endpoint for ``peer``: completion channel and CQ, a queue pair in INIT, the
        inbox (and bulk region) registered for remote writes, every receive posted and the CQ
        armed. On failure what was made is released and the error raised."""
        pv, pd, ctx, local, t = self.pv, self._pd, self._ctx, self.local, self._tuning
        assert pv is not None and local is not None
        e = pv.enums
        created: list[Any] = []
        buffers: list[verbs.HostBuffer] = []
        inbox: verbs.HostBuffer | None = None
        try:
            channel, fd = verbs.comp_channel_fd(lambda: pv.cq.CompChannel(ctx))
            created.append(channel)
            cq = pv.cq.CQ(ctx, t.send_depth + t.recv_depth + 8, None, channel, 0)
            created.append(cq)
            cap = pv.qp.QPCap(
                max_send_wr=t.send_depth,
                max_recv_wr=t.recv_depth,
                max_send_sge=1,
                max_recv_sge=1,
            )
            init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
            qp = pv.qp.QP(pd, init)
            created.append(qp)
            inbox = verbs.HostBuffer(t.inbox_bytes + 64)
            remote = int(e.IBV_ACCESS_LOCAL_WRITE) | int(e.IBV_ACCESS_REMOTE_WRITE)
            inbox_mr = pv.mr.MR(pd, t.inbox_bytes, remote, address=inbox.address)
            created.append(inbox_mr)
            scratch_mr = pv.mr.MR(
                pd, 64, int(e.IBV_ACCESS_LOCAL_WRITE), address=inbox.address + t.inbox_bytes
            )
            created.append(scratch_mr)
            bulk_mr = None
            if t.bulk_threshold:
                region = t.bulk_block * t.bulk_slots
                bulk = verbs.HostBuffer(region)
                buffers.append(bulk)
                bulk_mr = pv.mr.MR(pd, region, remote, address=bulk.address)
                created.append(bulk_mr)
            attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_INIT)
            attr.pkey_index = 0
            attr.port_num = local.port
            attr.qp_access_flags = remote
            qp.modify(
                attr,
                int(e.IBV_QP_STATE)
                | int(e.IBV_QP_PKEY_INDEX)
                | int(e.IBV_QP_PORT)
                | int(e.IBV_QP_ACCESS_FLAGS),
            )
            ep = Endpoint(
                peer=peer,
                id=ep_id,
                qp=qp,
                cq=cq,
                channel=channel,
                fd=fd,
                inbox=inbox,
                inbox_mr=inbox_mr,
                scratch_mr=scratch_mr,
                psn=psn,
                rx=RecvRing(t.inbox_bytes),
            )
            if bulk_mr is not None:
                ep.bulk, ep.bulk_mr = buffers[0], bulk_mr
                ep.brx = BulkRx(t.bulk_block, t.bulk_slots, t.bulk_max_message)
            for i in range(t.recv_depth):
                self.post_recv(ep, i)
            cq.req_notify()
            if fd is not None:
                verbs.set_nonblocking(fd)
        except BaseException:
            for obj in reversed(created):
                with contextlib.suppress(Exception):
                    obj.close()
            if inbox is not None:
                inbox.close()
            for buf in buffers:
                buf.close()
            raise
        return ep

    def post_recv(self, ep: Endpoint, i: int) -> None:
        """(Re)post receive number ``i`` of ``ep`` (for credit and doorbell immediates)."""
        wr = ep.recv_wr
        if wr is None:
            pv = self.pv
            assert pv is not None
            sge = pv.wr.SGE(ep.inbox.address + self._tuning.inbox_bytes, 64, ep.scratch_mr.lkey)
            wr = ep.recv_wr = pv.wr.RecvWR(wr_id=0, num_sge=1, sg=[sge])
        wr.wr_id = RECV_WR | i
        ep.qp.post_recv(wr, None)

    def connect_info(self, ep: Endpoint, dst: int) -> ConnectInfo:
        """What ``ep`` grants its peer (CONNECT), paired with peer endpoint ``dst`` (0: none)."""
        local, t = self.local, self._tuning
        assert local is not None
        return ConnectInfo(
            ep=ep.id,
            dst=dst,
            qpn=int(ep.qp.qp_num),
            psn=ep.psn,
            gid=local.gid,
            lid=local.lid,
            mtu=local.active_mtu,
            ethernet=local.link_layer_ethernet,
            addr=int(ep.inbox_mr.buf),
            rkey=int(ep.inbox_mr.rkey),
            size=t.inbox_bytes,
            baddr=int(ep.bulk_mr.buf) if ep.bulk_mr is not None else 0,
            brkey=int(ep.bulk_mr.rkey) if ep.bulk_mr is not None else 0,
            bblock=t.bulk_block if ep.bulk_mr is not None else 0,
            bslots=t.bulk_slots if ep.bulk_mr is not None else 0,
            bmax=t.bulk_max_message if ep.bulk_mr is not None else 0,
        )

    def connect(self, ep: Endpoint, info: ConnectInfo) -> None:
        """Connect ``ep``'s queue pair to the peer's (INIT -> RTR -> RTS), build the mirror
        of its inbox (and the staging copy of its bulk region), and mark ``ep`` paired. On
        failure the buffers made here are closed, ``ep`` stays unpaired and the error raised."""
        pv, local, t = self.pv, self.local, self._tuning
        assert pv is not None and local is not None
        e = pv.enums
        mirror: verbs.HostBuffer | None = None
        stage: verbs.HostBuffer | None = None
        try:
            if info.ethernet != local.link_layer_ethernet:
                raise ValueError("the peer's link layer differs from ours")
            attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_RTR)
            attr.path_mtu = min(info.mtu, local.active_mtu)
            attr.dest_qp_num = info.qpn
            attr.rq_psn = info.psn
            attr.max_dest_rd_atomic = 1
            attr.min_rnr_timer = t.min_rnr_timer
            if local.link_layer_ethernet:
                gr = pv.addr.GlobalRoute(
                    dgid=pv.addr.GID(verbs.gid_to_text(info.gid)), sgid_index=local.gid_index
                )
                attr.ah_attr = pv.addr.AHAttr(
                    port_num=local.port, is_global=1, gr=gr, dlid=info.lid
                )
            else:
                attr.ah_attr = pv.addr.AHAttr(port_num=local.port, is_global=0, dlid=info.lid)
            ep.qp.modify(
                attr,
                int(e.IBV_QP_STATE)
                | int(e.IBV_QP_AV)
                | int(e.IBV_QP_PATH_MTU)
                | int(e.IBV_QP_DEST_QPN)
                | int(e.IBV_QP_RQ_PSN)
                | int(e.IBV_QP_MAX_DEST_RD_ATOMIC)
                | int(e.IBV_QP_MIN_RNR_TIMER),
            )
            attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_RTS)
            attr.timeout = t.qp_timeout
            attr.retry_cnt = t.qp_retry_cnt
            attr.rnr_retry = t.qp_rnr_retry
            attr.sq_psn = ep.psn
            attr.max_rd_atomic = 1
            ep.qp.modify(
                attr,
                int(e.IBV_QP_STATE)
                | int(e.IBV_QP_TIMEOUT)
                | int(e.IBV_QP_RETRY_CNT)
                | int(e.IBV_QP_RNR_RETRY)
                | int(e.IBV_QP_SQ_PSN)
                | int(e.IBV_QP_MAX_QP_RD_ATOMIC),
            )
            mirror = verbs.HostBuffer(info.size)
            ep.mirror_mr = pv.mr.MR(
                self._pd, info.size, int(e.IBV_ACCESS_LOCAL_WRITE), address=mirror.address
            )
            if info.bslots and t.bulk_threshold:
                region = info.bblock * info.bslots
                stage = verbs.HostBuffer(region)
                ep.bstage_mr = pv.mr.MR(
                    self._pd, region, int(e.IBV_ACCESS_LOCAL_WRITE), address=stage.address
                )
        except BaseException:
            if mirror is not None:
                mirror.close()
            if stage is not None:
                stage.close()
            raise
        ep.mirror = mirror
        ep.tx = SendRing(info.size)
        if stage is not None:
            ep.bstage = stage
            ep.btx = BulkTx(info.bblock, info.bslots)
        ep.peer_info = info

    def release(self, ep: Endpoint) -> None:
        """Close ``ep``'s verbs objects (deregistering what it granted) and its buffers. Stop
        watching its channel first."""
        if self.pv is not None and ep.fd is not None:
            # events read from the channel must all be acknowledged before the CQ goes
            with contextlib.suppress(Exception):
                while True:
                    ep.channel.get_cq_event(ep.cq)
                    ep.unacked += 1
            with contextlib.suppress(Exception):
                if ep.unacked:
                    ep.cq.ack_events(ep.unacked)
                    ep.unacked = 0
        for obj in (
            ep.recv_wr,
            ep.imm_wr,
            ep.qp,
            ep.mirror_mr,
            ep.bstage_mr,
            ep.bulk_mr,
            ep.inbox_mr,
            ep.scratch_mr,
            ep.cq,
            ep.channel,
        ):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()
        ep.inbox.close()
        for buf in (ep.mirror, ep.bulk, ep.bstage):
            if buf is not None:
                buf.close()
