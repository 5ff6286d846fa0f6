"""What an external client and its relay say to each other, after the tcp handshake.

Theory of operation (docs/DESIGN.md §7.16): a client connection starts with the members' own
handshake (:mod:`derecho_async.transport.tcp.handshake`: both prove the group's secret), then
carries frames of a u32 length and a msgpack list whose first item is its kind. Every frame is
checked on arrival: its size against the reader's bound, its fields by kind and type; anything
else is a :class:`~derecho_async.errors.ProtocolViolation` and the connection closes. Nothing is
ever unpickled. A request carries an id the connection chose (``rid``); its answer names it.

client -> relay::

    [HELLO, client id (16 bytes)]
    [CALL, rid, actor, shard, seq, call bytes]  # an ordered call ("A.m" or "A.m.cast")
    [P2P, rid, member (-1: the relay or a host), actor, shard, call bytes]
    [SUB, sid, actor, shard, since view, since seq + 1]   # since 0, 0: from now on
    [UNSUB, sid]

relay -> client::

    [VIEW, view id, [members], [[member, host, port], ...], largest call in bytes]
                                                              # at HELLO and every view
    [DONE, rid, view id, seq, [[member, code, body], ...]]    # codes: OUTCOME_*
    [FAIL, rid, retry, type name, message]   # retry: try another member; else the call's error
    [ANSWER, rid, ok, body, view id, seq + 1]                 # a p2p call's result
    [EVENT, sid, view id, seq, time_ns, method, encoded [args, kwargs], one_way]
    [END, sid, reason]                                        # a subscription is over
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, Final

import msgpack  # type: ignore[import-untyped]

from derecho_async import wire
from derecho_async.api.calls import HandlerError, Replies, decode_result, safe_text
from derecho_async.api.delivery import encode_outcome
from derecho_async.errors import MemberFailed, ProtocolViolation
from derecho_async.wire.values import pack

__all__ = [
    "ANSWER",
    "CALL",
    "DONE",
    "END",
    "EVENT",
    "FAIL",
    "HELLO",
    "OUTCOME_ERROR",
    "OUTCOME_FAILED",
    "OUTCOME_OK",
    "P2P",
    "SUB",
    "UNSUB",
    "VIEW",
    "encode_outcomes",
    "outcomes_of",
    "read_frame",
    "write_frame",
]

HELLO: Final = 0
CALL: Final = 1
P2P: Final = 2
SUB: Final = 3
UNSUB: Final = 4
VIEW: Final = 10
DONE: Final = 11
FAIL: Final = 12
ANSWER: Final = 13
EVENT: Final = 14
END: Final = 15

OUTCOME_OK: Final = 0  # body: the encoded result
OUTCOME_ERROR: Final = 1  # body: encoded [type name, message] (the handler raised)
OUTCOME_FAILED: Final = 2  # body: encoded reason (the member departed before replying)

_LEN: Final = struct.Struct("<I")
_U63: Final = (1 << 63) - 1
_NAME: Final = 512  # characters of an actor name or a reason, at most

_SHAPES: Final[dict[int, tuple[type | tuple[type, ...], ...]]] = {
    HELLO: (bytes,),
    CALL: (int, str, int, int, bytes),
    P2P: (int, int, str, int, bytes),
    SUB: (int, str, int, int, int),
    UNSUB: (int,),
    VIEW: (int, list, list, int),
    DONE: (int, int, int, list),
    FAIL: (int, bool, str, str),
    ANSWER: (int, bool, bytes, int, int),
    EVENT: (int, int, int, int, str, bytes, bool),
    END: (int, str),
}
_SIGNED: Final = {(P2P, 2), (EVENT, 4)}  # (kind, field) that may be negative


def write_frame(writer: asyncio.StreamWriter, kind: int, *fields: object) -> None:
    """Queue one frame on ``writer``."""
    data: bytes = pack([kind, *fields])
    writer.write(_LEN.pack(len(data)) + data)


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> list[Any]:
    """Read and check one frame of at most ``max_bytes``; ``asyncio.IncompleteReadError`` at
    the end of the stream, :class:`ProtocolViolation` for anything malformed."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > max_bytes:
        raise ProtocolViolation(f"a frame of {n} bytes (at most {max_bytes})")
    data = await reader.readexactly(n)
    try:
        msg = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True,
                              max_bin_len=n, max_str_len=n, max_array_len=n, max_map_len=n)
    except Exception as exc:
        raise ProtocolViolation(f"undecodable frame: {exc}") from exc
    if not isinstance(msg, list) or not msg or type(msg[0]) is not int:
        raise ProtocolViolation("a frame is not a [kind, ...] list")
    kind = msg[0]
    shape = _SHAPES.get(kind)
    if shape is None or len(msg) != len(shape) + 1:
        raise ProtocolViolation(f"a frame of unknown kind {kind!r} or length {len(msg)}")
    for i, (value, want) in enumerate(zip(msg[1:], shape, strict=True), 1):
        if want is int:
            low = -_U63 - 1 if (kind, i) in _SIGNED else 0
            if type(value) is not int or not low <= value <= _U63:
                raise ProtocolViolation(f"frame field {i} of kind {kind} is not a valid int")
        elif want is bool:
            if type(value) is not bool:
                raise ProtocolViolation(f"frame field {i} of kind {kind} is not a bool")
        elif not isinstance(value, want):
            raise ProtocolViolation(f"frame field {i} of kind {kind} is a "
                                    f"{type(value).__name__}")
        elif type(value) is str and len(value) > _NAME:
            raise ProtocolViolation(f"frame field {i} of kind {kind}: a string too long")
    return msg


def encode_outcomes(replies: Replies[object]) -> list[list[object]]:
    """Each member's outcome of an ordered call as ``[member, code, body]`` (DONE, FORWARDED):
    a result, a handler's error (``[type name, message]``) or a departure's reason."""
    out: list[list[object]] = []
    for member, value in replies.items():
        if isinstance(value, MemberFailed):
            out.append([member, OUTCOME_FAILED, wire.encode(value.reason)])
        elif isinstance(value, HandlerError):
            out.append([member, OUTCOME_ERROR, wire.encode(
                [safe_text(value.type_name), safe_text(value.message)])])
        else:  # a result, or another exception: as a reply carries it
            ok, body = encode_outcome(not isinstance(value, BaseException), value)
            out.append([member, OUTCOME_OK if ok else OUTCOME_ERROR, body])
    return out


def outcomes_of(items: list[Any]) -> dict[int, object]:
    """The inverse of :func:`encode_outcomes` (checked: ProtocolViolation)."""
    results: dict[int, object] = {}
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int
                and type(item[1]) is int and type(item[2]) is bytes):
            raise ProtocolViolation("a malformed outcome")
        member, code, body = item
        if code == OUTCOME_OK:
            results[member] = decode_result(member, True, body)
        elif code == OUTCOME_ERROR:
            results[member] = decode_result(member, False, body)
        else:
            results[member] = MemberFailed(member, str(wire.decode(body)))
    return results
