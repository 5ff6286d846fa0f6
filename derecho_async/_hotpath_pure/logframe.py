"""The durable log's records framed as one batch: the pure twin of ``native/logframe.c``
(docs/DESIGN.md §4.6), with the same checks, in the same order, and the same messages."""

from __future__ import annotations

import struct
import zlib
from typing import Any

__all__ = ["frame_log_records", "frame_log_runs"]

_MAX_U63 = (1 << 63) - 1
_TAIL = struct.Struct("<IIQQQq")  # the header after magic and crc: what the crc covers first
_PREFIX = struct.Struct("<4sI")
_MAGIC = b"DLR1"
_KIND_CALL = 1


def _check_version(version: object) -> tuple[int, int]:
    if (type(version) is tuple and len(version) == 2 and type(version[0]) is int
            and type(version[1]) is int and 0 <= version[0] <= _MAX_U63
            and 0 <= version[1] <= _MAX_U63):
        return (version[0], version[1])
    raise ValueError(f"a version is a pair of ints in 0..2**63-1, got {version!r}")


def _check_time(time_ns: object) -> int:
    if type(time_ns) is not int or not -_MAX_U63 - 1 <= time_ns <= _MAX_U63:
        raise ValueError(f"time_ns must be a 64-bit int, got {time_ns!r}")
    return time_ns


def _frame(parts: list[bytes], batch: int, version: tuple[int, int], time_ns: int,
           prefix: bytes, body: bytes) -> None:
    """One record (its body ``prefix`` and ``body``) onto ``parts``."""
    tail = _TAIL.pack(len(prefix) + len(body), _KIND_CALL, batch, version[0], version[1],
                      time_ns)
    parts += (_PREFIX.pack(_MAGIC, zlib.crc32(body, zlib.crc32(prefix, zlib.crc32(tail)))),
              tail, prefix, body)


def frame_log_records(records: list[tuple[tuple[int, int], int, bytes]], batch: int,
                      after: tuple[int, int] | None, max_record_bytes: int, /) -> bytes:
    """``records`` (each ``(version, time_ns, body)``; versions strictly increasing from
    ``after``) framed as batch ``batch`` of the durable log: per record a 48-byte header (magic,
    crc32 of the rest of the header and the body, length, kind, batch, view, seq, time_ns) and
    the body. TypeError or ValueError for a record that breaks a rule."""
    if type(records) is not list:
        raise TypeError("frame_log_records: records must be a list")
    prev: object = after
    last = _check_version(after) if after is not None else None
    parts: list[bytes] = []
    for record in records:
        if not isinstance(record, tuple) or len(record) != 3:
            raise TypeError("a log record is a (version, time_ns, body) tuple")
        version, time_ns, body = record
        v = _check_version(version)
        if last is not None and v <= last:
            raise ValueError(f"version {version!r} does not follow {prev!r}")
        _check_time(time_ns)
        if type(body) is not bytes:
            raise TypeError(f"a record's body is bytes, got {type(body).__name__}")
        if len(body) > max_record_bytes:
            raise ValueError(f"a record of {len(body)} bytes is over the limit of "
                             f"{max_record_bytes}")
        _frame(parts, batch, v, time_ns, b"", body)
        last, prev = v, version
    return b"".join(parts)


def frame_log_runs(runs: list[tuple[list[Any], int]], batch: int, after: tuple[int, int] | None,
                   max_record_bytes: int, prefix: bytes, /) -> bytes | None:
    """As :func:`frame_log_records`, for runs of delivered calls as the driver reports them:
    ``runs`` is a list of ``(events, time_ns)``, each event a tuple whose items 2 and 3 are its
    view and seq and item 6 its payload; each record's body is ``prefix`` and the payload, its
    time the run's, or the sender's clock of a stamped call (``wire.stamp_call``). None
    (nothing framed) when a payload is not bytes."""
    if type(runs) is not list or type(prefix) is not bytes:
        raise TypeError("frame_log_runs: runs must be a list, prefix bytes")
    for run in runs:
        if not isinstance(run, tuple) or len(run) != 2 or type(run[0]) is not list:
            raise TypeError("a run is an (events, time_ns) tuple")
    last = _check_version(after) if after is not None else None
    parts: list[bytes] = []
    for events, time_ns in runs:
        _check_time(time_ns)
        for ev in events:
            if not isinstance(ev, tuple) or len(ev) < 7:
                raise TypeError("a delivered event is a tuple of 7 items")
            payload = ev[6]
            if type(payload) is not bytes:
                return None
            version = (ev[2], ev[3])
            v = _check_version(version)
            if last is not None and v <= last:
                raise ValueError(f"version {version!r} does not follow ({last[0]}, {last[1]})")
            n = len(prefix) + len(payload)
            if n > max_record_bytes:
                raise ValueError(f"a record of {n} bytes is over the limit of {max_record_bytes}")
            stamped = len(payload) > 13 and payload[0] in (0x94, 0x95) and payload[-9] == 0xcf
            at = int.from_bytes(payload[-8:], "big", signed=True) if stamped else time_ns
            _frame(parts, batch, v, at, prefix, payload)
            last = v
    return b"".join(parts)
