"""The shared-state table: one row per member over a single caller-supplied buffer.

Theory of operation: member *i* writes only row *i*; the other rows change only when a peer's push
lands (:meth:`Table.apply_push`). A landing write is validated first: it must be word aligned and
lie wholly inside the sending member's row, or it is rejected as a :class:`ProtocolViolation` by
that member. When a peer is suspected its row is *frozen*: a private copy of the row is taken and
every later read of that row returns the copy, so late or partial writes from the suspect cannot
change what the protocol sees (this also works where peers write the buffer directly, as over
shared memory or RDMA, and no push passes through this object).
"""

from __future__ import annotations

import struct

from derecho_async.core.schema import WORD, Column, RowSchema
from derecho_async.errors import ProtocolViolation
from derecho_async.hotpath import load_u64, store_u64

__all__ = ["Table"]

_U64 = struct.Struct("<Q")
_MASK = (1 << 64) - 1


class Table:
    """``n_rows`` rows of ``schema`` over ``buffer`` (a fresh bytearray when none is given)."""

    __slots__ = ("_frozen", "buf", "my_rank", "n_rows", "row_bytes", "schema")

    def __init__(
        self,
        schema: RowSchema,
        n_rows: int,
        my_rank: int,
        buffer: bytearray | memoryview | None = None,
    ) -> None:
        if not 0 <= my_rank < n_rows:
            raise ValueError(f"rank {my_rank} outside 0..{n_rows - 1}")
        self.schema = schema
        self.n_rows = n_rows
        self.my_rank = my_rank
        self.row_bytes = schema.row_bytes
        size = n_rows * schema.row_bytes
        if buffer is None:
            buffer = bytearray(size)
        view = memoryview(buffer).cast("B")
        if len(view) < size:
            raise ValueError(f"table buffer holds {len(view)} bytes, needs {size}")
        self.buf = view[:size]
        self._frozen: dict[int, bytes] = {}

    # -- reads -------------------------------------------------------------------------------
    def get(self, rank: int, col: Column, index: int = 0) -> int:
        """Word ``index`` of column ``col`` in row ``rank`` (the frozen copy if frozen)."""
        off = col.offset + index * WORD
        frozen = self._frozen.get(rank)
        if frozen is not None:
            return int(_U64.unpack_from(frozen, off)[0])
        # one whole-word load (acquire): where peers write the buffer directly (shared memory,
        # RDMA), a struct unpack, which reads byte by byte, could see half of a peer's store
        return load_u64(self.buf, rank * self.row_bytes + off)

    def read(self, rank: int, offset: int, nbytes: int) -> bytes:
        """``nbytes`` raw bytes at row offset ``offset`` of row ``rank``."""
        frozen = self._frozen.get(rank)
        if frozen is not None:
            return frozen[offset : offset + nbytes]
        base = rank * self.row_bytes + offset
        return bytes(self.buf[base : base + nbytes])

    def row_source(self, rank: int) -> tuple[bytes | memoryview, int]:
        """Where row ``rank`` is read from: ``(buffer, byte offset of the row in it)`` (the
        frozen copy if the row is frozen)."""
        frozen = self._frozen.get(rank)
        if frozen is not None:
            return frozen, 0
        return self.buf, rank * self.row_bytes

    @property
    def has_frozen(self) -> bool:
        """True once any row is frozen (reads must then go through :meth:`get`)."""
        return bool(self._frozen)

    def mine(self, col: Column, index: int = 0) -> int:
        """Word ``index`` of ``col`` in my own row."""
        return self.get(self.my_rank, col, index)

    # -- writes (my row only) ------------------------------------------------------------------
    def set(self, col: Column, value: int, index: int = 0) -> None:
        """Write word ``index`` of ``col`` in my row (values are taken modulo 2**64); one
        whole-word store with release ordering, for transports whose peers read it directly."""
        store_u64(self.buf, self.my_rank * self.row_bytes + col.offset + index * WORD, value & _MASK)

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Write raw bytes at row offset ``offset`` of my row."""
        base = self.my_rank * self.row_bytes + offset
        self.buf[base : base + len(data)] = data

    def my_bytes(self, offset: int, nbytes: int) -> bytes:
        """A copy of ``nbytes`` of my row at row offset ``offset`` (what a push carries)."""
        base = self.my_rank * self.row_bytes + offset
        return bytes(self.buf[base : base + nbytes])

    def table_offset(self, row_offset: int) -> int:
        """The table offset of row offset ``row_offset`` in my row (what a push is addressed by)."""
        return self.my_rank * self.row_bytes + row_offset

    # -- remote writes -------------------------------------------------------------------------
    def apply_push(self, sender_rank: int, offset: int, data: bytes | memoryview) -> None:
        """Land a peer's write. Raises :class:`ProtocolViolation` unless it comes from another
        row's rank, is aligned and lies inside that sender's row; ignored (after validation) if
        the row is frozen. (One function: it runs for every push a member receives.)"""
        nbytes = len(data)
        if not 0 <= sender_rank < self.n_rows or sender_rank == self.my_rank:
            raise ProtocolViolation(f"write from rank {sender_rank} into this table")
        lo = sender_rank * self.row_bytes
        hi = lo + self.row_bytes
        if offset % WORD or nbytes % WORD:
            raise ProtocolViolation(f"unaligned write at {offset} of {nbytes} bytes")
        if not (lo <= offset and offset + nbytes <= hi):
            raise ProtocolViolation(
                f"write of {nbytes} bytes at {offset} outside its row [{lo}, {hi})"
            )
        if sender_rank in self._frozen:
            return
        self.buf[offset : offset + nbytes] = data

    def freeze(self, rank: int) -> None:
        """Freeze row ``rank``: from now on reads see the row as it is at this moment."""
        if rank == self.my_rank or rank in self._frozen:
            return
        base = rank * self.row_bytes
        self._frozen[rank] = bytes(self.buf[base : base + self.row_bytes])

    def is_frozen(self, rank: int) -> bool:
        return rank in self._frozen
