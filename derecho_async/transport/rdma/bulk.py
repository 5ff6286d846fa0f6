# Theory of operation
# -------------------
# Bookkeeping of the bulk path, pure: a message of at least ``bulk_threshold`` bytes is cut
# into blocks (``bulk_blocks``); block k of a link goes to slot k mod slots of the region the
# receiver granted (:class:`BulkTx`, a slot freed by ring credit covering its record), and the
# receiver checks every BULK record against the message in progress and reassembles it
# (:class:`BulkRx`). ``piece_end`` cuts large pushes at aligned table offsets. See
# docs/DESIGN.md §5.4 (bulk messages).
"""The rdma bulk path's bookkeeping: block placement, slot credit, reassembly, push pieces."""

from __future__ import annotations

import collections
from typing import Any

from derecho_async.transport.rdma.rings import RingError

__all__ = ["BulkRx", "BulkTx", "bulk_blocks", "piece_end"]


class BulkTx:
    """The sender's view of a peer's bulk region: ``slots`` blocks of ``block`` bytes.

    Block number ``k`` of the link (counted over all bulk messages) goes to slot ``k % slots``;
    the receiver counts the same way, so records need not name the slot. A slot is free again
    once the receiver's ring credit covers the BULK record announcing its block: the receiver
    copies a block out before it consumes the record, and on an RC queue pair the block's WRITE
    was executed before the record's.
    """

    def __init__(self, block: int, slots: int) -> None:
        if block <= 0 or block % 8 or slots <= 0:
            raise ValueError("bulk block must be a positive multiple of 8, slots positive")
        self.block = block
        self.slots = slots
        self.seq = 0
        self.last_end = 0
        self.inflight: collections.deque[int] = collections.deque()  # records' ring ends

    def release(self, credit: int) -> None:
        """The receiver consumed ring bytes up to ``credit``: free the slots that covers."""
        while self.inflight and self.inflight[0] <= credit:
            self.inflight.popleft()

    def free(self) -> int:
        """Slots that may be filled now."""
        return self.slots - len(self.inflight)

    def place(self, record_end: int) -> int:
        """Take the next slot for a block whose record ends at ring position ``record_end``;
        returns the slot's byte offset in the region."""
        if not self.free():
            raise ValueError("no free bulk slot")
        if record_end <= self.last_end:
            raise ValueError("bulk records must be placed in ring order")
        slot = self.seq % self.slots
        self.seq += 1
        self.last_end = record_end
        self.inflight.append(record_end)
        return slot * self.block


def bulk_blocks(total: int, block: int) -> list[tuple[int, int]]:
    """(offset, length) of the blocks of a ``total``-byte bulk message: full blocks, the last
    one possibly shorter."""
    return [(off, min(block, total - off)) for off in range(0, total, block)]


class BulkRx:
    """The receiver's bookkeeping of one peer's bulk region: validates BULK records and
    reassembles messages. Every record must continue the message in progress exactly (same
    total, next offset, a full block unless final, final exactly at the end); anything else is
    a :class:`RingError` and the partial message is dropped with the link."""

    def __init__(self, block: int, slots: int, max_message: int) -> None:
        self.block = block
        self.slots = slots
        self.max_message = max_message
        self.seq = 0  # blocks landed on this link
        self.total = 0  # length of the message in progress (0: none)
        self.got = 0
        self.buf: bytearray | None = None

    @property
    def partial(self) -> bool:
        return self.buf is not None

    def land(self, region: Any, total: int, offset: int, length: int, final: bool) -> bytes | None:
        """Copy one announced block out of ``region``; the whole message once it is complete."""
        if self.buf is None:
            if offset != 0:
                raise RingError(f"bulk message starts at offset {offset}")
            if not 0 < total <= self.max_message:
                raise RingError(f"bulk message of {total} bytes (limit {self.max_message})")
            self.total, self.got = total, 0
        elif total != self.total:
            raise RingError(f"bulk block says total {total}, the message has {self.total}")
        if offset != self.got:
            raise RingError(f"bulk block at offset {offset}, expected {self.got}")
        if not 0 < length <= self.block:
            raise RingError(f"bulk block of {length} bytes (block size {self.block})")
        end = offset + length
        if end > total:
            raise RingError(f"bulk block [{offset}, {end}) beyond the message's {total} bytes")
        if final != (end == total):
            raise RingError("bulk block's final flag disagrees with its extent")
        if not final and length != self.block:
            raise RingError(f"short bulk block ({length} bytes) before the end of the message")
        if self.buf is None:
            self.buf = bytearray(total)
        at = (self.seq % self.slots) * self.block
        with memoryview(region) as whole, whole[at : at + length] as part:
            self.buf[offset:end] = part  # one copy, no export left on the region
        self.seq += 1
        self.got = end
        if not final:
            return None
        out = bytes(self.buf)
        self.buf = None
        self.total = self.got = 0
        return out

    def discard(self) -> None:
        """Drop a partially received message (its link failed)."""
        self.buf = None
        self.total = self.got = 0


def piece_end(offset: int, n: int, chunk: int) -> int:
    """End (table offset) of the first piece of a push ``[offset, offset+n)``.

    Pieces end at multiples of ``chunk`` (a multiple of 8), so no aligned word is split.
    """
    return min(offset + n, (offset // chunk + 1) * chunk)
