"""Logged calls: a delivered call as a log body and back, history entries, restart chunks.

Theory of operation (docs/DESIGN.md §7.12): a log record's body is one tag byte and the call:
``0`` and the call's bytes as delivered, or ``1`` and the call's bytes with its out-of-band
arrays (copied to host) encoded together by the value codec. :func:`decode_body` gives back the
call's wire name, args and kwargs (arrays as numpy), whatever was logged; :func:`replay` runs
logged calls on an actor, dropping their outcomes (every replica had the same).
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from types import CoroutineType
from typing import Any

from derecho_async import wire
from derecho_async.api.calls import exception_text
from derecho_async.api.delivery import Dispatcher, Hosted, encode_outcome
from derecho_async.api.once import ClientCalls
from derecho_async.durability import LogRecord
from derecho_async.errors import DerechoError, ProtocolViolation
from derecho_async.runtime.dataplane import OutOfBand

__all__ = ["PLAIN", "HistoryEntry", "Logged", "SuffixChunk", "Version", "decode_body", "encode_body",
           "entry_of", "held_by", "pack_records", "replay", "stamp_of", "unpack_records", "version_from_wire",
           "wire_version"]

log = logging.getLogger("derecho_async.durable")

Version = tuple[int, int]
"""``(view_id, seq)``: where a call stands in its subgroup's total order."""

PLAIN = b"\x00"
"""The tag of a log body that is the call's bytes as delivered."""
_ARRAYS = b"\x01"  # a log body: [call bytes, [host arrays]] encoded by the value codec
_SEQ_MAX = 1 << 62  # "the end of a view" (as a seq: above any real one, + 1 still fits)
_PACKED = struct.Struct("<QQqI")  # a packed record's header: view_id, seq, time_ns, body length


def held_by(upto: Version) -> Version | None:
    """The last version a snapshot labelled ``upto`` holds (exclusive label, inclusive bound);
    None for a snapshot that holds no call."""
    view_id, seq = upto
    if seq > 0:
        return (view_id, seq - 1)
    return (view_id - 1, _SEQ_MAX) if view_id > 0 else None


def wire_version(version: Version | None) -> list[int]:
    """A version as two unsigned wire fields, ``[view_id, seq + 1]`` (``[0, 0]``: none)."""
    return [0, 0] if version is None else [version[0], version[1] + 1]


def version_from_wire(view_id: int, seq_plus_one: int) -> Version | None:
    """The inverse of :func:`wire_version`."""
    return None if seq_plus_one == 0 else (view_id, seq_plus_one - 1)


def stamp_of(payload: object) -> int | None:
    """The sender's clock a delivered call's payload carries (``wire.stamp_call``), None for
    one without a stamp."""
    if isinstance(payload, OutOfBand):
        return wire.call_time(payload.call)
    return wire.call_time(payload) if isinstance(payload, bytes) else None


def _host_array(array: object) -> object:
    get = getattr(array, "get", None)  # a CuPy array: copied to host
    if get is not None and wire.is_cupy_array(array):
        return get()
    return array


class Logged(bytes):
    """A body that is already a log body (a restart suffix's record): written as it is."""


def encode_body(payload: object) -> bytes:
    """A delivered call's payload as one self-contained log body (out-of-band arrays by value,
    device arrays copied to host). Runs in the executor."""
    if type(payload) is Logged:
        return bytes(payload)
    if type(payload) is bytes:
        return PLAIN + payload
    if isinstance(payload, OutOfBand):
        arrays = [_host_array(a) for a in payload.arrays]
        return _ARRAYS + wire.encode([payload.call, arrays])
    raise TypeError(f"cannot log a payload of type {type(payload).__name__}")


def decode_body(body: bytes) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """``(wire name, args, kwargs)`` of a logged call (the inverse of :func:`encode_body`)."""
    tag, rest = body[:1], body[1:]
    if tag == PLAIN:
        return wire.decode_call(rest)
    if tag == _ARRAYS:
        parts = wire.decode(rest)
        if not (isinstance(parts, tuple | list) and len(parts) == 2
                and isinstance(parts[0], bytes) and isinstance(parts[1], tuple | list)):
            raise ValueError("a logged call with arrays is malformed")
        return wire.decode_call(parts[0], buffers=list(parts[1]))
    raise ValueError(f"unknown log body tag {tag!r}")


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One delivered call as the log holds it (``subgroup.history()``), or as a subscription
    delivers it (``group.subscribe()``).

    ``time`` is the sender's wall clock when it made the call, in seconds since the epoch, the
    same in every member's log (a call from a member without ``data_dir`` carries none: then
    this member's clock at delivery);
    ``method`` the ordered method's name; ``one_way`` whether it was a ``.cast``."""

    version: Version
    time: float
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    one_way: bool


