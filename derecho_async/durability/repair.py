# Theory of operation
# -------------------
# A member whose files are damaged at rest does not start: its log raises ``LogCorrupted`` at
# the damaged record (log.py), rather than drop calls that may have been acknowledged. Its group
# goes on without it (a restart after total failure is planned by the lowest running member,
# api/restart.py), and ``repair_member`` (``derecho-async repair DIR``) mends its files so that
# it can come back: each subgroup's log is cut at the first damaged record (the segment
# truncated there, every later segment removed: what follows a hole cannot be replayed), a
# damaged newest snapshot is removed (and with it the whole subgroup's files when the log no
# longer reaches back past it), and a damaged frontier file is rewritten from its valid records.
# The member then holds a prefix of what it held, and gets the rest from the others when it
# rejoins. It reports, per subgroup, what was cut and how far the files reach against the
# frontier the member acknowledged; a restart after total failure refuses to go below that
# frontier unless ``accept_loss`` lowers it to what the files hold (the operator's decision
# that those calls are gone).
"""Mending a member's damaged files: cut at the damage, report what it leaves."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from derecho_async.durability.files import Fs, RealFs
from derecho_async.durability.frontier import Frontier
from derecho_async.durability.log import Log
from derecho_async.durability.records import MAX_U63, Version
from derecho_async.durability.snapshots import Snapshots
from derecho_async.errors import LogCorrupted, UsageError

__all__ = ["SubgroupRepair", "repair_member"]

_MAX_CUTS = 64  # damaged spots mended in one subgroup at most (each cut shortens the log)


@dataclass
class SubgroupRepair:
    """What :func:`repair_member` did to one subgroup's files and what they hold after."""

    name: str
    cuts: list[str] = field(default_factory=list)
    """One line per change: the file, the offset and the bytes cut, or the file removed."""
    held: Version | None = None
    """The last version the files now hold (log or snapshot)."""
    acked: Version | None = None
    """The frontier the member acknowledged (after ``accept_loss``, lowered to ``held``)."""
    gap: bool = False
    """Whether the files hold less than was acknowledged (before any ``accept_loss``)."""


def _held_by(label: Version) -> Version | None:
    """The last call a snapshot labelled ``label`` holds (labels are exclusive)."""
    view, seq = label
    if seq > 0:
        return (view, seq - 1)
    return (view - 1, MAX_U63) if view > 0 else None


def _cut_log(directory: Path, fs: Fs, report: SubgroupRepair) -> Log:
    """Open the log in ``directory``, cutting it at each damaged record until it opens."""
    for _ in range(_MAX_CUTS):
        try:
            return Log.open(directory, fs=fs)
        except LogCorrupted as exc:
            damaged = Path(exc.path)
            size = _size(fs, damaged)
            fs.truncate(damaged, exc.offset)
            report.cuts.append(f"{damaged}: cut at offset {exc.offset} ({size - exc.offset} "
                               f"bytes: {exc.why})")
            later = sorted(n for n in fs.listdir(directory)
                           if n.endswith(".log") and n > damaged.name)
            for name in later:
                report.cuts.append(f"{directory / name}: removed ({_size(fs, directory / name)}"
                                   " bytes after the damage)")
                fs.remove(directory / name)
            fs.fsync_dir(directory)
    raise UsageError(f"{directory}: still damaged after {_MAX_CUTS} cuts")


def _size(fs: Fs, path: Path) -> int:
    file = fs.open_read(path)
    try:
        return file.size()
    finally:
        file.close()


def _repair_subgroup(directory: Path, fs: Fs, accept_loss: bool) -> SubgroupRepair:
    report = SubgroupRepair(directory.name)
    log = _cut_log(directory / "log", fs, report)
    try:
        snapshots = Snapshots(directory / "snapshots", fs=fs)
        removed = False
        for label in reversed(snapshots.versions()):
            try:
                snapshots.load(label)
                break
            except LogCorrupted as exc:
                report.cuts.append(f"{exc.path}: removed ({exc.why})")
                fs.remove(Path(exc.path))
                fs.fsync_dir(directory / "snapshots")
                removed = True
        remaining = snapshots.versions()
        first = log.first_version
        base = remaining[-1] if remaining else (0, 0)
        if removed and first is not None and first > base:
            # the log starts after what the snapshot that is gone held: a hole, not replayable
            log.close()
            for name in fs.listdir(directory / "log"):
                fs.remove(directory / "log" / name)
            fs.fsync_dir(directory / "log")
            report.cuts.append(f"{directory / 'log'}: emptied (it starts at {first}, after the "
                               "removed snapshot's state)")
            log = Log.open(directory / "log", fs=fs)
        held = log.durable_through
        newest = _held_by(remaining[-1]) if remaining else None
        if newest is not None and (held is None or newest > held):
            held = newest
    finally:
        log.close()
    report.held = held
    try:
        frontier = Frontier(directory / "acked", fs=fs)
    except LogCorrupted as exc:
        salvaged = Frontier.salvage(directory / "acked", fs=fs)
        report.cuts.append(f"{exc.path}: rewritten from its valid records ({exc.why})")
        fs.remove(directory / "acked")
        frontier = Frontier(directory / "acked", fs=fs)
        frontier.reset(salvaged)
    report.acked = frontier.acked
    report.gap = frontier.acked is not None and (held is None or held < frontier.acked)
    if report.gap and accept_loss:
        frontier.reset(held)
        report.acked = held
    frontier.close()
    return report


def repair_member(member_dir: Path | str, *, accept_loss: bool = False,
                  fs: Fs | None = None) -> list[SubgroupRepair]:
    """Mend the files of the member in ``member_dir`` (``<data_dir>/<group>/member-<id>``):
    see the module header. One report per subgroup, in name order; :class:`UsageError` if the
    directory holds no member's files."""
    fs = fs or RealFs()
    root = Path(member_dir)
    if not fs.exists(root):
        raise UsageError(f"{root}: no such directory")
    subgroups = sorted(n for n in fs.listdir(root) if fs.exists(root / n / "log"))
    if not subgroups:
        raise UsageError(f"{root}: no member's files here (expected <data_dir>/<group>/"
                         "member-<id>, holding a directory per subgroup)")
    return [_repair_subgroup(root / name, fs, accept_loss) for name in subgroups]
