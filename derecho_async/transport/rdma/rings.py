# Theory of operation
# -------------------
# One inbox ring per (sender, receiver) endpoint pair, pure bookkeeping: the sender's
# :class:`SendRing` places records (32-byte ``REC`` header, payload padded to 8, never wrapping:
# a PAD record fills the ring's end) and tracks staged, posted, credited and locally completed
# positions; the receiver's :class:`RecvRing` validates what the peer wrote before anything
# reads it. Doorbells and credit travel as 32-bit immediate values (``imm_doorbell``,
# ``imm_credit``, ``advance``). See docs/DESIGN.md §5.4 (inboxes, sending, credit).
"""The rdma inbox rings: record format, immediate values, sender and receiver ring state."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

__all__ = [
    "IMM_CREDIT",
    "IMM_FLAG",
    "IMM_MASK",
    "IMM_NOOP",
    "REC",
    "RF_FINAL",
    "R_BULK",
    "R_PAD",
    "R_PUSH",
    "Placement",
    "Record",
    "RecvRing",
    "RingError",
    "SendRing",
    "advance",
    "align8",
    "imm_credit",
    "imm_doorbell",
]

#: Inbox record header: type, flags, length, view_id, table offset, messages before.
REC = struct.Struct("<HHIQQQ")
R_PUSH, R_PAD, R_BULK = 1, 2, 3
RF_FINAL = 1  # last piece of a push / last block of a bulk message

IMM_CREDIT = 1 << 31
IMM_FLAG = 1 << 30  # doorbell: "return credit"; with IMM_CREDIT: no-op
IMM_MASK = (1 << 30) - 1
IMM_NOOP = IMM_CREDIT | IMM_FLAG

_U63 = 1 << 63


def align8(n: int) -> int:
    """``n`` rounded up to a multiple of 8."""
    return (n + 7) & ~7


class RingError(Exception):
    """The peer broke the inbox protocol (bad record, bad doorbell, bad credit)."""


def imm_doorbell(head: int, want_credit: bool) -> int:
    """Immediate value announcing ring head ``head`` (a multiple of 8)."""
    return ((head >> 3) & IMM_MASK) | (IMM_FLAG if want_credit else 0)


def imm_credit(tail: int) -> int:
    """Immediate value returning consumed position ``tail`` (a multiple of 8)."""
    return IMM_CREDIT | ((tail >> 3) & IMM_MASK)


def advance(old: int, units: int) -> int:
    """The position >= ``old`` whose 8-byte unit count is ``units`` mod 2**30."""
    return old + ((((units & IMM_MASK) - (old >> 3)) & IMM_MASK) << 3)


@dataclass(frozen=True)
class Placement:
    """Where one record goes in the ring: an optional PAD header, then the record."""

    pad_at: int | None  # ring offset of a PAD record, or None
    pad_len: int  # payload length of that PAD record
    at: int  # ring offset of the record header


class SendRing:
    """The sender's view of a peer's inbox ring. Positions are monotone byte counters.

    ``staged``: bytes written into the local mirror; ``posted``: bytes covered by posted
    writes; ``credit``: bytes the receiver consumed; ``done``: bytes covered by locally
    completed writes. Space is reusable below ``min(credit, done)``.
    """

    def __init__(self, size: int) -> None:
        if size % 8 or size < 4 * REC.size:
            raise ValueError("ring size must be a multiple of 8 and at least 128")
        self.size = size
        self.staged = self.posted = self.credit = self.done = 0

    @property
    def max_payload(self) -> int:
        """Largest record payload: records stay within a quarter of the ring."""
        return (self.size // 4 - REC.size) & ~7

    def free(self) -> int:
        """Bytes that may be staged now."""
        return self.size - (self.staged - min(self.credit, self.done))

    def place(self, payload_len: int) -> Placement | None:
        """Reserve space for one record of ``payload_len`` bytes; None when it does not fit."""
        if payload_len > self.max_payload:
            raise ValueError(f"record payload {payload_len} > {self.max_payload}")
        need = REC.size + align8(payload_len)
        pos = self.staged % self.size
        room = self.size - pos
        skip = pad = 0
        pad_at: int | None = None
        if room < REC.size:
            skip = room
        elif room < need:
            pad = room
            pad_at = pos
        total = skip + pad + need
        if total > self.free():
            return None
        at = 0 if (skip or pad) else pos
        self.staged += total
        return Placement(pad_at, pad - REC.size if pad else 0, at)

    def take_unposted(self, upto: int | None = None) -> list[tuple[int, int]]:
        """Ring spans (offset, length) staged but not posted (up to position ``upto``, default
        all), split at the wrap; marks them posted."""
        spans = []
        pos, end = self.posted, self.staged if upto is None else min(upto, self.staged)
        while pos < end:
            off = pos % self.size
            n = min(end - pos, self.size - off)
            spans.append((off, n))
            pos += n
        self.posted = end
        return spans

    def on_credit(self, units: int) -> int:
        """Apply a credit immediate value; returns the new credit. Raises :class:`RingError`."""
        new = advance(self.credit, units)
        if new > self.posted:
            raise RingError(f"credit {new} beyond the {self.posted} bytes posted")
        self.credit = new
        return new

    def on_done(self, pos: int) -> None:
        """Local writes up to ``pos`` completed."""
        if pos > self.done:
            self.done = pos


@dataclass(frozen=True)
class Record:
    """One validated PUSH or BULK record at the tail of an inbox.

    For a BULK record ``view_id`` is the message's total length, ``offset`` the block's offset
    in the message and ``length`` the block's length; its bytes are in the bulk region, not in
    the ring (``data_at`` is unused)."""

    final: bool
    view_id: int
    offset: int
    length: int
    msgs_before: int
    data_at: int  # ring offset of the bytes
    total: int  # bytes the record occupies (header + padded payload)
    bulk: bool = False


class RecvRing:
    """The receiver's view of one inbox ring: validates what the peer wrote."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.head = self.tail = 0
        self.msgs_floor = 0  # records' messages-before never decreases

    def on_doorbell(self, units: int) -> int:
        """Apply a doorbell; returns the new head. Raises :class:`RingError`."""
        new = advance(self.head, units)
        if new - self.tail > self.size:
            raise RingError(f"doorbell head {new} is more than a ring ahead of {self.tail}")
        self.head = new
        return new

    def peek(self, buf: Any) -> Record | None:
        """The next PUSH record (skipping PADs), or None when the ring is empty so far."""
        while self.tail < self.head:
            avail = self.head - self.tail
            pos = self.tail % self.size
            room = self.size - pos
            if room < REC.size:
                if avail < room:
                    raise RingError("doorbell inside the ring's end gap")
                self.tail += room
                continue
            if avail < REC.size:
                raise RingError(f"truncated record header ({avail} bytes)")
            typ, flags, length, view_id, offset, msgs_before = REC.unpack_from(buf, pos)
            if typ == R_PAD:
                if flags or view_id or offset or msgs_before or length != room - REC.size:
                    raise RingError(f"malformed PAD record at ring offset {pos}")
                if avail < room:
                    raise RingError("truncated PAD record")
                self.tail += room
                continue
            if typ not in (R_PUSH, R_BULK):
                raise RingError(f"unknown record type {typ} at ring offset {pos}")
            if flags & ~RF_FINAL:
                raise RingError(f"record flags {flags:#x}")
            bulk = typ == R_BULK
            total = REC.size if bulk else REC.size + align8(length)
            if total > room:
                raise RingError(f"record of {length} bytes crosses the ring end")
            if total > avail:
                raise RingError(f"record of {length} bytes extends past the doorbell")
            if view_id >= _U63 or offset >= _U63:
                raise RingError(f"record view {view_id} / offset {offset} out of range")
            if msgs_before < self.msgs_floor:
                raise RingError("record's message count went backwards")
            return Record(
                bool(flags & RF_FINAL),
                view_id,
                offset,
                length,
                msgs_before,
                pos + REC.size,
                total,
                bulk,
            )
        return None

    def consume(self, rec: Record) -> None:
        """Advance past ``rec`` (returned by :meth:`peek`)."""
        self.tail += rec.total
        self.msgs_floor = rec.msgs_before