def entry_of(version: Version, time_ns: int, name: str, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> HistoryEntry:
    """The entry of a call of wire name ``name`` (``<Actor>.<method>[.cast]``)."""
    one_way = name.endswith(".cast")
    method = name.removesuffix(".cast").partition(".")[2]
    return HistoryEntry(version, time_ns / 1e9, method, args, kwargs, one_way)


@dataclass(frozen=True, slots=True)
class SuffixChunk:
    """A piece of a subgroup's log sent to a restarting member that is behind
    (:mod:`~derecho_async.api.restart`): the source's snapshot (first chunk only, when its log
    no longer reaches back far enough), then records in order; ``last`` ends the suffix."""

    snapshot: tuple[Version, int, bytes] | None
    records: list[LogRecord]
    last: bool

    def wire(self) -> list[object]:
        """The SUFFIX message's snapshot, records and last fields."""
        snap: list[object] = [] if self.snapshot is None else [
            self.snapshot[0][0], self.snapshot[0][1], self.snapshot[1], self.snapshot[2]]
        return [snap, [[r.version[0], r.version[1], r.time_ns, r.body] for r in self.records],
                self.last]

    @classmethod
    def from_wire(cls, snapshot: list[Any], records: list[Any], last: bool) -> SuffixChunk:
        """From fields the envelope validated (types and ranges)."""
        snap = None if not snapshot else ((snapshot[0], snapshot[1]), snapshot[2], snapshot[3])
        return cls(snap, [LogRecord((v, q), t, b) for v, q, t, b in records], last)


def pack_records(records: list[LogRecord]) -> bytes:
    """Records as one byte string (a joiner's log suffix): each a header and its body."""
    out = bytearray()
    for rec in records:
        out += _PACKED.pack(rec.version[0], rec.version[1], rec.time_ns, len(rec.body))
        out += rec.body
    return bytes(out)


def unpack_records(data: bytes, after: Version) -> list[LogRecord]:
    """The records :func:`pack_records` made, checked: every length inside ``data``, versions
    rising from above ``after``; ValueError naming the offset otherwise."""
    records = []
    at, last = 0, after
    view_ = memoryview(data)
    while at < len(data):
        if at + _PACKED.size > len(data):
            raise ValueError(f"a log suffix ends inside a record header at offset {at}")
        view_id, seq, time_ns, length = _PACKED.unpack_from(data, at)
        at += _PACKED.size
        if length > len(data) - at:
            raise ValueError(f"a log suffix record at offset {at} runs past the end")
        if (view_id, seq) <= last:
            raise ValueError(f"a log suffix record at offset {at} is not after {last}")
        last = (view_id, seq)
        records.append(LogRecord(last, time_ns, bytes(view_[at:at + length])))
        at += length
    return records


async def replay(hosted: Hosted, records: list[LogRecord], upto: Version | None,
                 once: ClientCalls | None = None) -> None:
    """Run logged calls (those at or after ``upto``) on ``hosted``'s actor, in order; their
    outcomes are dropped (each replica had the same), but an external client's call goes
    through ``once`` as at its delivery: run the first time, kept, never run again."""
    spec, _runner, actor, methods = hosted
    for rec in records:
        if upto is not None and rec.version < upto:
            continue
        body = rec.body
        tag = wire.client_tag(body[1:]) if once is not None and body[:1] == PLAIN else None
        if tag is not None:
            assert once is not None
            if once.admit(*tag) is not None:
                continue  # a retried copy: it ran at its first delivery
            try:
                name, args, kwargs = decode_body(body)
                fn, _one_way = Dispatcher.method_entry(spec, actor, methods, name)
            except (ProtocolViolation, DerechoError) as exc:
                once.done(*tag, *encode_outcome(False, exc))
                continue
        else:
            name, args, kwargs = decode_body(body)
            fn, _one_way = Dispatcher.method_entry(spec, actor, methods, name)
        ok, value = True, None
        try:
            value = fn(*args, **kwargs)
            if type(value) is CoroutineType:
                value = await value
        except BaseException as exc:  # the handler's own outcome, as when it first ran
            if log.isEnabledFor(logging.DEBUG):
                log.debug("replayed call %s raised %s: %s", rec.version, *exception_text(exc))
            ok, value = False, exc
        if tag is not None:
            assert once is not None
            once.done(*tag, *encode_outcome(ok, value))
