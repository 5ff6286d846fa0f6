# Theory of operation
# -------------------
# Every file operation of the durable log and the snapshots goes through an ``Fs``: the real
# file system (``RealFs``, the default) or the simulated disk of ``testing/simdisk.py``, which
# loses what was not made durable when it "crashes". The protocol is small on purpose: append-only
# writers, positional readers, and the namespace operations whose durability needs an fsync of
# the directory (create, rename, remove). Nothing here is durable until ``WriteFile.fsync`` (the
# bytes) and ``Fs.fsync_dir`` (the name) have both returned.
#
# ``atomic_write`` replaces a small file all at once: it writes a checked copy to ``<name>.tmp``,
# fsyncs it, renames it over the target and fsyncs the directory, so after a crash the target
# holds either the old contents or the new, never a mix. The copy starts with a header (magic,
# crc32 of length and data, length); ``read_checked`` verifies it and raises ``LogCorrupted`` for
# anything else, so a file damaged at rest is an error, not wrong data.
"""The file-system abstraction of the durable log, and checked atomic replacement of a file."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Protocol

from derecho_async.errors import LogCorrupted

__all__ = ["Fs", "ReadFile", "RealFs", "WriteFile", "atomic_write", "read_checked"]


class WriteFile(Protocol):
    """An open file that is written only at its end."""

    def write(self, data: bytes) -> None:
        """Hands all of ``data`` to the OS (not durable until ``fsync``)."""
        ...

    def fsync(self) -> None:
        """Makes every byte written so far durable."""
        ...

    def close(self) -> None: ...


class ReadFile(Protocol):
    """An open file read at given offsets."""

    def pread(self, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer at the end of the file)."""
        ...

    def size(self) -> int: ...

    def close(self) -> None: ...


class Fs(Protocol):
    """The file operations the durable log uses. Paths are absolute or relative to the cwd."""

    def makedirs(self, path: Path) -> None:
        """Creates ``path`` and its missing parents (no error if it exists)."""
        ...

    def listdir(self, path: Path) -> list[str]: ...

    def exists(self, path: Path) -> bool: ...

    def open_append(self, path: Path) -> WriteFile:
        """Opens ``path`` for appending, creating it empty if absent."""
        ...

    def create(self, path: Path) -> WriteFile:
        """Opens ``path`` for writing, empty: created if absent, truncated if present."""
        ...

    def open_read(self, path: Path) -> ReadFile:
        """Opens ``path`` for reading; ``FileNotFoundError`` if absent."""
        ...

    def truncate(self, path: Path, length: int) -> None:
        """Cuts ``path`` to ``length`` bytes (durable after an fsync of the file)."""
        ...

    def rename(self, src: Path, dst: Path) -> None:
        """Renames ``src`` over ``dst`` atomically (both in one directory)."""
        ...

    def remove(self, path: Path) -> None: ...

    def fsync_dir(self, path: Path) -> None:
        """Makes the creates, renames and removes done in directory ``path`` durable."""
        ...


class _RealWriteFile:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def fsync(self) -> None:
        # fdatasync: the data and the metadata needed to read it back (the size), not times
        os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _RealReadFile:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def pread(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RealFs:
    """The operating system's file system."""

    def makedirs(self, path: Path) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def exists(self, path: Path) -> bool:
        return os.path.exists(path)

    def open_append(self, path: Path) -> WriteFile:
        return _RealWriteFile(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                                      0o644))

    def create(self, path: Path) -> WriteFile:
        return _RealWriteFile(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                                      0o644))

    def open_read(self, path: Path) -> ReadFile:
        return _RealReadFile(os.open(path, os.O_RDONLY | os.O_CLOEXEC))

    def truncate(self, path: Path, length: int) -> None:
        os.truncate(path, length)

    def rename(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def remove(self, path: Path) -> None:
        os.remove(path)

    def fsync_dir(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


_CHECKED = struct.Struct("<4sIQ")  # magic, crc32 of (length, data), length of data
_CHECKED_MAGIC = b"DAW1"


def atomic_write(path: Path, data: bytes, *, fs: Fs | None = None) -> None:
    """Replaces ``path`` with ``data`` (plus a checking header) durably and atomically."""
    fs = fs or RealFs()
    length = struct.pack("<Q", len(data))
    header = _CHECKED.pack(_CHECKED_MAGIC, zlib.crc32(data, zlib.crc32(length)), len(data))
    tmp = path.with_name(path.name + ".tmp")
    file = fs.create(tmp)
    try:
        file.write(header + data)
        file.fsync()
    finally:
        file.close()
    fs.rename(tmp, path)
    fs.fsync_dir(path.parent)


def read_checked(path: Path, *, fs: Fs | None = None) -> bytes | None:
    """The data ``atomic_write`` put in ``path``; None if there is no such file.

    Raises ``LogCorrupted`` if the file is not exactly what ``atomic_write`` wrote.
    """
    fs = fs or RealFs()
    try:
        file = fs.open_read(path)
    except FileNotFoundError:
        return None
    try:
        size = file.size()
        if size < _CHECKED.size:
            raise LogCorrupted(path, 0, f"{size} bytes, shorter than the {_CHECKED.size}-byte header")
        magic, crc, length = _CHECKED.unpack(file.pread(0, _CHECKED.size))
        if magic != _CHECKED_MAGIC:
            raise LogCorrupted(path, 0, f"bad magic {magic!r}")
        if length != size - _CHECKED.size:
            raise LogCorrupted(path, 0, f"header says {length} bytes of data, the file holds "
                                        f"{size - _CHECKED.size}")
        data = file.pread(_CHECKED.size, length)
    finally:
        file.close()
    if len(data) != length or zlib.crc32(data, zlib.crc32(struct.pack("<Q", length))) != crc:
        raise LogCorrupted(path, 0, "checksum mismatch")
    return data
