# Theory of operation
# -------------------
# Everything that leaves this member on an endpoint's queue pair. ``push`` copies header and
# bytes into the registered mirror of the peer's inbox at the ring position they will occupy
# there (or keeps them in the endpoint's FIFO backlog when space or pairing is missing);
# ``queue_bulk`` queues a large message behind the pushes, and its blocks are staged in the
# copy of the peer's bulk region as slots and ring space allow. ``flush`` (once per loop
# iteration for every endpoint marked dirty) posts the new ring bytes as RDMA WRITEs, the last
# WITH_IMM carrying the new head, each bulk block's WRITE before the ring bytes announcing it,
# and the credit this side owes as a zero-length SEND_WITH_IMM. See docs/DESIGN.md §5.4
# (sending, credit, bulk messages).
"""The rdma send path: staging pushes and bulk messages, posting writes, returning credit."""

from __future__ import annotations

import socket
from typing import Any

from derecho_async.transport.rdma.bulk import piece_end
from derecho_async.transport.rdma.endpoint import Device, Endpoint, LinkOwner, Tuning
from derecho_async.transport.rdma.rings import (
    R_BULK,
    R_PAD,
    R_PUSH,
    REC,
    RF_FINAL,
    Placement,
    imm_credit,
    imm_doorbell,
)

__all__ = ["SendPath"]


