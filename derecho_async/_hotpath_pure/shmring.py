"""The shm transport's ring: the pure twin of ``native/shmring.c`` (see docs/DESIGN.md §5.2, §8).

The ring's data area is used circularly (stream position ``p`` is byte ``p % len(data)``); a
record is a 32-byte header (u32 type, u32 flags, u64 a, u64 b, u64 length) and a payload padded
to 8. :func:`ring_scan` validates and copies out the records a peer published; :func:`ring_put`
writes one.
"""

from __future__ import annotations

import struct

from derecho_async._hotpath_pure.words import U64, WORD, Buffer, arg_u64

__all__ = ["RING_HEADER", "R_MSG", "R_PUSH", "RingRecord", "ring_put", "ring_scan"]

RingRecord = tuple[int, int, int, bytes]
"""(type, a, b, payload) of one shm ring record."""

RING_HEADER = 32
R_PUSH = 1
R_MSG = 2
_U63 = 1 << 63

_RING = struct.Struct("<IIQQQ")


def _ring_read(data: Buffer, cap: int, pos: int, n: int) -> bytes:
    i = pos % cap
    if i + n <= cap:
        return bytes(data[i : i + n])
    return bytes(data[i:]) + bytes(data[: n - (cap - i)])


def ring_scan(
    data: Buffer, tail: int, head: int, budget: int, /
) -> tuple[list[RingRecord], int, str | None]:
    """Parse and validate up to ``budget`` records of a shm ring between ``tail`` and ``head``.

    ``data`` is the ring's data area, used circularly (stream position ``p`` is byte
    ``p % len(data)``). A record is a header (u32 type, u32 flags = 0, u64 a, u64 b, u64 length)
    and ``length`` payload bytes, padded to 8. Returns the valid records (type, a, b, payload),
    the stream position after them, and the reason the next record was refused (None when the
    scan stopped at ``head`` or at ``budget``). A ``tail .. head`` range that is not inside the
    ring raises ValueError (the caller validates the published head first).
    """
    tail = arg_u64(tail, "tail")
    head = arg_u64(head, "head")
    budget = arg_u64(budget, "budget")
    cap = len(data) if not isinstance(data, memoryview) else data.nbytes
    if cap == 0 or cap % WORD or head < tail or head - tail > cap or tail % WORD or head % WORD:
        raise ValueError("published range does not fit the ring")
    records: list[RingRecord] = []
    count = 0
    while tail != head and count < budget:
        avail = head - tail
        if avail < RING_HEADER:
            return records, tail, f"{avail} bytes left, less than a record header"
        typ, flags, a, b, length = _RING.unpack(_ring_read(data, cap, tail, RING_HEADER))
        if flags:
            return records, tail, f"record flags {flags:#x} are not zero"
        padded = (length + 7) & ~7
        if padded > avail - RING_HEADER:
            return records, tail, f"record of {length} bytes overruns published data"
        if typ == R_PUSH:
            if a >= _U63 or b >= _U63:
                return records, tail, f"push view {a} / offset {b} out of range"
        elif typ != R_MSG:
            return records, tail, f"unknown record type {typ}"
        payload = _ring_read(data, cap, tail + RING_HEADER, length) if length else b""
        records.append((typ, a, b, payload))
        tail += RING_HEADER + padded
        count += 1
    return records, tail, None


def _ring_write(data: bytearray | memoryview, cap: int, pos: int, src: Buffer) -> None:
    i = pos % cap
    n = len(src) if not isinstance(src, memoryview) else src.nbytes
    first = min(n, cap - i)
    data[i : i + first] = src[:first]
    if n > first:
        data[: n - first] = src[first:]


def ring_put(
    data: bytearray | memoryview, pos: int, typ: int, a: int, b: int, payload: Buffer, /
) -> int:
    """Write one shm ring record (the header :func:`ring_scan` reads, then ``payload``) at
    stream position ``pos`` of the ring whose data area is ``data``; returns the record's size
    (header and payload padded to 8). The padding bytes are left as they are. The caller checks
    that the ring has room; a record larger than the whole ring, or a position or ring size that
    is not whole words, raises ValueError."""
    pos = arg_u64(pos, "pos")
    typ = arg_u64(typ, "typ")
    a = arg_u64(a, "a")
    b = arg_u64(b, "b")
    if typ >= 1 << 32:
        raise ValueError("typ must be an int in [0, 2**32)")
    if memoryview(data).readonly:
        raise TypeError("buffer is not writable")
    payload = memoryview(payload).cast("B")
    cap = len(data) if not isinstance(data, memoryview) else data.nbytes
    length = payload.nbytes
    size = RING_HEADER + ((length + 7) & ~7)
    if cap == 0 or cap % WORD or pos % WORD:
        raise ValueError("ring size and position must be whole words")
    if size > cap:
        raise ValueError(f"a record of {size} bytes does not fit a ring of {cap}")
    if pos > U64 - 1 - size:
        raise ValueError("the record would pass stream position 2**64")
    _ring_write(data, cap, pos, _RING.pack(typ, 0, a, b, length))
    if length:
        _ring_write(data, cap, pos + RING_HEADER, payload)
    return size
