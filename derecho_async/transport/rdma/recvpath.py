# Theory of operation
# -------------------
# Everything that arrives on an endpoint's queue pair, and the order between the two channels.
# Completions are noticed by a reader on the endpoint's completion channel (events acknowledged
# in batches, the CQ re-armed, then drained) and, with ``busy_poll``, by polling from the loop
# while they keep coming. Each is classified (``completions.py``) and applied: send completions
# free ring space, doorbells advance the inbox head, credits the peer's. ``pump`` then reads
# the inbox in ring order: push records go through the ``PushGate``, BULK records reassemble a
# message, and a record waits for the channel messages sent before it, as a channel message
# waits (held) for the pushes sent before it. Any breach of the protocol is a violation of that
# peer: its endpoint is torn down and the peer reported. See docs/DESIGN.md §5.4 (order between
# the channels, completions).
"""The rdma receive and poll path: completions, the inbox, and link order with messages."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

from derecho_async.transport.rdma import verbs
from derecho_async.transport.rdma.completions import RECV_WR, WcEvent, classify_wc
from derecho_async.transport.rdma.endpoint import Device, Endpoint, Link, LinkOwner, Tuning
from derecho_async.transport.rdma.rings import RingError
from derecho_async.transport.rdma.sendpath import SendPath

__all__ = ["RecvPath"]


class RecvPath:
    """Notices and applies completions of one member's endpoints and delivers what arrived.

    ``deliver(sender, payload)`` hands a message to the transport's handler;
    ``push_arrived(view_id, sender, offset, data)`` passes a push to the ``PushGate``. Credit
    owed to a peer goes back through ``send``; failures through ``owner.fail``.
    """

    def __init__(
        self,
        owner: LinkOwner,
        device: Device,
        send: SendPath,
        tuning: Tuning,
        *,
        deliver: Callable[[int, bytes], None],
        push_arrived: Callable[[int, int, int, bytes], object],
    ) -> None:
        self._owner = owner
        self._device = device
        self._send = send
        self._tuning = tuning
        self._deliver = deliver
        self._push_arrived = push_arrived

    def watch(self, ep: Endpoint) -> None:
        """Start noticing ``ep``'s completions: a reader on its completion channel, or polling
        from the loop when its descriptor is unknown."""
        loop = self._owner.loop
        assert loop is not None
        if ep.fd is not None:
            loop.add_reader(ep.fd, self.on_cq_event, ep)
        else:
            ep.spinning = True  # no fd found: poll from the loop
            loop.call_soon(self.spin, ep, True)

    def unwatch(self, ep: Endpoint) -> None:
        """Stop reading ``ep``'s completion channel (before its resources are released)."""
        loop = self._owner.loop
        if ep.fd is not None and loop is not None:
            with contextlib.suppress(Exception):
                loop.remove_reader(ep.fd)

    def on_cq_event(self, ep: Endpoint) -> None:
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
            self._owner.fail(ep, f"rdma completion channel of member {ep.peer} failed: {exc}")
            return
        if self.drain_cq(ep) and self._tuning.busy_poll:
            self.start_spin(ep)

    def start_spin(self, ep: Endpoint) -> None:
        """Busy-poll ``ep``'s CQ from the loop for ``busy_poll_window`` after its last
        completion (``busy_poll``)."""
        ep.spin_until = time.monotonic() + self._tuning.busy_poll_window
        if not ep.spinning and self._owner.loop is not None:
            ep.spinning = True
            self._owner.loop.call_soon(self.spin, ep, False)

    def spin(self, ep: Endpoint, forever: bool) -> None:
        """Busy-poll ``ep``'s CQ while completions keep coming (``forever``: no channel fd)."""
        if ep.dead or self._owner.closed:
            ep.spinning = False
            return
        if self.drain_cq(ep):
            ep.spin_until = time.monotonic() + self._tuning.busy_poll_window
        if forever or time.monotonic() < ep.spin_until:
            assert self._owner.loop is not None
            if forever and time.monotonic() >= ep.spin_until:
                self._owner.loop.call_later(0.001, self.spin, ep, True)
            else:
                self._owner.loop.call_soon(self.spin, ep, forever)
        else:
            ep.spinning = False

    def drain_cq(self, ep: Endpoint) -> bool:
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
                self._owner.fail(ep, f"polling the rdma CQ for member {ep.peer} failed: {exc}")
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
            self._owner.fail(ep, f"reposting rdma receives for member {ep.peer} failed: {exc}")
            return got
        if doorbell or ep.held:
            self.pump(ep)
        owed = ep.rx.tail - ep.returned
        if not ep.dead and (
            ep.flush_wanted
            or ep.backlog
            or (owed > 0 and (ep.credit_wanted or owed >= ep.rx.size // 4))
        ):
            ep.flush_wanted = False
            self._owner.mark_dirty(ep)
        if got:
            self._owner.wake_drainers()
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
                self.violation(ep, str(exc))
                return False
            if ev.flag:
                ep.credit_wanted = True
            return True
        if ev.kind == "credit":
            if ep.tx is None:
                self.violation(ep, "credit before the link was paired")
                return False
            try:
                ep.tx.on_credit(ev.units)
            except RingError as exc:
                self.violation(ep, str(exc))
                return False
            return True
        if ev.kind == "noop":
            return True
        if ev.kind == "flushed":
            self._owner.fail(ep, f"rdma queue pair to member {ep.peer} is in the error state")
            return False
        detail = ev.detail
        if "RETRY_EXC" in detail:
            detail += " (retries exhausted: member unreachable over rdma)"
        elif "REM_ACCESS" in detail or "REM_INV" in detail:
            detail += " (remote access rejected)"
        self._owner.fail(ep, f"rdma link to member {ep.peer} failed: {detail}")
        return False

    def violation(self, ep: Endpoint, why: str) -> None:
        """``ep``'s peer broke the protocol: tear the endpoint down and report the peer."""
        self._owner.fail(ep, f"protocol violation by member {ep.peer}: {why}")

    def pump(self, ep: Endpoint) -> None:
        """Deliver inbox records and held messages of ``ep`` in their link order."""
        link = self._owner.link(ep.peer)
        mm = ep.inbox.mm
        while not ep.dead and not self._owner.closed:
            while ep.held and ep.held[0][0] <= ep.pushes_consumed:
                _, payload = ep.held.popleft()
                ep.held_bytes -= len(payload)
                self.deliver_user(link, ep.peer_ep, payload)
            try:
                rec = ep.rx.peek(mm)
            except RingError as exc:
                self.violation(ep, str(exc))
                return
            if rec is None:
                break
            seen = link.rx_count if link.rx_tag == ep.peer_ep else 0
            if rec.msgs_before > seen:
                break  # a message sent before this push is still on its way
            if rec.bulk:
                brx, region = ep.brx, ep.bulk
                if brx is None or region is None:
                    self.violation(ep, "bulk record but no bulk region was granted")
                    return
                try:
                    msg = brx.land(region.mm, rec.view_id, rec.offset, rec.length, rec.final)
                except RingError as exc:
                    self.violation(ep, str(exc))
                    return
                ep.rx.consume(rec)
                if msg is not None:
                    ep.pushes_consumed += 1
                    self._deliver(ep.peer, msg)
                continue
            data = mm[rec.data_at : rec.data_at + rec.length]
            ep.rx.consume(rec)
            if rec.final:
                ep.pushes_consumed += 1
            self._push_arrived(rec.view_id, ep.peer, rec.offset, data)
        if not ep.dead:
            self._send.maybe_return_credit(ep)

    def on_user_message(self, sender: int, tag: int, pushes_before: int, body: bytes) -> None:
        """A message of the channel, sent after ``pushes_before`` pushes of the sender's
        endpoint ``tag`` (0: none): delivered now, or held until those pushes were delivered."""
        link = self._owner.link(sender)
        ep = link.ep
        if (
            ep is not None
            and not ep.dead
            and tag != 0
            and ep.peer_ep == tag
            and (ep.held or pushes_before > ep.pushes_consumed)
        ):
            if ep.held_bytes + len(body) > self._tuning.max_held_bytes:
                ep.held.append((pushes_before, body))
                self.violation(ep, "too many messages waiting for pushes that do not arrive")
                return
            ep.held.append((pushes_before, body))
            ep.held_bytes += len(body)
            return
        self.deliver_user(link, tag, body)
        if ep is not None and not ep.dead and tag != 0 and ep.peer_ep == tag:
            self.pump(ep)  # pushes may have waited for this message

    def deliver_user(self, link: Link, tag: int, body: bytes) -> None:
        """Deliver a message of ``link``, counting it for pushes that wait for it."""
        if tag:
            if link.rx_tag != tag:
                link.rx_tag, link.rx_count = tag, 0
            link.rx_count += 1
        self._deliver(link.peer, body)

    def deliver_held(self, link: Link, tag: int, held: list[bytes]) -> None:
        """Messages that waited for pushes of a torn-down endpoint (those pushes are lost)."""
        for payload in held:
            self.deliver_user(link, tag, payload)
