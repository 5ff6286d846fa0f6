"""The CUDA IPC plane's pure parts of a device pool: the range allocator and the announcement.

Theory of operation (DESIGN.md §6.6). A member's device pool is a few large segments, each
carved up by a first-fit :class:`RangeAllocator`; a :class:`PoolAnnouncement` carries the IPC
handles of its segments and events to every peer once per view (and when the pool grows), never
per message. Nothing here needs CuPy: both are tested on the CPU.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import msgpack  # type: ignore[import-untyped]

from derecho_async.errors import ProtocolViolation

__all__ = ["ALIGN", "PoolAnnouncement", "RangeAllocator"]

ALIGN = 256  # bytes: regions start at multiples of this (CUDA's own allocation granularity)
_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
_MAX_SEGMENTS = 4096
_MAX_EVENTS = 1 << 16


# -- the allocator (pure; tested on the CPU) ---------------------------------------------------
class RangeAllocator:
    """First-fit allocation of aligned byte ranges within one segment of ``size`` bytes.

    Free ranges are kept sorted by offset and merged with their neighbours on release, so a pool
    that has returned everything is one free range again.
    """

    def __init__(self, size: int) -> None:
        if size <= 0 or size % ALIGN:
            raise ValueError(f"segment size {size} is not a positive multiple of {ALIGN}")
        self.size = size
        self._starts: list[int] = [0]
        self._lengths: list[int] = [size]
        self._taken: dict[int, int] = {}

    @property
    def in_use(self) -> int:
        """Bytes allocated and not yet released."""
        return sum(self._taken.values())

    @property
    def allocations(self) -> int:
        return len(self._taken)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free range of at least ``nbytes`` (rounded up), or None."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, length in enumerate(self._lengths):
            if length >= need:
                start = self._starts[i]
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] = start + need
                    self._lengths[i] = length - need
                self._taken[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        """Return the range allocated at ``offset``."""
        length = self._taken.pop(offset, None)
        if length is None:
            raise ValueError(f"offset {offset} is not allocated")
        i = bisect.bisect_left(self._starts, offset)
        # merge with the following free range
        if i < len(self._starts) and self._starts[i] == offset + length:
            length += self._lengths[i]
            del self._starts[i], self._lengths[i]
        # merge with the preceding free range
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset:
            self._lengths[i - 1] += length
        else:
            self._starts.insert(i, offset)
            self._lengths.insert(i, length)


# -- the announcement (a wire format; validated field by field) --------------------------------
@dataclass(frozen=True, slots=True)
class PoolAnnouncement:
    """A member's IPC handles: ``segments`` as (size, handle), ``events`` as handles."""

    device_bus_id: str
    segments: tuple[tuple[int, bytes], ...]
    events: tuple[bytes, ...]

    def encode(self) -> bytes:
        body = [self.device_bus_id, [[s, h] for s, h in self.segments], list(self.events)]
        out = msgpack.packb(body, use_bin_type=True)
        assert isinstance(out, bytes)
        return out

    @classmethod
    def decode(cls, raw: bytes) -> PoolAnnouncement:
        try:
            msg = msgpack.unpackb(raw, raw=False, use_list=True)
        except Exception as exc:
            raise ProtocolViolation(f"undecodable pool announcement: {exc}") from exc
        if not (isinstance(msg, list) and len(msg) == 3 and isinstance(msg[0], str)
                and len(msg[0]) <= 64 and isinstance(msg[1], list) and isinstance(msg[2], list)):
            raise ProtocolViolation("pool announcement is not [bus id, segments, events]")
        if len(msg[1]) > _MAX_SEGMENTS or len(msg[2]) > _MAX_EVENTS:
            raise ProtocolViolation("pool announcement with too many segments or events")
        segments = []
        for seg in msg[1]:
            if not (isinstance(seg, list) and len(seg) == 2 and type(seg[0]) is int
                    and 0 < seg[0] < 1 << 48 and seg[0] % ALIGN == 0
                    and isinstance(seg[1], bytes) and len(seg[1]) == _HANDLE_BYTES):
                raise ProtocolViolation("pool segment must be [size, 64-byte handle]")
            segments.append((seg[0], seg[1]))
        for h in msg[2]:
            if not (isinstance(h, bytes) and len(h) == _HANDLE_BYTES):
                raise ProtocolViolation("pool event must be a 64-byte handle")
        return cls(msg[0], tuple(segments), tuple(msg[2]))
