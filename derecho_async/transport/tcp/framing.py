"""Frames of the tcp transport: the 32-byte header, its types and the check of a received one.

Theory of operation (DESIGN.md §5.3): after the handshake a stream carries frames, a header
(type u32, flags u32 = 0, view_id u64, offset u64, length u64) and ``length`` payload bytes.
PUSH: view_id, table offset. MSG: view_id = offset = 0. BYE: a graceful goodbye, empty. CLOSE:
the peer closes on us, the payload a UTF-8 reason of at most :data:`MAX_REASON` bytes. BEACON:
the sender's beacon port, epoch and key (:mod:`.beacon`), :data:`BEACON_BYTES` exactly. A
receiver checks every header with :func:`check_header` before it reads the payload.
"""

from __future__ import annotations

import struct

__all__ = [
    "BEACON_BYTES",
    "FRAME",
    "F_BEACON",
    "F_BYE",
    "F_CLOSE",
    "F_MSG",
    "F_PUSH",
    "MAX_REASON",
    "U63",
    "beacon_frame",
    "bye_frame",
    "check_header",
    "close_frames",
]

FRAME = struct.Struct("<IIQQQ")  # type, flags, view_id, offset, length
F_PUSH, F_MSG, F_BYE, F_CLOSE, F_BEACON = 1, 2, 3, 4, 5
BEACON_BYTES = 32
MAX_REASON = 1024
"""The longest reason text (a CLOSE frame's payload, a handshake verdict's ``why``)."""
U63 = 1 << 63


def check_header(
    typ: int, flags: int, view_id: int, offset: int, length: int, max_frame: int
) -> str | None:
    """What is wrong with a received frame header (None: nothing); ``max_frame`` bounds the
    payload."""
    if typ not in (F_PUSH, F_MSG, F_BYE, F_CLOSE, F_BEACON):
        return f"unknown frame type {typ}"
    if flags:
        return f"frame flags {flags:#x} are not zero"
    if length > max_frame:
        return f"frame length {length} exceeds max_frame={max_frame}"
    if typ == F_PUSH:
        if view_id >= U63 or offset >= U63:
            return f"push view {view_id} / offset {offset} out of range"
    elif view_id or offset:
        return f"frame type {typ} has non-zero view/offset fields"
    if typ == F_BYE and length:
        return "goodbye frame with a payload"
    if typ == F_CLOSE and length > MAX_REASON:
        return f"close reason of {length} bytes"
    if typ == F_BEACON and length != BEACON_BYTES:
        return f"beacon frame of {length} bytes"
    return None


def beacon_frame(payload: bytes) -> list[bytes]:
    """A BEACON frame carrying ``payload`` (:meth:`.beacon.UdpBeacon.announcement`)."""
    return [FRAME.pack(F_BEACON, 0, 0, 0, len(payload)), payload]


def bye_frame() -> bytes:
    """A BYE frame."""
    return FRAME.pack(F_BYE, 0, 0, 0, 0)


def close_frames(reason: str) -> list[bytes]:
    """A CLOSE frame telling the peer ``reason`` (cut to :data:`MAX_REASON` bytes)."""
    msg = reason.encode()[:MAX_REASON]
    return [FRAME.pack(F_CLOSE, 0, 0, 0, len(msg)), msg]