class SendPath:
    """Stages and posts what one member sends over its endpoints' queue pairs.

    Works on the endpoints its :class:`~derecho_async.transport.rdma.endpoint.LinkOwner`
    hands out; a link that does not drain or a post that fails is reported back through
    ``owner.fail``.
    """

    def __init__(self, owner: LinkOwner, device: Device, tuning: Tuning) -> None:
        self._owner = owner
        self._device = device
        self._tuning = tuning

    def push(self, ep: Endpoint, view_id: int, offset: int, mv: memoryview) -> None:
        """Send one push on ``ep``: staged in the mirror when it fits and nothing waits before
        it, else kept (copied) in the backlog; flushed in a loop callback."""
        ep.pushes_issued += 1
        mb = ep.msgs_sent
        if ep.backlog or ep.tx is None or not self._stage(ep, view_id, offset, mv, mb):
            self._to_backlog(ep, view_id, offset, mv, mb)
        self._owner.mark_dirty(ep)

    def drained(self, ep: Endpoint) -> bool:
        """True when everything staged on ``ep`` was posted and completed locally (or ``ep``
        failed)."""
        if ep.dead:
            return True
        if ep.backlog or ep.bulk_posts:
            return False
        tx = ep.tx
        return tx is None or (tx.staged == tx.posted and tx.done >= tx.posted)

    def queue_bulk(self, ep: Endpoint, payload: object, mv: memoryview) -> None:
        """Queue a bulk message behind the link's pushes; it counts as one push for the order
        between the two channels."""
        n = len(mv)
        if ep.bulk_backlog_bytes + n > self._tuning.max_bulk_backlog_bytes:
            self._owner.fail(
                ep,
                f"rdma link to member {ep.peer} not draining: more than "
                f"{self._tuning.max_bulk_backlog_bytes} bytes of bulk messages waiting",
            )
            return
        data = mv if isinstance(payload, bytes) else memoryview(bytes(mv))  # immutable only
        ep.pushes_issued += 1
        ep.backlog.append((-1, 0, data, ep.msgs_sent))
        ep.bulk_backlog_bytes += n
        self._owner.mark_dirty(ep)

    def _to_backlog(
        self, ep: Endpoint, view_id: int, offset: int, mv: memoryview, mb: int
    ) -> None:
        if ep.backlog_bytes + len(mv) > self._tuning.max_backlog_bytes:
            self._owner.fail(
                ep,
                f"rdma link to member {ep.peer} not draining: more than "
                f"{self._tuning.max_backlog_bytes} bytes of pushes waiting",
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
            self._owner.fail(
                ep,
                f"member {ep.peer} grants no rdma bulk region for a message of {n} bytes "
                f"(its bulk limit: {limit})",
            )
            return False
        if ep.peer_info is not None and n > ep.peer_info.bmax:
            self._owner.fail(ep, f"message of {n} bytes exceeds member {ep.peer}'s bulk limit")
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

    def flush(self, ep: Endpoint) -> bool:
        """Post staged bytes (one WRITE per span, the last WITH_IMM) and any due credit; True
        when ``ep`` was paired and posting did not fail (busy polling may follow)."""
        tx = ep.tx
        if tx is None or ep.dead:
            return False
        self._drain_backlog(ep)
        pv = self._device.pv
        assert pv is not None and ep.peer_info is not None and ep.mirror_mr is not None
        if tx.staged > tx.posted:
            try:
                # each bulk block: its WRITE into the peer's region, then the ring up to and
                # including its record, with a doorbell asking for credit (frees the slot)
                while ep.bulk_posts:
                    if ep.sq_seq - ep.sq_done + 5 > self._tuning.send_depth:
                        break
                    at, length, rec_end = ep.bulk_posts.popleft()
                    self.post_bulk_block(ep, at, length)
                    self.post_ring(ep, rec_end, True)
                if ep.bulk_posts or ep.sq_seq - ep.sq_done + 3 > self._tuning.send_depth:
                    ep.flush_wanted = True  # resumes on a send completion
                elif tx.staged > tx.posted:
                    self.post_ring(ep, None, tx.free() < tx.size // 2 or bool(ep.backlog))
            except pv.any_error as exc:
                self._owner.fail(ep, f"rdma post to member {ep.peer} failed: {exc}")
                return False
        self.maybe_return_credit(ep)
        return True

    def post_ring(self, ep: Endpoint, upto: int | None, want: bool) -> None:
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
            signal = ep.unsignaled + 1 >= self._tuning.signal_every or (
                last and (want or self._owner.draining)
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
            self.post(ep, wr, signal, end)

    def post_bulk_block(self, ep: Endpoint, at: int, length: int) -> None:
        """One plain RDMA WRITE of a staged block into the same slot of the peer's region."""
        pv, tx, info, stage = self._device.pv, ep.tx, ep.peer_info, ep.bstage
        assert pv is not None and tx is not None and info is not None and stage is not None
        e = pv.enums
        signal = ep.unsignaled + 1 >= self._tuning.signal_every
        sge = pv.wr.SGE(stage.address + at, length, ep.bstage_mr.lkey)
        wr = pv.wr.SendWR(
            wr_id=ep.sq_seq + 1,
            opcode=e.IBV_WR_RDMA_WRITE,
            num_sge=1,
            sg=[sge],
            send_flags=int(e.IBV_SEND_SIGNALED) if signal else 0,
        )
        wr.set_wr_rdma(info.brkey, info.baddr + at)
        self.post(ep, wr, signal, tx.posted)

    def post(self, ep: Endpoint, wr: Any, signal: bool, pos: int) -> None:
        """Post one send work request; a signalled one records that its completion covers
        ring position ``pos``. Raises pyverbs errors."""
        ep.qp.post_send(wr, None)
        ep.sq_seq += 1
        if signal:
            ep.unsignaled = 0
            ep.signaled.append((ep.sq_seq, pos))
        else:
            ep.unsignaled += 1

    def post_imm_send(self, ep: Endpoint, imm: int, *, signal: bool = False) -> bool:
        """A zero-length SEND_WITH_IMM (credit or no-op); False when the SQ is full."""
        pv = self._device.pv
        if pv is None or ep.dead or not ep.paired:
            return False
        if ep.sq_seq - ep.sq_done + 1 > self._tuning.send_depth:
            return False
        e = pv.enums
        signal = signal or ep.unsignaled + 1 >= self._tuning.signal_every
        wr = ep.imm_wr
        if wr is None:
            sge = pv.wr.SGE(ep.inbox.address + self._tuning.inbox_bytes, 0, ep.scratch_mr.lkey)
            wr = ep.imm_wr = pv.wr.SendWR(
                wr_id=0, opcode=e.IBV_WR_SEND_WITH_IMM, num_sge=1, sg=[sge], send_flags=0
            )
        wr.wr_id = ep.sq_seq + 1
        wr.imm_data = socket.htonl(imm)
        wr.send_flags = int(e.IBV_SEND_SIGNALED) if signal else 0
        try:
            self.post(ep, wr, signal, ep.tx.posted if ep.tx is not None else 0)
        except pv.any_error as exc:
            self._owner.fail(ep, f"rdma post to member {ep.peer} failed: {exc}")
            return False
        return True

    def maybe_return_credit(self, ep: Endpoint) -> None:
        """Return the consumed inbox position to the peer when a quarter of the ring was
        consumed since the last return, or the peer asked for it."""
        rx = ep.rx
        consumed = rx.tail - ep.returned
        if consumed <= 0 or not ep.paired:
            return
        if ep.credit_wanted or consumed >= rx.size // 4:
            if self.post_imm_send(ep, imm_credit(rx.tail)):
                ep.returned = rx.tail
                ep.credit_wanted = False
            else:
                ep.flush_wanted = True
