"""Durable actors through the public API, in one process (sim transport, real files)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import derecho_async as da
from derecho_async import wire
from derecho_async.durability import RealFs, Snapshots, WriteFile
from derecho_async.durability.records import HEADER

_ids = itertools.count()


class KV(da.Actor):
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    @da.ordered
    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    @da.ordered
    async def slow_put(self, key: str, value: bytes) -> None:
        await asyncio.sleep(0.002)
        self.data[key] = value

    @da.p2p
    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def snapshot(self) -> dict[str, bytes]:
        return dict(self.data)

    def restore(self, state: dict[str, bytes]) -> None:
        self.data = dict(state)


def cfg(group: str, member: int, data_dir: Path | None, n: int = 3, **kw: object) -> da.Config:
    return da.Config(group=group, member_id=member, initial_members=n, transport="sim",
                     heartbeat_ms=5, suspect_after_ms=500,
                     data_dir=None if data_dir is None else str(data_dir), **kw)  # type: ignore[arg-type]


async def join_all(name: str, data_dir: Path | None, n: int = 3, *, timeout: float = 10,
                   **kw: Any) -> list[da.Group]:
    """Members 0..n-1 of group ``name`` hosting KV, joined together (a restart when their
    files are there)."""
    return list(await asyncio.gather(*(
        da.Group.join(cfg(name, i, data_dir, n, **kw), actors=[KV], timeout=timeout)
        for i in range(n))))


async def start(data_dir: Path | None, n: int = 3, **kw: Any) -> list[da.Group]:
    return await join_all(f"d{next(_ids)}", data_dir, n, **kw)


def local(group: da.Group) -> KV:
    kv = group.local(KV)
    return kv


async def close(groups: list[da.Group]) -> None:
    for g in groups:
        await g.leave()


async def test_persisted_resolves_once_every_member_has_the_version_on_disk(
        tmp_path: Path) -> None:
    groups = await start(tmp_path)
    kv = groups[0].subgroup(KV)
    versions = [await kv.put.cast(f"k{i}", b"v%d" % i) for i in range(20)]
    await asyncio.wait_for(kv.persisted(versions[-1]), 5)
    frontier = kv.persisted_frontier
    assert frontier is not None and frontier >= versions[-1]
    for g in groups:  # every member's log holds all 20 calls, in order
        entries = [e async for e in g.subgroup(KV).history()]
        assert [e.version for e in entries] == versions
        assert [e.method for e in entries] == ["put"] * 20
        assert entries[3].args == ("k3", b"v3")
    await close(groups)


async def test_without_data_dir_the_durable_calls_say_what_is_missing() -> None:
    groups = await start(None, n=1)
    kv = groups[0].subgroup(KV)
    with pytest.raises(da.UsageError, match="data_dir"):
        await kv.persisted((0, 0))
    with pytest.raises(da.UsageError, match="data_dir"):
        kv.persisted_frontier  # noqa: B018
    await close(groups)


async def test_history_since_and_reads_by_version_and_time(tmp_path: Path) -> None:
    groups = await start(tmp_path)
    kv = groups[1].subgroup(KV)
    first = await kv.put.cast("a", b"1")
    await kv.persisted(first)
    t_mid = time.time()
    await asyncio.sleep(0.01)
    second = await kv.slow_put.cast("a", b"2")
    third = await kv.put.cast("b", b"3")
    await kv.persisted(third)
    later = [e.version async for e in kv.history(since=first)]
    assert later == [second, third]
    old = await kv.at_version(first)
    assert isinstance(old, KV) and old.data == {"a": b"1"}
    mid = await kv.at_version(second)
    assert isinstance(mid, KV) and mid.data == {"a": b"2"}
    at_t = await kv.at_time(t_mid)
    assert isinstance(at_t, KV) and at_t.data == {"a": b"1"}
    assert local(groups[1]).data == {"a": b"2", "b": b"3"}  # the live replica is untouched
    await close(groups)


async def test_snapshots_bound_the_log_and_reads_still_see_every_version(tmp_path: Path) -> None:
    groups = await start(tmp_path, snapshot_every=8)
    kv = groups[0].subgroup(KV)
    versions = [await kv.put.cast(f"k{i % 5}", b"%d" % i) for i in range(40)]
    await kv.persisted(versions[-1])
    snaps = sorted((tmp_path).glob("*/member-0/KV/snapshots/*.snap"))
    assert 1 <= len(snaps) <= 2
    state = await kv.at_version(versions[-1])
    assert isinstance(state, KV) and state.data == local(groups[0]).data
    await close(groups)


async def test_a_member_restarted_with_its_files_resumes_then_catches_up(tmp_path: Path) -> None:
    name = f"d{next(_ids)}"
    groups = await join_all(name, tmp_path)
    kv = groups[0].subgroup(KV)
    for i in range(10):
        v = await kv.put.cast(f"k{i}", b"x")
    await kv.persisted(v)
    await groups[2].leave()
    for i in range(10, 15):
        v = await kv.put.cast(f"k{i}", b"y")
    back = await da.Group.join(cfg(name, 2, tmp_path, 3), actors=[KV], timeout=10)
    groups[2] = back
    v = await kv.put.cast("last", b"z")
    await kv.persisted(v)
    states = [local(g).data for g in groups]
    assert states[0] == states[1] == states[2] and len(states[0]) == 16
    entries = [e async for e in back.subgroup(KV).history()]
    assert entries[-1].version == v
    await close(groups)


async def test_the_group_restarts_after_every_member_stopped(tmp_path: Path) -> None:
    name = f"d{next(_ids)}"
    groups = await join_all(name, tmp_path)
    kv = groups[1].subgroup(KV)
    for i in range(30):
        v = await kv.put.cast(f"k{i}", b"%d" % i)
    await kv.persisted(v)
    before = local(groups[0]).data
    for g in groups:  # one after the other: each member's last view differs
        await g.leave()
    groups = await join_all(name, tmp_path, timeout=20)
    assert all(local(g).data == before for g in groups)
    view = groups[0].view
    assert view.view_id >= 3 and sorted(view.members) == [0, 1, 2]
    kv = groups[2].subgroup(KV)
    v2 = await kv.put.cast("after", b"restart")
    await kv.persisted(v2)
    assert v2 > v
    assert all(local(g).data == {**before, "after": b"restart"} for g in groups)
    await close(groups)


@pytest.mark.parametrize("snapshot_every", [10000, 7])
async def test_a_restart_brings_every_member_to_the_longest_durable_log(
        tmp_path: Path, snapshot_every: int) -> None:
    name = f"d{next(_ids)}"
    groups = await join_all(name, tmp_path, snapshot_every=snapshot_every)
    kv = groups[2].subgroup(KV)
    for i in range(10):
        await kv.put.cast(f"a{i}", b"1")
    await groups[0].leave()  # member 0 (the contact) misses what follows
    for i in range(25):
        v = await kv.put.cast(f"b{i}", b"2")
    await kv.persisted(v)
    before = local(groups[2]).data
    await groups[1].leave()
    await groups[2].leave()
    groups = await join_all(name, tmp_path, timeout=20, snapshot_every=snapshot_every)
    assert [len(local(g).data) for g in groups] == [35, 35, 35]
    assert all(local(g).data == before for g in groups)
    history = [e.version async for e in groups[0].subgroup(KV).history()]
    assert history == sorted(history)
    if snapshot_every > 35:  # (else the suffix came as the source's snapshot)
        assert v in history  # the contact's own log now holds the suffix it was sent
    await close(groups)


async def test_a_restart_over_tcp_ships_the_suffix_between_members(tmp_path: Path) -> None:
    from derecho_async.launch import free_ports

    ports = free_ports(3)
    peers = {i: f"127.0.0.1:{p}" for i, p in enumerate(ports)}
    secret = da.new_secret()

    def tcp(i: int) -> da.Config:
        return da.Config(group="durable-tcp", member_id=i, initial_members=3, transport="tcp",
                         peers=peers, listen=peers[i], secret=secret,
                         heartbeat_ms=20, suspect_after_ms=1000, data_dir=str(tmp_path))

    groups = list(await asyncio.gather(*(da.Group.join(tcp(i), actors=[KV], timeout=20)
                                         for i in range(3))))
    kv = groups[1].subgroup(KV)
    await groups[0].leave()
    for i in range(20):
        v = await kv.put.cast(f"k{i}", b"%d" % i)
    await kv.persisted(v)
    before = local(groups[1]).data
    await groups[1].leave()
    await groups[2].leave()
    groups = list(await asyncio.gather(*(da.Group.join(tcp(i), actors=[KV], timeout=30)
                                         for i in range(3))))
    assert all(local(g).data == before for g in groups)
    await close(groups)


class Arrays(da.Actor):
    def __init__(self) -> None:
        self.sums: list[float] = []

    @da.ordered
    def add(self, x: object, blob: bytes) -> None:
        import numpy as np

        assert isinstance(x, np.ndarray)
        self.sums.append(float(x.sum()) + len(blob))

    def snapshot(self) -> list[float]:
        return list(self.sums)

    def restore(self, state: list[float]) -> None:
        self.sums = list(state)


async def test_out_of_band_arguments_are_logged_by_value_and_replayed(tmp_path: Path) -> None:
    import numpy as np

    name = f"d{next(_ids)}"

    def conf(i: int) -> da.Config:
        return cfg(name, i, tmp_path, 2)

    groups = list(await asyncio.gather(*(da.Group.join(conf(i), actors=[Arrays], timeout=10)
                                         for i in range(2))))
    h = groups[0].subgroup(Arrays)
    arrays = [np.full((300, 300), float(i), dtype=np.float32) for i in range(4)]
    for i, x in enumerate(arrays):  # large enough to travel out of band
        v = await h.add.cast(x, bytes([i]) * (1 << 17))
    await h.persisted(v)
    entries = [e async for e in groups[1].subgroup(Arrays).history()]
    assert [float(e.args[0].sum()) for e in entries] == [float(x.sum()) for x in arrays]
    assert all(isinstance(e.args[0], np.ndarray) and e.args[0].dtype == np.float32
               for e in entries)
    assert entries[2].args[1] == bytes([2]) * (1 << 17)
    state = list(groups[1].local(Arrays).sums)
    for g in groups:
        await g.leave()
    groups = list(await asyncio.gather(*(da.Group.join(conf(i), actors=[Arrays], timeout=10)
                                         for i in range(2))))
    assert all(g.local(Arrays).sums == state for g in groups)
    await close(groups)


async def test_the_contact_restarted_alone_joins_the_running_group(tmp_path: Path) -> None:
    name = f"d{next(_ids)}"
    groups = await join_all(name, tmp_path)
    kv = groups[1].subgroup(KV)
    await kv.put.cast("before", b"1")
    await groups[0].leave()  # the contact stops; the others go on
    v = await kv.put.cast("while away", b"2")
    await kv.persisted(v)
    groups[0] = await da.Group.join(cfg(name, 0, tmp_path, 3), actors=[KV], timeout=10)
    assert sorted(groups[0].view.members) == [0, 1, 2]
    assert local(groups[0]).data == local(groups[1]).data == {"before": b"1", "while away": b"2"}
    await close(groups)


class _StuckFsync:
    """A real file whose fsync waits until the test lets it go (a disk that stalls)."""

    def __init__(self, inner: object, gate: threading.Event, waiting: threading.Event) -> None:
        self._inner = inner
        self._gate = gate
        self.waiting = waiting  # set when an fsync waits at the closed gate

    def write(self, data: bytes) -> None:
        self._inner.write(data)  # type: ignore[attr-defined]

    def fsync(self) -> None:
        if not self._gate.is_set():
            self.waiting.set()
        self._gate.wait(30)
        self._inner.fsync()  # type: ignore[attr-defined]

    def close(self) -> None:
        self._inner.close()  # type: ignore[attr-defined]


class _StallingFs(RealFs):
    """The real file system, with the log's fsyncs held at a gate."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate
        self.waiting = threading.Event()  # an fsync waits at the closed gate

    def open_append(self, path: Path) -> WriteFile:
        return _StuckFsync(super().open_append(path), self.gate, self.waiting)


