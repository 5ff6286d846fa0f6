"""Durable actors: this member's log of delivered calls, its snapshots, the persistence frontier.

Theory of operation (docs/DESIGN.md §7.12): with ``data_dir`` set, each hosted subgroup gets a
:class:`~derecho_async.durability.log.Log` and its
:class:`~derecho_async.durability.snapshots.Snapshots` under
``<data_dir>/<group>/member-<id>/<subgroup>/``. Each run of deliveries is kept as it is, on the
loop (a list append per run). A call stamped with its sender's clock (``wire.stamp_call``:
every durable member stamps the calls it makes) is logged at that time, the same at every
member; another at this member's clock when its run was delivered. One flush at a time runs in
the executor: it frames the runs as log records (natively, the GIL released; a call with
out-of-band arrays is encoded first, its arrays copied to host), appends, and syncs: one fsync
per subgroup per flush however many calls it holds (group commit). Back on the loop it raises
this member's ``persisted`` word in the shared-state table; the core reports the lowest word of
the shard's members as ``Persisted`` events, which move :attr:`Durable.frontier` and resolve
``persisted(version)``. Delivery never waits for the disk: the two frontiers are separate.
Under load (a flush of at least ``_BUSY_CALLS`` calls just ended) the next flush first waits
up to ``log_batch_ms``, or until ``_FULL_CALLS`` calls are waiting, so that more calls share
its fsync; after a quiet spell a call is flushed at once.

Snapshots are labelled with the version they run up to, exclusive: a snapshot labelled
``(v, s)`` holds every call before ``(v, s)`` and none after. One is taken through a hold in the
actor's runner (every call delivered before the hold has run, none after), every
``snapshot_every`` logged calls and when this member joins by state transfer (its *base*: it
publishes no mark before that base is durable, so a mark of 1 means the same everywhere:
everything before this view is on the disk). Once a snapshot is durable the log before it is
trimmed. A member that starts with files restores its newest snapshot and replays the log after
it into its actors before it joins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from derecho_async import wire
from derecho_async.api.delivery import Hosted
from derecho_async.api.logged_calls import (
    PLAIN,
    HistoryEntry,
    Logged,
    SuffixChunk,
    Version,
    decode_body,
    encode_body,
    entry_of,
    held_by,
    pack_records,
    replay,
    stamp_of,
    unpack_records,
)
from derecho_async.api.once import ClientCalls, restore_bytes, state_bytes
from derecho_async.durability import Fs, Log, LogRecord, Snapshots, atomic_write, read_checked
from derecho_async.durability.frontier import Frontier
from derecho_async.durability.records import MAX_U63
from derecho_async.errors import GroupClosed, UsageError

if TYPE_CHECKING:
    from derecho_async.api.actor import Actor
    from derecho_async.api.membership import Membership
    from derecho_async.config import Config
    from derecho_async.core import Delivered, Persisted, ViewInstalled

__all__ = ["Durable", "member_dir"]

log = logging.getLogger("derecho_async.durable")

_BUSY_CALLS = 64
"""A flush of at least this many calls means load: the next one waits for more calls."""
_FULL_CALLS = 512
"""A waiting flush starts at once when this many calls are waiting."""


def member_dir(config: Config) -> Path:
    """Where a member keeps its files: ``<data_dir>/<group>/member-<id>``."""
    if config.data_dir is None:
        raise UsageError("this group has no data_dir")
    return Path(config.data_dir) / config.group / f"member-{config.member_id}"


class _Subgroup:
    """One hosted subgroup's files, pending records and snapshot bookkeeping."""

    def __init__(self, name: str, hosted: Hosted, directory: Path, fs: Fs | None,
                 once: ClientCalls | None) -> None:
        self.name = name
        self.hosted = hosted
        self.once = once  # the subgroup's table of clients' calls (part of its state)
        self.directory = directory
        self.fs = fs
        self.log: Log | None = None
        self.snapshots = Snapshots(directory / "snapshots", fs=fs)
        self.pending: list[tuple[Version, int, object]] = []
        self.since_snapshot = 0
        self.snapshot_due = False
        self.durable: Version | None = None  # this member's log is durable through it
        self.frontier: Frontier | None = None  # what it acknowledged as durable (opened)
        self.applied: Version | None = None  # the last call its actor ran (restarting)


