"""Which shm segment files of a group are stale, and their removal (at start, by tools).

Theory of operation (DESIGN.md §5.2): a ring is stale when its producer is dead, or its consumer
attached (wrote its incarnation) and is dead; a pool segment when its owner is dead. "Dead" is
the doorbell rule (:func:`.doorbell.is_alive`). A starting member holds its own doorbell, so it
also removes its own rings of an earlier incarnation and the rings written to that incarnation,
and tells those peers it restarted. With every member of a group gone, :func:`cleanup_group`
removes all of the group's files.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from derecho_async.transport.shm.doorbell import Doorbell, is_alive
from derecho_async.transport.shm.files import check_group, read_word, unlink_file
from derecho_async.transport.shm.pool import cleanup_pool, pool_segments
from derecho_async.transport.shm.ring import W_CINC, ring_segments

__all__ = ["clean_at_start", "cleanup_group", "segments"]


def _stale(path: str, s: int, r: int, alive: Callable[[int], bool]) -> bool:
    if not alive(s):
        return True
    return not alive(r) and (read_word(path, W_CINC) or 0) != 0


def cleanup_group(group: str) -> int:
    """Unlink the segments (rings and pool segments) of ``group`` left by dead members;
    returns how many."""
    check_group(group)
    removed = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        probe.setblocking(False)

        def alive(member: int) -> bool:
            return is_alive(probe, group, member)

        for path, s, r in list(ring_segments(group)):
            if _stale(path, s, r, alive) and unlink_file(path):
                removed += 1
    return removed + cleanup_pool(group)


def segments(group: str) -> list[str]:
    """Paths of the shared-memory segments (rings and pool segments) of ``group`` that exist
    now."""
    check_group(group)
    paths = [p for p, _, _ in ring_segments(group)]
    return sorted(paths + [p for p, _, _ in pool_segments(group)])


def clean_at_start(bell: Doorbell) -> tuple[list[int], set[int]]:
    """Remove the stale rings of the group of a member that just bound its doorbell ``bell``.

    Returns the senders whose rings wait for this member (live producers that wrote before it
    started) and the peers to tell that it restarted.
    """
    group = bell.group
    me = bell.member
    keep: list[int] = []
    notify: set[int] = set()
    for path, s, r in ring_segments(group):
        if s == me:  # my outgoing ring from an earlier incarnation
            unlink_file(path)
            notify.add(r)
        elif r == me:
            if not bell.alive(s):
                unlink_file(path)
            elif read_word(path, W_CINC) == 0:
                keep.append(s)  # a live producer wrote to me before I started
            else:  # it was written to my earlier incarnation
                unlink_file(path)
                notify.add(s)
        elif _stale(path, s, r, bell.alive):
            unlink_file(path)
    notify.discard(me)
    return keep, notify
