# Theory of operation
# -------------------
# A log segment is a sequence of records, each a fixed 48-byte header and its body:
#
#   magic "DLR1" | crc32 u32 | length u32 | kind u32 | batch u64 | view u64 | seq u64 | time_ns i64
#
# little-endian. ``crc`` is zlib's crc32 of the header bytes after it followed by the body, so a
# damaged length, version or body is caught like a damaged byte of the body. ``batch`` numbers the
# ``Log.append`` call that wrote the record (every record of one call shares it; calls number up
# by one), which lets recovery tell a torn tail from damage in the middle (log.py). ``kind`` is
# 1 for now: room for other record kinds later.
#
# Nothing read from disk is trusted before it is checked: the length is compared with the record
# size limit and with what is left of the file before a body is read, and a record is valid only
# when magic, kind and crc all match. ``scan`` reads a file forward in chunks and yields each valid
# record, then at most one ``Bad`` saying where and why the valid records ended (nothing when the
# file ends cleanly on a record boundary). ``find_record`` looks past a bad spot for the next valid
# record of a later batch, trying every occurrence of the magic.
"""Framing of log records: the header, its checksum, and checked scanning of a segment."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import NamedTuple

from derecho_async.durability.files import ReadFile
from derecho_async.errors import UsageError

__all__ = ["HEADER", "MAX_U63", "Bad", "LogRecord", "Scanned", "Version", "check_version",
           "find_record", "scan"]

Version = tuple[int, int]
"""(view_id, seq): the order of delivered calls; tuples compare lexicographically."""

MAX_U63 = (1 << 63) - 1

HEADER = struct.Struct("<4sIIIQQQq")
_MAGIC = b"DLR1"
_KIND_CALL = 1
_CHUNK = 1 << 20


class LogRecord(NamedTuple):
    """One delivered ordered call: its version, delivery time and encoded bytes."""

    version: Version
    time_ns: int
    body: bytes


class Scanned(NamedTuple):
    """A valid record found at ``offset``; the next record starts at ``end``."""

    offset: int
    end: int
    batch: int
    record: LogRecord


class Bad(NamedTuple):
    """The bytes at ``offset`` are not a valid record, because ``why``."""

    offset: int
    why: str


def check_version(version: object) -> Version:
    """``version`` as a Version, or UsageError if it is not a pair of ints in 0..2**63-1."""
    if (not isinstance(version, tuple) or len(version) != 2
            or not all(type(v) is int and 0 <= v <= MAX_U63 for v in version)):
        raise UsageError(f"a version is a pair of ints in 0..2**63-1, got {version!r}")
    return (version[0], version[1])


def _decode(header: bytes, body_of: int, max_record_bytes: int) -> tuple[int, int, int, int, int,
                                                                         int] | str:
    """The header's (crc, length, batch, view, seq, time_ns), or why it is not one; ``body_of``
    is how many bytes follow the header in the file."""
    magic, crc, length, kind, batch, view, seq, time_ns = HEADER.unpack(header)
    if magic != _MAGIC:
        return f"bad magic {magic!r}"
    if kind != _KIND_CALL:
        return f"unknown record kind {kind}"
    if length > max_record_bytes:
        return f"length {length} over the limit of {max_record_bytes}"
    if length > body_of:
        return f"length {length} past the end of the file ({body_of} bytes left)"
    if view > MAX_U63 or seq > MAX_U63 or batch > MAX_U63:
        return "version or batch out of range"
    return crc, length, batch, view, seq, time_ns


def _check(header: bytes, body: bytes, crc: int) -> bool:
    return zlib.crc32(body, zlib.crc32(memoryview(header)[8:])) == crc


class _Reader:
    """Positional reads of ``file`` up to ``end``, through a buffer of about a chunk."""

    def __init__(self, file: ReadFile, end: int) -> None:
        self.file = file
        self.end = end
        self._buf = b""
        self._at = 0

    def get(self, offset: int, length: int) -> bytes:
        lo = offset - self._at
        if lo < 0 or lo + length > len(self._buf):
            self._at = offset
            self._buf = self.file.pread(offset, min(max(length, _CHUNK), self.end - offset))
            lo = 0
        return self._buf[lo:lo + length]


def _record_at(reader: _Reader, offset: int, max_record_bytes: int) -> Scanned | Bad:
    end = reader.end
    if end - offset < HEADER.size:
        return Bad(offset, f"{end - offset} bytes left, too few for a record header")
    header = reader.get(offset, HEADER.size)
    if len(header) < HEADER.size:
        return Bad(offset, "short read of the header")
    decoded = _decode(header, end - offset - HEADER.size, max_record_bytes)
    if isinstance(decoded, str):
        return Bad(offset, decoded)
    crc, length, batch, view, seq, time_ns = decoded
    body = reader.get(offset + HEADER.size, length)
    if len(body) != length:
        return Bad(offset, "short read of the body")
    if not _check(header, body, crc):
        return Bad(offset, "checksum mismatch")
    return Scanned(offset, offset + HEADER.size + length, batch,
                   LogRecord((view, seq), time_ns, body))


def scan(file: ReadFile, start: int, end: int, max_record_bytes: int) -> Iterator[Scanned | Bad]:
    """The valid records of ``file`` from ``start`` to ``end``, then a ``Bad`` where they stop
    if that is before ``end``."""
    reader = _Reader(file, end)
    offset = start
    while offset < end:
        found = _record_at(reader, offset, max_record_bytes)
        yield found
        if isinstance(found, Bad):
            return
        offset = found.end


def find_record(file: ReadFile, start: int, end: int, max_record_bytes: int,
                after_batch: int) -> Scanned | None:
    """The first valid record at or after ``start`` (before ``end``) whose batch is greater
    than ``after_batch``, trying every place the magic occurs; None if there is none."""
    reader = _Reader(file, end)
    at = start
    while at < end:
        chunk = file.pread(at, min(_CHUNK, end - at))
        if not chunk:
            return None
        pos = chunk.find(_MAGIC)
        while pos >= 0:
            found = _record_at(reader, at + pos, max_record_bytes)
            if isinstance(found, Scanned) and found.batch > after_batch:
                return found
            pos = chunk.find(_MAGIC, pos + 1)
        at += max(1, len(chunk) - len(_MAGIC) + 1)  # a magic across the chunk edge is seen next
    return None