class Durable:
    """This member's durable state (see the module header): made by the Group when
    ``data_dir`` is set; the dispatcher calls :meth:`record`, the Group routes events."""

    def __init__(self, config: Config, state: Membership, hosted: dict[str, Hosted],
                 last_delivered: dict[str, Version], fs: Fs | None = None,
                 clock: Callable[[], int] = time.time_ns,
                 once: dict[str, ClientCalls] | None = None) -> None:
        self.root = member_dir(config)
        self._clock = clock
        self._fs = fs
        self._state = state
        self._snapshot_every = config.snapshot_every
        self._batch_s = config.log_batch_ms / 1000.0
        self._run_calls = 0  # calls in self._runs
        self._paced: asyncio.Future[None] | None = None  # set: a flush waits for more calls
        once = once or {}
        self._subs = {name: _Subgroup(name, h, self.root / name, fs, once.get(name))
                      for name, h in hosted.items()}
        self._last_delivered = last_delivered  # the p2p server's map (written per delivery run)
        self._flush: asyncio.Task[None] | None = None
        self._jobs: list[Callable[[], None]] = []  # file work for the next flush, in order
        self._view_id = -1
        self._view_dirty = False
        self._base_pending = False  # joined by state transfer: no mark before the base snapshot
        self.frontier: dict[str, Version | None] = dict.fromkeys(self._subs)
        """Per subgroup, the highest version known durable at every member of the view."""
        self._bound: dict[str, Version] = {}  # versions below it are durable everywhere
        self._prior: dict[str, Version | None] = {}  # last delivered before the current view
        self._base_marker: Callable[[], None] | None = None
        self._bases_left = 0
        self._view_job: Callable[[], None] | None = None  # a joiner's, written after its base
        self._lock = asyncio.Lock()  # one flush at a time: batches reach the log in order
        self._apply_lock = asyncio.Lock()  # one restart suffix chunk at a time
        self._runs: list[tuple[list[Delivered], int]] = []  # deliveries not yet flushed
        self._only = next(iter(self._subs.values())) if len(self._subs) == 1 else None
        self._waiters: dict[str, list[tuple[Version, asyncio.Future[None]]]] = {
            name: [] for name in self._subs}
        self.closed: BaseException | None = None
        self._crashed = False
        self._failed = False  # a write or fsync failed: no more flushes (the member leaves)

    # -- start ---------------------------------------------------------------------------------
    async def open(self) -> None:
        """Open (or create) the files and bring the actors to what they hold: the newest
        snapshot, then the log after it."""
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, self._open_files)
        for sub in self._subs.values():
            snap, records = found[sub.name]
            actor = sub.hosted.actor
            upto: Version | None = None
            if snap is not None:
                upto, _t, data = snap
                actor.restore(restore_bytes(data, sub.once))
            await replay(sub.hosted, records, upto, sub.once)
            sub.durable = sub.log.durable_through if sub.log is not None else None
        for name, version in self.durable_versions().items():
            self._subs[name].applied = version
        for name, (have, acked) in self.gaps().items():
            log.warning("member %d: %s: this member acknowledged calls up to %s as durable, but "
                        "its files hold them only up to %s: the calls after that are missing "
                        "here (another member's files must hold them; a restart after total "
                        "failure refuses to go on without them)", self._state.me, name, acked,
                        have)

    def _open_files(self) -> dict[str, tuple[tuple[Version, int, bytes] | None,
                                             list[LogRecord]]]:
        found = {}
        me = self._state.me
        for sub in self._subs.values():
            sub.log = Log.open(sub.directory / "log", fs=sub.fs)
            torn = sub.log.recovered
            if torn.torn_path is not None:
                log.warning("member %d: %s: cut a torn tail of %d bytes off %s (%s): a write a "
                            "crash cut short, never acknowledged", me, sub.name, torn.torn_bytes,
                            torn.torn_path, torn.torn_why)
            sub.frontier = Frontier(sub.directory / "acked", fs=sub.fs)
            snap = sub.snapshots.load_newest()
            since = held_by(snap[0]) if snap is not None else None
            found[sub.name] = (snap, list(sub.log.read(since)))
        return found

    def last_view(self) -> tuple[int, tuple[int, ...]] | None:
        """The last view this member installed, from its files (None: none recorded)."""
        data = read_checked(self.root / "view", fs=self._fs)
        if data is None:
            return None
        view = wire.decode(data)
        if not (isinstance(view, tuple | list) and len(view) == 2 and isinstance(view[0], int)
                and isinstance(view[1], tuple | list)):
            raise ValueError(f"{self.root / 'view'}: malformed view record")
        return view[0], tuple(int(m) for m in view[1])

    # -- the dispatcher's and the group's calls ------------------------------------------------
    def record(self, events: list[Delivered]) -> None:
        """A run of deliveries (before their handlers run): kept as it is (the driver makes a
        new list per run) for the next flush, which makes the log records off the loop."""
        if self.closed is not None:  # (out of the group, or the log failed: nothing to keep)
            return
        self._runs.append((events, self._clock()))
        self._run_calls += len(events)
        paced = self._paced
        if paced is not None and self._run_calls >= _FULL_CALLS:
            _resolve(paced)
        only = self._only
        if only is not None:  # (every delivery is its subgroup's: no walk over the run)
            self._count(only, len(events))
        else:
            for ev in events:
                sub = self._subs.get(ev[0])
                if sub is not None:
                    self._count(sub, 1)
        flush = self._flush
        if flush is None or flush.done():
            self._kick()

    def _count(self, sub: _Subgroup, calls: int) -> None:
        """``calls`` more logged calls of ``sub``: a snapshot once ``snapshot_every`` passed."""
        sub.since_snapshot += calls
        if sub.since_snapshot >= self._snapshot_every and not sub.snapshot_due:
            sub.snapshot_due = True
            asyncio.get_running_loop().call_soon(self._snapshot, sub)

    def on_view(self, ev: ViewInstalled) -> None:
        """A view was installed: record it, and mark again from 1 once it is on the disk."""
        self._view_id = ev.view.view_id
        self._view_dirty = True
        for name in self._subs:
            last = self._last_delivered.get(name)
            if last is not None and last[0] < ev.view.view_id:
                self._prior[name] = last
        members = list(ev.view.members)
        view_id = ev.view.view_id

        def write_view() -> None:
            atomic_write(self.root / "view", wire.encode([view_id, members]), fs=self._fs)

        if self._state.me in ev.joined and ev.state is not None:
            # a joiner's state arrives by state transfer: after the transfer's holds (queued
            # later in this step), a hold of ours takes it as the base snapshot; the view is
            # recorded only after it (a restart counts this member in the view only then)
            self._base_pending = True
            self._view_job = write_view
            asyncio.get_running_loop().call_soon(self._take_base)
        else:
            self._jobs.append(write_view)
        self._kick()

    def on_persisted(self, ev: Persisted) -> None:
        """The core saw the shard's lowest ``persisted`` word rise: every member of the view
        has the versions below ``bound`` durable."""
        name = ev.subgroup
        if name not in self._subs:
            return
        bound = (ev.view_id, ev.mark - 1)
        old = self._bound.get(name)
        if old is not None and bound <= old:
            return
        self._bound[name] = bound
        self.frontier[name] = (ev.view_id, ev.mark - 2) if ev.mark >= 2 else self._prior.get(name)
        waiters = self._waiters[name]
        keep = []
        for version, fut in waiters:
            if version < bound:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((version, fut))
        self._waiters[name] = keep

    def close(self, exc: BaseException) -> None:
        """This member is out of the group: waiters fail with ``exc``; files are synced and
        closed once the last flush is done."""
        if self.closed is None:
            self.closed = exc
        if self._paced is not None:
            _resolve(self._paced)
        for waiters in self._waiters.values():
            for _v, fut in waiters:
                if not fut.done():
                    fut.set_exception(exc)
            waiters.clear()

    def crash(self) -> None:
        """Stop dead, as a process crash would (simulation): nothing more is written."""
        self.close(GroupClosed("crashed"))
        self._crashed = True
        if self._flush is not None:
            self._flush.cancel()
        for sub in self._subs.values():
            sub.pending = []
            sub.log = None
            sub.frontier = None
        self._jobs = []
        self._runs = []
        self._run_calls = 0

    async def aclose(self) -> None:
        """Finish the flush under way and close the files."""
        if self._paced is not None:
            _resolve(self._paced)  # a flush waiting for more calls: there will be none
        task = self._flush
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        if not self._failed and (self._runs or self._jobs
                                 or any(s.pending for s in self._subs.values())):
            await self._flush_once()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._close_files)

    def _close_files(self) -> None:
        for sub in self._subs.values():
            if sub.frontier is not None:
                sub.frontier.close()
            if sub.log is not None:
                sub.log.close()
                sub.log = None

    # -- the subgroup handle's calls -----------------------------------------------------------
    def persisted(self, name: str, version: Version) -> asyncio.Future[None]:
        """A future set once every member of the view has ``name``'s log durable through
        ``version``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.closed is not None:
            fut.set_exception(self.closed)
            return fut
        bound = self._bound.get(name)
        if bound is not None and version < bound:
            fut.set_result(None)
        else:
            self._waiters[name].append((version, fut))
        return fut

    async def history(self, name: str, since: Version | None) -> AsyncIterator[HistoryEntry]:
        """The delivered calls of ``name`` after ``since`` that this member's log holds."""
        sub = self._subs[name]
        await self._flush_once()  # what was delivered before the call is in the log
        logfile = sub.log
        if logfile is None:
            raise GroupClosed("the log is closed")
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(None, lambda: list(logfile.read(since)))
        for rec in records:
            yield entry_of(rec.version, rec.time_ns, *decode_body(rec.body))

    async def at_version(self, name: str, version: Version) -> Actor:
        """A new replica of ``name``'s actor holding every call up to ``version`` (from the
        newest snapshot at or before it, and the log after that snapshot)."""
        sub = self._subs[name]
        await self._flush_once()
        logfile = sub.log
        if logfile is None:
            raise GroupClosed("the log is closed")

        def load() -> tuple[tuple[Version, int, bytes] | None, list[LogRecord]]:
            snap = None
            for upto in sorted(sub.snapshots.versions(), reverse=True):
                held = held_by(upto)
                if held is None or held <= version:
                    snap = sub.snapshots.load(upto)
                    break
            since = held_by(snap[0]) if snap is not None else None
            first = logfile.first_version
            if snap is None and first is not None and sub.snapshots.versions():
                raise UsageError(f"version {version} is older than the oldest snapshot kept")
            out = []
            for rec in logfile.read(since):
                if rec.version > version:
                    break
                out.append(rec)
            return snap, out

        snap, records = await asyncio.get_running_loop().run_in_executor(None, load)
        spec = sub.hosted.spec
        actor = spec.cls()
        upto = None
        once = ClientCalls()
        if snap is not None:
            upto = snap[0]
            actor.restore(restore_bytes(snap[2], once))
        await replay(Hosted(spec, sub.hosted.runner, actor, {}), records, upto, once)
        return actor

    async def at_time(self, name: str, t: float) -> Actor:
        """As :meth:`at_version`, for the last call logged at or before ``t``."""
        version = await self.version_at(name, t)
        if version is not None:
            return await self.at_version(name, version)
        sub = self._subs[name]
        if sub.snapshots.versions():
            raise UsageError(f"no state of {name} from before {t} is kept")
        return sub.hosted.spec.cls()

    async def version_at(self, name: str, t: float) -> Version | None:
        """The version of the last call of ``name`` logged at or before time ``t`` (its sender's
        stamp, or the delivery time here of a call without one), before the first after it."""
        sub = self._subs[name]
        await self._flush_once()
        logfile = sub.log
        if logfile is None:
            raise GroupClosed("the log is closed")
        t_ns = int(t * 1e9)

        def find() -> Version | None:
            found = None
            for rec in logfile.read(None):
                if rec.time_ns > t_ns:
                    break
                found = rec.version
            return found

        return await asyncio.get_running_loop().run_in_executor(None, find)

    # -- restart after total failure (api/restart.py) -----------------------------------------
    def acked_versions(self) -> dict[str, Version | None]:
        """Per subgroup, the highest version this member ever acknowledged as durable (its
        frontier file, kept apart from the log)."""
        return {name: sub.frontier.acked if sub.frontier is not None else None
                for name, sub in self._subs.items()}

    def gaps(self) -> dict[str, tuple[Version | None, Version]]:
        """The subgroups whose files hold less than this member acknowledged: name ->
        (what the files hold, what was acknowledged)."""
        have = self.durable_versions()
        out: dict[str, tuple[Version | None, Version]] = {}
        for name, acked in self.acked_versions().items():
            held = have[name]
            if acked is not None and (held is None or held < acked):
                out[name] = (held, acked)
        return out

    def durable_versions(self) -> dict[str, Version | None]:
        """Per subgroup, the last version this member holds durably (log or snapshot)."""
        out: dict[str, Version | None] = {}
        for name, sub in self._subs.items():
            through = sub.durable
            versions = sub.snapshots.versions()
            held = held_by(versions[-1]) if versions else None
            if held is not None and (through is None or held > through):
                through = held
            out[name] = through
        return out

    async def sync(self) -> None:
        """Flush what is pending and wait until it is durable."""
        await self._flush_once()

    async def suffix(self, name: str, since: Version | None,
                     chunk_bytes: int) -> AsyncIterator[SuffixChunk]:
        """This member's log of ``name`` after ``since``, in chunks of about ``chunk_bytes``;
        led by the newest snapshot when the log no longer reaches back to ``since``."""
        sub = self._subs.get(name)
        if sub is None or sub.log is None:
            yield SuffixChunk(None, [], True)
            return
        logfile = sub.log

        def load() -> tuple[tuple[Version, int, bytes] | None, list[LogRecord]]:
            snap = sub.snapshots.load_newest()
            held = held_by(snap[0]) if snap is not None else None
            if snap is not None and held is not None and (since is None or since < held):
                return snap, list(logfile.read(held))
            return None, list(logfile.read(since))

        snap, records = await asyncio.get_running_loop().run_in_executor(None, load)
        chunk: list[LogRecord] = []
        size = 0
        for rec in records:
            chunk.append(rec)
            size += len(rec.body)
            if size >= chunk_bytes:
                yield SuffixChunk(snap, chunk, False)
                snap, chunk, size = None, [], 0
        yield SuffixChunk(snap, chunk, True)

    def applied_versions(self) -> dict[str, Version | None]:
        """Per subgroup, the last call its actor holds (restarting: what its files held, and
        the suffixes applied since, durable or not yet)."""
        return {name: sub.applied for name, sub in self._subs.items()}

    async def apply_suffix(self, name: str, chunk: SuffixChunk) -> None:
        """Bring ``name``'s actor and log forward by a chunk of another member's log: only
        what its actor does not hold yet (a chunk may overlap what an earlier plan's source
        sent), one chunk at a time and never cut short."""
        await asyncio.shield(self._apply_suffix(name, chunk))  # (cancelled: it still ends)

    async def _apply_suffix(self, name: str, chunk: SuffixChunk) -> None:
        async with self._apply_lock:
            await self._apply_suffix_locked(name, chunk)

    async def _apply_suffix_locked(self, name: str, chunk: SuffixChunk) -> None:
        sub = self._subs.get(name)
        if sub is None:
            return
        held = held_by(chunk.snapshot[0]) if chunk.snapshot is not None else None
        if chunk.snapshot is not None and (sub.applied is None or (
                held is not None and held > sub.applied)):
            upto, t_ns, data = chunk.snapshot
            sub.hosted.actor.restore(restore_bytes(data, sub.once))

            def write_snapshot() -> None:
                sub.snapshots.write(upto, t_ns, data)
                held = held_by(upto)
                if sub.log is not None and held is not None:
                    sub.log.trim(held)

            self._jobs.append(write_snapshot)
            sub.durable = sub.applied = held
        have = sub.applied
        records = [r for r in chunk.records if have is None or r.version > have]
        await replay(sub.hosted, records, None, sub.once)
        if records:
            sub.applied = records[-1].version
        sub.pending.extend((r.version, r.time_ns, Logged(r.body)) for r in records)
        await self._flush_once()

    # -- a restarted member rejoining a running group (api/rejoin.py) ---------------------------
    async def log_suffix(self, name: str, since: Version, view_id: int, max_calls: int,
                         max_bytes: int) -> bytes | None:
        """At a sponsor whose runners are fenced for a joiner of view ``view_id``: the calls of
        ``name`` after ``since`` and before that view, packed; None when this log does not
        hold ``since`` itself, they are more than ``max_calls`` or ``max_bytes``, or the log
        is incomplete here (this member's own base is not yet written)."""
        sub = self._subs.get(name)
        if sub is None or sub.log is None or self._base_pending or self.closed is not None:
            return None
        await self._flush_once()  # every call delivered before the view is in the file now
        logfile = sub.log
        below = (since[0], since[1] - 1) if since[1] > 0 else (since[0] - 1, MAX_U63)

        def load() -> bytes | None:
            first = logfile.first_version
            if first is None or first > since:
                return None
            records: list[LogRecord] = []
            size = 0
            for rec in logfile.read(below):
                if not records and rec.version != since:
                    return None  # ``since`` is not a call this member delivered
                if rec.version[0] >= view_id:
                    break
                records.append(rec)
                size += len(rec.body)
                if len(records) > max_calls + 1 or size > max_bytes:
                    return None
            return pack_records(records[1:]) if records else None

        return await asyncio.get_running_loop().run_in_executor(None, load)

    async def replay_suffix(self, name: str, since: Version, data: bytes) -> int:
        """At a joiner: run the calls of ``name`` a sponsor sent as what this member's files
        lack (``since`` must be how far they reach); the number of calls. The base snapshot
        taken after the transfer makes them durable."""
        sub = self._subs.get(name)
        if sub is None:
            raise ValueError(f"a log suffix for {name!r}, which this member does not host")
        have = self.durable_versions().get(name)
        if have != since:
            raise ValueError(f"a log suffix of {name} after {since}, but this member's files "
                             f"reach {have}")
        records = await asyncio.get_running_loop().run_in_executor(
            None, unpack_records, data, since)
        await replay(sub.hosted, records, None, sub.once)
        return len(records)

    # -- flushing ------------------------------------------------------------------------------
    def _kick(self) -> None:
        if self._crashed or self._failed:
            return
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._flush_loop())

    def _holding_calls(self) -> bool:
        """A joiner whose base is not yet queued for the disk: its delivered calls wait, so
        that no call of its view is durable over the hole a crash before the base would
        leave (everything before the view)."""
        return self._base_pending and self._base_marker is None

    def _has_work(self) -> bool:
        return bool(self._jobs or self._view_dirty or (not self._holding_calls() and (
            self._runs or any(s.pending for s in self._subs.values()))))

    async def _flush_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self._has_work() and not self._failed:
            try:
                calls = await self._flush_once()
            except Exception:  # (reported once by _flush_locked: the member is leaving)
                return
            if calls >= _BUSY_CALLS and self._batch_s > 0 and self.closed is None:
                await self._pace(loop.time() + self._batch_s)

    async def _pace(self, deadline: float) -> None:
        """Under load: wait until ``deadline`` or until ``_FULL_CALLS`` calls wait."""
        if self._run_calls >= _FULL_CALLS:
            return
        loop = asyncio.get_running_loop()
        self._paced = paced = loop.create_future()
        timer = loop.call_at(deadline, _resolve, paced)
        try:
            await paced
        finally:
            timer.cancel()
            self._paced = None

    async def _flush_once(self) -> int:
        """Flush what is pending now; the number of delivered calls it wrote."""
        async with self._lock:
            return await self._flush_locked()

    async def _flush_locked(self) -> int:
        view_id = self._view_id
        self._view_dirty = False
        jobs, self._jobs = self._jobs, []
        batches: dict[str, list[tuple[Version, int, object]]] = {}
        runs: list[tuple[list[Delivered], int]] = []
        calls = 0
        if not self._holding_calls():  # (the base, if pending, is among these jobs)
            batches = {name: sub.pending for name, sub in self._subs.items() if sub.pending}
            for name in batches:
                self._subs[name].pending = []
            runs, self._runs = self._runs, []
            calls, self._run_calls = self._run_calls, 0
        loop = asyncio.get_running_loop()
        try:
            durable = await loop.run_in_executor(None, self._write, batches, runs, jobs)
        except Exception as exc:  # a disk error: the member cannot keep its promise
            self._disk_failed(exc)
            raise
        for name, through in durable.items():
            self._subs[name].durable = through
        if self._base_marker is not None and self._base_marker in jobs:
            self._base_marker = None
            self._base_pending = False
        self._publish(view_id)
        return calls

    def _write(self, batches: dict[str, list[tuple[Version, int, object]]],
               runs: list[tuple[list[Delivered], int]],
               jobs: list[Callable[[], None]]) -> dict[str, Version | None]:
        """In the executor: the file jobs, then each subgroup's records appended and synced."""
        for job in jobs:
            job()
        records: dict[str, list[LogRecord]] = {
            name: [LogRecord(v, t, encode_body(p)) for v, t, p in batch]
            for name, batch in batches.items()}
        only = self._only
        # the usual flush: one subgroup, calls of plain bytes, framed natively
        if (only is not None and runs and not records and only.log is not None
                and only.log.append_delivered(runs, PLAIN)):
            synced: dict[str, Version | None] = {only.name: only.log.sync()}
            self._acknowledge(synced)
            return synced
        for events, now in runs:  # else a record per call (arrays encoded, copied to host)
            for ev in events:
                if ev[0] in self._subs:
                    at = stamp_of(ev[6])
                    records.setdefault(ev[0], []).append(LogRecord(
                        (ev[2], ev[3]), now if at is None else at, encode_body(ev[6])))
        durable: dict[str, Version | None] = {}
        for name, batch in records.items():
            logfile = self._subs[name].log
            if logfile is None or not batch:
                continue
            logfile.append(batch)
            durable[name] = logfile.sync()
        self._acknowledge(durable)
        return durable

    def _acknowledge(self, durable: dict[str, Version | None]) -> None:
        """In the executor, before any of it is published: record how far each subgroup's
        files are durable now in its frontier file (the log's new point, or a snapshot's)."""
        for name, sub in self._subs.items():
            if sub.frontier is None:
                continue
            points = [v for v in (durable.get(name), sub.durable) if v is not None]
            if points:
                sub.frontier.advance(max(points))

    def _disk_failed(self, exc: BaseException) -> None:
        """A write or fsync failed (a full disk, a file size limit, an I/O error): this member
        can no longer make what it delivers durable, so it says so once and leaves the group,
        rather than hold every member's ``persisted()`` back (or log at every delivery)."""
        if self._failed or self._crashed:
            return
        self._failed = True
        reason = f"the durable log failed: {exc!r}"
        log.error("member %d: %s; leaving the group", self._state.me, reason)
        self.close(GroupClosed(reason))
        self._runs, self._run_calls = [], 0
        driver = self._state.driver
        if driver is not None and not driver.closed:
            driver.leave(reason)

    def _publish(self, view_id: int) -> None:
        """Raise this member's ``persisted`` words after a flush that began in view
        ``view_id``."""
        driver = self._state.driver
        if driver is None or driver.core is None or view_id != self._view_id:
            return
        if self._base_pending or self._view_dirty:
            return
        core = driver.core
        for sh in core.shards:
            if sh is None:
                continue
            sub = self._subs.get(sh.info.subgroup)
            if sub is None:
                continue
            through = sub.durable
            mark = through[1] + 2 if through is not None and through[0] == view_id else 1
            core.set_persisted(sh.info.index, mark)
        driver.kick()

    # -- snapshots -----------------------------------------------------------------------------
    def _upto(self, name: str) -> Version:
        """The label of a snapshot whose hold is queued now: after every call delivered."""
        last = self._last_delivered.get(name)
        if last is not None and last[0] >= self._view_id:
            return (last[0], last[1] + 1)
        return (self._view_id, 0)

    def _snapshot(self, sub: _Subgroup, base: bool = False) -> None:
        """Put a hold in ``sub``'s runner; when it is reached, snapshot the actor."""
        upto = self._upto(sub.name)

        def reached(release: Callable[[], None]) -> None:
            try:
                data = state_bytes(sub.hosted.actor.snapshot(), sub.once)
            except Exception as exc:
                log.warning("member %d: snapshot of %s failed: %r", self._state.me, sub.name,
                            exc)
                sub.snapshot_due = False
                release()
                return
            release()
            now = self._clock()

            def write() -> None:
                sub.snapshots.write(upto, now, data)
                held = held_by(upto)
                if sub.log is not None and held is not None:
                    sub.log.trim(held)
                sub.snapshots.prune()

            self._jobs.append(write)
            sub.since_snapshot = 0
            sub.snapshot_due = False
            if base:
                self._bases_left -= 1
                if self._bases_left == 0:
                    if self._view_job is not None:
                        self._jobs.append(self._view_job)
                        self._view_job = None
                    self._base_marker = marker = _base_written  # (a job of its own)
                    self._jobs.append(marker)
            self._kick()

        sub.hosted.runner.submit_hold(reached)

    def _take_base(self) -> None:
        self._bases_left = len(self._subs)
        if not self._subs:
            self._base_pending = False
            return
        for sub in self._subs.values():
            self._snapshot(sub, base=True)


def _base_written() -> None:
    """A job that does nothing: a flush that ran it has written the base snapshots."""


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
