"""The NCCL plane's pure parts: the communicator plan, unique ids and each view's bookkeeping.

Theory of operation (DESIGN.md §6.7). Per installed view there is one communicator per sender
per shard, its ranks the shard's members in view order, its root that sender; which ones exist
is a pure function of the layout and the view (:func:`communicator_plan`), so every member
computes the same plan and names a communicator on the wire by (root, index among the root's
communicators). :class:`Comm` is this member's side of one (its broadcasts' sequence numbers,
checked on arrival, and the stall watchdog), :class:`ViewComms` a view's communicators and the
order every member joins them in, :class:`EarlyUids` the unique ids that arrive before their
view. Nothing here needs CuPy: it is tested on the CPU
(``tests/runtime/test_ncclplane_pure.py``).
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.gpu.completions import Lane
from derecho_async.runtime.gpu.descriptor import Descriptor

__all__ = [
    "STALL_FLOOR_BPS",
    "UID_BYTES",
    "Comm",
    "CommSpec",
    "EarlyUids",
    "ViewComms",
    "communicator_plan",
    "uid_from_frame",
    "uid_to_bytes",
    "uid_to_tuple",
]

UID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES
_MAX_EARLY_UIDS = 4096  # unique-id frames held for views not yet installed here
STALL_FLOOR_BPS = 100e6  # the stall limit grows by a broadcast's bytes at this rate
_STALL_GAP_S = 5.0  # watchdog checks further apart than this (a blocked loop) restart its clock


# -- unique ids (pure) -------------------------------------------------------------------------
def uid_to_bytes(uid: Sequence[int]) -> bytes:
    """``cupy.cuda.nccl.get_unique_id()``'s id (bytes, or a tuple of C chars signed or not) as
    128 bytes."""
    if len(uid) != UID_BYTES or not all(type(b) is int and -128 <= b <= 255 for b in uid):
        raise ValueError(f"a NCCL unique id is {UID_BYTES} chars")
    return bytes(b & 0xFF for b in uid)


def uid_to_tuple(raw: bytes, signed: bool) -> tuple[int, ...]:
    """128 bytes as the tuple ``NcclCommunicator`` takes: chars in -128..127 where C's ``char``
    is signed (x86), 0..255 where it is not (arm64, ppc64le)."""
    return tuple(b - 256 if signed and b > 127 else b for b in raw)


def uid_from_frame(raw: object) -> bytes:
    """Validate a unique id from an ``NCCL_UID`` frame: exactly :data:`UID_BYTES` bytes."""
    if not isinstance(raw, bytes) or len(raw) != UID_BYTES:
        size = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise ProtocolViolation(f"NCCL unique id of {size} bytes, not {UID_BYTES}")
    return raw


# -- the plan and the bookkeeping (pure) -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CommSpec:
    """One communicator of a view: rooted at ``root``, its ``index``-th; ranks in ``members``."""

    root: int
    index: int
    members: tuple[int, ...]

    @property
    def root_rank(self) -> int:
        return self.members.index(self.root)


def communicator_plan(shards: Iterable[tuple[Sequence[int], Sequence[int]]],
                      min_ranks: int = 2) -> dict[int, tuple[CommSpec, ...]]:
    """Root -> its communicators, for shards given as (members in view order, senders).

    One communicator per sender per distinct member list; none with fewer than ``min_ranks``
    ranks (a communicator of one rank moves nothing; tests on a one-GPU machine pass 1 to
    exercise setup, broadcast and abort). Deterministic: every member computes the same plan.
    """
    plan: dict[int, list[CommSpec]] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for members, senders in shards:
        ranks = tuple(members)
        if len(ranks) < min_ranks:
            continue
        for s in senders:
            if (s, ranks) in seen or s not in ranks:
                continue
            seen.add((s, ranks))
            mine = plan.setdefault(s, [])
            mine.append(CommSpec(s, len(mine), ranks))
    return {s: tuple(specs) for s, specs in plan.items()}


@dataclass(slots=True, eq=False, kw_only=True)
class Comm(Lane):
    """This member's side of one communicator: its state, handle, stream (as a :class:`Lane`)
    and the ordering bookkeeping of its broadcasts."""

    spec: CommSpec
    rank: int
    state: str = "setup"  # setup | ready | failed | aborted
    why: str = ""  # what failed
    handle: Any = None  # the NcclCommunicator, once ready
    next_send: int = 0  # the root's next broadcast sequence number
    next_recv: int = 0  # the sequence number the next descriptor must carry
    # descriptors that arrived before the communicator was up, in order
    waiting: collections.deque[tuple[tuple[int, int, int], Descriptor]] = field(
        default_factory=collections.deque)

    # the oldest broadcast in flight when last checked, since when it has been the oldest, and
    # when the watchdog last looked
    oldest: object = None
    oldest_since: float = 0.0
    checked: float = -math.inf

    def stalled(self, now: float, limit_s: float, bytes_per_s: float = STALL_FLOOR_BPS,
                gap_s: float = _STALL_GAP_S) -> bool:
        """True when the same broadcast has been the oldest in flight for ``limit_s`` seconds
        plus its bytes at ``bytes_per_s`` (checked at ``now``, monotonic): no broadcast of this
        communicator completed since. Completed work must have been polled off ``inflight``
        first. A check more than ``gap_s`` after the previous one restarts the clock: a loop
        that was blocked saw no progress it could have seen."""
        head = self.inflight[0] if self.inflight else None
        late = now - self.checked > gap_s
        self.checked = now
        if head is not self.oldest or late:
            self.oldest, self.oldest_since = head, now
            return False
        if head is None:
            return False
        nbytes = sum(n for _, n in head[2])  # the regions it writes (see NcclPlane._receive)
        return now - self.oldest_since >= limit_s + nbytes / bytes_per_s

    def take_send(self) -> int:
        """The sequence number of the root's next broadcast."""
        seq = self.next_send
        self.next_send += 1
        return seq

    def take_recv(self, seq: int) -> None:
        """Check that descriptor ``seq`` is the next one of this communicator (the root issues
        in order and the channel is FIFO: anything else would desynchronise the ranks)."""
        if seq != self.next_recv:
            raise ProtocolViolation(
                f"broadcast {seq} of member {self.spec.root}'s communicator {self.spec.index} "
                f"arrived where {self.next_recv} was due"
            )
        self.next_recv += 1