async def test_a_slow_disk_holds_back_persisted_not_delivery(tmp_path: Path) -> None:
    name = f"d{next(_ids)}"
    gate = threading.Event()
    gate.set()
    groups = list(await asyncio.gather(*(
        da.Group.join(cfg(name, i, tmp_path, 3), actors=[KV], timeout=10,
                      fs=_StallingFs(gate) if i == 2 else None) for i in range(3))))
    kv = groups[0].subgroup(KV)
    await kv.persisted(await kv.put.cast("warm", b"0"))
    gate.clear()  # member 2's disk stalls
    versions = [await kv.put.cast(f"k{i}", b"%d" % i) for i in range(20)]
    while len(local(groups[2]).data) < 21:  # delivered and applied at the slow member too
        await asyncio.sleep(0.005)
    waiting = asyncio.ensure_future(kv.persisted(versions[-1]))
    await asyncio.sleep(0.3)
    assert not waiting.done(), "persisted() must wait for the slow member's disk"
    frontier = kv.persisted_frontier
    assert frontier is not None and frontier < versions[0]
    gate.set()
    await asyncio.wait_for(waiting, 10)
    assert kv.persisted_frontier is not None and kv.persisted_frontier >= versions[-1]
    await close(groups)


async def test_under_load_flushes_wait_for_more_calls_and_a_quiet_member_does_not(
        tmp_path: Path) -> None:
    """Group commit under load: after a flush of many calls, member 0 (log_batch_ms=1000) waits
    before its next flush so that more calls share its fsync; a lone call after a quiet spell
    is flushed at once."""
    name = f"d{next(_ids)}"
    gate = threading.Event()
    gate.set()
    fs = _StallingFs(gate)
    groups = list(await asyncio.gather(*(
        da.Group.join(cfg(name, i, tmp_path, 3, log_batch_ms=1000.0 if i == 0 else 0.0),
                      actors=[KV], timeout=10, fs=fs if i == 0 else None) for i in range(3))))
    try:
        kv = groups[1].subgroup(KV)
        t0 = time.monotonic()
        await kv.persisted(await kv.put.cast("lone", b"0"))
        assert time.monotonic() - t0 < 0.5, "a lone call must not wait for company"
        gate.clear()  # member 0's next fsync stalls: calls pile up behind it
        await kv.put.cast("first", b"1")
        assert await asyncio.to_thread(fs.waiting.wait, 10)
        versions = [await kv.put.cast(f"k{i}", b"2") for i in range(99)]
        gate.set()  # one flush of 99 calls: load
        await asyncio.wait_for(kv.persisted(versions[-1]), 10)
        t0 = time.monotonic()
        await kv.persisted(await kv.put.cast("late", b"3"))
        waited = time.monotonic() - t0
        assert waited > 0.6, f"after a busy flush the next waited only {waited:.3f} s"
        await asyncio.sleep(1.1)  # quiet again
        t0 = time.monotonic()
        await kv.persisted(await kv.put.cast("quiet", b"4"))
        assert time.monotonic() - t0 < 0.5, "a lone call after a quiet spell must not wait"
        assert local(groups[0]).data == local(groups[2]).data and len(local(groups[0]).data) == 103
    finally:
        gate.set()
        await close(groups)


