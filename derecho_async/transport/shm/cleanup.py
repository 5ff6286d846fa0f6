"""Which shm segment files of a group are stale, and their removal (at start, at a view change,
by tools).

Theory of operation (DESIGN.md §5.2): a ring is stale when its producer is dead, or its consumer
attached (wrote its incarnation) and is dead; a pool segment when its owner is dead. "Dead" is
the doorbell rule (:func:`.doorbell.is_alive`). A starting member holds its own doorbell, so it
also removes its own rings of an earlier incarnation and the rings written to that incarnation,
and tells those peers it restarted. With every member of a group gone, :func:`cleanup_group`
removes all of the group's files. At a view change the survivors remove every segment owned by
or paired with a departed member that is dead (:func:`remove_members`), dead-to-dead rings
included. Tools (``derecho-async status``) see each group's files by owner
(:func:`survey`) and remove only those whose owner is dead (:func:`remove_dead_owners`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from derecho_async.transport.shm.doorbell import Doorbell, is_alive
from derecho_async.transport.shm.files import (
    GROUP_RE,
    PREFIX,
    SHM_DIR,
    check_group,
    read_word,
    unlink_file,
)
from derecho_async.transport.shm.pool import cleanup_pool, pool_segments
from derecho_async.transport.shm.ring import W_CINC, ring_segments

__all__ = [
    "Departures",
    "SegmentFile",
    "clean_at_start",
    "cleanup_group",
    "remove_dead_owners",
    "remove_members",
    "segments",
    "survey",
]


def _stale(path: str, s: int, r: int, alive: Callable[[int], bool]) -> bool:
    if not alive(s):
        return True
    return not alive(r) and (read_word(path, W_CINC) or 0) != 0


def _probe() -> socket.socket:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    probe.setblocking(False)
    return probe


def cleanup_group(group: str) -> int:
    """Unlink the segments (rings and pool segments) of ``group`` left by dead members;
    returns how many."""
    check_group(group)
    removed = 0
    with _probe() as probe:

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


def remove_members(group: str, members: Collection[int]) -> int:
    """Unlink every segment of ``group`` owned by or paired with one of ``members``: rings
    from or to any of them (between two of them too) and their pool segments; returns how many.

    Only for members the caller found dead (the doorbell rule) after they left the view: a live
    process's segments must never be passed here.
    """
    check_group(group)
    gone = set(members)
    removed = 0
    if not gone:
        return 0
    for path, s, r in list(ring_segments(group)):
        if (s in gone or r in gone) and unlink_file(path):
            removed += 1
    for path, owner, _ in list(pool_segments(group)):
        if owner in gone and unlink_file(path):
            removed += 1
    return removed


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


# -- tools -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SegmentFile:
    """One file of a group in /dev/shm, as ``derecho-async status`` shows it.

    ``owner`` is the member that created it (a ring's sender, a pool segment's owner), None for
    a name that is neither; ``mine`` whether it belongs to this user (only those are judged or
    removed); ``alive`` whether its owner holds its doorbell now (None where not judged).
    """

    group: str
    name: str
    size: int
    owner: int | None
    mine: bool
    alive: bool | None


def _owner_of(rest: str) -> str | None:
    """The owner field of a file name's tail ``<owner>.<ring receiver or pool<k>>``."""
    parts = rest.split(".")
    if len(parts) != 2 or not parts[0].isdigit() or len(parts[0]) > 19:
        return None
    tail = parts[1].removeprefix("pool")
    if not tail.isdigit() or len(tail) > 19:
        return None
    return parts[0]


def _files() -> Iterator[tuple[str, str, str]]:
    """(group, name, rest) of every ``derecho_async.`` file in /dev/shm."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except OSError:
        return
    for name in names:
        if name.startswith(PREFIX):
            group, _, rest = name[len(PREFIX):].partition(".")
            yield group, name, rest


def survey() -> dict[str, list[SegmentFile]]:
    """Every ``derecho_async`` file in /dev/shm by group, each with its owner and whether the
    owner is alive (probed once per owner; files of other users or with foreign names are
    listed, not judged)."""
    uid = os.getuid()
    out: dict[str, list[SegmentFile]] = {}
    with _probe() as probe:
        alive: dict[tuple[str, int], bool] = {}
        for group, name, rest in _files():
            try:
                st = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)
            except OSError:  # removed while we looked
                continue
            digits = _owner_of(rest)
            owner = None if digits is None else int(digits)
            mine = st.st_uid == uid
            live: bool | None = None
            if owner is not None and mine and GROUP_RE.fullmatch(group):
                key = (group, owner)
                if key not in alive:
                    alive[key] = is_alive(probe, group, owner)
                live = alive[key]
            out.setdefault(group, []).append(
                SegmentFile(group, name, st.st_size, owner, mine, live))
    return out


def remove_dead_owners(group: str) -> list[SegmentFile]:
    """Unlink the files of ``group`` (this user's) whose owner is dead: every ring it sends on
    and its pool segments; returns what was removed. A live owner's files are never touched:
    each owner is probed again just before its files are removed."""
    check_group(group)
    files = [f for f in survey().get(group, []) if f.alive is False]
    owners = sorted({f.owner for f in files if f.owner is not None})
    removed: list[SegmentFile] = []
    with _probe() as probe:
        for owner in owners:
            if is_alive(probe, group, owner):
                continue  # it started meanwhile
            for f in files:
                if f.owner == owner and unlink_file(os.path.join(SHM_DIR, f.name)):
                    removed.append(f)
    return removed


class Departures:
    """The members that left this member's views and whose segments are not yet removed.

    A member that left a view stays departed until it is dead (its segments can go) or it is
    back in a later view; ``bool(departures)`` says whether any is waiting."""

    def __init__(self, me: int) -> None:
        self.me = me
        self.waiting: set[int] = set()
        self._members: frozenset[int] | None = None  # of the latest view

    def __bool__(self) -> bool:
        return bool(self.waiting)

    def view(self, members: Collection[int]) -> bool:
        """Note a new view's members; whether any departed member is now waiting."""
        now = frozenset(members)
        if self._members is not None:
            self.waiting |= self._members - now
        self._members = now
        self.waiting -= now
        self.waiting.discard(self.me)
        return bool(self.waiting)

    def take_dead(self, alive: Callable[[int], bool]) -> set[int]:
        """The waiting members that are dead now, no longer waiting (their segments go)."""
        dead = {m for m in self.waiting if not alive(m)}
        self.waiting -= dead
        return dead
