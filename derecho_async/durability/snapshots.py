# Theory of operation
# -------------------
# A ``Snapshots`` directory holds one file per snapshot, ``<view:016x>-<seq:016x>.snap``, named by
# the version of the last call the state includes. Each is written with ``atomic_write`` (temp
# file, fsync, rename, fsync of the directory), so a crash leaves either the whole snapshot or
# none, and its contents (a 24-byte header of view, seq and time_ns, then the state) are checked
# by ``read_checked``. The newest snapshot is the one with the greatest version. A damaged newest
# snapshot raises ``LogCorrupted``: recovery never falls back silently to an older state (whose
# log may already be trimmed). Leftover ``.tmp`` files of writes cut short are removed on open.
"""Checked, atomic snapshots of a replica's state, named by version."""

from __future__ import annotations

import re
import struct
from pathlib import Path

from derecho_async.durability.files import Fs, RealFs, atomic_write, read_checked
from derecho_async.durability.records import Version, check_version
from derecho_async.errors import LogCorrupted, UsageError

__all__ = ["Snapshots"]

_NAME = re.compile(r"^([0-9a-f]{16})-([0-9a-f]{16})\.snap$")
_HEADER = struct.Struct("<QQq")  # view, seq, time_ns


class Snapshots:
    """The snapshots kept in ``directory`` (created if absent)."""

    def __init__(self, directory: Path, *, fs: Fs | None = None) -> None:
        self._dir = Path(directory)
        self._fs = fs or RealFs()
        if not self._fs.exists(self._dir):
            self._fs.makedirs(self._dir)
            self._fs.fsync_dir(self._dir.parent)
        stale = [n for n in self._fs.listdir(self._dir) if n.endswith(".snap.tmp")]
        for name in stale:
            self._fs.remove(self._dir / name)
        if stale:
            self._fs.fsync_dir(self._dir)

    def _path(self, version: Version) -> Path:
        return self._dir / f"{version[0]:016x}-{version[1]:016x}.snap"

    def write(self, version: Version, time_ns: int, data: bytes) -> None:
        """Stores ``data`` as the state through ``version``, atomically and durably."""
        version = check_version(version)
        if type(time_ns) is not int or not -(1 << 63) <= time_ns < 1 << 63:
            raise UsageError(f"time_ns must be a 64-bit int, got {time_ns!r}")
        atomic_write(self._path(version), _HEADER.pack(*version, time_ns) + bytes(data),
                     fs=self._fs)

    def versions(self) -> list[Version]:
        """The versions of the snapshots present, oldest first."""
        found = []
        for name in self._fs.listdir(self._dir):
            m = _NAME.match(name)
            if m:
                found.append((int(m[1], 16), int(m[2], 16)))
        return sorted(found)

    def load_newest(self) -> tuple[Version, int, bytes] | None:
        """(version, time_ns, data) of the newest snapshot, None if there is none; a damaged
        newest snapshot raises LogCorrupted."""
        versions = self.versions()
        return self.load(versions[-1]) if versions else None

    def load(self, version: Version) -> tuple[Version, int, bytes]:
        """(version, time_ns, data) of the snapshot of ``version``; LogCorrupted if damaged."""
        path = self._path(version)
        raw = read_checked(path, fs=self._fs)
        if raw is None:
            raise LogCorrupted(path, 0, "listed but could not be opened")
        if len(raw) < _HEADER.size:
            raise LogCorrupted(path, 0, "shorter than the snapshot header")
        view, seq, time_ns = _HEADER.unpack_from(raw)
        if (view, seq) != version:
            raise LogCorrupted(path, 0, f"holds version {(view, seq)}, the name says {version}")
        return (view, seq), time_ns, raw[_HEADER.size:]

    def prune(self, keep: int = 2) -> None:
        """Removes all but the ``keep`` newest snapshots."""
        if keep < 1:
            raise UsageError(f"keep at least one snapshot, got keep={keep}")
        old = self.versions()[:-keep]
        for version in old:
            self._fs.remove(self._path(version))
        if old:
            self._fs.fsync_dir(self._dir)
