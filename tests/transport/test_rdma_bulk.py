"""The rdma bulk path's bookkeeping, without a device: block placement, slot credit,
reassembly, and hostile BULK records (on a device: test_rdma_bulk_device.py)."""

from __future__ import annotations

import random

import pytest

from derecho_async.transport.rdma.bulk import (
    BulkRx,
    BulkTx,
    bulk_blocks,
)
from derecho_async.transport.rdma.codec import MIN_INBOX
from derecho_async.transport.rdma.rings import (
    R_BULK,
    R_PAD,
    R_PUSH,
    REC,
    RF_FINAL,
    RecvRing,
    RingError,
    SendRing,
    imm_credit,
    imm_doorbell,
)

BLOCK = 4096


def test_blocks_cover_the_message_with_full_blocks_then_a_short_one() -> None:
    assert bulk_blocks(1, BLOCK) == [(0, 1)]
    assert bulk_blocks(BLOCK, BLOCK) == [(0, BLOCK)]
    assert bulk_blocks(2 * BLOCK + 5, BLOCK) == [(0, BLOCK), (BLOCK, BLOCK), (2 * BLOCK, 5)]
    assert bulk_blocks(0, BLOCK) == []


def test_slots_round_robin_and_are_freed_only_by_credit_covering_their_record() -> None:
    tx = BulkTx(BLOCK, 3)
    assert [tx.place(end) for end in (32, 64, 96)] == [0, BLOCK, 2 * BLOCK]
    assert tx.free() == 0
    with pytest.raises(ValueError):
        tx.place(128)
    tx.release(63)  # credit short of the second record's end frees only the first slot
    assert tx.free() == 1
    assert tx.place(128) == 0  # slot 0 again: block 3 of the link
    tx.release(128)
    assert tx.free() == 3
    with pytest.raises(ValueError):
        tx.place(100)  # records are placed in ring order
    with pytest.raises(ValueError):
        BulkTx(BLOCK + 4, 2)


class _Link:
    """Sender and receiver of one link with a simulated RDMA fabric: WRITEs are memcpys into
    the receiver's inbox and bulk region; doorbells and credit are delivered on ``pump``."""

    def __init__(self, slots: int, ring: int = MIN_INBOX, max_message: int = 1 << 20) -> None:
        self.tx, self.rx = SendRing(ring), RecvRing(ring)
        self.btx, self.brx = BulkTx(BLOCK, slots), BulkRx(BLOCK, slots, max_message)
        self.mirror, self.inbox = bytearray(ring), bytearray(ring)
        self.stage, self.region = bytearray(BLOCK * slots), bytearray(BLOCK * slots)
        self.posts: list[tuple[int, int, int]] = []  # staged blocks: slot, length, record end
        self.got: list[tuple[str, bytes]] = []
        self.max_inflight = 0

    def _record(self, typ: int, flags: int, length: int, a: int, b: int, data: bytes) -> bool:
        place = self.tx.place(len(data))
        if place is None:
            return False
        if place.pad_at is not None:
            REC.pack_into(self.mirror, place.pad_at, R_PAD, 0, place.pad_len, 0, 0, 0)
        REC.pack_into(self.mirror, place.at, typ, flags, length, a, b, 0)
        self.mirror[place.at + REC.size : place.at + REC.size + len(data)] = data
        return True

    def push(self, data: bytes) -> bool:
        return self._record(R_PUSH, RF_FINAL, len(data), 1, 0, data)

    def bulk(self, msg: bytes, sent: int) -> int:
        """Stage blocks of ``msg`` from ``sent`` while slots and ring last; the new ``sent``."""
        self.btx.release(self.tx.credit)
        for off, n in bulk_blocks(len(msg), BLOCK):
            if off < sent:
                continue
            if not self.btx.free():
                break
            final = off + n == len(msg)
            if not self._record(R_BULK, RF_FINAL if final else 0, n, len(msg), off, b""):
                break
            at = self.btx.place(self.tx.staged)
            self.stage[at : at + n] = msg[off : off + n]
            self.posts.append((at, n, self.tx.staged))
            sent = off + n
        self.max_inflight = max(self.max_inflight, len(self.btx.inflight))
        return sent

    def post_and_pump(self) -> None:
        """Post (block WRITE, then ring up to its record), deliver, return credit."""
        doorbells = []
        for at, n, end in self.posts:
            self.region[at : at + n] = self.stage[at : at + n]
            for off, k in self.tx.take_unposted(end):
                self.inbox[off : off + k] = self.mirror[off : off + k]
            doorbells.append(imm_doorbell(self.tx.posted, True))
        self.posts.clear()
        for off, k in self.tx.take_unposted():
            self.inbox[off : off + k] = self.mirror[off : off + k]
        self.tx.on_done(self.tx.posted)
        doorbells.append(imm_doorbell(self.tx.posted, False))
        for imm in doorbells:
            self.rx.on_doorbell(imm)
            while (rec := self.rx.peek(self.inbox)) is not None:
                if rec.bulk:
                    msg = self.brx.land(self.region, rec.view_id, rec.offset, rec.length, rec.final)
                    if msg is not None:
                        self.got.append(("bulk", msg))
                else:
                    data = bytes(self.inbox[rec.data_at : rec.data_at + rec.length])
                    self.got.append(("push", data))
                self.rx.consume(rec)
        self.tx.on_credit(imm_credit(self.rx.tail))


