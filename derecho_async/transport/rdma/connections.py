# Theory of operation
# -------------------
# The link table: per peer a ``Link`` and its current endpoint. An endpoint is created on first
# use (a push or message to the peer, or the peer's CONNECT) and announced with CONNECT(src=its
# id, dst=0); a member answering a dst=0 CONNECT pairs a fresh endpoint with it and replies
# CONNECT(src, dst=the peer's id); a CONNECT for an endpoint that no longer exists is ignored,
# one from a peer endpoint that replaced the paired one resets the link. Any failure tears the
# endpoint down once (RESET to the peer, resources released, the peer reported) and the next
# push after a short back-off builds a fresh one; ``revoke`` closes a link quietly when its
# peer left the view. The table is what the send and receive paths call back
# (:class:`~derecho_async.transport.rdma.endpoint.LinkOwner`): it schedules their flushes and
# wakes ``drain``. See docs/DESIGN.md §5.4 (endpoints, views).
"""rdma connection management: the link table, the CONNECT/RESET handshake, teardown."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable

from derecho_async.transport.base import log
from derecho_async.transport.rdma.codec import CHAN, K_CONNECT, ConnectInfo, encode_reset
from derecho_async.transport.rdma.endpoint import Device, Endpoint, Link, Tuning
from derecho_async.transport.rdma.recvpath import RecvPath
from derecho_async.transport.rdma.rings import IMM_NOOP
from derecho_async.transport.rdma.sendpath import SendPath

__all__ = ["Connections"]

_U64 = 1 << 64


class Connections:
    """One member's links to its peers and their endpoints (a
    :class:`~derecho_async.transport.rdma.endpoint.LinkOwner`).

    ``channel(peer, payload)`` sends on the tcp channel (CONNECT, RESET); ``report(peer,
    reason)`` reports a failure to the transport's handler; ``deliver`` and ``push_arrived``
    go to the receive path. The send and receive paths (:attr:`send`, :attr:`recv`) are built
    here, over the same endpoints.
    """

    def __init__(
        self,
        member_id: int,
        device: Device,
        tuning: Tuning,
        *,
        channel: Callable[[int, bytes], None],
        report: Callable[[int, str], None],
        deliver: Callable[[int, bytes], None],
        push_arrived: Callable[[int, int, int, bytes], object],
    ) -> None:
        self.member_id = member_id
        self._device = device
        self._tuning = tuning
        self._channel = channel
        self._report = report
        self.links: dict[int, Link] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.send = SendPath(self, device, tuning)
        self.recv = RecvPath(
            self, device, self.send, tuning, deliver=deliver, push_arrived=push_arrived
        )
        self._dirty: set[Endpoint] = set()
        self._flush_scheduled = False
        self._draining = 0
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._rng = random.SystemRandom()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run on ``loop`` (the transport's, once it starts)."""
        self.loop = loop

    def close(self) -> None:
        """Tell paired peers (a graceful RESET), tear every endpoint down, wake ``drain``."""
        self.closed = True
        for link in self.links.values():
            ep = link.ep
            if ep is not None and ep.paired and not ep.dead:
                with contextlib.suppress(Exception):
                    self._channel(link.peer, encode_reset(ep.id, ep.peer_ep, "closed", True))
            if ep is not None:
                self._destroy(ep)
            link.ep = None
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        self._drain_waiters.clear()
        self._dirty.clear()

    def link(self, peer: int) -> Link:
        """The link to ``peer`` (created on first use)."""
        link = self.links.get(peer)
        if link is None:
            link = self.links[peer] = Link(peer)
        return link

    # -- endpoints ---------------------------------------------------------------------------
    def endpoint_for(self, peer: int, force: bool = False) -> Endpoint | None:
        """The current endpoint to ``peer``, creating one (and sending CONNECT) if needed;
        None during the back-off after a failure, unless ``force``."""
        link = self.link(peer)
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
        ep: Endpoint | None = None
        try:
            ep_id, psn = self._rng.randrange(1, _U64), self._rng.randrange(0, 1 << 24)
            ep = device.create(link.peer, ep_id, psn)
            self.recv.watch(ep)
        except errors as exc:
            if ep is not None:
                device.release(ep)
            reason = f"cannot create an rdma endpoint for member {link.peer}: {exc}"
            log.error("member %d: %s", self.member_id, reason)
            link.quiet_until = time.monotonic() + self._tuning.reconnect_backoff
            assert self.loop is not None
            self.loop.call_soon(self._report, link.peer, reason)
            return None
        link.ep = ep
        link.dropped = 0
        return ep

    def _send_connect(self, ep: Endpoint, dst: int) -> None:
        body = self._device.connect_info(ep, dst).encode()
        try:
            self._channel(ep.peer, CHAN.pack(K_CONNECT, ep.id, 0) + body)
        except Exception as exc:  # the channel refused (closed): the endpoint is useless
            self.fail(ep, f"cannot send CONNECT to member {ep.peer}: {exc}", report=False)

    def on_connect(self, sender: int, info: ConnectInfo) -> None:
        """A validated CONNECT from ``sender``: answer one for a new peer endpoint (pairing a
        fresh endpoint, or replacing one the peer replaced), or pair the endpoint it answers."""
        link = self.link(sender)
        ep = link.ep
        if ep is not None and ep.dead:
            ep = None
        if info.dst == 0:
            if ep is not None and ep.peer_ep == info.ep:
                return  # duplicate
            if ep is not None and ep.paired:
                self.fail(
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

    def on_reset(self, sender: int, ep_id: int, dst: int, why: str, graceful: bool) -> None:
        """``sender`` tore down its endpoint ``ep_id`` paired with our ``dst``: ours goes too
        (reported as a failure unless ``graceful``)."""
        link = self.links.get(sender)
        ep = link.ep if link is not None else None
        if ep is None or ep.dead or ep.id != dst or ep.peer_ep != ep_id:
            return
        if graceful:
            self.fail(ep, f"member {sender} closed its rdma endpoint", report=False, tell=False)
            if link is not None:
                link.quiet_until = 0.0
        else:
            self.fail(ep, f"member {sender} reset the rdma link: {why}", tell=False)

    def _pair(self, ep: Endpoint, info: ConnectInfo) -> None:
        """Connect ``ep`` to the peer endpoint ``info`` describes; what waited for the pairing
        is flushed."""
        try:
            self._device.connect(ep, info)
        except self._device.errors() as exc:
            self.fail(ep, f"cannot connect the rdma queue pair to member {ep.peer}: {exc}")
            return
        log.debug(
            "member %d: rdma link to member %d up (qpn %d -> %d)",
            self.member_id,
            ep.peer,
            ep.qp.qp_num,
            info.qpn,
        )
        self.mark_dirty(ep)

    def fail(self, ep: Endpoint, reason: str, *, report: bool = True, tell: bool = True) -> None:
        """Tear ``ep`` down (once); report ``reason`` as a failure of its peer."""
        if ep.dead:
            return
        link = self.links.get(ep.peer)
        if tell and ep.paired and not self.closed:
            with contextlib.suppress(Exception):
                self._channel(ep.peer, encode_reset(ep.id, ep.peer_ep, reason, False))
        held = self._destroy(ep)
        if link is not None and link.ep is ep:
            link.ep = None
            link.quiet_until = time.monotonic() + self._tuning.reconnect_backoff
        self.wake_drainers()
        if self.closed or self.loop is None:
            return
        # never call the handler from inside a call the driver made: defer, in order
        if held and link is not None:
            self.loop.call_soon(self.recv.deliver_held, link, ep.peer_ep, held)
        if report:
            log.warning("member %d: %s", self.member_id, reason)
            self.loop.call_soon(self._report, ep.peer, reason)

    def _destroy(self, ep: Endpoint) -> list[bytes]:
        """Release the endpoint's resources; returns the messages that waited for its pushes."""
        if ep.dead:
            return []
        ep.dead = True
        self._dirty.discard(ep)
        self.recv.unwatch(ep)
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

    def revoke(self, peer: int, view_id: int) -> None:
        """Close the link to ``peer`` quietly (it left the view): a graceful RESET, no failure
        report; a later message or push to it builds a fresh endpoint with fresh keys."""
        link = self.links.get(peer)
        ep = link.ep if link is not None else None
        if link is None or ep is None or ep.dead:
            return
        if ep.paired:
            with contextlib.suppress(Exception):
                why = f"not in view {view_id}"
                self._channel(peer, encode_reset(ep.id, ep.peer_ep, why, True))
        self.fail(ep, f"member {peer} left the view", report=False, tell=False)
        link.quiet_until = 0.0
        log.debug(
            "member %d: rdma link to member %d closed (view %d)", self.member_id, peer, view_id
        )

    # -- flushing and draining ---------------------------------------------------------------
    def mark_dirty(self, ep: Endpoint) -> None:
        """``ep`` has something to post: flush it in a loop callback soon (once per turn)."""
        self._dirty.add(ep)
        if not self._flush_scheduled and self.loop is not None and not self.closed:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush_all)

    def _flush_all(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, set()
        for ep in dirty:
            if not ep.dead and self.send.flush(ep) and self._tuning.busy_poll:
                self.recv.start_spin(ep)
        self.wake_drainers()

    @property
    def draining(self) -> bool:
        """True while a ``drain`` call waits."""
        return self._draining > 0

    def wake_drainers(self) -> None:
        """Progress was made: let waiting ``drain`` calls look again."""
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def drain(self) -> None:
        """Wait until every push was written and completed locally (or its link failed)."""
        assert self.loop is not None
        self._draining += 1
        try:
            while True:
                pending = [
                    link.ep
                    for link in self.links.values()
                    if link.ep is not None and not self.send.drained(link.ep)
                ]
                if not pending or self.closed:
                    break
                for ep in pending:
                    self.mark_dirty(ep)
                    if ep.tx is not None and not ep.signaled and ep.tx.done < ep.tx.posted:
                        self.send.post_imm_send(ep, IMM_NOOP, signal=True)
                fut: asyncio.Future[None] = self.loop.create_future()
                self._drain_waiters.append(fut)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(fut, 0.5)
        finally:
            self._draining -= 1
