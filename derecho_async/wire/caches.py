"""The wire's caches, as objects: one bounded table class and every table it makes.

Theory of operation (docs/DESIGN.md §7.11): the codec remembers what it checked or built once in
:class:`BoundedCache` tables, dicts that stop growing at their ``max_size`` and keep what they
have (nothing is evicted: a peer can neither grow one nor push out what the usual calls hit). A
hot path binds a table's dict once at import and reads it with one ``dict.get``; only a miss
calls :meth:`BoundedCache.put`, and :meth:`BoundedCache.clear` empties a table in place.
"""

from __future__ import annotations

from typing import Any, Final, Generic, TypeVar

__all__ = [
    "ALL_CACHES",
    "ARRAY_HEADS",
    "CUPY_TYPES",
    "DEVICE_CALLS",
    "DEVICE_CALL_METHODS",
    "LITTLE_DTYPES",
    "NAME_BY_STR",
    "OOB_CALLS",
    "REFERENCES",
    "REF_RECORDS",
    "VALID_METHODS",
    "BoundedCache",
    "clear_all",
]

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """A table of at most ``max_size`` entries that keeps what it has once full.

    ``table`` is the dict itself, for hot paths to read directly (bind it once); entries go in
    by :meth:`put` only, so the bound holds. Not locked: a table may be filled from the event
    loop and from a worker thread at once (large calls are decoded off the loop), and then ends
    at most a few entries past its bound, which is harmless.
    """

    __slots__ = ("max_size", "name", "table")

    def __init__(self, name: str, max_size: int) -> None:
        if max_size < 0:
            raise ValueError(f"max_size must be >= 0, got {max_size}")
        self.name: Final = name
        self.max_size: Final = max_size
        self.table: Final[dict[K, V]] = {}

    def put(self, key: K, value: V) -> bool:
        """Store ``value`` under ``key`` if the table has room; return whether it did."""
        table = self.table
        if len(table) < self.max_size:
            table[key] = value
            return True
        return False

    def full(self) -> bool:
        """Whether :meth:`put` would store nothing new."""
        return len(self.table) >= self.max_size

    def clear(self) -> None:
        """Forget every entry, in place: a dict bound from ``table`` stays this table."""
        self.table.clear()

    def __len__(self) -> int:
        return len(self.table)

    def __repr__(self) -> str:
        return f"<BoundedCache {self.name}: {len(self.table)} of {self.max_size}>"


# ------------------------------------------------------------------------------ encode side

ARRAY_HEADS: BoundedCache[tuple[Any, tuple[int, ...]], bytes] = BoundedCache(
    "array heads", 4096)
"""Inline array headers (msgpack dtype name and shape) by (dtype, shape): checked once."""

REF_RECORDS: BoundedCache[tuple[int, type, str, tuple[int, ...]], object] = BoundedCache(
    "reference records", 4096)
"""Buffer reference records (ext records) of numpy and CuPy arrays by (index, type, dtype.str,
shape): a sender references the same few shapes again and again."""

DEVICE_CALLS: BoundedCache[tuple[object, ...], bytes] = BoundedCache("device calls", 4096)
"""Encoded calls of distinct CuPy array arguments by (method, dtype.str and shape of each)."""

DEVICE_CALL_METHODS: BoundedCache[bytes, tuple[str, int]] = BoundedCache(
    "device call methods", 4096)
"""The reverse of :data:`DEVICE_CALLS`: a device call's bytes -> (method, argument count), for a
member's own call delivered back to it. Filled only beside an entry of :data:`DEVICE_CALLS`."""

# ------------------------------------------------------------------------------ decode side

REFERENCES: BoundedCache[bytes, tuple[int, str, tuple[int, ...], str]] = BoundedCache(
    "references", 4096)
"""Buffer references already checked, by their bytes: (index, dtype name, shape, kind). The
values are never handed out (a buffer's shape is compared with them)."""

OOB_CALLS: BoundedCache[bytes, tuple[str, tuple[object, ...], dict[str, object]]] = (
    BoundedCache("out-of-band calls", 1024))
"""Short calls with out-of-band buffers, decoded once, by their bytes (see
:mod:`.call_memos`)."""

# ------------------------------------------------------------------------------ both sides

VALID_METHODS: BoundedCache[str, bool] = BoundedCache("valid methods", 4096)
"""Method names found valid (a dotted identifier of at most 512 characters)."""

CUPY_TYPES: BoundedCache[type, bool] = BoundedCache("cupy types", 256)
"""Whether a type is CuPy's ndarray, by type."""

NAME_BY_STR: BoundedCache[str, str] = BoundedCache("dtype names", 256)
"""numpy ``dtype.str`` ('<f4', '>i8', '|b1') -> ``dtype.name``, for dtypes that may travel."""

LITTLE_DTYPES: BoundedCache[str, Any] = BoundedCache("little-endian dtypes", 64)
"""Dtype name (one of ``DTYPES``) -> its little-endian numpy dtype."""

ALL_CACHES: Final[tuple[BoundedCache[Any, Any], ...]] = (
    ARRAY_HEADS,
    REF_RECORDS,
    DEVICE_CALLS,
    DEVICE_CALL_METHODS,
    REFERENCES,
    OOB_CALLS,
    VALID_METHODS,
    CUPY_TYPES,
    NAME_BY_STR,
    LITTLE_DTYPES,
)
"""Every table of the wire, for tests and diagnostics."""


def clear_all() -> None:
    """Empty every table of the wire (each in place)."""
    for cache in ALL_CACHES:
        cache.clear()
