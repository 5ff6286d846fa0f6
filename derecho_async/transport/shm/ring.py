"""The ring segment of one shm link (sender -> receiver): header words, records, create/attach.

Theory of operation (DESIGN.md §5.2): one single-producer/single-consumer ring per ordered pair
of members, file ``/dev/shm/derecho_async.<group>.<sender>.<receiver>`` (:mod:`.files`), created
by the sender. A 4 KiB header of u64 words, each on its own cache line (magic, version, sender,
receiver, capacity, producer incarnation; producer-owned ``head``, ``blocked``, ``closed``;
consumer-owned ``tail``, ``sleeping``, consumer incarnation, ``closed``; the producer's
``alive`` count, which its beacon thread moves while the process runs, and ``view``, the view
the producer installed last), then ``capacity`` data
bytes used circularly. ``head`` and ``tail`` are monotone byte counters; words are single
aligned 8-byte loads and stores. Records are 8-byte aligned: a 32-byte header (type, flags=0, a,
b, length) and the payload; PUSH: a=view_id, b=table offset; MSG: a=total message length,
b=fragment offset. :func:`derecho_async.hotpath.ring_put` writes them and
:func:`derecho_async.hotpath.ring_scan` reads and validates them.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

from derecho_async import hotpath
from derecho_async.transport.base import log
from derecho_async.transport.shm.files import (
    PREFIX,
    SHM_DIR,
    BadSegment,
    create_segment,
    group_files,
    map_segment,
)

__all__ = [
    "HDR",
    "MAGIC",
    "MAX_RING",
    "MIN_RING",
    "REC_HEADER",
    "R_MSG",
    "R_PUSH",
    "VERSION",
    "W_CAPACITY",
    "W_CCLOSED",
    "W_CINC",
    "W_CSLEEP",
    "W_HEAD",
    "W_MAGIC",
    "W_PALIVE",
    "W_PBLOCKED",
    "W_PCLOSED",
    "W_PINC",
    "W_PVIEW",
    "W_RECEIVER",
    "W_SENDER",
    "W_TAIL",
    "W_VERSION",
    "Record",
    "Ring",
    "attach_ring",
    "create_ring",
    "fence",
    "record_size",
    "ring_path",
    "ring_segments",
]

MAGIC = int.from_bytes(b"DAshmRg1", "little")
VERSION = 1
HDR = 4096  # header bytes before the data area
# header word indexes (u64): 8 words = one 64-byte cache line apart
W_MAGIC, W_VERSION, W_SENDER, W_RECEIVER, W_CAPACITY, W_PINC = 0, 1, 2, 3, 4, 5
W_HEAD, W_PBLOCKED, W_PCLOSED = 8, 16, 24
W_TAIL, W_CSLEEP, W_CINC, W_CCLOSED = 32, 40, 48, 56
W_PALIVE = 64  # producer-owned, written by its beacon thread (hotpath.beacon_add)
W_PVIEW = 72  # producer-owned: its current view (its beacon counts only within one view)

REC_HEADER = 32  # a record's header: u32 type, u32 flags, u64 a, u64 b, u64 length
R_PUSH, R_MSG = 1, 2
Record = tuple[int, int, int, bytes | memoryview]
"""A record to write: (type, a, b, payload); :func:`derecho_async.hotpath.ring_put` packs the
header."""

MIN_RING = 64 << 10
MAX_RING = 1 << 30

fence = hotpath.fence
"""Full memory barrier between a store and a later load of the other side's word
(sleeping/head, blocked/tail): a seq_cst fence in the native hot path, an uncontended lock round
trip (a locked RMW on x86-64) in its pure twin; the sweep timer covers any platform where this is
weaker."""


def record_size(payload: bytes | memoryview) -> int:
    """Bytes a record with ``payload`` takes in a ring: its header, then the payload padded
    to 8 (what :func:`derecho_async.hotpath.ring_put` writes and returns)."""
    return REC_HEADER + ((len(payload) + 7) & ~7)


def ring_path(group: str, sender: int, receiver: int) -> str:
    """The file of the ring from ``sender`` to ``receiver`` in ``group``."""
    return os.path.join(SHM_DIR, f"{PREFIX}{group}.{sender}.{receiver}")


def ring_segments(group: str) -> Iterator[tuple[str, int, int]]:
    """(path, sender, receiver) of every ring segment file of ``group``."""
    for path, sender, receiver in group_files(group):
        if receiver.isdigit() and len(receiver) <= 19:
            yield path, int(sender), int(receiver)


class Ring:
    """One mapped ring segment, seen from either end: ``words`` (the header) and ``data``."""

    def __init__(self, path: str, mm: mmap.mmap, capacity: int) -> None:
        self.path = path
        self.mm = mm
        self.capacity = capacity
        whole = memoryview(mm)
        self.words = whole[:HDR].cast("Q")
        self.data = whole[HDR : HDR + capacity]
        whole.release()

    def close(self) -> None:
        """Unmap the segment (the file stays)."""
        self.words.release()
        self.data.release()
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - a view leaked; the mapping dies with us
            log.warning("could not unmap %s: buffers still exported", self.path)


def create_ring(path: str, sender: int, receiver: int, capacity: int, inc: int) -> Ring:
    """Create (replacing a leftover) and initialise the ring at ``path``; the producer's side.
    ``inc`` is the producer's incarnation."""
    ring = Ring(path, create_segment(path, HDR + capacity), capacity)
    w = ring.words
    w[W_VERSION] = VERSION
    w[W_SENDER] = sender
    w[W_RECEIVER] = receiver
    w[W_CAPACITY] = capacity
    w[W_PINC] = inc
    w[W_CSLEEP] = 1  # nobody attached: the first write rings the doorbell
    fence()
    w[W_MAGIC] = MAGIC
    return ring


def attach_ring(path: str, sender: int, receiver: int) -> Ring:
    """Map an existing ring for reading, validating ownership and the whole header."""
    mm = map_segment(path, HDR + MIN_RING, HDR + MAX_RING)
    size = len(mm)
    ring = Ring(path, mm, size - HDR)
    w = ring.words
    problem = None
    if w[W_MAGIC] != MAGIC or w[W_VERSION] != VERSION:
        problem = "bad magic/version (not initialised yet?)"
    elif w[W_SENDER] != sender or w[W_RECEIVER] != receiver:
        problem = f"header names {w[W_SENDER]}->{w[W_RECEIVER]}"
    elif w[W_CAPACITY] != ring.capacity or ring.capacity % 8:
        problem = f"header capacity {w[W_CAPACITY]} does not match size {size}"
    if problem is not None:
        ring.close()
        raise BadSegment(f"{path}: {problem}")
    return ring
