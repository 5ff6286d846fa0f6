from __future__ import annotations

import pytest

from derecho_async.core.schema import WORD, RowSchema
from derecho_async.core.table import Table
from derecho_async.errors import ProtocolViolation


@pytest.mark.parametrize("n,shards,window,payload", [(1, 1, 1, 0), (3, 1, 8, 256), (7, 3, 4, 64)])
def test_columns_are_aligned_disjoint_documented_and_fill_the_row(
    n: int, shards: int, window: int, payload: int
) -> None:
    s = RowSchema(n, shards, window, payload)
    cols = sorted(s.columns.values(), key=lambda c: c.offset)
    pos = 0
    for c in cols:
        assert c.offset == pos and c.offset % WORD == 0, c
        assert c.doc and c.words >= 1
        pos += c.nbytes
    assert pos == s.row_bytes
    assert len(s.shards) == shards
    sh = s.shards[-1]
    assert sh.slot_offset(window) == sh.slot_offset(0)  # a ring
    assert sh.slot_offset(window - 1) + sh.slot_words * WORD == sh.slots.offset + sh.slots.nbytes


def test_schema_rejects_impossible_shapes() -> None:
    with pytest.raises(ValueError):
        RowSchema(0, 1, 8, 8)
    with pytest.raises(ValueError):
        RowSchema(65, 1, 8, 8)
    with pytest.raises(ValueError):
        RowSchema(3, 1, 0, 8)


def test_owner_writes_and_peers_read_through_pushes() -> None:
    s = RowSchema(3, 1, 2, 16)
    a = Table(s, 3, 0)
    b = Table(s, 3, 1)
    a.set(s.heartbeat, 41)
    a.set(s.prop_joiners, 7, 3)
    b.apply_push(0, a.table_offset(0), a.my_bytes(0, s.row_bytes))
    assert b.get(0, s.heartbeat) == 41
    assert b.get(0, s.prop_joiners, 3) == 7
    assert b.get(2, s.heartbeat) == 0


def test_a_write_outside_the_senders_row_is_a_violation_by_that_sender() -> None:
    s = RowSchema(3, 1, 2, 16)
    t = Table(s, 3, 0)
    with pytest.raises(ProtocolViolation):
        t.apply_push(1, 2 * s.row_bytes, b"\0" * 8)  # into row 2
    with pytest.raises(ProtocolViolation):
        t.apply_push(1, s.row_bytes + s.row_bytes - 8, b"\0" * 16)  # runs past the row
    with pytest.raises(ProtocolViolation):
        t.apply_push(1, s.row_bytes + 3, b"\0" * 8)  # unaligned
    with pytest.raises(ProtocolViolation):
        t.apply_push(0, 0, b"\0" * 8)  # nobody writes my row
    assert t.read(2, 0, s.row_bytes) == bytes(s.row_bytes)


def test_a_frozen_row_ignores_later_writes_even_direct_ones() -> None:
    s = RowSchema(2, 1, 2, 16)
    t = Table(s, 2, 0)
    off = s.row_bytes + s.heartbeat.offset
    t.apply_push(1, off, (5).to_bytes(8, "little"))
    t.freeze(1)
    t.apply_push(1, off, (6).to_bytes(8, "little"))
    t.buf[off : off + 8] = (7).to_bytes(8, "little")  # as a peer writing shared memory would
    assert t.get(1, s.heartbeat) == 5
    assert t.is_frozen(1)


def test_table_over_a_caller_buffer_and_too_small_buffers() -> None:
    s = RowSchema(2, 1, 1, 8)
    buf = bytearray(2 * s.row_bytes + 100)
    t = Table(s, 2, 1, buf)
    t.set(s.wedged, 1)
    assert buf[s.row_bytes + s.wedged.offset] == 1
    with pytest.raises(ValueError):
        Table(s, 2, 0, bytearray(10))
