"""Segment files of shm groups in ``/dev/shm``: names, creation, checked mapping, listing.

Theory of operation (DESIGN.md §5.2): every file of group ``g`` is
``/dev/shm/derecho_async.<g>.<owner>.<rest>`` (a ring, ``<rest>`` the receiver: :mod:`.ring`;
a pool segment of the shm data plane, ``pool<k>``: :mod:`.pool`), a private regular file of this
user (mode 0o600), created with ``os.open`` and mapped with ``mmap`` so no resource tracker owns
it. Whoever maps a file checks owner, type, mode and size first (:class:`BadSegment` otherwise).
Which files are stale is :mod:`.cleanup`'s rule.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from collections.abc import Iterator

from derecho_async.errors import ConfigError
from derecho_async.transport.base import log

__all__ = [
    "GROUP_RE",
    "PREFIX",
    "SHM_DIR",
    "BadSegment",
    "check_group",
    "create_segment",
    "group_files",
    "map_segment",
    "open_segment",
    "read_word",
    "unlink_file",
]

SHM_DIR = "/dev/shm"
PREFIX = "derecho_async."
GROUP_RE = re.compile(r"[A-Za-z0-9_-]{1,48}")


def check_group(group: object) -> str:
    """``group`` if it is a valid group name (it becomes part of file names), else
    :class:`ConfigError`."""
    if not isinstance(group, str) or not GROUP_RE.fullmatch(group):
        raise ConfigError("group", "1-48 characters from [A-Za-z0-9_-]", group)
    return group


def group_files(group: str) -> Iterator[tuple[str, str, str]]:
    """(path, owner, rest) of every ``<prefix><group>.<owner>.<rest>`` file, owner a member id
    in digits (the rest is for the caller to check)."""
    prefix = f"{PREFIX}{group}."
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        parts = name[len(prefix) :].split(".")
        if len(parts) == 2 and parts[0].isdigit() and len(parts[0]) <= 19:
            yield os.path.join(SHM_DIR, name), parts[0], parts[1]


def unlink_file(path: str) -> bool:
    """Remove ``path``; False if it was not there or could not be removed (logged)."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("could not unlink %s: %s", path, exc)
        return False


def open_segment(path: str, flags: int) -> int:
    """An fd of the segment file ``path``, read/write (``MAP_SHARED`` needs it), no symlinks."""
    return os.open(path, flags | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def create_segment(path: str, size: int, flags: int = mmap.MAP_SHARED) -> mmap.mmap:
    """Create the private file ``path`` of ``size`` bytes and map it (shm rings, pool segments).

    A file already there is a leftover of an earlier incarnation of its only writer: the caller
    holds that writer's doorbell, so nobody else can be writing into it; it is replaced.
    """
    try:
        fd = open_segment(path, os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        unlink_file(path)
        fd = open_segment(path, os.O_CREAT | os.O_EXCL)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=flags)
    except BaseException:
        os.close(fd)
        unlink_file(path)
        raise
    os.close(fd)
    return mm


def map_segment(path: str, min_size: int, max_size: int, flags: int = mmap.MAP_SHARED
                 ) -> mmap.mmap:
    """Map an existing segment file, after checking it is a private regular file of this user
    of ``min_size`` to ``max_size`` bytes (``BadSegment`` otherwise; mapping errors pass)."""
    try:
        fd = open_segment(path, 0)
    except OSError as exc:
        raise BadSegment(f"cannot open {path}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise BadSegment(f"{path} is not a private file of this user")
        if not min_size <= st.st_size <= max_size:
            raise BadSegment(f"{path} has a bad size {st.st_size}")
        return mmap.mmap(fd, st.st_size, flags=flags)
    finally:
        os.close(fd)


def read_word(path: str, index: int) -> int | None:
    """Header word ``index`` (u64) of a segment of ours, without mapping it (None if unreadable
    or foreign)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            return None
        raw = os.pread(fd, 8, index * 8)
        return int.from_bytes(raw, "little") if len(raw) == 8 else None
    finally:
        os.close(fd)


class BadSegment(Exception):
    """A segment file is missing, foreign or malformed."""
