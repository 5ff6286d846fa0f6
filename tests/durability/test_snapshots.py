"""Snapshots and checked atomic files: round trips, pruning, atomicity across a crash, damage."""

from __future__ import annotations

from pathlib import Path

import pytest

from derecho_async.durability import ReadFile, Snapshots, WriteFile, atomic_write, read_checked
from derecho_async.errors import LogCorrupted, UsageError
from derecho_async.testing.simdisk import SimDisk


def test_snapshots_round_trip_versions_and_prune(tmp_path: Path) -> None:
    snaps = Snapshots(tmp_path / "snaps")
    assert snaps.load_newest() is None and snaps.versions() == []
    snaps.write((1, 9), 111, b"first")
    snaps.write((2, 0), 222, b"")
    snaps.write((1, 10), 333, b"x" * 100_000)
    assert snaps.versions() == [(1, 9), (1, 10), (2, 0)]
    assert snaps.load_newest() == ((2, 0), 222, b"")
    snaps.prune(keep=2)
    assert Snapshots(tmp_path / "snaps").versions() == [(1, 10), (2, 0)]
    with pytest.raises(UsageError):
        snaps.prune(keep=0)
    with pytest.raises(UsageError):
        snaps.write((1, -1), 0, b"")


def test_a_damaged_newest_snapshot_is_an_error(tmp_path: Path) -> None:
    snaps = Snapshots(tmp_path)
    snaps.write((1, 1), 0, b"old")
    snaps.write((1, 2), 0, b"new state")
    newest = tmp_path / "0000000000000001-0000000000000002.snap"
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0x10
    newest.write_bytes(data)
    with pytest.raises(LogCorrupted) as caught:
        snaps.load_newest()
    assert caught.value.path == newest and "checksum" in caught.value.why
    newest.write_bytes(bytes(data[:-1]))
    with pytest.raises(LogCorrupted, match="holds"):
        snaps.load_newest()


def test_a_snapshot_renamed_to_another_version_is_an_error(tmp_path: Path) -> None:
    snaps = Snapshots(tmp_path)
    snaps.write((1, 1), 0, b"state")
    (tmp_path / "0000000000000001-0000000000000001.snap").rename(
        tmp_path / "0000000000000001-0000000000000005.snap")
    with pytest.raises(LogCorrupted, match="the name says"):
        snaps.load_newest()


def test_read_checked(tmp_path: Path) -> None:
    path = tmp_path / "view"
    assert read_checked(path) is None
    atomic_write(path, b"view 7")
    assert read_checked(path) == b"view 7"
    atomic_write(path, b"")
    assert read_checked(path) == b""
    assert not (tmp_path / "view.tmp").exists()
    for damaged in (b"", b"DAW1", b"XXXX" + path.read_bytes()[4:], path.read_bytes() + b"!"):
        path.write_bytes(damaged)
        with pytest.raises(LogCorrupted):
            read_checked(path)


class _Crash(Exception):
    pass


class _Stopping:
    """A SimDisk that stops (raises _Crash) at its ``stop_at``-th file operation, so that the
    disk can crash at every point of a write."""

    def __init__(self, disk: SimDisk, stop_at: int) -> None:
        self.disk = disk
        self.left = stop_at

    def step(self) -> None:
        if self.left == 0:
            raise _Crash
        self.left -= 1

    def makedirs(self, path: Path) -> None:
        self.step()
        self.disk.makedirs(path)

    def listdir(self, path: Path) -> list[str]:
        return self.disk.listdir(path)

    def exists(self, path: Path) -> bool:
        return self.disk.exists(path)

    def open_append(self, path: Path) -> WriteFile:
        self.step()
        return _StoppingFile(self, self.disk.open_append(path))

    def create(self, path: Path) -> WriteFile:
        self.step()
        return _StoppingFile(self, self.disk.create(path))

    def open_read(self, path: Path) -> ReadFile:
        return self.disk.open_read(path)

    def truncate(self, path: Path, length: int) -> None:
        self.step()
        self.disk.truncate(path, length)

    def rename(self, src: Path, dst: Path) -> None:
        self.step()
        self.disk.rename(src, dst)

    def remove(self, path: Path) -> None:
        self.step()
        self.disk.remove(path)

    def fsync_dir(self, path: Path) -> None:
        self.step()
        self.disk.fsync_dir(path)


class _StoppingFile:
    def __init__(self, fs: _Stopping, file: WriteFile) -> None:
        self.fs = fs
        self.file = file

    def write(self, data: bytes) -> None:
        self.fs.step()
        self.file.write(data[:len(data) // 2])
        self.fs.step()
        self.file.write(data[len(data) // 2:])

    def fsync(self) -> None:
        self.fs.step()
        self.file.fsync()

    def close(self) -> None:
        self.file.close()


@pytest.mark.parametrize("seed", range(5))
def test_a_snapshot_or_atomic_write_cut_by_a_crash_is_all_or_nothing(seed: int) -> None:
    root = Path("/sim")
    outcomes = set()
    for stop_at in range(14):
        disk = SimDisk(seed * 100 + stop_at)
        Snapshots(root / "snaps", fs=disk).write((1, 1), 5, b"old" * 2000)
        atomic_write(root / "view", b"view 1", fs=disk)
        stopping = _Stopping(disk, stop_at)
        finished = True
        try:
            Snapshots(root / "snaps", fs=stopping).write((1, 2), 6, b"new")
            atomic_write(root / "view", b"view 2", fs=stopping)
        except _Crash:
            finished = False
        outcomes.add(finished)
        disk.crash()
        newest = Snapshots(root / "snaps", fs=disk).load_newest()
        assert newest in (((1, 1), 5, b"old" * 2000), ((1, 2), 6, b"new")), stop_at
        assert read_checked(root / "view", fs=disk) in (b"view 1", b"view 2"), stop_at
        assert not any(n.endswith(".tmp") for n in disk.listdir(root / "snaps"))
        if finished:
            assert newest is not None and newest[0] == (1, 2)
            assert read_checked(root / "view", fs=disk) == b"view 2"
    assert outcomes == {False, True}, "stop points before and past the end of both writes"
