"""Which members of an shm group run now: whom a joiner asks when its contact is not running.

Theory of operation (DESIGN.md §5.2): a running member holds its doorbell, the abstract UNIX
socket name ``dasync/<uid>/<group>/<member>`` (:mod:`.doorbell`). The candidates are the names
of this user's doorbells of the group that the kernel lists in ``/proc/net/unix`` (abstract
names belong to the network namespace, and that file lists this namespace's), which finds a
member alone in its view too (it has no segment), and the members the group's files in
/dev/shm name (ring senders and receivers, pool owners), which covers a ``/proc`` that lists no
socket. Each candidate is then probed (:func:`.doorbell.is_alive`): a name released since, a
stale file of a dead member, count for nothing. The uid in the name keeps out a same-named
group of another user. At most :data:`MAX_CANDIDATES` are probed, lowest ids first.
"""

from __future__ import annotations

import socket

from derecho_async.transport.shm.doorbell import doorbell_prefix, is_alive
from derecho_async.transport.shm.files import check_group, group_files

__all__ = ["MAX_CANDIDATES", "PROC_NET_UNIX", "bound_doorbells", "live_members", "named_in_files"]

PROC_NET_UNIX = "/proc/net/unix"
MAX_CANDIDATES = 256
"""Candidates probed at most (a view holds at most 64 members)."""

_DIGITS = 19  # the longest member id in digits


def _member(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= _DIGITS else None


def bound_doorbells(group: str, listing: str = PROC_NET_UNIX) -> set[int]:
    """The members of ``group`` (this user's) whose doorbell name ``listing`` shows bound; none
    where it cannot be read. The kernel writes an abstract name with ``@`` for its NUL bytes."""
    prefix = "@" + doorbell_prefix(group)
    found: set[int] = set()
    try:
        with open(listing, encoding="ascii", errors="replace") as lines:
            for line in lines:
                fields = line.split(None, 7)  # Num RefCount Protocol Flags Type St Inode Path
                if len(fields) == 8 and fields[7].startswith(prefix):
                    member = _member(fields[7].rstrip("\n")[len(prefix):])
                    if member is not None:
                        found.add(member)
    except OSError:
        return set()
    return found


def named_in_files(group: str) -> set[int]:
    """The members the files of ``group`` in /dev/shm name: ring ends, pool owners."""
    found: set[int] = set()
    for _, owner, rest in group_files(group):
        for member in (_member(owner), _member(rest)):  # (rest: a ring's receiver, or pool<k>)
            if member is not None:
                found.add(member)
    return found


def live_members(group: str, listing: str = PROC_NET_UNIX) -> list[int]:
    """The members of ``group`` whose process runs now (their doorbell is bound; unsure counts
    as running), lowest first; ``listing`` is where bound socket names are listed."""
    check_group(group)
    candidates = sorted(bound_doorbells(group, listing) | named_in_files(group))
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
        probe.setblocking(False)
        return [m for m in candidates[:MAX_CANDIDATES] if is_alive(probe, group, m)]
