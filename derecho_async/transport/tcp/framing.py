"""Frames of the tcp transport: the 32-byte header, its types and the check of a received one.

Theory of operation (DESIGN.md §5.3): after the handshake a stream carries frames, a header
(type u32, flags u32 = 0, view_id u64, offset u64, length u64) and ``length`` payload bytes.
PUSH: view_id, table offset. MSG: view_id = offset = 0. BYE: a graceful goodbye, empty. CLOSE:
the peer closes on us, the payload a UTF-8 reason of at most :data:`MAX_REASON` bytes. A
receiver checks every header with :func:`check_header` before it reads the payload.
"""

from __future__ import annotations

import struct

__all__ = [
    "FRAME",
    "F_BYE",
    "F_CLOSE",
    "F_MSG",
    "F_PUSH",
    "MAX_REASON",
    "U63",
    "bye_frame",
    "check_header",
    "close_frames",
]

FRAME = struct.Struct("<IIQQQ")  # type, flags, view_id, offset, length
F_PUSH, F_MSG, F_BYE, F_CLOSE = 1, 2, 3, 4
MAX_REASON = 1024
"""The longest reason text (a CLOSE frame's payload, a handshake verdict's ``why``)."""
U63 = 1 << 63


def check_header(
    typ: int, flags: int, view_id: int, offset: int, length: int, max_frame: int
) -> str | None:
    """What is wrong with a received frame header (None: nothing); ``max_frame`` bounds the
    payload."""
    if typ not in (F_PUSH, F_MSG, F_BYE, F_CLOSE):
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
    return None


def bye_frame() -> bytes:
    """A BYE frame."""
    return FRAME.pack(F_BYE, 0, 0, 0, 0)


def close_frames(reason: str) -> list[bytes]:
    """A CLOSE frame telling the peer ``reason`` (cut to :data:`MAX_REASON` bytes)."""
    msg = reason.encode()[:MAX_REASON]
    return [FRAME.pack(F_CLOSE, 0, 0, 0, len(msg)), msg]
