"""The simulated disk's crash semantics, and the log recovering from every crash it makes."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from derecho_async.durability import Log, LogRecord
from derecho_async.testing.simdisk import SimDisk

ROOT = Path("/sim")


def test_a_crash_keeps_the_fsynced_bytes_and_a_prefix_of_the_rest() -> None:
    outcomes = set()
    for seed in range(60):
        disk = SimDisk(seed)
        disk.makedirs(ROOT)
        file = disk.open_append(ROOT / "f")
        file.write(b"durable.")
        file.fsync()
        disk.fsync_dir(ROOT)
        file.write(b"0123456789" * 10)
        disk.crash()
        got = disk.open_read(ROOT / "f").pread(0, 1000)
        assert got.startswith(b"durable.")
        rest, extra = got[8:], b"0123456789" * 10
        assert len(rest) <= len(extra)  # garbage only up to the size the file had reached
        if rest == extra:
            outcomes.add("all")
        elif extra.startswith(rest):
            outcomes.add("cut")
        else:
            outcomes.add("cut, then garbage")
    assert {"cut", "cut, then garbage"} <= outcomes


def test_a_create_without_a_directory_fsync_may_be_lost() -> None:
    survived = set()
    for seed in range(40):
        disk = SimDisk(seed)
        disk.makedirs(ROOT)
        file = disk.create(ROOT / "new")
        file.write(b"x")
        file.fsync()
        disk.crash()
        survived.add(disk.exists(ROOT / "new"))
    assert survived == {True, False}


def test_a_crash_replays_per_seed() -> None:
    def run(seed: int) -> list[bytes]:
        disk = SimDisk(seed)
        log = Log.open(ROOT / "log", fs=disk, segment_bytes=3000)
        for i in range(30):
            log.append([LogRecord((0, i), i, bytes([i]) * (i * 3))])
            if i == 10:
                log.sync()
        disk.crash()
        return [r.body for r in Log.open(ROOT / "log", fs=disk).read()]

    assert run(5) == run(5)
    assert len({len(run(seed)) for seed in range(10)}) > 1


def test_a_corrupted_middle_record_in_the_sim_is_reported() -> None:
    disk = SimDisk(1)
    with Log.open(ROOT, fs=disk) as log:
        for i in range(3):
            log.append([LogRecord((0, i), 0, b"abc")])
    (name,) = disk.listdir(ROOT)
    disk.corrupt(ROOT / name, 60)
    try:
        Log.open(ROOT, fs=disk)
    except Exception as exc:  # LogCorrupted, checked by name and offset
        assert (getattr(exc, "path", None), getattr(exc, "offset", None)) == (ROOT / name, 51)
    else:
        raise AssertionError("damage went unnoticed")


_STEP = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 6), st.integers(0, 300)),
    st.tuples(st.just("sync"), st.just(0), st.just(0)),
    st.tuples(st.just("view"), st.just(0), st.just(0)),
    st.tuples(st.just("trim"), st.integers(0, 100), st.just(0)),
    st.tuples(st.just("crash"), st.just(0), st.just(0)),
)


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), segment_bytes=st.sampled_from([200, 1000, 1 << 20]),
       steps=st.lists(_STEP, max_size=50))
def test_after_any_crash_the_log_holds_every_synced_record_and_is_a_prefix(
        seed: int, segment_bytes: int, steps: list[tuple[str, int, int]]) -> None:
    disk = SimDisk(seed)
    log = Log.open(ROOT / "log", fs=disk, segment_bytes=segment_bytes)
    history: list[LogRecord] = []   # what the log should hold, oldest first (trims aside)
    durable: tuple[int, int] | None = None   # the last durable_through that sync() returned
    trimmed: tuple[int, int] | None = None   # the greatest version trimmed through
    view, seq = 0, 0
    for op, a, b in [*steps, ("crash", 0, 0)]:
        if op == "append":
            batch = []
            for _ in range(a):
                batch.append(LogRecord((view, seq), seq * 1000, bytes([seq % 256]) * b))
                seq += 1
            log.append(batch)
            history.extend(batch)
        elif op == "sync":
            durable = log.sync()
            assert durable == (history[-1].version if history else None)
        elif op == "view":
            view, seq = view + 1, 0
        elif op == "trim" and history:
            through = history[min(a, len(history) - 1)].version
            log.trim(through)
            trimmed = max(trimmed or through, through)
        elif op == "crash":
            disk.crash()
            log = Log.open(ROOT / "log", fs=disk, segment_bytes=segment_bytes)  # never raises
            got = list(log.read())
            versions = [r.version for r in history]
            if got:  # a contiguous run of what was appended, bodies and times included
                start = versions.index(got[0].version)
                assert got == history[start:start + len(got)]
            else:
                start = len(history)
            kept_through = got[-1].version if got else None
            # every record that sync() reported durable is there, unless trimmed away
            must = [v for v in versions if (durable is not None and v <= durable)
                    and (trimmed is None or v > trimmed)]
            assert all(kept_through is not None and v <= kept_through for v in must)
            assert all(v >= versions[start] for v in must)
            assert log.durable_through == log.appended_through == kept_through
            history = got
            durable = kept_through
            if history:  # new versions continue above what survived
                view, seq = history[-1].version[0] + 1, 0
