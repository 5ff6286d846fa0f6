"""The frontier a member acknowledged, kept apart from its log (durability/frontier.py), and the
repair of a member's damaged files (durability/repair.py): on the simulated disk, which loses
or tears what was not synced, and on real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from derecho_async.durability import Log, LogRecord, Snapshots
from derecho_async.durability.frontier import COMPACT_BYTES, Frontier
from derecho_async.durability.repair import repair_member
from derecho_async.errors import LogCorrupted
from derecho_async.testing.simdisk import SimDisk


def test_the_frontier_only_rises_and_survives_a_crash_once_recorded() -> None:
    disk = SimDisk(1)
    disk.makedirs(Path("/m/KV"))
    f = Frontier(Path("/m/KV/acked"), fs=disk)
    assert f.acked is None
    f.advance((0, 5))
    f.advance((0, 3))  # (lower: nothing written)
    f.advance((1, 0))
    disk.crash()
    assert Frontier(Path("/m/KV/acked"), fs=disk).acked == (1, 0)


def test_a_torn_last_record_is_ignored_and_damage_before_a_good_one_is_loud() -> None:
    disk = SimDisk(2)
    disk.makedirs(Path("/m"))
    path = Path("/m/acked")
    f = Frontier(path, fs=disk)
    for seq in range(3):
        f.advance((2, seq))
    f.close()
    w = disk.open_append(path)
    w.write(b"DAF1\x01\x02")  # a record cut short: never published
    w.close()
    again = Frontier(path, fs=disk)
    assert again.acked == (2, 2)
    again.advance((2, 7))  # starts clean past the torn record (the file is rewritten)
    again.advance((2, 8))
    again.close()
    assert Frontier(path, fs=disk).acked == (2, 8)
    disk.corrupt(path, 5)  # the first record damaged, a good one after it
    with pytest.raises(LogCorrupted):
        Frontier(path, fs=disk)
    assert Frontier.salvage(path, fs=disk) == (2, 8)


def test_a_long_file_is_compacted_to_its_last_record() -> None:
    disk = SimDisk(3)
    disk.makedirs(Path("/m"))
    f = Frontier(Path("/m/acked"), fs=disk)
    n = COMPACT_BYTES // 28 + 10
    for seq in range(n):
        f.advance((0, seq))
    f.close()
    size = disk.open_read(Path("/m/acked")).size()
    assert size < COMPACT_BYTES
    assert Frontier(Path("/m/acked"), fs=disk).acked == (0, n - 1)


def _member_files(root: Path, calls: int, acked: int) -> Path:
    sub = root / "member-0" / "KV"
    with Log.open(sub / "log", segment_bytes=4096) as log:
        for seq in range(calls):
            log.append([LogRecord((1, seq), seq, b"call %d" % seq * 10)])
        log.sync()
    Snapshots(sub / "snapshots")
    Frontier(sub / "acked").advance((1, acked))
    return root / "member-0"


def test_repair_cuts_the_log_at_the_damage_and_reports_the_gap(tmp_path: Path) -> None:
    member = _member_files(tmp_path, 200, 199)
    segments = sorted((member / "KV" / "log").glob("*.log"))
    assert len(segments) > 3
    damaged = segments[1]
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(LogCorrupted):
        Log.open(member / "KV" / "log")
    (report,) = repair_member(member)
    assert any("cut at offset" in c for c in report.cuts), report.cuts
    assert any("removed" in c for c in report.cuts), report.cuts  # the segments after it
    assert report.held is not None and report.held < (1, 199)
    assert report.acked == (1, 199) and report.gap
    with Log.open(member / "KV" / "log") as log:  # it opens now: a prefix of what it held
        assert [r.version for r in log.read()] == [(1, s) for s in range(report.held[1] + 1)]
    (again,) = repair_member(member, accept_loss=True)
    assert again.cuts == [] and again.gap and again.acked == again.held
    assert Frontier(member / "KV" / "acked").acked == report.held
    (clean,) = repair_member(member)
    assert not clean.gap