@pytest.mark.parametrize("slots", [1, 2, 8])
def test_interleaved_pushes_and_bulk_messages_arrive_whole_and_in_order(slots: int) -> None:
    rnd = random.Random(slots)
    link = _Link(slots)
    want: list[tuple[str, bytes]] = []
    queue: list[tuple[str, bytes]] = []
    sent = 0  # bytes of the bulk message at the head of the queue already staged
    for _ in range(400):
        if rnd.random() < 0.15:
            size = rnd.choice((1, BLOCK - 1, BLOCK, 3 * BLOCK + 17, 40000))
            want.append(("bulk", rnd.randbytes(size)))
        else:
            want.append(("push", rnd.randbytes(rnd.choice((8, 64, 1000)))))
        queue.append(want[-1])
        while queue:  # FIFO: the head goes first, a bulk message block by block
            kind, data = queue[0]
            if kind == "push" and link.push(data):
                queue.pop(0)
            elif kind == "bulk" and (sent := link.bulk(data, sent)) == len(data):
                queue.pop(0)
                sent = 0
            else:
                link.post_and_pump()  # out of ring space or slots: let the receiver catch up
        if rnd.random() < 0.3:
            link.post_and_pump()
    link.post_and_pump()
    assert link.got == want
    assert not link.brx.partial
    assert link.max_inflight <= slots
    if slots > 1:
        assert link.max_inflight > 1  # several blocks in flight (pipelined)


def _region(slots: int = 4) -> bytearray:
    return bytearray(bytes(range(256)) * (BLOCK * slots // 256))


def test_reassembly_copies_each_block_from_its_slot() -> None:
    region = _region(2)
    rx = BulkRx(BLOCK, 2, 1 << 20)
    total = 2 * BLOCK + 100
    assert rx.land(region, total, 0, BLOCK, False) is None
    assert rx.partial
    region[:BLOCK] = b"\x07" * BLOCK  # block 2 reuses slot 0
    assert rx.land(region, total, BLOCK, BLOCK, False) is None
    msg = rx.land(region, total, 2 * BLOCK, 100, True)
    assert msg is not None and len(msg) == total
    assert msg[:BLOCK] == bytes(_region(2)[:BLOCK])
    assert msg[BLOCK : 2 * BLOCK] == bytes(_region(2)[BLOCK : 2 * BLOCK])
    assert msg[2 * BLOCK :] == b"\x07" * 100
    assert not rx.partial
    assert rx.land(region, 5, 0, 5, True) == bytes(region[BLOCK : BLOCK + 5])  # slot 1 next


@pytest.mark.parametrize(
    "steps,why",
    [
        ([(10, 4, 6, True)], "starts at offset"),
        ([(0, 0, 0, True)], "bulk message of 0 bytes"),
        ([((1 << 20) + 1, 0, BLOCK, False)], "limit"),
        ([(3 * BLOCK, 0, BLOCK, False), (2 * BLOCK, BLOCK, BLOCK, False)], "says total"),
        ([(3 * BLOCK, 0, BLOCK, False), (3 * BLOCK, 2 * BLOCK, BLOCK, True)], "expected"),
        ([(3 * BLOCK, 0, BLOCK + 8, False)], "block size"),
        ([(3 * BLOCK, 0, 0, False)], "block size"),
        ([(BLOCK, 0, BLOCK, False)], "final flag"),
        ([(3 * BLOCK, 0, BLOCK, True)], "final flag"),
        ([(3 * BLOCK, 0, 8, False)], "short bulk block"),
        ([(2 * BLOCK, 0, BLOCK, False), (2 * BLOCK, BLOCK, BLOCK + 8, True)], "block size"),
        ([(BLOCK, 0, 2 * BLOCK, True)], "block size"),
        ([(100, 0, 200, True)], "beyond"),
    ],
)
def test_hostile_bulk_records_are_rejected(
    steps: list[tuple[int, int, int, bool]], why: str
) -> None:
    rx = BulkRx(BLOCK, 4, 1 << 20)
    region = _region()
    with pytest.raises(RingError, match=why):
        for total, offset, length, final in steps:
            rx.land(region, total, offset, length, final)


def test_a_discarded_partial_message_is_never_delivered() -> None:
    rx = BulkRx(BLOCK, 4, 1 << 20)
    region = _region()
    assert rx.land(region, 2 * BLOCK, 0, BLOCK, False) is None
    rx.discard()
    assert not rx.partial
    with pytest.raises(RingError, match="starts at offset"):
        rx.land(region, 2 * BLOCK, BLOCK, BLOCK, True)


def test_recv_ring_reads_bulk_records_without_ring_payload() -> None:
    inbox = bytearray(MIN_INBOX)
    REC.pack_into(inbox, 0, R_BULK, 0, BLOCK, 3 * BLOCK, 0, 2)
    REC.pack_into(inbox, REC.size, R_BULK, RF_FINAL | 4, BLOCK, 3 * BLOCK, BLOCK, 2)
    rx = RecvRing(MIN_INBOX)
    rx.on_doorbell(imm_doorbell(2 * REC.size, False))
    rec = rx.peek(inbox)
    assert rec is not None and rec.bulk and not rec.final
    assert (rec.view_id, rec.offset, rec.length, rec.total) == (3 * BLOCK, 0, BLOCK, REC.size)
    rx.consume(rec)
    with pytest.raises(RingError, match="flags"):
        rx.peek(inbox)
