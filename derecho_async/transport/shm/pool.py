"""Pool segments of the shm data plane: naming, creation, attach, cleanup.

Theory of operation (DESIGN.md §5.2, §6.4): a member owns the segments of its pool, files
``/dev/shm/derecho_async.<group>.<owner>.pool<k>`` (:mod:`.files`) next to the rings. Layout: a
4 KiB header of u64 words (magic, owner, generation, capacity), then the data. The generation is
a random 63-bit number chosen at creation: a receiver that cached a mapping of segment ``k`` of
``owner`` knows from a descriptor's generation whether it still maps the same file. Only the
owner writes; peers map read/write (``MAP_SHARED`` needs it) but only copy out, after validating
the file and the whole header. The owner unlinks its segments when it closes; after a crash they
stay until someone who can tell the owner is dead (the doorbell rule) removes them: surviving
members' planes at the next view, a restarting member with the same id, :mod:`.cleanup`.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
from collections.abc import Iterator

from derecho_async.transport.shm.doorbell import is_alive
from derecho_async.transport.shm.files import (
    PREFIX,
    SHM_DIR,
    BadSegment,
    check_group,
    create_segment,
    group_files,
    map_segment,
    unlink_file,
)

__all__ = [
    "HDR",
    "MAX_CAPACITY",
    "MAX_SEGMENTS",
    "MIN_CAPACITY",
    "BadPoolSegment",
    "PoolSegment",
    "attach_pool_segment",
    "cleanup_pool",
    "create_pool_segment",
    "pool_path",
    "pool_segments",
    "unlink_own_pool",
    "unlink_pool_segment",
]

_MAGIC = int.from_bytes(b"DApool01", "little")
HDR = 4096
MIN_CAPACITY = 1 << 16
MAX_CAPACITY = 1 << 40
MAX_SEGMENTS = 64  # segment indexes per owner
_W_MAGIC, _W_OWNER, _W_GEN, _W_CAPACITY = 0, 1, 2, 3
# Populated in one system call rather than a page fault per page on first touch: the owner
# writes the whole segment sooner or later, and a peer's mapping then only adds page-table
# entries for pages that exist.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
# Populating holds the GIL (and the event loop with it) for the whole system call: a segment larger
# than this is created unpopulated, and the owner's first copy into it, off the loop, faults its
# pages in.
_POPULATE_MAX = 64 << 20


class BadPoolSegment(Exception):
    """A pool segment is missing, foreign or malformed."""


def pool_path(group: str, owner: int, index: int) -> str:
    """The file of segment ``index`` of ``owner``'s pool in ``group``."""
    return os.path.join(SHM_DIR, f"{PREFIX}{group}.{owner}.pool{index}")


def pool_segments(group: str) -> Iterator[tuple[str, int, int]]:
    """(path, owner, index) of every pool segment file of ``group``."""
    for path, owner, rest in group_files(group):
        idx = rest.removeprefix("pool")
        if idx != rest and idx.isdigit() and len(idx) <= 6:
            yield path, int(owner), int(idx)


class PoolSegment:
    """One mapped pool segment (owned, or a peer's attached for reading)."""

    def __init__(self, path: str, index: int, mm: mmap.mmap, generation: int) -> None:
        self.path = path
        self.index = index
        self.mm = mm
        self.generation = generation
        self.capacity = len(mm) - HDR
        whole = memoryview(mm)
        self.data = whole[HDR:]
        whole.release()

    def close(self) -> None:
        """Unmap the segment (the file stays)."""
        self.data.release()
        with contextlib.suppress(BufferError):  # a view leaked: the mapping dies with us
            self.mm.close()


def create_pool_segment(group: str, owner: int, index: int, capacity: int) -> PoolSegment:
    """Create (replacing a leftover of an earlier incarnation) and map segment ``index``."""
    check_group(group)
    if not MIN_CAPACITY <= capacity <= MAX_CAPACITY or not 0 <= index < MAX_SEGMENTS:
        raise ValueError(f"pool segment {index} of {capacity} bytes")
    path = pool_path(group, owner, index)
    # only the live holder of the owner's doorbell creates its segments: a file there is a leftover
    flags = _MAP_FLAGS if capacity <= _POPULATE_MAX else mmap.MAP_SHARED
    mm = create_segment(path, HDR + capacity, flags)
    gen = int.from_bytes(os.urandom(8), "little") >> 1
    words = memoryview(mm)[:HDR].cast("Q")
    words[_W_OWNER] = owner
    words[_W_GEN] = gen
    words[_W_CAPACITY] = capacity
    words[_W_MAGIC] = _MAGIC
    words.release()
    return PoolSegment(path, index, mm, gen)


def attach_pool_segment(group: str, owner: int, index: int) -> PoolSegment:
    """Map ``owner``'s segment ``index``, validating the file and its header."""
    if not 0 <= index < MAX_SEGMENTS:
        raise BadPoolSegment(f"segment index {index} out of range")
    path = pool_path(group, owner, index)
    try:
        mm = map_segment(path, HDR + MIN_CAPACITY, HDR + MAX_CAPACITY, _MAP_FLAGS)
    except BadSegment as exc:
        raise BadPoolSegment(str(exc)) from exc
    except (OSError, ValueError) as exc:
        raise BadPoolSegment(f"cannot map {path}: {exc}") from exc
    size = len(mm)
    words = memoryview(mm)[:HDR].cast("Q")
    magic, got_owner, gen, cap = (words[i] for i in (_W_MAGIC, _W_OWNER, _W_GEN, _W_CAPACITY))
    words.release()
    if magic != _MAGIC or got_owner != owner or cap != size - HDR:
        mm.close()
        raise BadPoolSegment(f"{path}: bad header (owner {got_owner}, capacity {cap})")
    return PoolSegment(path, index, mm, gen)


def cleanup_pool(group: str, owners: set[int] | None = None) -> int:
    """Unlink the pool segments of ``group`` whose owner is dead (of ``owners`` only, if
    given); returns how many were removed."""
    check_group(group)
    removed = 0
    alive: dict[int, bool] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        probe.setblocking(False)
        for path, owner, _ in list(pool_segments(group)):
            if owners is not None and owner not in owners:
                continue
            if owner not in alive:
                alive[owner] = is_alive(probe, group, owner)
            if not alive[owner] and unlink_file(path):
                removed += 1
    return removed


def unlink_pool_segment(path: str) -> None:
    """Remove one pool file (its owner dropping it)."""
    unlink_file(path)


def unlink_own_pool(group: str, owner: int) -> None:
    """Remove every pool file of ``owner`` (the owner itself, at start or close)."""
    for path, o, _ in list(pool_segments(group)):
        if o == owner:
            unlink_file(path)
