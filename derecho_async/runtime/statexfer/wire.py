"""What state transfer puts in other layers' fields: the ticket a Welcome carries, and the
msg_no of a state chunk's data key.

Theory of operation: the Welcome's state is a ticket ``[1, xfer_id]`` naming the transfer that
will bring the joiner its state. Each chunk moves on a data plane under a key whose msg_no has
:data:`STATE_TAG` set, which no core message number reaches, and carries the transfer id and
the chunk's index below it, so the driver can route its landing here. See docs/DESIGN.md §7.7.
"""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]

from derecho_async.errors import ProtocolViolation

__all__ = [
    "INDEX_BITS",
    "STATE_TAG",
    "XFER_MASK",
    "chunk_msg_no",
    "decode_ticket",
    "encode_ticket",
    "is_state_key",
    "split_msg_no",
]

STATE_TAG = 1 << 62
"""Set in the msg_no of every state chunk's data key (core message numbers never reach it)."""
INDEX_BITS = 32
"""Bits of a chunk's msg_no that hold its index (a stream has fewer chunks than 2**32)."""
XFER_MASK = (1 << 30) - 1
"""Transfer ids wrap at this mask (they sit between :data:`STATE_TAG` and the index)."""


def chunk_msg_no(xfer_id: int, index: int) -> int:
    """The msg_no of chunk ``index`` of transfer ``xfer_id`` in its data key."""
    return STATE_TAG | (xfer_id & XFER_MASK) << INDEX_BITS | index


def is_state_key(key: tuple[int, int, int]) -> bool:
    """Whether a data key is a state chunk's (see :data:`STATE_TAG`)."""
    return key[2] >= STATE_TAG


def split_msg_no(msg_no: int) -> tuple[int, int]:
    """``(xfer_id, index)`` of a state chunk's msg_no."""
    return (msg_no >> INDEX_BITS) & XFER_MASK, msg_no & ((1 << INDEX_BITS) - 1)


def encode_ticket(xfer_id: int) -> bytes:
    """The small state a Welcome carries: which transfer will bring the joiner its state."""
    out = msgpack.packb([1, xfer_id], use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def decode_ticket(data: bytes) -> int:
    """The transfer id of a ticket; :class:`ProtocolViolation` if it is not one."""
    try:
        value = msgpack.unpackb(data, raw=False) if len(data) <= 64 else None
    except Exception:
        value = None
    if not (isinstance(value, list) and len(value) == 2 and value[0] == 1
            and type(value[1]) is int and 0 <= value[1] <= XFER_MASK):
        raise ProtocolViolation("the Welcome's state is not a state-transfer ticket")
    return int(value[1])
