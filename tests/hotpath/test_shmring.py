"""The shm ring of the twins: ring_scan and ring_put agree, and what one writes the other reads
back, across the ring's wrap (derecho_async/_hotpath_pure/shmring.py)."""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from derecho_async import hotpath
from tests.hotpath.twins import SETTINGS, U64, field, ints, native, needs_native, outcome, same

# -- ring scan --------------------------------------------------------------------------------


@st.composite
def rings(draw: st.DrawFn) -> tuple[bytearray, int, int, int]:
    cap = 8 * draw(st.integers(4, 40))
    data = bytearray(draw(st.binary(min_size=cap, max_size=cap)))
    tail = 8 * draw(st.integers(0, 3 * cap // 8))
    pos = tail
    for _ in range(draw(st.integers(0, 5))):
        length = draw(st.integers(0, 40))
        padded = (length + 7) & ~7
        if pos + 32 + padded - tail > cap:
            break
        good = draw(st.booleans()) or draw(st.booleans())
        typ = draw(st.sampled_from([1, 2])) if good else draw(st.integers(0, 4))
        flags = 0 if good else draw(st.sampled_from([0, 1, 0x80000000]))
        a = draw(st.integers(0, 5)) if good else draw(field)
        b = draw(st.integers(0, 5)) if good else draw(field)
        hdr = struct.pack("<IIQQQ", typ, flags, a, b, length if good else draw(field))
        for i, byte in enumerate(hdr + draw(st.binary(min_size=padded, max_size=padded))):
            data[(pos + i) % cap] = byte
        pos += 32 + padded
    head = pos if draw(st.integers(0, 5)) else tail + 8 * draw(st.integers(0, cap // 8 + 1))
    budget = draw(st.one_of(st.just(1024), st.integers(0, 6)))
    return data, tail, head, budget


@needs_native
@SETTINGS
@given(rings())
def test_ring_scan(ring: tuple[bytearray, int, int, int]) -> None:
    data, tail, head, budget = ring
    kind, value = same("ring_scan", data, tail, head, budget)
    same("ring_scan", memoryview(data), tail, head, budget)
    if kind == "ok":
        records, new_tail, error = value
        assert tail <= new_tail <= head
        assert len(records) <= budget
        if error is None:
            assert new_tail == head or len(records) == budget


@needs_native
def test_ring_scan_refuses_examples() -> None:
    cap = 64
    data = bytearray(cap)
    struct.pack_into("<IIQQQ", data, 0, 1, 0, 1, 2, 1000)
    assert same("ring_scan", data, 0, 40, 10)[1] == (
        [],
        0,
        "record of 1000 bytes overruns published data",
    )
    struct.pack_into("<IIQQQ", data, 0, 9, 0, 1, 2, 0)
    assert same("ring_scan", data, 0, 32, 10)[1] == ([], 0, "unknown record type 9")
    struct.pack_into("<IIQQQ", data, 0, 1, 3, 1, 2, 0)
    assert same("ring_scan", data, 0, 32, 10)[1] == ([], 0, "record flags 0x3 are not zero")
    struct.pack_into("<IIQQQ", data, 0, 1, 0, 1 << 63, 2, 0)
    assert same("ring_scan", data, 0, 32, 10)[1][2] == f"push view {1 << 63} / offset 2 out of range"
    assert same("ring_scan", data, 0, 72, 10)[0] == "ValueError"


@st.composite
def puts(draw: st.DrawFn) -> tuple[int, int, list[tuple[Any, ...]]]:
    """A ring size, a start position and records to write one after the other (some of them
    out of range: a bad type, field or size)."""
    cap = 8 * draw(st.integers(1, 40))
    start = draw(st.one_of(st.integers(0, 3 * cap), st.sampled_from([U64 - 8, 1 << 63])))
    recs = draw(st.lists(st.tuples(
        st.one_of(st.sampled_from([1, 2]), ints),
        st.one_of(st.integers(0, 9), ints),
        st.one_of(st.integers(0, 9), ints),
        st.binary(max_size=3 * cap // 2),
    ), max_size=4))
    return cap, start, recs


@needs_native
@SETTINGS
@given(puts())
def test_ring_put(case: tuple[int, int, list[tuple[Any, ...]]]) -> None:
    """Both twins write the same bytes and refuse the same records; what they write reads back
    through ring_scan as written, across the ring's wrap."""
    assert native is not None
    cap, start, recs = case
    rings = {name: bytearray(b"\xee" * cap) for name in ("pure", "native")}
    pos = start
    for typ, a, b, payload in recs:
        results = {
            name: outcome(mod.ring_put, memoryview(rings[name]), pos, typ, a, b, payload)
            for name, mod in (("pure", pure), ("native", native))
        }
        assert results["pure"] == results["native"], (typ, a, b, len(payload), pos)
        assert rings["pure"] == rings["native"]
        kind, size = results["pure"]
        if kind != "ok":
            continue
        assert size == 32 + (len(payload) + 7) // 8 * 8
        readable = typ == 2 or (typ == 1 and a < 1 << 63 and b < 1 << 63)
        if readable and pos + size < U64:
            got = same("ring_scan", bytes(rings["pure"]), pos, pos + size, 1)[1]
            assert got == ([(typ, a, b, payload)], pos + size, None)
        pos += size
    assert same("ring_put", bytes(cap), 0, 1, 0, 0, b"") == ("TypeError", "buffer is not writable")


def test_ring_put_refuses_examples() -> None:
    for mod in (pure, native) if native is not None else (pure,):
        with pytest.raises(ValueError, match="whole words"):
            mod.ring_put(bytearray(64), 4, 1, 0, 0, b"")
        with pytest.raises(ValueError, match="does not fit a ring of 64"):
            mod.ring_put(bytearray(64), 0, 1, 0, 0, bytes(33))
        with pytest.raises(ValueError, match="typ must be"):
            mod.ring_put(bytearray(64), 0, 1 << 32, 0, 0, b"")
        data = bytearray(64)
        assert mod.ring_put(data, 48, 2, 7, 3, b"abcdefghij") == 48  # wraps: 16 + 32 bytes
        assert hotpath.ring_scan(data, 48, 96, 9) == ([(2, 7, 3, b"abcdefghij")], 96, None)
