"""The runtime's messages on the transport's reliable channel, msgpack-encoded.

Every channel message is a msgpack list whose first item is its kind. Decoding validates each
field's type and range; anything malformed raises :class:`ProtocolViolation` and is dropped by the
driver with a logged reason. Nothing is ever unpickled.
"""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]

from derecho_async.codec import _pack  # a reused Packer per thread (msgpack, bin type)
from derecho_async.errors import ProtocolViolation

__all__ = [
    "BLOCK",
    "CORE",
    "DATA",
    "GPU_BATCH",
    "GPU_DATA",
    "GPU_POOL",
    "NCCL_DATA",
    "NCCL_UID",
    "P2P_REQ",
    "P2P_RESP",
    "REPLIES",
    "REPLY",
    "SHM_DESC",
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
}
_MAX_INT = (1 << 63) - 1


def encode(kind: int, *fields: object) -> bytes:
    """Pack one channel message."""
    return _pack([kind, *fields])


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
    return msg
