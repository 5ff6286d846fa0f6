"""The rdma inbox rings without a device: immediate values across the wrap, push pieces at
aligned table offsets (``piece_end``), send and receive rings joined by a simulated RDMA
write, and malformed records and doorbells."""

from __future__ import annotations

import random

import pytest

from derecho_async.transport.rdma.bulk import piece_end
from derecho_async.transport.rdma.codec import MIN_INBOX
from derecho_async.transport.rdma.rings import (
    IMM_CREDIT,
    IMM_FLAG,
    IMM_NOOP,
    R_PAD,
    R_PUSH,
    REC,
    RF_FINAL,
    RecvRing,
    RingError,
    SendRing,
    advance,
    imm_credit,
    imm_doorbell,
)


def test_immediate_values_round_trip_across_the_wrap() -> None:
    for old in (0, 8, (1 << 33) - 8, 5 << 40):
        for delta in (0, 8, 4096, (1 << 32) - 8):
            new = old + delta
            units = imm_doorbell(new, False)
            assert not units & (IMM_CREDIT | IMM_FLAG)
            assert advance(old, units) == new
            c = imm_credit(new)
            assert c & IMM_CREDIT and not c & IMM_FLAG
            assert advance(old, c) == new
    assert imm_doorbell(64, True) & IMM_FLAG
    assert IMM_NOOP == IMM_CREDIT | IMM_FLAG


def test_pieces_split_on_aligned_table_offsets() -> None:
    chunk = 4096
    for offset, n in ((12, 200 << 10), (0, 4096), (4090, 10), (7, 1)):
        pos, ends = offset, []
        while pos < offset + n:
            end = piece_end(pos, offset + n - pos, chunk)
            assert end > pos and end - pos <= chunk
            ends.append(end)
            pos = end
        assert ends[-1] == offset + n
        assert all(e % 8 == 0 for e in ends[:-1])


class _Pipe:
    """A sender ring and a receiver ring joined by a simulated RDMA write (memcpy of spans)."""

    def __init__(self, size: int) -> None:
        self.tx = SendRing(size)
        self.rx = RecvRing(size)
        self.mirror = bytearray(size)
        self.inbox = bytearray(size)
        self.sent: list[tuple[int, int, bytes, int]] = []
        self.got: list[tuple[int, int, bytes, int]] = []

    def stage(self, view: int, offset: int, data: bytes, mb: int) -> bool:
        place = self.tx.place(len(data))
        if place is None:
            return False
        if place.pad_at is not None:
            REC.pack_into(self.mirror, place.pad_at, R_PAD, 0, place.pad_len, 0, 0, 0)
        REC.pack_into(self.mirror, place.at, R_PUSH, RF_FINAL, len(data), view, offset, mb)
        self.mirror[place.at + REC.size : place.at + REC.size + len(data)] = data
        self.sent.append((view, offset, data, mb))
        return True

    def post(self) -> int:
        for off, n in self.tx.take_unposted():
            self.inbox[off : off + n] = self.mirror[off : off + n]
        self.tx.on_done(self.tx.posted)
        return imm_doorbell(self.tx.posted, False)

    def receive(self, imm: int) -> None:
        self.rx.on_doorbell(imm)
        while (rec := self.rx.peek(self.inbox)) is not None:
            data = bytes(self.inbox[rec.data_at : rec.data_at + rec.length])
            self.rx.consume(rec)
            self.got.append((rec.view_id, rec.offset, data, rec.msgs_before))
        self.tx.on_credit(imm_credit(self.rx.tail))


def test_rings_carry_every_record_in_order_with_wrap_pad_and_credit() -> None:
    rnd = random.Random(5)
    pipe = _Pipe(MIN_INBOX)
    mb = 0
    backlog: list[tuple[int, int, bytes, int]] = []
    for i in range(3000):
        n = rnd.choice((0, 8, 16, 24, 40, 1000, 3000, pipe.tx.max_payload))
        mb += rnd.random() < 0.1
        backlog.append((1, i * 8, rnd.randbytes(n), mb))
        while backlog and pipe.stage(*backlog[0]):
            backlog.pop(0)
        if rnd.random() < 0.3 or backlog:
            pipe.receive(pipe.post())
    while backlog:
        assert pipe.stage(*backlog.pop(0))
        pipe.receive(pipe.post())
    pipe.receive(pipe.post())
    assert pipe.got == pipe.sent
    assert pipe.tx.free() == pipe.tx.size


def test_send_ring_needs_credit_and_local_completion() -> None:
    tx = SendRing(MIN_INBOX)
    n = 0
    while tx.place(1000) is not None:
        n += 1
    assert n == MIN_INBOX // (REC.size + 1000)
    tx.take_unposted()
    tx.on_credit(imm_credit(tx.posted))  # consumed remotely, but writes not completed here
    assert tx.place(1000) is None
    tx.on_done(tx.posted)
    assert tx.place(1000) is not None
    with pytest.raises(RingError):
        tx.on_credit(imm_credit(tx.posted + 8))  # credit for bytes never posted


def _inbox_with(*records: tuple[int, int, int, int, int, int], size: int = MIN_INBOX) -> bytearray:
    buf = bytearray(size)
    pos = 0
    for rec in records:
        REC.pack_into(buf, pos, *rec)
        pos += REC.size + ((rec[2] + 7) & ~7) if rec[0] != R_PAD else size - pos
    return buf


@pytest.mark.parametrize(
    "record,head,why",
    [
        ((9, 0, 8, 1, 0, 0), 40, "unknown record type"),
        ((R_PUSH, 2, 8, 1, 0, 0), 40, "flags"),
        ((R_PUSH, 1, 64, 1, 0, 0), 40, "past the doorbell"),
        ((R_PUSH, 1, MIN_INBOX, 1, 0, 0), MIN_INBOX, "crosses the ring end"),
        ((R_PUSH, 1, 8, 1 << 63, 0, 0), 40, "out of range"),
        ((R_PUSH, 1, 8, 1, 1 << 63, 0), 40, "out of range"),
        ((R_PAD, 0, 8, 0, 0, 0), 40, "malformed PAD"),
        ((R_PUSH, 1, 8, 1, 0, 0), 16, "truncated record header"),
    ],
)
def test_recv_ring_rejects_malformed_records(
    record: tuple[int, int, int, int, int, int], head: int, why: str
) -> None:
    rx = RecvRing(MIN_INBOX)
    rx.on_doorbell(imm_doorbell(head, False))
    with pytest.raises(RingError, match=why):
        rx.peek(_inbox_with(record))


def test_recv_ring_rejects_bad_doorbells_and_backwards_counts() -> None:
    rx = RecvRing(MIN_INBOX)
    with pytest.raises(RingError):
        rx.on_doorbell(imm_doorbell(MIN_INBOX + 8, False))  # more than a ring ahead
    buf = _inbox_with((R_PUSH, 1, 8, 1, 0, 5), (R_PUSH, 1, 8, 1, 0, 4))
    rx.on_doorbell(imm_doorbell(80, False))
    first = rx.peek(buf)
    assert first is not None and first.msgs_before == 5
    rx.consume(first)
    with pytest.raises(RingError, match="backwards"):
        rx.peek(buf)
