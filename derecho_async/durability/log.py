# Theory of operation
# -------------------
# A ``Log`` is a directory of segment files, each named by the version of its first record
# (``<view:016x>-<seq:016x>.log``) and holding records framed by records.py. Versions strictly
# increase over the whole log, so the names order the segments and a reader skips every segment
# whose successor starts at or below what it wants.
#
# Writing. ``append`` frames one batch (one ``batch`` number for all of its records) and writes it
# with one write to the last segment; nothing is fsynced. When the last segment has reached
# ``segment_bytes``, the batch goes to a new segment instead; the old one is fsynced (and the
# directory, for its name) before the new one is created, so only the last segment can ever hold
# data that is not durable. ``sync`` is the group commit: a caller notes how many batches were
# appended when it called, then takes the sync lock; if a sync that ran meanwhile already covered
# its batches it returns at once, otherwise it fsyncs the last segment (and the directory when a
# segment was created since the last sync), covering every batch appended up to then, its own and
# other threads'. Appends go on while an fsync runs: the sync lock and the state lock are apart.
# A write or fsync that fails leaves the log failed: every later call raises UsageError (the
# state of the file after a failed fsync is unknown; reopening recovers what is on disk).
#
# Recovery (``open``). The segments are scanned in order, each checked: valid framing, the first
# record's version equal to the name, versions increasing. A bad record in any but the last
# segment is ``LogCorrupted``. In the last segment a bad record followed, anywhere after it, by a
# valid record of a later batch than the last good one is ``LogCorrupted`` too: the damaged bytes
# were written before a batch that is still intact, so they are not a write cut short by a
# crash. Otherwise the bad record and everything after it is a torn tail: it is cut off (truncate
# and fsync, so new appends never follow garbage), and an emptied segment is removed. The rule
# errs on the loud side: if a crash of the whole machine (not just this process) wrote back a
# later unsynced batch and not an earlier one, recovery reports corruption rather than guess.
# What remains is then fsynced, so ``durable_through`` is true from the start.
#
# Trim removes whole segments, oldest first, that hold only records at or below both the given
# version and ``durable_through``, never the last segment; then fsyncs the directory.
"""The durable per-subgroup log: checksummed segment files with group commit and torn-tail
recovery."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from derecho_async.durability.files import Fs, RealFs, WriteFile
from derecho_async.durability.records import (
    Bad,
    LogRecord,
    Version,
    check_version,
    find_record,
    scan,
)
from derecho_async.errors import LogCorrupted, UsageError
from derecho_async.hotpath import frame_log_records, frame_log_runs

__all__ = ["Log", "Recovery", "segment_name"]

_SEGMENT = re.compile(r"^([0-9a-f]{16})-([0-9a-f]{16})\.log$")


def segment_name(first: Version) -> str:
    """The file name of a segment whose first record has version ``first``."""
    return f"{first[0]:016x}-{first[1]:016x}.log"


class Recovery(NamedTuple):
    """What ``Log.open`` found on disk."""

    records: int                 # valid records kept
    segments: int                # segment files kept
    torn_bytes: int              # bytes cut off the end of the last segment
    torn_path: Path | None       # the segment they were cut from (None: nothing torn)
    torn_why: str | None         # what was wrong with the first bad record of the torn tail
    removed: tuple[Path, ...]    # segments removed because the torn tail emptied them


@dataclass
class _Segment:
    path: Path
    first: Version
    last: Version
    size: int


class Log:
    """An append-only, checksummed log of ``LogRecord``s in one directory. See ``open``."""

    def __init__(self, directory: Path, fs: Fs, segment_bytes: int, max_record_bytes: int,
                 segments: list[_Segment], next_batch: int, recovered: Recovery) -> None:
        self._dir = directory
        self._fs = fs
        self._segment_bytes = segment_bytes
        self._max_record_bytes = max_record_bytes
        self._segments = segments
        self._lock = threading.Lock()        # the state below, and writes
        self._sync_lock = threading.Lock()   # one fsync at a time
        self._file: WriteFile | None = None  # the last segment, open for appending
        self._retired: list[WriteFile] = []  # earlier segments' files, fsynced, to close
        self._next_batch = next_batch
        self._durable_batch = next_batch - 1
        last = segments[-1].last if segments else None
        self._appended: Version | None = last
        self._durable: Version | None = last
        self._dir_dirty = False
        self._failed: BaseException | None = None
        self._closed = False
        self.recovered = recovered

    # ---- opening and recovery

    @classmethod
    def open(cls, directory: Path, *, fs: Fs | None = None, segment_bytes: int = 64 << 20,
             max_record_bytes: int = 1 << 30) -> Log:
        """Opens (creating if needed) the log in ``directory`` and recovers it: a torn tail is
        dropped; damage anywhere else raises ``LogCorrupted(path, offset, why)``."""
        fs = fs or RealFs()
        if segment_bytes < 1:
            raise UsageError(f"segment_bytes must be positive, got {segment_bytes}")
        if not 0 <= max_record_bytes <= 0xFFFFFFFF:
            raise UsageError(f"max_record_bytes must be in 0..2**32-1, got {max_record_bytes}")
        directory = Path(directory)
        if not fs.exists(directory):
            fs.makedirs(directory)
            fs.fsync_dir(directory.parent)
        names = []
        for name in fs.listdir(directory):
            m = _SEGMENT.match(name)
            if m:
                names.append(((int(m[1], 16), int(m[2], 16)), name))
        names.sort()
        segments: list[_Segment] = []
        last_version: Version | None = None
        last_batch = -1
        records = 0
        torn: tuple[Path, int, int, str] | None = None   # path, offset, size, why
        for i, (first, name) in enumerate(names):
            path = directory / name
            is_last = i == len(names) - 1
            seg = _Segment(path, first, first, 0)
            file = fs.open_read(path)
            try:
                size = file.size()
                for found in scan(file, 0, size, max_record_bytes):
                    if isinstance(found, Bad):
                        later = (find_record(file, found.offset + 1, size, max_record_bytes,
                                             last_batch) if is_last else None)
                        if not is_last or later is not None:
                            why = found.why if later is None else (
                                f"{found.why}; a valid record of a later batch follows at "
                                f"offset {later.offset}")
                            raise LogCorrupted(path, found.offset, why)
                        torn = (path, found.offset, size, found.why)
                        break
                    version = found.record.version
                    if found.offset == 0 and version != first:
                        raise LogCorrupted(path, 0, f"first record has version {version}, the "
                                                    f"name says {first}")
                    if last_version is not None and version <= last_version:
                        raise LogCorrupted(path, found.offset, f"version {version} does not "
                                           f"follow {last_version}")
                    if found.batch < last_batch:
                        raise LogCorrupted(path, found.offset, f"batch {found.batch} after "
                                                               f"batch {last_batch}")
                    last_version, last_batch = version, found.batch
                    seg.last, seg.size = version, found.end
                    records += 1
            finally:
                file.close()
            if seg.size == 0 and not is_last:
                raise LogCorrupted(path, 0, "empty segment before the last one")
            segments.append(seg)
        removed: list[Path] = []
        if segments:
            tail = segments[-1]
            if tail.size == 0:
                fs.remove(tail.path)
                removed.append(tail.path)
                segments.pop()
            elif torn is not None:
                fs.truncate(tail.path, tail.size)
            if segments:
                file_w = fs.open_append(segments[-1].path)
                try:
                    file_w.fsync()
                finally:
                    file_w.close()
            fs.fsync_dir(directory)
        recovered = Recovery(
            records=records, segments=len(segments),
            torn_bytes=0 if torn is None else torn[2] - torn[1],
            torn_path=None if torn is None else torn[0],
            torn_why=None if torn is None else torn[3], removed=tuple(removed))
        return cls(directory, fs, segment_bytes, max_record_bytes, segments, last_batch + 1,
                   recovered)

    # ---- state

    @property
    def durable_through(self) -> Version | None:
        """The last version known to be on stable storage."""
        with self._lock:
            return self._durable

    @property
    def appended_through(self) -> Version | None:
        """The last version appended (durable or not)."""
        with self._lock:
            return self._appended

    @property
    def first_version(self) -> Version | None:
        """The first record still in the log (None if the log is empty)."""
        with self._lock:
            return self._segments[0].first if self._segments else None

    def _check_usable(self) -> None:
        if self._closed:
            raise UsageError("the log is closed")
        if self._failed is not None:
            raise UsageError(f"the log failed earlier ({self._failed!r}); reopen it")

    # ---- writing

    def append(self, records: Iterable[LogRecord]) -> None:
        """Writes ``records`` as one batch to the OS (not durable until ``sync``). Versions must
        strictly increase over the whole log; UsageError otherwise."""
        batch = list(records)
        with self._lock:
            self._check_usable()
            if not batch:
                return
            try:  # checked, framed, checksummed and copied (natively: without the GIL)
                data = frame_log_records(batch, self._next_batch,  # type: ignore[arg-type]
                                         self._appended, self._max_record_bytes)
            except (TypeError, ValueError) as exc:
                raise UsageError(str(exc)) from None
            first, last = batch[0][0], batch[-1][0]
            self._write_batch(data, (first[0], first[1]), (last[0], last[1]))

    def append_delivered(self, runs: list[tuple[list[Any], int]], prefix: bytes) -> bool:
        """As :meth:`append`, for runs of delivered calls as the driver reports them (``(events,
        time_ns)``, each event a ``Delivered``): a record per call, its body ``prefix`` and the
        payload, framed without a Python object per record. False, and nothing written, when a
        payload is not bytes (append those as records)."""
        with self._lock:
            self._check_usable()
            try:
                data = frame_log_runs(runs, self._next_batch, self._appended,
                                      self._max_record_bytes, prefix)
            except (TypeError, ValueError) as exc:
                raise UsageError(str(exc)) from None
            if data is None:
                return False
            events = [ev for ev, _t in runs if ev]
            if events:
                first, last = events[0][0], events[-1][-1]
                self._write_batch(data, (first[2], first[3]), (last[2], last[3]))
            return True

    def _write_batch(self, data: bytes, first: Version, last: Version) -> None:
        """Writes one framed batch (under the state lock)."""
        try:
            seg = self._segments[-1] if self._segments else None
            if seg is None or seg.size >= self._segment_bytes:
                seg = self._roll(first)
            elif self._file is None:
                self._file = self._fs.open_append(seg.path)
            assert self._file is not None
            self._file.write(data)
        except BaseException as exc:
            self._failed = exc
            raise
        seg.size += len(data)
        seg.last = last
        self._appended = last
        self._next_batch += 1

    def _roll(self, first: Version) -> _Segment:
        """Starts a new last segment for ``first`` (under the state lock); the old one is made
        durable first, name and all, so only the last segment ever holds undurable data."""
        if self._file is not None:
            self._file.fsync()
            self._retired.append(self._file)
            self._file = None
        if self._segments:
            self._fs.fsync_dir(self._dir)
            self._durable = self._segments[-1].last
            self._durable_batch = self._next_batch - 1
        seg = _Segment(self._dir / segment_name(first), first, first, 0)
        self._file = self._fs.open_append(seg.path)
        self._segments.append(seg)
        self._dir_dirty = True
        return seg

    def sync(self) -> Version | None:
        """Makes every record appended before the call durable and returns ``durable_through``.
        Concurrent callers share fsyncs (group commit)."""
        with self._lock:
            self._check_usable()
            wanted = self._next_batch - 1
        with self._sync_lock:
            with self._lock:
                self._check_usable()
                if self._durable_batch >= wanted:
                    return self._durable
                file, dir_dirty, retired = self._file, self._dir_dirty, self._retired
                self._dir_dirty, self._retired = False, []
                covers, through = self._next_batch - 1, self._appended
            try:
                if file is not None:
                    file.fsync()
                if dir_dirty:
                    self._fs.fsync_dir(self._dir)
                for old in retired:
                    old.close()
            except BaseException as exc:
                with self._lock:
                    self._failed = exc
                raise
            with self._lock:
                if covers > self._durable_batch:
                    self._durable_batch, self._durable = covers, through
                return self._durable

    # ---- reading and trimming

    def read(self, since: Version | None = None) -> Iterator[LogRecord]:
        """The records with a version above ``since`` (all if None), in order: those appended
        when the call was made, durable or not, read back from the files."""
        with self._lock:
            self._check_usable()
            segments = [(s.path, s.first, s.size) for s in self._segments]
        return self._read(segments, since)

    def _read(self, segments: list[tuple[Path, Version, int]],
              since: Version | None) -> Iterator[LogRecord]:
        for i, (path, _first, size) in enumerate(segments):
            if since is not None and i + 1 < len(segments) and segments[i + 1][1] <= since:
                continue
            file = self._fs.open_read(path)
            try:
                for found in scan(file, 0, size, self._max_record_bytes):
                    if isinstance(found, Bad):
                        raise LogCorrupted(path, found.offset, found.why)
                    if since is None or found.record.version > since:
                        yield found.record
            finally:
                file.close()

    def trim(self, through: Version) -> None:
        """Removes the oldest segments whose every record is at or below ``through`` and
        durable; never the last segment."""
        through = check_version(through)
        with self._lock:
            self._check_usable()
            durable = self._durable
            if durable is None:
                return
            limit = min(through, durable)
            removed = 0
            while len(self._segments) > 1 and self._segments[0].last <= limit:
                self._fs.remove(self._segments[0].path)
                self._segments.pop(0)
                removed += 1
            if removed:
                self._fs.fsync_dir(self._dir)

    def close(self) -> None:
        """Syncs, then closes the files. Further calls raise UsageError."""
        if self._closed:
            return
        if self._failed is None:
            self.sync()
        with self._sync_lock, self._lock:
            for file in [*self._retired, *([self._file] if self._file else [])]:
                file.close()
            self._retired, self._file = [], None
            self._closed = True

    def __enter__(self) -> Log:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