class _NotingFile:
    """A real log file that notes, at each fsync, the newest view of the records it made
    durable."""

    def __init__(self, inner: WriteFile, events: list[tuple[str, int]]) -> None:
        self._inner = inner
        self._events = events
        self._views: list[int] = []

    def write(self, data: bytes) -> None:
        at = 0
        while at + HEADER.size <= len(data):
            magic, _crc, length, _kind, _batch, view, _seq, _t = HEADER.unpack_from(data, at)
            assert magic == b"DLR1", "a log write that does not start on a record"
            self._views.append(view)
            at += HEADER.size + length
        self._inner.write(data)

    def fsync(self) -> None:
        self._inner.fsync()
        if self._views:
            self._events.append(("log", max(self._views)))
            self._views = []

    def close(self) -> None:
        self._inner.close()


class _NotingFs(RealFs):
    """The real file system, noting in order what became durable: log records (by view) and
    snapshots put in place (by the view of their label)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def open_append(self, path: Path) -> WriteFile:
        return _NotingFile(super().open_append(path), self.events)

    def rename(self, src: Path, dst: Path) -> None:
        super().rename(src, dst)
        if dst.suffix == ".snap":
            self.events.append(("snapshot", int(dst.name[:16], 16)))


async def test_a_joiner_logs_no_call_of_its_view_before_its_base_is_on_disk(
        tmp_path: Path) -> None:
    """A joiner's log must not hold calls of the view it joined before the state it joined
    with is durable: a crash in between would leave a log that claims those versions over a
    hole (every call before the view), and a restart would resume from it."""
    name = f"d{next(_ids)}"
    groups = await join_all(name, tmp_path, state_chunk_kb=16)
    kv = groups[0].subgroup(KV)
    await groups[2].leave()
    for i in range(8):  # a state that takes a while to move in 16 KiB chunks
        await kv.put.cast(f"big{i}", bytes([i]) * (1 << 20))
    stop = asyncio.Event()

    async def cast_on() -> None:
        i = 0
        while not stop.is_set():
            await kv.put.cast(f"during{i}", b"x")
            i += 1
            await asyncio.sleep(0.001)

    caster = asyncio.ensure_future(cast_on())
    fs = _NotingFs()
    try:
        groups[2] = await da.Group.join(cfg(name, 2, tmp_path, 3, state_chunk_kb=16),
                                        actors=[KV], timeout=20, fs=fs)
        joined_view = groups[2].view.view_id
        await asyncio.sleep(0.2)
    finally:
        stop.set()
        await caster
    v = await kv.put.cast("last", b"z")
    await kv.persisted(v)
    base = fs.events.index(("snapshot", joined_view))
    early = [e for e in fs.events[:base] if e[0] == "log" and e[1] >= joined_view]
    assert not early, f"calls of view {joined_view} were durable before the base: {fs.events}"
    assert any(e == ("log", joined_view) for e in fs.events[base:])
    assert local(groups[2]).data == local(groups[0]).data
    await close(groups)


async def test_a_member_restarted_with_its_files_gets_only_the_calls_it_missed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Behind by a few calls, a restarted member gets those calls from its sponsor's log, not a
    snapshot of the whole state, and ends with the same state."""
    name = f"d{next(_ids)}"
    groups = await join_all(name, tmp_path)
    kv = groups[0].subgroup(KV)
    for i in range(50):
        v = await kv.put.cast(f"k{i}", b"x" * 100)
    await kv.persisted(v)
    await groups[2].leave()
    missed = [await kv.put.cast(f"away{i}", b"y") for i in range(7)]
    caplog.set_level("INFO", logger="derecho_async.statexfer")
    groups[2] = await da.Group.join(cfg(name, 2, tmp_path, 3), actors=[KV], timeout=10)
    assert "KV as log suffixes" in caplog.text
    assert f"ran {len(missed)} calls of KV from log suffixes" in caplog.text
    v = await kv.put.cast("last", b"z")
    await kv.persisted(v)
    states = [local(g).data for g in groups]
    assert states[0] == states[1] == states[2] and len(states[0]) == 58
    await close(groups)
    # the base it wrote after running them holds them: a later restart starts from there
    newest = Snapshots(tmp_path / name / "member-2" / "KV" / "snapshots").load_newest()
    assert newest is not None
    base = wire.decode(newest[2])
    assert isinstance(base, dict) and {f"away{i}" for i in range(7)} <= set(base)


