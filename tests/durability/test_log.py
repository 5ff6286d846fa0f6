"""The durable log on real files: round trips, segments, trim, recovery of torn tails and
detection of damage, group commit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from derecho_async.durability import Log, LogRecord, RealFs, WriteFile
from derecho_async.durability.records import HEADER
from derecho_async.errors import LogCorrupted, UsageError


def rec(view: int, seq: int, size: int = 20) -> LogRecord:
    return LogRecord((view, seq), 1_000 + seq, bytes([seq % 251]) * size)


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.log"))


def test_round_trip_and_reopen(tmp_path: Path) -> None:
    log = Log.open(tmp_path / "log")
    assert (log.appended_through, log.durable_through, log.first_version) == (None, None, None)
    records = [rec(0, i, size=i * 7) for i in range(10)]
    log.append(records[:3])
    assert log.appended_through == (0, 2)
    assert log.durable_through is None
    log.append(records[3:])
    assert log.sync() == (0, 9) == log.durable_through
    assert list(log.read()) == records
    assert list(log.read((0, 4))) == records[5:]
    log.close()
    with pytest.raises(UsageError):
        log.append([rec(0, 10)])
    again = Log.open(tmp_path / "log")
    assert list(again.read()) == records
    assert again.recovered.records == 10 and again.recovered.torn_bytes == 0
    assert (again.appended_through, again.durable_through, again.first_version) == (
        (0, 9), (0, 9), (0, 0))
    again.append([rec(1, 0)])
    again.close()
    assert [r.version for r in Log.open(tmp_path / "log").read()][-2:] == [(0, 9), (1, 0)]


def test_read_sees_appended_records_before_sync(tmp_path: Path) -> None:
    with Log.open(tmp_path) as log:
        log.append([rec(0, 0), rec(0, 1)])
        assert [r.version for r in log.read()] == [(0, 0), (0, 1)]
        assert log.durable_through is None


def test_versions_must_strictly_increase(tmp_path: Path) -> None:
    with Log.open(tmp_path) as log:
        log.append([rec(2, 5)])
        for bad in ([rec(2, 5)], [rec(2, 4)], [rec(1, 9)], [rec(2, 6), rec(2, 6)]):
            with pytest.raises(UsageError):
                log.append(bad)
        with pytest.raises(UsageError):
            log.append([LogRecord((2, -1), 0, b"")])
        with pytest.raises(UsageError):
            log.append([LogRecord((3, "0"), 0, b"")])  # type: ignore[arg-type]
        log.append([rec(3, 0)])  # a rejected batch wrote nothing
        assert [r.version for r in log.read()] == [(2, 5), (3, 0)]


def test_record_size_limit(tmp_path: Path) -> None:
    with Log.open(tmp_path, max_record_bytes=16) as log:
        with pytest.raises(UsageError):
            log.append([rec(0, 0, size=17)])
        log.append([rec(0, 0, size=16)])
        log.append([rec(0, 1, size=4)])
    # a length above the reader's limit is damage (here: followed by an intact later batch),
    # and is never allocated
    with pytest.raises(LogCorrupted, match="over the limit"):
        Log.open(tmp_path, max_record_bytes=8)


def test_segments_roll_and_trim(tmp_path: Path) -> None:
    log = Log.open(tmp_path, segment_bytes=200)
    for i in range(0, 40, 2):
        log.append([rec(0, i), rec(0, i + 1)])  # 2 x 68 bytes: a segment holds two batches
    names = [p.name for p in segments(tmp_path)]
    assert len(names) == 10 and names[1] == "0000000000000000-0000000000000004.log"
    assert log.durable_through == (0, 35)  # rolling made every earlier segment durable
    log.trim((0, 10))  # segments [0..3], [4..7], [8..11]: only the first two go
    assert log.first_version == (0, 8)
    log.trim((0, 39))  # durable through (0, 35) only, and never the last segment
    assert log.first_version == (0, 36)
    log.append([rec(1, 0)])  # the last segment is full: (1, 0) starts a new one
    log.sync()
    log.trim((9, 0))  # the last segment stays
    assert log.first_version == (1, 0)
    assert [r.version for r in log.read()] == [(1, 0)]
    log.close()
    again = Log.open(tmp_path, segment_bytes=200)
    assert again.first_version == (1, 0) and again.recovered.segments == 1
    again.append([rec(1, 1)])
    assert len(segments(tmp_path)) == 1
    again.close()


def test_read_since_skips_whole_segments(tmp_path: Path) -> None:
    with Log.open(tmp_path, segment_bytes=100) as log:
        for i in range(20):
            log.append([rec(i // 5, i % 5)])
        assert [r.version for r in log.read((3, 2))] == [(3, 3), (3, 4)]
        assert len(list(log.read((0, 0)))) == 19


def _build(directory: Path, last_batch: int = 1) -> tuple[list[LogRecord], int]:
    """Three batches of records, the last of ``last_batch`` records; returns the records and
    the offset of the last record."""
    records = [rec(0, i, size=30) for i in range(5 + last_batch)]
    with Log.open(directory) as log:
        log.append(records[:3])
        log.append(records[3:5])
        log.append(records[5:])
    size = HEADER.size + 30
    return records, size * (len(records) - 1)


def test_a_torn_tail_at_every_offset_of_the_last_record_is_dropped(tmp_path: Path) -> None:
    records, last = _build(tmp_path / "src")
    (src,) = segments(tmp_path / "src")
    whole = src.read_bytes()
    for cut in range(last, len(whole)):
        directory = tmp_path / f"cut{cut}"
        directory.mkdir()
        (directory / src.name).write_bytes(whole[:cut])
        log = Log.open(directory)
        assert list(log.read()) == records[:-1], cut
        assert log.recovered.torn_bytes == cut - last
        assert (log.recovered.torn_path is None) == (cut == last)
        assert (directory / src.name).stat().st_size == last  # cut off for good
        log.append([rec(1, 0)])
        log.close()
        assert [r.version for r in Log.open(directory).read()][-2:] == [(0, 4), (1, 0)]


def test_a_torn_tail_with_garbage_after_it_is_dropped(tmp_path: Path) -> None:
    records, last = _build(tmp_path)
    (seg,) = segments(tmp_path)
    whole = seg.read_bytes()
    seg.write_bytes(whole[:last + 10] + bytes(range(256)) * 8)
    log = Log.open(tmp_path)
    assert list(log.read()) == records[:-1]
    assert log.recovered.torn_bytes == 10 + 2048


def test_a_lone_torn_segment_is_removed(tmp_path: Path) -> None:
    with Log.open(tmp_path, segment_bytes=10) as log:
        log.append([rec(0, 0)])
        log.append([rec(0, 1)])
    second = segments(tmp_path)[1]
    second.write_bytes(second.read_bytes()[:HEADER.size - 1])
    log = Log.open(tmp_path, segment_bytes=10)
    assert log.recovered.removed == (second,) and not second.exists()
    assert [r.version for r in log.read()] == [(0, 0)]
    log.append([rec(0, 2)])
    log.close()
    assert [p.name[-6:] for p in segments(tmp_path)] == ["00.log", "02.log"]


def test_a_flipped_byte_in_a_middle_record_names_file_and_offset(tmp_path: Path) -> None:
    _build(tmp_path)
    (seg,) = segments(tmp_path)
    whole = seg.read_bytes()
    start, end = 3 * (HEADER.size + 30), 4 * (HEADER.size + 30)  # the 4th record, batch 2 of 3
    for at in range(start, end):
        damaged = bytearray(whole)
        damaged[at] ^= 0x01
        seg.write_bytes(damaged)
        with pytest.raises(LogCorrupted) as caught:
            Log.open(tmp_path)
        assert caught.value.path == seg and caught.value.offset == start, at
        assert str(seg) in str(caught.value)
    seg.write_bytes(whole)  # the damage was never "repaired" by truncation
    assert len(list(Log.open(tmp_path).read())) == 6


def test_a_flipped_byte_in_the_last_record_of_the_last_segment_is_a_torn_tail(
        tmp_path: Path) -> None:
    records, last = _build(tmp_path, last_batch=3)
    (seg,) = segments(tmp_path)
    whole = seg.read_bytes()
    last = len(whole) - (HEADER.size + 30)
    for at in range(last, len(whole), 7):
        damaged = bytearray(whole)
        damaged[at] ^= 0x80
        seg.write_bytes(damaged)
        log = Log.open(tmp_path)
        assert list(log.read()) == records[:-1], at
        log.close()
        seg.write_bytes(whole)


def test_damage_in_an_earlier_segment_is_never_a_torn_tail(tmp_path: Path) -> None:
    with Log.open(tmp_path, segment_bytes=10) as log:
        log.append([rec(0, 0)])
        log.append([rec(0, 1)])
    first = segments(tmp_path)[0]
    damaged = bytearray(first.read_bytes())
    damaged[-1] ^= 0x01
    first.write_bytes(damaged)
    with pytest.raises(LogCorrupted) as caught:
        Log.open(tmp_path)
    assert (caught.value.path, caught.value.offset, caught.value.why) == (
        first, 0, "checksum mismatch")
    first.write_bytes(bytes(damaged[:-5]))  # cut short: the last record of a non-last segment
    with pytest.raises(LogCorrupted, match="past the end"):
        Log.open(tmp_path)


def test_a_segment_whose_name_lies_is_damage(tmp_path: Path) -> None:
    with Log.open(tmp_path) as log:
        log.append([rec(0, 3)])
    (seg,) = segments(tmp_path)
    seg.rename(tmp_path / "0000000000000000-0000000000000002.log")
    with pytest.raises(LogCorrupted, match="the name says"):
        Log.open(tmp_path)


class _CountingFs(RealFs):
    """The real file system, counting the fsyncs of files."""

    def __init__(self) -> None:
        self.fsyncs = 0
        self._lock = threading.Lock()

    def open_append(self, path: Path) -> WriteFile:
        real = super().open_append(path)
        fs = self

        class Counted:
            def write(self, data: bytes) -> None:
                real.write(data)

            def fsync(self) -> None:
                with fs._lock:
                    fs.fsyncs += 1
                real.fsync()

            def close(self) -> None:
                real.close()

        return Counted()


def test_concurrent_syncs_share_fsyncs(tmp_path: Path) -> None:
    fs = _CountingFs()
    log = Log.open(tmp_path, fs=fs)
    opened_with = fs.fsyncs
    order = threading.Lock()
    counter = iter(range(1_000_000))
    acked: list[tuple[int, int]] = []
    threads, per_thread = 8, 40

    def worker() -> None:
        for _ in range(per_thread):
            with order:  # versions must reach the log in order
                version = (0, next(counter))
                log.append([LogRecord(version, 0, b"v" * 100)])
            through = log.sync()
            assert through is not None and through >= version
            acked.append(version)

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    syncs = threads * per_thread
    fsyncs = fs.fsyncs - opened_with
    assert len(acked) == syncs
    assert fsyncs < syncs, f"group commit: {syncs} syncs made {fsyncs} fsyncs"
    log.close()
    reopened = Log.open(tmp_path)
    assert [r.version for r in reopened.read()] == [(0, i) for i in range(syncs)]
