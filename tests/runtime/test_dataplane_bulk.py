"""The bulk host data planes in groups over real shared memory and real sockets: large payloads
arrive intact and in order with small ones, the shm pool returns to empty, the numpy adapter's
flat layout round-trips, and a plane added first is offered every transfer. Each plane alone
(hostile frames, copies off the loop) is tested in test_shmplane.py and test_chainplane.py."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
from typing import Any

import numpy as np
import pytest

import derecho_async as da
from derecho_async.launch import free_ports
from derecho_async.runtime.chainplane import ChainPlane
from derecho_async.runtime.shmplane import ShmPlane
from derecho_async.transport.shm import ShmTransport

_ids = itertools.count()
SLOT = 256  # max_payload of these groups: anything longer is large


class Sink(da.Actor):
    """Records a digest of everything delivered, in order."""

    def __init__(self) -> None:
        self.log: list[str] = []

    @da.ordered
    def put(self, data: bytes) -> int:
        self.log.append("b:" + hashlib.sha256(data).hexdigest()[:16])
        return len(data)

    @da.ordered
    def arrays(self, tag: str, arrs: list[Any]) -> str:
        parts = [tag]
        for a in arrs:
            assert isinstance(a, np.ndarray) and a.flags.writeable
            native = a.astype(a.dtype.newbyteorder("="), copy=False).tobytes()
            parts.append(f"{a.dtype.name}{a.shape}:{hashlib.sha256(native).hexdigest()[:16]}")
        self.log.append("|".join(parts))
        return parts[-1]


def _configs(transport: str, n: int) -> list[da.Config]:
    name = f"bulk{os.getpid()}x{next(_ids)}"
    extra: dict[str, Any] = {}
    if transport == "tcp":
        ports = free_ports(n)
        extra["peers"] = {i: f"127.0.0.1:{p}" for i, p in enumerate(ports)}
        extra["secret"] = da.new_secret()
    out = []
    for i in range(n):
        fields = dict(extra)
        if transport == "tcp":
            fields["listen"] = extra["peers"][i]
        out.append(
            da.Config(
                group=name,
                member_id=i,
                initial_members=n,
                transport=transport,
                max_payload=SLOT,
                heartbeat_ms=50,
                suspect_after_ms=5000,
                **fields,
            )
        )
    return out


async def _form(transport: str, n: int) -> list[da.Group]:
    return list(
        await asyncio.gather(
            *(da.Group.join(c, actors=[Sink], timeout=20) for c in _configs(transport, n))
        )
    )


def _plane(g: da.Group) -> Any:
    driver = g._driver
    assert driver is not None
    (plane,) = driver.planes
    return plane


def _expected(value: object) -> str:
    if isinstance(value, bytes):
        return "b:" + hashlib.sha256(value).hexdigest()[:16]
    raise AssertionError


def _arrays(rng: np.random.Generator, scale: int) -> list[np.ndarray]:
    return [
        rng.integers(0, 255, size=scale, dtype=np.uint8),
        rng.standard_normal((scale // 64 + 1, 4)).astype(np.float32),
        rng.integers(-(1 << 40), 1 << 40, size=(3, scale // 256 + 1), dtype=np.int64),
        np.arange(7, dtype=np.float64)[::2],  # strided: copied in the plane, once
        np.arange(12, dtype=">i4").reshape(3, 4),  # big-endian: swapped on the way
        np.zeros((0, 5), np.complex64),
        np.array(True),
    ]


@pytest.mark.parametrize("transport,n", [("shm", 3), ("shm", 5), ("tcp", 3), ("tcp", 5)])
async def test_large_payloads_arrive_intact_in_order_with_small_ones(transport: str, n: int) -> None:
    groups = await _form(transport, n)
    name = groups[0].config.group
    plane_type = ShmPlane if transport == "shm" else ChainPlane
    assert all(isinstance(_plane(g), plane_type) for g in groups)
    rng = np.random.default_rng(7)
    try:
        sizes = [SLOT + 1, 4096, 1 << 20, (1 << 20) + 3, 3 << 20, 20 << 20]
        calls = []
        for k, size in enumerate(sizes):
            g = groups[k % n]
            h = g.subgroup(Sink)
            calls.append(h.put(rng.bytes(size)))
            calls.append(h.put(b"small %d" % k))  # interleaved small messages
            calls.append(h.arrays(f"a{k}", _arrays(rng, size // 8)))
        replies = await asyncio.gather(*calls)
        assert all(len(r) == n and not any(isinstance(v, BaseException) for v in r.values())
                   for r in replies)
        assert sum(_plane(g).sent for g in groups) == 2 * len(sizes)
        assert all(_plane(g).landed == 2 * len(sizes) - 2 * len(sizes[g.member_id :: n])
                   for g in groups)
        logs = [g.local(Sink).log for g in groups]
        assert len(logs[0]) == 3 * len(sizes)
        assert all(lg == logs[0] for lg in logs)
        if transport == "shm":
            await asyncio.sleep(0.1)
            for g in groups:
                plane = _plane(g)
                assert plane.outstanding == {} and plane.pool.in_use == 0
    finally:
        for g in groups:
            await g.leave()
    assert ShmTransport.segments(name) == []


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_a_member_that_cannot_buffer_a_large_message_leaves_and_the_sender_stays(
    transport: str,
) -> None:
    """A receiver that cannot allocate the buffer for a valid large message (an injected
    MemoryError at member 2) is at fault itself: it leaves and says why, and the sender and the
    relay stay in the group, deliver the message and go on. Blaming the sender would evict a
    healthy member; doing nothing would leave the message unstable for good."""
    groups = await _form(transport, 3)
    rng = np.random.default_rng(11)

    def no_memory(nbytes: int) -> Any:
        raise MemoryError(f"injected: no room for {nbytes} bytes")

    _plane(groups[2]).buffers.take = no_memory
    try:
        first = await asyncio.wait_for(groups[0].subgroup(Sink).arrays("a", _arrays(rng, 4096)), 20)
        assert first[0] == first[1] and isinstance(first[0], str), first
        assert set(first) == {0, 1} or isinstance(first[2], da.MemberFailed), first
        after = await asyncio.wait_for(groups[1].subgroup(Sink).put(b"after"), 20)
        assert set(after) == {0, 1} and groups[0].view.members == (0, 1)
        with pytest.raises(da.GroupClosed, match="could not be taken in here: MemoryError"):
            await groups[2].subgroup(Sink).put(b"from the departed")
        logs = [g.local(Sink).log for g in groups[:2]]
        assert logs[0] == logs[1] and len(logs[0]) == 2
    finally:
        for g in groups:
            with contextlib.suppress(da.GroupClosed):
                await g.leave()


async def test_array_contents_survive_the_trip() -> None:
    for transport in ("shm", "tcp"):
        groups = await _form(transport, 3)
        try:
            rng = np.random.default_rng(1)
            sent = _arrays(rng, 100_000)
            expect = "|".join(
                ["x"]
                + [
                    f"{a.dtype.name}{a.shape}:"
                    + hashlib.sha256(a.astype(a.dtype.newbyteorder("=")).tobytes()).hexdigest()[
                        :16
                    ]
                    for a in sent
                ]
            )
            await groups[1].subgroup(Sink).arrays("x", sent)
            for g in groups:
                assert g.local(Sink).log == [expect]
        finally:
            for g in groups:
                await g.leave()


# -- the pool ---------------------------------------------------------------------------------


async def test_the_pool_returns_to_empty_after_many_messages_from_every_sender() -> None:
    groups = await _form("shm", 3)
    name = groups[0].config.group
    rng = np.random.default_rng(3)
    try:
        sizes = [SLOT + 1, 5000, 70_000, 1 << 20, (2 << 20) + 17]
        calls = []
        for k in range(120):
            h = groups[k % 3].subgroup(Sink)
            size = sizes[k % len(sizes)]
            if k % 2:
                calls.append(h.put(rng.bytes(size)))
            else:
                calls.append(h.arrays(str(k), [rng.integers(0, 9, size // 4, dtype=np.int32)]))
        await asyncio.gather(*calls)
        logs = [g.local(Sink).log for g in groups]
        assert len(logs[0]) == 120 and logs[0] == logs[1] == logs[2]
        for g in groups:
            plane = _plane(g)
            assert plane.sent == 40
            assert plane.outstanding == {}, "regions not freed after delivery"
            assert plane.pool.in_use == 0
            assert len(plane.pool.segments) == 1  # one 64 MiB segment, reused throughout
            (seg,) = plane.pool.segments
            assert plane.pool._free == [[(0, seg.capacity)]]  # coalesced back into one range
    finally:
        for g in groups:
            await g.leave()
    assert ShmTransport.segments(name) == []


# -- the numpy adapter: flat layout and receive buffers ----------------------------------------


def test_flat_layout_round_trips_arrays_of_every_kind() -> None:
    import gc

    from derecho_async.runtime.dataplane import (
        OutOfBand,
        RecvBuffers,
        flat_layout,
        flat_meta,
        read_flat,
        write_flat,
    )

    rng = np.random.default_rng(5)
    arrays: tuple[np.ndarray[Any, Any], ...] = (
        rng.standard_normal((300, 7)).astype(np.float64),
        np.arange(24, dtype=">u2").reshape(2, 3, 4),  # big-endian
        np.arange(40, dtype=np.int8)[::3],  # strided
        rng.standard_normal((50, 50)).astype(np.float32).T,  # Fortran order
        np.zeros((4, 0), np.complex128),
        np.array(3.5, np.float16),  # 0-d
        np.ones(1 << 19, np.bool_),
    )
    oob = OutOfBand(b"call bytes", arrays)
    meta = flat_meta(oob)
    assert meta is not None
    layout = flat_layout(meta)
    assert [off % 64 for off, *_ in layout.arrays] == [0] * len(arrays)
    flat = bytearray(layout.total)
    write_flat(oob, layout, memoryview(flat))
    buffers = RecvBuffers(min_bytes=4096)
    got = read_flat(flat_layout(meta), bytes(flat), buffers)
    assert isinstance(got, OutOfBand) and got.call == b"call bytes"
    for sent, back in zip(arrays, got.arrays, strict=True):
        assert isinstance(back, np.ndarray) and back.flags.writeable
        assert back.dtype == sent.dtype.newbyteorder("=") and back.shape == sent.shape
        np.testing.assert_array_equal(back, sent)
    # the receive buffer returns to the free list once every array over it is gone, and the
    # next message of that size reuses it instead of mapping fresh memory
    assert buffers.created == 1 and buffers.kept == 0
    del got, back
    gc.collect()
    assert buffers.kept > 0
    read_flat(flat_layout(meta), bytes(flat), buffers)
    assert buffers.created == 1
    # plain bytes: the bytes themselves; device-only or unsupported payloads are not flat
    assert read_flat(flat_layout(flat_meta(b"xyz")), b"xyz") == b"xyz"
    assert flat_meta(OutOfBand(b"", (np.zeros(2, dtype=[("a", "i4")]),))) is None
    assert flat_meta(object()) is None


# -- the routing hook (where a GPU plane plugs in) ---------------------------------------------


class _Declining:
    """A plane that takes nothing: it sees every offer, own delivery and event."""

    kinds: tuple[int, ...] = ()

    def __init__(self) -> None:
        self.offers: list[tuple[int, int, int]] = []
        self.own_delivered: list[tuple[int, int, int]] = []
        self.views: list[int] = []

    def start(self, key: tuple[int, int, int], payload: object, targets: tuple[int, ...]) -> bool:
        self.offers.append(key)
        return False

    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        raise AssertionError("no frames of mine")

    def on_own_delivered(self, key: tuple[int, int, int]) -> None:
        self.own_delivered.append(key)

    def on_event(self, event: object) -> None:
        from derecho_async.core import ViewInstalled

        if isinstance(event, ViewInstalled):
            self.views.append(event.view.view_id)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("transport", ["sim", "shm"])
async def test_a_plane_added_first_is_offered_every_transfer_before_the_others(
    transport: str,
) -> None:
    if transport == "sim":
        name = f"hook{os.getpid()}x{next(_ids)}"
        configs = [
            da.Config(group=name, member_id=i, initial_members=3, transport="sim", max_payload=SLOT)
            for i in range(3)
        ]
    else:
        configs = _configs("shm", 3)
    groups = list(
        await asyncio.gather(*(da.Group.join(c, actors=[Sink], timeout=20) for c in configs))
    )
    try:
        hooks = []
        for g in groups:
            assert g._driver is not None
            hook = _Declining()
            g._driver.add_plane(hook, first=True)
            hooks.append(hook)
        await groups[1].subgroup(Sink).put(b"y" * 1000)
        await groups[1].subgroup(Sink).arrays("z", [np.arange(100)])  # 800 bytes: large
        await groups[1].subgroup(Sink).put(b"small")
        await groups[1].subgroup(Sink).arrays("s", [np.arange(10)])  # fits the slot: inline
        # offered the two large messages; told of every own delivery (the freeing points)
        assert hooks[1].offers == [(0, 1, 0), (0, 1, 1)]
        assert hooks[1].own_delivered == [(0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3)]
        assert hooks[0].offers == [] and hooks[2].offers == []
        logs = [g.local(Sink).log for g in groups]
        assert len(logs[0]) == 4 and logs[0] == logs[1] == logs[2]  # the next plane moved them
    finally:
        for g in groups:
            await g.leave()


class Blob(da.Actor):
    """A large state: moved to joiners in many chunks."""

    def __init__(self) -> None:
        self.data = b""

    @da.ordered
    def fill(self, n: int) -> int:
        self.data = np.random.default_rng(n).bytes(n)
        return len(self.data)

    def snapshot(self) -> bytes:
        return self.data

    def restore(self, state: bytes) -> None:
        self.data = state


def _chunked_config(group: str, member: int) -> da.Config:
    """A member of a shm group whose state travels in 64 KiB chunks."""
    return da.Config(group=group, member_id=member, initial_members=1, transport="shm",
                     state_chunk_kb=64, heartbeat_ms=50, suspect_after_ms=5000)


async def test_joiners_one_after_another_get_their_state_over_shm_and_the_pool_empties() -> None:
    """Two joins in quick succession: the second's view change comes while the first's chunks
    stream, so they are re-sent under the new view; every copy's region is freed once its chunk
    is acknowledged, and none is reused while a joiner may still read it."""
    name = f"bulkjoin{os.getpid()}x{next(_ids)}"

    founder = await da.Group.join(_chunked_config(name, 0), actors=[Blob], timeout=20)
    groups = [founder]
    try:
        await founder.subgroup(Blob).fill(24 << 20)
        first = asyncio.ensure_future(
            da.Group.join(_chunked_config(name, 1), actors=[Blob], timeout=30))
        xfer = founder._xfer
        assert xfer is not None
        for _ in range(2000):  # the first transfer is streaming: now the second joiner comes
            if any(o.phase == "stream" and o.acked > 2 for o in xfer.sponsor.transfers.values()):
                break
            await asyncio.sleep(0.001)
        second = asyncio.ensure_future(
            da.Group.join(_chunked_config(name, 2), actors=[Blob], timeout=30))
        groups += await asyncio.gather(first, second)
        want = founder.local(Blob).data
        assert all(g.local(Blob).data == want for g in groups)
        plane = _plane(founder)
        assert not xfer.sponsor.transfers and not plane.outstanding
        assert plane.pool.in_use == 0
    finally:
        for g in reversed(groups):
            await g.leave()


async def test_a_chunk_landing_again_after_it_was_stored_is_only_acknowledged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk re-sent under a new view may land after the joiner stored its first copy and
    the sponsor freed every copy's region on the acknowledgement, so the second copy's bytes
    can be another chunk's by then. The joiner must take it as the duplicate its key says it
    is (acknowledge it again), not read it: it once failed the join as "a malformed state
    chunk" (seen in the pure-twin run of the two-joins test above)."""
    from derecho_async.runtime.dataplane import OutOfBand
    from derecho_async.runtime.statexfer.joiner import Incoming, Joiner
    from derecho_async.runtime.statexfer.wire import chunk_msg_no

    injected: list[int] = []
    stored = Joiner._stored

    def stored_then_landed_again(self: Joiner, inc: Incoming, index: int,
                                 fut: asyncio.Future[bool]) -> None:
        stored(self, inc, index, fut)
        if not injected and inc.chunk_state[index] == 2:
            injected.append(index)  # its region now holds anything: here, 3 stray bytes
            key = (0, inc.sponsor, chunk_msg_no(inc.xfer_id, index))
            self.landed(key, OutOfBand(b"\x93\x01\x02\x03", (np.zeros(3, np.uint8),)))

    monkeypatch.setattr(Joiner, "_stored", stored_then_landed_again)
    name = f"bulkdup{os.getpid()}x{next(_ids)}"

    founder = await da.Group.join(_chunked_config(name, 0), actors=[Blob], timeout=20)
    groups = [founder]
    try:
        await founder.subgroup(Blob).fill(1 << 20)
        groups.append(await da.Group.join(_chunked_config(name, 1), actors=[Blob], timeout=30))
        assert injected
        assert groups[1].local(Blob).data == founder.local(Blob).data
    finally:
        for g in reversed(groups):
            await g.leave()