async def test_a_restarted_member_gets_a_snapshot_when_the_log_no_longer_reaches_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    name = f"d{next(_ids)}"
    groups = await join_all(name, tmp_path, snapshot_every=4)
    kv = groups[0].subgroup(KV)
    v = await kv.put.cast("first", b"1")
    await kv.persisted(v)
    await groups[2].leave()
    for i in range(40):  # several snapshots while it is away: the others' logs are trimmed
        await kv.put.cast(f"away{i % 9}", b"%d" % i)
    caplog.set_level("INFO", logger="derecho_async.statexfer")
    groups[2] = await da.Group.join(cfg(name, 2, tmp_path, 3, snapshot_every=4), actors=[KV],
                                    timeout=10)
    assert "log suffixes" not in caplog.text
    v = await kv.put.cast("last", b"z")
    await kv.persisted(v)
    assert local(groups[0]).data == local(groups[1]).data == local(groups[2]).data
    await close(groups)


async def test_every_member_logs_a_call_at_its_senders_clock(tmp_path: Path) -> None:
    """entry.time is one clock for the group: the sender's when it made the call, the same in
    every member's log, and at_time picks the same version everywhere."""
    groups = await start(tmp_path)
    sent: list[tuple[float, float]] = []
    versions = []
    for i in range(12):
        caller = groups[i % 3].subgroup(KV)
        before = time.time()
        versions.append(await caller.put.cast(f"k{i}", b"%d" % i))
        sent.append((before, time.time()))
        await asyncio.sleep(0.003)
    await groups[0].subgroup(KV).persisted(versions[-1])
    logs = [[e async for e in g.subgroup(KV).history()] for g in groups]
    times = [[e.time for e in log] for log in logs]
    assert times[0] == times[1] == times[2]
    for entry, (before, after) in zip(logs[0], sent, strict=True):
        assert before <= entry.time <= after, "the time is the sender's clock at the call"
    middle = (times[0][5] + times[0][6]) / 2
    at = [await g.subgroup(KV).at_time(middle) for g in groups]
    assert all(isinstance(a, KV) and a.data == {f"k{i}": b"%d" % i for i in range(6)}
               for a in at)
    await close(groups)
