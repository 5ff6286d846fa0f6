# Theory of operation
# -------------------
# ``SimDisk`` is an in-memory ``Fs`` (durability/files.py) that can crash. Each file is an inode
# with two copies of its bytes: ``data`` (what reads see now) and ``durable`` (what an fsync of
# the file last made durable). Names live in two maps: the current namespace and the durable one;
# every create, rename and remove is applied to the current namespace at once and also queued on
# its directory, and ``fsync_dir`` applies the directory's queue to the durable namespace.
#
# ``crash()`` is a power loss. For each directory a random prefix of its queued namespace
# operations survives (a journal keeps them in order), the rest are lost. For each surviving
# file whose current bytes extend its durable bytes, the durable bytes are kept plus a random
# prefix of the unsynced suffix (a torn tail, possibly part of a record); when that prefix ends
# inside a block, the rest of that block may hold garbage (size updated, data not). A file that
# was truncated or rewritten since its fsync comes back either as it was durably or as a torn
# version of its current bytes. Afterwards current and durable agree, and files opened before the
# crash refuse further use. ``corrupt(path, offset)`` flips one byte, durably (damage at rest).
#
# Every random choice comes from ``random.Random(seed)`` and directories and files are visited in
# sorted order, so a seed replays exactly. Directories themselves are created durably; a rename
# must stay within one directory. Single-threaded (the actor simulator runs executors inline).
"""An in-memory, seeded file system with crash semantics, for testing the durable log."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from derecho_async.durability.files import ReadFile, WriteFile

__all__ = ["SimDisk"]

BLOCK = 4096


@dataclass
class _Inode:
    data: bytearray = field(default_factory=bytearray)
    durable: bytes = b""


class _SimWriteFile:
    def __init__(self, disk: SimDisk, inode: _Inode) -> None:
        self._disk = disk
        self._inode = inode
        self._epoch = disk.epoch
        self._open = True

    def _check(self) -> None:
        if not self._open:
            raise ValueError("I/O on a closed file")
        if self._epoch != self._disk.epoch:
            raise OSError("file opened before the simulated crash")

    def write(self, data: bytes) -> None:
        self._check()
        self._inode.data += data

    def fsync(self) -> None:
        self._check()
        self._inode.durable = bytes(self._inode.data)
        self._disk.fsyncs += 1

    def close(self) -> None:
        self._open = False


class _SimReadFile:
    def __init__(self, disk: SimDisk, inode: _Inode) -> None:
        self._disk = disk
        self._inode = inode
        self._epoch = disk.epoch

    def pread(self, offset: int, length: int) -> bytes:
        if self._epoch != self._disk.epoch:
            raise OSError("file opened before the simulated crash")
        return bytes(self._inode.data[offset:offset + length])

    def size(self) -> int:
        return len(self._inode.data)

    def close(self) -> None:
        pass


def _key(path: Path) -> str:
    return str(Path(path))


class SimDisk:
    """A seeded in-memory file system that loses what was not made durable on ``crash()``."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._names: dict[str, _Inode] = {}
        self._durable_names: dict[str, _Inode] = {}
        self._pending: dict[str, list[tuple[str, str, str, _Inode | None]]] = {}
        self._dirs: set[str] = set()
        self.epoch = 0
        self.fsyncs = 0        # file fsyncs so far
        self.dir_fsyncs = 0    # directory fsyncs so far
        self.crashes = 0

    # ---- Fs

    def makedirs(self, path: Path) -> None:
        p = Path(path)
        for d in [p, *p.parents]:
            self._dirs.add(_key(d))

    def listdir(self, path: Path) -> list[str]:
        d = _key(path)
        if d not in self._dirs:
            raise FileNotFoundError(d)
        return sorted(Path(k).name for k in self._names if _key(Path(k).parent) == d)

    def exists(self, path: Path) -> bool:
        return _key(path) in self._names or _key(path) in self._dirs

    def _parent(self, path: Path) -> str:
        d = _key(Path(path).parent)
        if d not in self._dirs:
            raise FileNotFoundError(d)
        return d

    def _link(self, path: Path) -> _Inode:
        inode = _Inode()
        self._names[_key(path)] = inode
        self._pending.setdefault(self._parent(path), []).append(("link", _key(path), "", inode))
        return inode

    def open_append(self, path: Path) -> WriteFile:
        self._parent(path)
        inode = self._names.get(_key(path)) or self._link(path)
        return _SimWriteFile(self, inode)

    def create(self, path: Path) -> WriteFile:
        self._parent(path)
        inode = self._names.get(_key(path))
        if inode is None:
            inode = self._link(path)
        else:
            inode.data = bytearray()
        return _SimWriteFile(self, inode)

    def open_read(self, path: Path) -> ReadFile:
        inode = self._names.get(_key(path))
        if inode is None:
            raise FileNotFoundError(_key(path))
        return _SimReadFile(self, inode)

    def truncate(self, path: Path, length: int) -> None:
        inode = self._names.get(_key(path))
        if inode is None:
            raise FileNotFoundError(_key(path))
        del inode.data[length:]

    def rename(self, src: Path, dst: Path) -> None:
        d = self._parent(src)
        if self._parent(dst) != d:
            raise OSError("SimDisk renames only within one directory")
        inode = self._names.pop(_key(src), None)
        if inode is None:
            raise FileNotFoundError(_key(src))
        self._names[_key(dst)] = inode
        self._pending.setdefault(d, []).append(("rename", _key(src), _key(dst), inode))

    def remove(self, path: Path) -> None:
        if self._names.pop(_key(path), None) is None:
            raise FileNotFoundError(_key(path))
        self._pending.setdefault(self._parent(path), []).append(("unlink", _key(path), "", None))

    def fsync_dir(self, path: Path) -> None:
        d = _key(path)
        if d not in self._dirs:
            raise FileNotFoundError(d)
        self._apply(self._pending.pop(d, []))
        self.dir_fsyncs += 1

    def _apply(self, ops: list[tuple[str, str, str, _Inode | None]]) -> None:
        for op, a, b, inode in ops:
            if op == "link":
                assert inode is not None
                self._durable_names[a] = inode
            elif op == "rename":
                moved = self._durable_names.pop(a, None)
                if moved is not None:
                    self._durable_names[b] = moved
            else:
                self._durable_names.pop(a, None)

    # ---- faults

    def crash(self) -> None:
        """Power loss: keeps what was durable plus a random part of what was not (see top)."""
        for d in sorted(self._pending):
            ops = self._pending[d]
            self._apply(ops[:self._rng.randint(0, len(ops))])
        self._pending.clear()
        seen: set[int] = set()
        for name in sorted(self._durable_names):
            inode = self._durable_names[name]
            if id(inode) in seen:
                continue
            seen.add(id(inode))
            inode.durable = self._torn(inode)
            inode.data = bytearray(inode.durable)
        self._names = dict(self._durable_names)
        self.epoch += 1
        self.crashes += 1

    def _torn(self, inode: _Inode) -> bytes:
        old, now = inode.durable, bytes(inode.data)
        if now.startswith(old):
            base = old
        elif self._rng.random() < 0.5:
            return old
        else:
            common = 0
            while common < min(len(old), len(now)) and old[common] == now[common]:
                common += 1
            base = now[:common]
        extra = now[len(base):]
        kept = base + extra[:self._rng.randint(0, len(extra))]
        if len(kept) < len(now) and len(kept) % BLOCK and self._rng.random() < 0.5:
            room = min(BLOCK - len(kept) % BLOCK, len(now) - len(kept))
            kept += self._rng.randbytes(self._rng.randint(1, room))
        return kept

    def corrupt(self, path: Path, offset: int) -> None:
        """Flips every bit of the byte at ``offset`` of ``path``, in memory and durably."""
        inode = self._names[_key(path)]
        inode.data[offset] ^= 0xFF
        if offset < len(inode.durable):
            durable = bytearray(inode.durable)
            durable[offset] ^= 0xFF
            inode.durable = bytes(durable)

    def size(self, path: Path) -> int:
        """The current size of file ``path``."""
        return len(self._names[_key(path)].data)