class ViewComms:
    """The communicators of one view at one member (pure bookkeeping; the plane adds threads)."""

    def __init__(self, view_id: int, members: tuple[int, ...],
                 plan: dict[int, tuple[CommSpec, ...]], me: int) -> None:
        self.view_id = view_id
        self.members = members
        self.plan = plan
        self.me = me
        rank_in_view = {m: i for i, m in enumerate(members)}
        #: every communicator this member belongs to, in the order all members join them
        self.order: tuple[CommSpec, ...] = tuple(sorted(
            (spec for specs in plan.values() for spec in specs if me in spec.members),
            key=lambda spec: (rank_in_view.get(spec.root, len(members)), spec.index),
        ))
        self.comms: dict[tuple[int, int], Comm] = {
            (spec.root, spec.index): Comm(spec=spec, rank=spec.members.index(me))
            for spec in self.order
        }
        # the setup thread and the loop share these (under ``cond``)
        self.cond = threading.Condition()
        self.uids: dict[tuple[int, int], bytes] = {}
        self.joining: dict[tuple[int, int], Any] = {}  # joined, still warming up
        self.cancelled = False

    def comm_for_uid(self, sender: int, index: int) -> Comm:
        """The communicator an ``NCCL_UID`` frame from ``sender`` names (it must be its root
        and this member one of its ranks)."""
        comm = self.comms.get((sender, index))
        if comm is None:
            raise ProtocolViolation(
                f"member {sender} sent a unique id for communicator {index} of view "
                f"{self.view_id}, which it does not root or this member is not in"
            )
        return comm

    def comm_for_data(self, sender: int, index: int) -> Comm:
        """The communicator an ``NCCL_DATA`` frame from ``sender`` names."""
        comm = self.comms.get((sender, index))
        if comm is None:
            raise ProtocolViolation(
                f"device data from member {sender} on communicator {index} of view "
                f"{self.view_id}, which it does not root or this member is not in"
            )
        return comm

    def sending_comm(self, targets: Iterable[int]) -> Comm | None:
        """This member's communicator whose other ranks are exactly ``targets``, if any."""
        want = {self.me, *targets}
        for spec in self.plan.get(self.me, ()):
            if len(spec.members) == len(want) and want.issuperset(spec.members):
                return self.comms[(self.me, spec.index)]
        return None


class EarlyUids:
    """``NCCL_UID`` frames for views not installed here yet (bounded; older views dropped)."""

    def __init__(self, limit: int = _MAX_EARLY_UIDS) -> None:
        self.limit = limit
        self._held: dict[int, list[tuple[int, int, bytes]]] = {}
        self._count = 0

    def hold(self, view_id: int, sender: int, index: int, uid: bytes) -> None:
        if self._count >= self.limit:
            raise ProtocolViolation(f"more than {self.limit} NCCL unique ids for future views")
        self._held.setdefault(view_id, []).append((sender, index, uid))
        self._count += 1

    def take(self, view_id: int) -> list[tuple[int, int, bytes]]:
        """The frames held for ``view_id``; those of older views are dropped."""
        out = self._held.pop(view_id, [])
        for v in [v for v in self._held if v < view_id]:
            del self._held[v]
        self._count = sum(len(x) for x in self._held.values())
        return out

    def __len__(self) -> int:
        return self._count
