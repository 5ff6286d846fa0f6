"""Words of shared memory: the pure twin of ``native/words.c`` (see docs/DESIGN.md §8).

Words are little-endian u64. Python has no acquire/release loads: here :func:`load_u64` and
:func:`store_u64` go through a one-item ``"Q"`` memoryview, whose item access is a single 8-byte
copy (one instruction on x86-64 and aarch64), so a peer process never sees half a word.
``struct`` is not used for them: its little-endian packer stores byte by byte, and a concurrent
reader of a ring counter could see a torn value. :func:`fence` is an uncontended lock round
trip, which is a locked read-modify-write instruction (a full barrier) on x86-64.
:func:`arg_u64` checks the u64 arguments of every module of the twin.
"""

from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Sequence

__all__ = ["U64", "WORD", "Buffer", "arg_u64", "fence", "load_u64", "min_u64", "store_u64"]

Buffer = bytes | bytearray | memoryview

WORD = 8
U64 = 1 << 64

_WORD = struct.Struct("<Q")
_lock = threading.Lock()
_NATIVE_LE = sys.byteorder == "little"  # a "Q" item is then a little-endian u64


def _offset(buf: Buffer, offset: int) -> int:
    if type(offset) is not int and not isinstance(offset, int):
        raise TypeError("offset must be an int")
    n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if offset < 0 or n < WORD or offset > n - WORD:
        raise IndexError(f"word at offset {offset} is outside a buffer of {n} bytes")
    return offset


def arg_u64(value: object, name: str) -> int:
    """``value`` when it is an int in [0, 2**64); else ValueError naming the argument."""
    if not isinstance(value, int) or not 0 <= value < U64:
        raise ValueError(f"{name} must be an int in [0, 2**64)")
    return value


def load_u64(buf: Buffer, offset: int, /) -> int:
    """The little-endian u64 at byte ``offset`` of ``buf`` (IndexError outside the buffer)."""
    off = _offset(buf, offset)
    if _NATIVE_LE:
        word: int = memoryview(buf).cast("B")[off : off + WORD].cast("Q")[0]
        return word
    return int(_WORD.unpack_from(buf, off)[0])


def store_u64(buf: bytearray | memoryview, offset: int, value: int, /) -> None:
    """Store ``value`` (an int in [0, 2**64)) as a little-endian u64 at byte ``offset``."""
    if not isinstance(value, int):
        raise TypeError("value must be an int")
    if not 0 <= value < U64:
        raise OverflowError("value outside [0, 2**64)")
    mv = memoryview(buf)
    if mv.readonly:
        raise TypeError("buffer is not writable")
    off = _offset(buf, offset)
    if _NATIVE_LE:
        mv.cast("B")[off : off + WORD].cast("Q")[0] = value
    else:
        _WORD.pack_into(buf, off, value)


def fence() -> None:
    """A full memory barrier (best effort in pure Python: a lock round trip)."""
    _lock.acquire()
    _lock.release()


def min_u64(buf: Buffer, offsets: Sequence[int], start: int, /) -> int:
    """The minimum of ``start`` and the u64 words of ``buf`` at each of ``offsets``."""
    best = arg_u64(start, "start")
    for off in offsets:
        v = load_u64(buf, off)
        if v < best:
            best = v
    return best
