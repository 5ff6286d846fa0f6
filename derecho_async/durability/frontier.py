# Theory of operation
# -------------------
# A member tells its group how far its log is durable (its ``persisted`` word), and ``persisted()``
# resolves on those words. The log itself cannot tell, after the fact, how far it reached: a tail
# cut off at rest (a truncated file, a restored backup) reads back as a shorter log, or as a torn
# tail a crash left, which recovery drops in silence. So the member also keeps, apart from the
# log, the frontier it acknowledged: a ``Frontier`` file in the subgroup's directory that holds
# the highest version it ever published as durable. It is written before the word is published
# (each record appended and fsynced by the flush that made the log durable that far), so it is
# never behind what the group was told, and never ahead of what the files held when it was
# written. A restart compares it with what the files hold now (log.py, snapshots.py): the
# difference is a gap, named, not a silent loss.
#
# The file is a sequence of 28-byte records: magic "DAF1" | view u64 | seq u64 | crc32 u32 (of the
# 16 version bytes) | 4 zero bytes, little-endian; versions only grow. Reading takes the highest
# valid record; a record torn by a crash (the last, unsynced) is ignored, it was never published;
# a bad record followed by a good one is damage (``LogCorrupted``). (So damage to the last
# record at rest reads as the record before it: the frontier then errs one flush low.) When the file passes
# ``COMPACT_BYTES`` it is replaced, atomically, by one record.
"""The frontier a member acknowledged as durable, kept apart from its log."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from derecho_async.durability.files import Fs, RealFs, WriteFile
from derecho_async.durability.records import Version, check_version
from derecho_async.errors import LogCorrupted

__all__ = ["COMPACT_BYTES", "Frontier"]

_RECORD = struct.Struct("<4sQQI4x")
_MAGIC = b"DAF1"
COMPACT_BYTES = 64 << 10
"""Past this size the file is rewritten as its last record."""


def _record(version: Version) -> bytes:
    body = struct.pack("<QQ", *version)
    return _RECORD.pack(_MAGIC, version[0], version[1], zlib.crc32(body))


def _parse(data: bytes, offset: int) -> Version | None:
    magic, view, seq, crc = _RECORD.unpack_from(data, offset)
    if magic != _MAGIC or zlib.crc32(struct.pack("<QQ", view, seq)) != crc:
        return None
    return (view, seq)


class Frontier:
    """The acknowledged frontier of one subgroup's log (see the module header): ``path`` is its
    file. Not thread-safe: one flush at a time writes it."""

    def __init__(self, path: Path, *, fs: Fs | None = None) -> None:
        self.path = Path(path)
        self._fs = fs or RealFs()
        self._file: WriteFile | None = None
        self._size = 0
        self.acked: Version | None = self._read()
        """The highest version acknowledged (None: none yet)."""

    def _read(self) -> Version | None:
        fs = self._fs
        if not fs.exists(self.path):
            return None
        file = fs.open_read(self.path)
        try:
            size = file.size()
            data = file.pread(0, size)
        finally:
            file.close()
        best: Version | None = None
        bad: int | None = None
        whole = len(data) - len(data) % _RECORD.size
        for offset in range(0, whole, _RECORD.size):
            version = _parse(data, offset)
            if version is None:
                bad = offset if bad is None else bad
                continue
            if bad is not None:
                raise LogCorrupted(self.path, bad, "a damaged record before a valid one")
            if best is None or version > best:
                best = version
        self._size = size
        return best

    def advance(self, version: Version) -> None:
        """Record ``version`` durably (appended and fsynced) if it is above :attr:`acked`."""
        version = check_version(version)
        if self.acked is not None and version <= self.acked:
            return
        if self._size >= COMPACT_BYTES or (self._file is None and self._size % _RECORD.size):
            self._compact(version)  # (too long, or a torn record last: start clean)
        else:
            new = self._size == 0
            if self._file is None:
                self._file = self._fs.open_append(self.path)
            self._file.write(_record(version))
            self._file.fsync()
            if new:  # its name must be durable too
                self._fs.fsync_dir(self.path.parent)
            self._size += _RECORD.size
        self.acked = version

    def _compact(self, version: Version) -> None:
        """Replace the file by one record of ``version``, atomically."""
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        file = self._fs.create(tmp)
        try:
            file.write(_record(version))
            file.fsync()
        finally:
            file.close()
        self._fs.rename(tmp, self.path)
        self._fs.fsync_dir(self.path.parent)
        self._size = _RECORD.size

    @staticmethod
    def salvage(path: Path, *, fs: Fs | None = None) -> Version | None:
        """The highest valid record of a damaged frontier file at ``path`` (None: none)."""
        fs = fs or RealFs()
        file = fs.open_read(Path(path))
        try:
            data = file.pread(0, file.size())
        finally:
            file.close()
        found = [_parse(data, o) for o in range(0, len(data) - _RECORD.size + 1, _RECORD.size)]
        valid = [v for v in found if v is not None]
        return max(valid) if valid else None

    def reset(self, version: Version | None) -> None:
        """Lower (or raise) the frontier to ``version`` on purpose (``derecho-async repair
        --accept-loss``): the file holds that version alone, or is removed for None."""
        if version is None:
            self.close()
            if self._fs.exists(self.path):
                self._fs.remove(self.path)
                self._fs.fsync_dir(self.path.parent)
            self._size = 0
        else:
            self._compact(check_version(version))
        self.acked = version

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
