"""Fenced, streamed state transfer (derecho_async.runtime.statexfer) through the public API.

A joiner's state comes from its sponsor at the cut, in chunks on the data planes; every way
the transfer fails makes the joiner's join raise GroupClosed naming why, and nobody else leaves.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

import derecho_async as da
from derecho_async.runtime.observer import GroupObserver
from derecho_async.runtime.statexfer import decode_ticket, encode_ticket
from derecho_async.runtime.statexfer.chunks import Stream, checksum
from derecho_async.testing.simnet import SimNetwork, crash_group
from derecho_async.testing.vloop import run_virtual
from derecho_async.wire import envelope as env
from tests.runtime.simgroups import cfg, close, group_name, settle, start


class Arrays(da.Actor):
    """A state of arrays, a large byte string and small nested values."""

    def __init__(self) -> None:
        self.w = np.zeros((0,), np.float32)
        self.ids = np.zeros((0,), np.int64)
        self.blob = b""
        self.meta: dict[str, object] = {}

    @da.ordered
    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.w = rng.standard_normal((300, 70)).astype(np.float32)
        self.ids = np.arange(5000, dtype=np.int64) * 3
        self.blob = rng.bytes((1 << 20) + 4321)  # out of band ("bytes" buffer)
        self.meta = {"name": "layer", "sizes": [1, 2, 3], "small": b"abc"}

    @da.ordered
    def bump(self) -> None:
        self.w += 1.0  # in place: the state sent must be the one at the cut

    @da.p2p
    def nothing(self) -> None:
        return None

    def snapshot(self) -> object:
        return {"w": self.w, "ids": self.ids, "blob": self.blob, "meta": self.meta}

    def restore(self, state: Any) -> None:
        self.w, self.ids = state["w"], state["ids"]
        self.blob, self.meta = state["blob"], state["meta"]


class Recorder(GroupObserver):
    def __init__(self) -> None:
        self.taken: list[tuple[int, int, int, Mapping[str, object]]] = []
        self.restored_: list[tuple[int, int, Mapping[str, object]]] = []

    def snapshot_taken(self, member: int, view_id: int, joiner: int,
                       state: Mapping[str, object]) -> None:
        self.taken.append((member, view_id, joiner, copy.deepcopy(dict(state))))

    def restored(self, member: int, view_id: int, state: Mapping[str, object]) -> None:
        # copied: restore hands these very objects to the actor, which changes them later
        self.restored_.append((member, view_id, copy.deepcopy(dict(state))))


def same(a: Arrays, b: Arrays) -> bool:
    return (np.array_equal(a.w, b.w) and a.w.dtype == b.w.dtype and np.array_equal(a.ids, b.ids)
            and a.blob == b.blob and a.meta == b.meta)


async def test_a_numpy_state_round_trips_in_many_small_chunks() -> None:
    rec = Recorder()
    name = group_name()
    groups = list(await asyncio.gather(*(
        da.Group.join(cfg(name, i, state_chunk_kb=4), actors=[Arrays], timeout=10,
                      observer=rec if i == 0 else None) for i in range(3))))
    h = groups[0].subgroup(Arrays)
    try:
        await h.fill(7)
        bumps = [h.bump.cast() for _ in range(5)]  # in flight at the cut, some of them
        joiner = await da.Group.join(cfg(name, 9, state_chunk_kb=4), actors=[Arrays],
                                     timeout=10, observer=rec)
        groups.append(joiner)
        await asyncio.gather(*bumps)
        await h.bump()
        replicas = [g.local(Arrays) for g in groups]
        await settle(lambda: all(same(r, replicas[0]) for r in replicas))
        a = replicas[0]
        assert isinstance(a, Arrays) and list(a.w.shape) == [300, 70]
        assert len(a.blob) == (1 << 20) + 4321
        # the observer saw the state at the cut at the sponsor and the same at the joiner
        assert len(rec.taken) == 1 and len(rec.restored_) == 1
        sponsor, view_id, who, taken = rec.taken[0]
        assert (sponsor, who) == (0, 9)
        assert (rec.restored_[0][0], rec.restored_[0][1]) == (9, view_id)
        got = rec.restored_[0][2]
        assert set(got) == set(taken) == {"Arrays"}
        st, sg = taken["Arrays"], got["Arrays"]
        assert isinstance(st, dict) and isinstance(sg, dict)
        assert np.array_equal(st["w"], sg["w"]) and st["blob"] == sg["blob"]
        assert st["meta"] == sg["meta"]
        xfer = groups[0]._xfer
        assert xfer is not None and not xfer.sponsor.transfers  # done and freed
    finally:
        await close(groups)


class Broken(da.Actor):
    @da.ordered
    def put(self, x: int) -> int:
        return x

    def snapshot(self) -> object:
        raise ValueError("disk on fire")


async def test_a_snapshot_that_raises_fails_the_join_by_name_and_nobody_else_leaves() -> None:
    name, gs = await start([Broken])
    try:
        await gs[0].subgroup(Broken).put(1)
        with pytest.raises(da.GroupClosed, match=r"Broken\.snapshot raised ValueError: disk on"):
            await da.Group.join(cfg(name, 5), actors=[Broken], timeout=10)
        await settle(lambda: all(g.view.members == (0, 1, 2) for g in gs))
        assert all(g._closed is None for g in gs)
        replies = await gs[1].subgroup(Broken).put(2)
        assert dict(replies) == {0: 2, 1: 2, 2: 2}
        # the joiner's view came and went; nobody else departed
        for g in gs:
            assert all(set(v.members) >= {0, 1, 2} for v in g.history)
    finally:
        await close(gs)


class Slow(da.Actor):
    def __init__(self) -> None:
        self.n = 0

    @da.ordered
    async def wait(self, s: float) -> None:
        await asyncio.sleep(s)
        self.n += 1

    def snapshot(self) -> object:
        return self.n

    def restore(self, state: Any) -> None:
        self.n = state


async def test_a_fence_not_reached_in_time_fails_the_join_and_the_sponsor_stays() -> None:
    name, gs = await start([Slow], fence_timeout_s=0.3)
    try:
        slow = gs[0].subgroup(Slow).wait.cast(2.0)  # holds every runner past the fence bound
        await slow
        with pytest.raises(da.GroupClosed, match=r"fence_timeout_s=0.3"):
            await da.Group.join(cfg(name, 5, fence_timeout_s=0.3), actors=[Slow], timeout=10)
        await settle(lambda: all(g.view.members == (0, 1, 2) for g in gs))
        await settle(lambda: all(g.local(Slow).n == 1 for g in gs))
        assert all(g._closed is None for g in gs)
    finally:
        await close(gs)


async def test_a_chunk_that_does_not_match_its_digest_fails_the_join() -> None:
    name, gs = await start([Arrays], state_chunk_kb=64)
    try:
        await gs[0].subgroup(Arrays).fill(3)
        for g in gs:
            xfer = g._xfer
            assert xfer is not None

            def corrupt(index: int, chunk: Any) -> Any:
                if index != 5:
                    return chunk
                bad = np.array(chunk, copy=True)
                bad[17] ^= 0xFF
                return bad

            xfer.chunk_hook = corrupt
        with pytest.raises(da.GroupClosed, match="sha256"):
            await da.Group.join(cfg(name, 5, state_chunk_kb=64), actors=[Arrays], timeout=10)
        await settle(lambda: all(g.view.members == (0, 1, 2) for g in gs))
        assert all(g._closed is None for g in gs)
    finally:
        await close(gs)


def test_the_envelope_rejects_malformed_manifests() -> None:
    good = [["skeleton", "uint8", [10], 10], ["numpy", "float32", [2, 3], 24]]
    msg = env.decode(env.encode(env.STATE_BEGIN, 1, 2, 4096, 34, good))
    assert msg[5] == good
    bad_parts: list[object] = [
        [["numpy", "float32", [2, 3], 24]],  # no skeleton first
        [["skeleton", "uint8", [10], 11]],  # size does not match the shape
        [["skeleton", "float32", [10], 40]],  # a skeleton is uint8
        [["skeleton", "uint8", [10], 10], ["pickle", "uint8", [1], 1]],
        [["skeleton", "uint8", [10], 10], ["numpy", "object", [1], 8]],
        [["skeleton", "uint8", [-1], -1]],
        [],
    ]
    for parts in bad_parts:
        with pytest.raises(da.ProtocolViolation):
            env.decode(env.encode(env.STATE_BEGIN, 1, 2, 4096, 34, parts))
    with pytest.raises(da.ProtocolViolation):
        env.decode(env.encode(env.STATE_ABORT, 1, "x" * 5000))
    assert decode_ticket(encode_ticket(77)) == 77
    for junk in (b"", b"\x93\x01\x02\x03", encode_ticket(1)[:-1], b"\xc0"):
        with pytest.raises(da.ProtocolViolation):
            decode_ticket(junk)


def test_chunks_cover_the_stream_exactly() -> None:
    rng = random.Random(5)
    for _ in range(400):
        sizes = [rng.randrange(0, 50) for _ in range(rng.randrange(1, 6))]
        chunk = rng.randrange(1, 40)
        alone = frozenset(p for p in range(len(sizes)) if rng.random() < 0.3)
        s = Stream(sizes, chunk, alone)
        seen = [0] * sum(sizes)
        for i in range(s.count):
            total = 0
            pieces = s.pieces(i)
            for part, off, at, n in pieces:
                assert at == total and off >= 0 and off + n <= sizes[part] and n > 0
                for k in range(n):
                    seen[s.starts[part] + off + k] += 1
                total += n
            assert total == s.length(i) <= chunk
            if any(p in alone for p, *_ in pieces):  # a device part's chunk is its own slice
                assert len(pieces) == 1
        assert all(c == 1 for c in seen)
        assert s.count <= max(1, -(-sum(sizes) // chunk) + 2 * len(alone))


def test_the_checksum_of_a_chunk_sees_every_byte_and_its_place() -> None:
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, (3 << 20) + 17, dtype=np.uint8)
    base = checksum(data)
    assert len(base) == 32 and checksum(data.copy()) == base
    flipped = data.copy()
    flipped[(2 << 20) + 5] ^= 1
    swapped = data.copy()
    swapped[[10, 11]] = swapped[[11, 10]] if data[10] != data[11] else (0, 1)
    zeros = np.zeros(1000, np.uint8)
    assert len({base, checksum(flipped), checksum(swapped), checksum(data[:-1]),
                checksum(zeros), checksum(zeros[:-1])}) == 6


# -- the sponsor crashes mid-transfer (SimNetwork, virtual time) ------------------------------


def sim_config(member: int) -> da.Config:
    return da.Config(group="sxsim", member_id=member, initial_members=3, transport="sim",
                     heartbeat_ms=50.0, suspect_after_ms=500.0, send_batch=0,
                     state_chunk_kb=4)


class Big(da.Actor):
    def __init__(self) -> None:
        self.a = np.zeros(0, np.uint8)

    @da.ordered
    def make(self, n: int) -> int:
        self.a = (np.arange(n, dtype=np.int64) % 251).astype(np.uint8)
        return int(self.a.sum())

    def snapshot(self) -> object:
        return self.a

    def restore(self, state: Any) -> None:
        self.a = state


async def sponsor_crash_scenario(seed: int) -> tuple[str, list[tuple[int, ...]]]:
    net = SimNetwork(random.Random(seed), max_delay_s=0.003)
    groups = list(await asyncio.gather(*(
        da.Group.join(sim_config(m), [Big], transport=net.transport(m), timeout=10.0)
        for m in range(3))))
    await groups[0].subgroup(Big).make(2 << 20)  # 512 chunks of 4 KiB
    joiner = da.Group(sim_config(3), [Big], transport=net.transport(3))
    joining = asyncio.ensure_future(joiner.start(timeout=10.0))

    def received() -> int:
        inc = joiner._xfer.joiner.incoming if joiner._xfer is not None else None
        return inc.done if inc is not None else 0

    while received() < 20:
        await asyncio.sleep(0.001)
    crash_group(net, groups[0])  # the sponsor (the leader, which welcomed the joiner)
    with pytest.raises(da.GroupClosed) as failed:
        await joining
    survivors = groups[1:]
    async with asyncio.timeout(30.0):
        while not all(g.view.members == (1, 2) for g in survivors):
            await asyncio.sleep(0.05)
    replies = await survivors[0].subgroup(Big).make(1000)
    assert set(replies) == {1, 2}
    views = [v.members for v in survivors[0].history]
    for g in survivors:
        await g.leave()
    await joiner.leave()
    return str(failed.value), views


def test_the_sponsor_crashing_mid_transfer_fails_the_join_and_the_others_go_on() -> None:
    reason, views = run_virtual(lambda: sponsor_crash_scenario(11), max_virtual_s=120.0)
    assert "sponsor, member 0, departed during the state transfer" in reason
    assert views[0] == (0, 1, 2) and views[-1] == (1, 2)
    assert all(1 in v and 2 in v for v in views)  # neither survivor ever left


# -- device arrays (CuPy): staged through host memory, chunked -----------------------------


def _gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return False


class Device(da.Actor):
    def __init__(self) -> None:
        self.x: Any = None

    @da.ordered
    def make(self, n: int) -> None:
        import cupy

        self.x = cupy.arange(n, dtype=cupy.float32).reshape(-1, 16)

    def snapshot(self) -> object:
        return {"x": self.x}

    def restore(self, state: Any) -> None:
        self.x = state["x"]


@pytest.mark.skipif(not _gpu(), reason="needs CuPy and a GPU")
async def test_a_cupy_state_arrives_as_a_cupy_array() -> None:
    import cupy

    name, gs = await start([Device], state_chunk_kb=64)
    try:
        await gs[0].subgroup(Device).make(1 << 20)
        joiner = await da.Group.join(cfg(name, 5, state_chunk_kb=64), actors=[Device],
                                     timeout=30)
        gs.append(joiner)
        got = joiner.local(Device).x
        assert isinstance(got, cupy.ndarray) and got.shape == ((1 << 20) // 16, 16)
        assert bool((got == gs[0].local(Device).x).all())
    finally:
        await close(gs)


@pytest.mark.skipif(not _gpu(), reason="needs CuPy and a GPU")
def test_the_device_checksum_equals_the_hostchecksum() -> None:
    import cupy

    rng = np.random.default_rng(4)
    for n in (0, 1, 4095, (5 << 20) + 3):
        host = rng.integers(0, 256, n, dtype=np.uint8)
        assert checksum(cupy.asarray(host)) == checksum(host)
