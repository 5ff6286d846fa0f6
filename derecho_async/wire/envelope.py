"""The runtime's messages on the transport's reliable channel, msgpack-encoded.

Theory of operation (docs/DESIGN.md §7.2): every channel message is a msgpack list whose first
item is its kind. Decoding validates each field's type and range; anything malformed raises
:class:`ProtocolViolation` and is dropped by the driver with a logged reason. Nothing is ever
unpickled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]

from derecho_async.errors import ProtocolViolation
from derecho_async.wire.arrays import DTYPES, MAX_NDIM
from derecho_async.wire.values import pack  # a reused Packer per thread (msgpack, bin type)

__all__ = [
    "BLOCK",
    "CLIENT_ADDR",
    "CORE",
    "DATA",
    "FORWARD",
    "FORWARDED",
    "GPU_BATCH",
    "GPU_DATA",
    "GPU_POOL",
    "HANDOFF",
    "HANDOFF_EMPTY",
    "MEMBER_ADDR",
    "NCCL_DATA",
    "NCCL_UID",
    "P2P_REQ",
    "P2P_RESP",
    "RECOVER_ABORT",
    "RECOVER_INFO",
    "RECOVER_LIVE",
    "RECOVER_PLAN",
    "RECOVER_READY",
    "REPLIES",
    "REPLY",
    "RESTART_KINDS",
    "SHM_DESC",
    "STATE_ABORT",
    "STATE_ACK",
    "STATE_BEGIN",
    "STATE_READY",
    "SUFFIX",
    "SUFFIX_REQ",
    "decode",
    "encode",
]

CORE = 0  # [CORE, core message as a list]
REPLY = 1  # [REPLY, subgroup, msg_no, ok, encoded result]
P2P_REQ = 2  # [P2P_REQ, req_id, actor, method, encoded call]
# [P2P_RESP, req_id, ok, encoded result, view_id, seq]: (view_id, seq) names the delivered
# prefix the p2p handler saw (seq -1: the state at the start of that view)
P2P_RESP = 3
DATA = 4  # [DATA, view_id, sender, msg_no, payload bytes]
# [SHM_DESC, view_id, sender, msg_no, segment, generation, offset, length, meta]
SHM_DESC = 5
# [BLOCK, view_id, origin, msg_no, index, count, total, head, block bytes]
BLOCK = 6
REPLIES = 7  # [REPLIES, [msg_no, ok, encoded result, msg_no, ok, encoded result, ...]]
GPU_POOL = 8  # [GPU_POOL, pool announcement bytes] (CUDA IPC handles, once per view)
GPU_DATA = 9  # [GPU_DATA, view_id, sender, msg_no, device descriptor bytes]
# [NCCL_UID, view_id, communicator index, 128-byte NCCL unique id] (root -> each rank, per view)
NCCL_UID = 10
# [NCCL_DATA, view_id, sender, msg_no, communicator index, broadcast seq, descriptor bytes]
NCCL_DATA = 11
# [GPU_BATCH, view_id, sender, [msg_no, device descriptor bytes, ...]]: the GPU_DATA of one step
GPU_BATCH = 12
# State transfer to a joiner (:mod:`derecho_async.runtime.statexfer`); its chunks travel on the data planes.
# [STATE_BEGIN, xfer_id, view_id, chunk_size, total, [[kind, dtype, shape, nbytes], ...]]
STATE_BEGIN = 13
STATE_READY = 14  # [STATE_READY, xfer_id] (joiner -> sponsor: send the chunks)
STATE_ACK = 15  # [STATE_ACK, xfer_id, chunk index] (joiner -> sponsor: verified and stored)
STATE_ABORT = 16  # [STATE_ABORT, xfer_id, reason] (either way: the transfer is over, failed)
# Restart after total failure (:mod:`derecho_async.api.restart`). A version travels as two
# unsigned ints, view_id and seq + 1 (0, 0: none).
# [RECOVER_INFO, last view id, [members], [[subgroup, view_id, seq + 1, acked view_id,
#  acked seq + 1], ...]] (-> every member it knows: how far its files reach, and how far it
#  acknowledged them durable)
RECOVER_INFO = 17
# [RECOVER_PLAN, epoch, new view id, [members], [[subgroup, source, view_id, seq + 1], ...]]
RECOVER_PLAN = 18
SUFFIX_REQ = 19  # [SUFFIX_REQ, epoch, subgroup, view_id, seq + 1] (-> source: records after it)
# [SUFFIX, epoch, subgroup, [] or [view_id, seq, time_ns, snapshot bytes],
#  [[view_id, seq, time_ns, body], ...], last]
SUFFIX = 20
RECOVER_READY = 21  # [RECOVER_READY, epoch] (-> planner: the suffixes are applied and durable)
RECOVER_LIVE = 22  # [RECOVER_LIVE, view id] (a running member -> a recovering one: join it)
CLIENT_ADDR = 23  # [CLIENT_ADDR, host, port]: where the sender serves external clients
# A sharded actor's state to a member that gains the shard at a view (api/handoff.py):
HANDOFF = 24  # [HANDOFF, actor, shard, view_id, chunk index, chunk count, chunk bytes]
HANDOFF_EMPTY = 25  # [HANDOFF_EMPTY, actor, shard, view_id]: no host survived: start empty
# A call to a shard the caller does not host, and its answer (api/forward.py):
FORWARD = 26  # [FORWARD, rid, actor, shard, client id, seq, encoded call]
# [FORWARDED, rid, code, view_id, seq, [[member, code, body], ...], error type, message]
FORWARDED = 27
# [MEMBER_ADDR, [[member, host, port], ...]]: listen addresses of the view's members the sender
# knows, sent at a view with joiners (a joiner may know one member: runtime/driver.py)
MEMBER_ADDR = 28
# [RECOVER_ABORT, reason]: the restart's planner refuses to restart the group (it would lose
# calls a member acknowledged as durable); every restarting member stops with the reason
RECOVER_ABORT = 29
RESTART_KINDS = frozenset({RECOVER_INFO, RECOVER_PLAN, SUFFIX_REQ, SUFFIX, RECOVER_READY,
                           RECOVER_LIVE, RECOVER_ABORT})
"""The kinds of the restart after total failure (api/restart.py)."""

_SHAPES: dict[int, tuple[type | tuple[type, ...], ...]] = {
    CORE: (list,),
    REPLY: (str, int, bool, bytes),
    P2P_REQ: (int, str, str, bytes),
    P2P_RESP: (int, bool, bytes, int, int),
    DATA: (int, int, int, bytes),
    SHM_DESC: (int, int, int, int, int, int, int, list),
    BLOCK: (int, int, int, int, int, int, bytes, bytes),
    REPLIES: (list,),
    GPU_POOL: (bytes,),
    GPU_DATA: (int, int, int, bytes),
    NCCL_UID: (int, int, bytes),
    NCCL_DATA: (int, int, int, int, int, bytes),
    GPU_BATCH: (int, int, list),
    STATE_BEGIN: (int, int, int, int, list),
    STATE_READY: (int,),
    STATE_ACK: (int, int),
    STATE_ABORT: (int, str),
    RECOVER_INFO: (int, list, list),
    RECOVER_PLAN: (int, int, list, list),
    SUFFIX_REQ: (int, str, int, int),
    SUFFIX: (int, str, list, list, bool),
    RECOVER_READY: (int,),
    RECOVER_LIVE: (int,),
    CLIENT_ADDR: (str, int),
    HANDOFF: (str, int, int, int, int, bytes),
    HANDOFF_EMPTY: (str, int, int),
    FORWARD: (int, str, int, bytes, int, bytes),
    FORWARDED: (int, int, int, int, list, str, str),
    MEMBER_ADDR: (list,),
    RECOVER_ABORT: (str,),
}
_MAX_INT = (1 << 63) - 1


def encode(kind: int, *fields: object) -> bytes:
    """Pack one channel message."""
    return pack([kind, *fields])


def decode(data: bytes) -> list[Any]:
    """Unpack and validate one channel message: ``[kind, *fields]``."""
    try:
        msg = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:
        raise ProtocolViolation(f"undecodable channel message: {exc}") from exc
    if not isinstance(msg, list) or not msg or type(msg[0]) is not int:
        raise ProtocolViolation("channel message is not a [kind, ...] list")
    shape = _SHAPES.get(msg[0])
    if shape is None:
        raise ProtocolViolation(f"unknown channel message kind {msg[0]!r}")
    fields = msg[1:]
    if len(fields) != len(shape):
        raise ProtocolViolation(f"channel message kind {msg[0]} has {len(fields)} fields")
    for value, want in zip(fields, shape, strict=True):
        if want is int and (type(value) is not int or not 0 <= value <= _MAX_INT):
            raise ProtocolViolation(f"channel message field {value!r} is not a valid count/id")
        if want is bool and type(value) is not bool:
            raise ProtocolViolation("channel message flag is not a bool")
        if not isinstance(value, want):
            raise ProtocolViolation(f"channel message field of type {type(value).__name__}")
    if msg[0] == STATE_BEGIN:
        _check_state_parts(msg[5])
    elif msg[0] == STATE_ABORT and len(msg[2]) > _MAX_REASON:
        raise ProtocolViolation(f"state abort reason of {len(msg[2])} characters")
    elif msg[0] == RECOVER_ABORT and len(msg[1]) > _MAX_REASON:
        raise ProtocolViolation(f"restart abort reason of {len(msg[1])} characters")
    elif msg[0] in (RECOVER_INFO, RECOVER_PLAN, SUFFIX):
        _check_restart(msg)
    elif msg[0] == CLIENT_ADDR and (len(msg[1]) > 255 or msg[2] > 65535):
        raise ProtocolViolation("a client address of a host name too long or a bad port")
    elif msg[0] == MEMBER_ADDR:
        _check_member_addresses(msg[1])
    return msg


_MAX_RESTART_ITEMS = 1 << 20  # subgroups or records in one restart message
_MAX_ADDRESSES = 1024  # entries of one MEMBER_ADDR message (a view holds at most 64 members)


def _check_member_addresses(items: list[Any]) -> None:
    if len(items) > _MAX_ADDRESSES:
        raise ProtocolViolation(f"{len(items)} member addresses in one message")
    for item in items:
        if not (isinstance(item, list) and len(item) == 3 and _unsigned(item[0])
                and isinstance(item[1], str) and 0 < len(item[1]) <= 255
                and type(item[2]) is int and 0 < item[2] <= 65535):
            raise ProtocolViolation("a member address is not [member, host, port]")


def _unsigned(value: object) -> bool:
    return type(value) is int and 0 <= value <= _MAX_INT


def _members(members: list[Any]) -> bool:
    return len(members) <= 64 and all(map(_unsigned, members))


def _record(r: list[Any]) -> bool:  # [view_id, seq, time_ns, bytes]: a record or a snapshot
    return (len(r) == 4 and _unsigned(r[0]) and _unsigned(r[1]) and type(r[2]) is int
            and type(r[3]) is bytes)


def _rows(items: list[Any], row: Callable[[list[Any]], bool]) -> bool:
    return len(items) <= _MAX_RESTART_ITEMS and all(type(i) is list and row(i) for i in items)


def _check_restart(msg: list[Any]) -> None:
    """RECOVER_INFO, RECOVER_PLAN and SUFFIX past their field types (the other restart kinds
    have nothing more to check)."""
    kind = msg[0]
    if kind == RECOVER_INFO:  # versions: [subgroup, view_id, seq + 1, acked: the same two]
        ok = _members(msg[2]) and _rows(msg[3], lambda e: len(e) == 5 and type(e[0]) is str
                                        and all(map(_unsigned, e[1:])))
    elif kind == RECOVER_PLAN:  # sources: [subgroup, source, view_id, seq + 1]
        ok = _members(msg[3]) and _rows(msg[4], lambda e: len(e) == 4 and type(e[0]) is str
                                        and all(map(_unsigned, e[1:])))
    else:
        ok = (not msg[3] or _record(msg[3])) and _rows(msg[4], _record)
    if not ok:
        raise ProtocolViolation(f"malformed restart message of kind {kind}")


_MAX_REASON = 4096  # characters of a STATE_ABORT reason
STATE_PART_KINDS = frozenset({"skeleton", "bytes", "numpy", "cuda"})
"""Kinds of the parts of a state stream: the msgpack skeleton, then each out-of-band buffer."""
MAX_STATE_PARTS = 4097  # the skeleton and up to MAX_ARRAYS buffers


def _check_state_parts(parts: list[Any]) -> None:
    """Validate a STATE_BEGIN manifest's parts: ``[kind, dtype, shape, nbytes]`` each, the first
    the skeleton (uint8 of one dimension), nbytes exactly the shape's size in that dtype."""
    if not 1 <= len(parts) <= MAX_STATE_PARTS:
        raise ProtocolViolation(f"state manifest of {len(parts)} parts")
    for i, part in enumerate(parts):
        if not (isinstance(part, list) and len(part) == 4):
            raise ProtocolViolation("state part is not [kind, dtype, shape, nbytes]")
        kind, dtype, shape, nbytes = part
        if not isinstance(kind, str) or kind not in STATE_PART_KINDS or (
            (kind == "skeleton") != (i == 0)
        ):
            raise ProtocolViolation(f"state part {i} of kind {kind!r}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ProtocolViolation(f"state part {i} of dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
            type(n) is int and 0 <= n <= _MAX_INT for n in shape
        ):
            raise ProtocolViolation(f"state part {i} of shape {shape!r}")
        if kind in ("skeleton", "bytes") and (dtype != "uint8" or len(shape) != 1):
            raise ProtocolViolation(f"state part {i} of kind {kind} is not uint8 of one dimension")
        size = DTYPES[dtype]
        for n in shape:
            size *= n
        if type(nbytes) is not int or nbytes != size:
            raise ProtocolViolation(f"state part {i}: {nbytes!r} bytes for {dtype}{shape}")
