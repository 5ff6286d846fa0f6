"""The bulk host data planes over real shared memory and real sockets: the shm pool (write once,
copy out at each receiver) and the tcp chain (pipelined blocks, relayed member to member)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import itertools
import os
import secrets
import threading
from collections.abc import Iterator
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
        extra["secret"] = secrets.token_hex(8)
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
        logs = [g.local(Sink).log for g in groups]  # type: ignore[attr-defined]
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
        logs = [g.local(Sink).log for g in groups[:2]]  # type: ignore[attr-defined]
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
                assert g.local(Sink).log == [expect]  # type: ignore[attr-defined]
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
        logs = [g.local(Sink).log for g in groups]  # type: ignore[attr-defined]
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


def test_pool_allocator_coalesces_reuses_and_drops_idle_segments() -> None:
    from derecho_async.runtime.shmplane import HostPool

    group = f"pool{os.getpid()}x{next(_ids)}"
    pool = HostPool(group, 4, first_segment=4 << 20)
    try:
        regions = [pool.alloc(n) for n in (1, 4096, 4097, 100_000)]
        assert [off for _, off, _ in regions] == [0, 4096, 8192, 16384]
        assert pool.in_use == 4096 + 4096 + 8192 + 102400
        for seg, off, size in (regions[1], regions[3], regions[0], regions[2]):
            pool.free(seg.index, off, size)
        assert pool.in_use == 0 and pool._free == [[(0, 4 << 20)]]
        big = pool.alloc(5 << 20)  # does not fit: a second segment of what is needed
        assert big[0].index == 1 and big[0].capacity == 6 << 20
        again = pool.alloc(4 << 20)  # the first segment, whole
        assert again[0].index == 0 and again[1] == 0
        assert len(ShmTransport.segments(group)) == 2
        held = [big, again] + [pool.alloc(n << 20) for n in (7, 8, 9, 10, 11, 12)]
        assert len(pool.segments) == 8
        for seg, off, size in held:
            pool.free(seg.index, off, size)
        assert pool.in_use == 0
        pool.alloc(20 << 20)  # with 8 segments, growing drops the idle ones first
        assert [s.index for s in pool.segments] == [0]
        assert len(ShmTransport.segments(group)) == 1
    finally:
        pool.close()
    assert ShmTransport.segments(group) == []


# -- hostile frames ---------------------------------------------------------------------------


def _captured_shm_descriptor(group: str) -> tuple[ShmPlane, list[Any]]:
    """A real sender plane (member 1) and the descriptor it sent for a call with two arrays."""
    from derecho_async.wire import envelope as env

    frames: list[bytes] = []
    sender = ShmPlane(group, 1, lambda to, f: frames.append(f), lambda k, p: None)
    arrs = (np.arange(1000, dtype=np.float32), np.ones((3, 4), np.int16))
    assert sender.start((0, 1, 5), da_oob(b"the call", arrs), (2,))
    (frame,) = frames
    return sender, env.decode(frame)


def da_oob(call: bytes, arrays: tuple[object, ...]) -> object:
    from derecho_async.runtime.dataplane import OutOfBand

    return OutOfBand(call, arrays)


def _hostile_descriptors(good: list[Any]) -> list[tuple[str, int, list[Any]]]:
    """(why, transport sender, descriptor) variations of a valid descriptor from member 1."""
    _, v, s, m, idx, gen, off, length, meta = good
    return [
        ("relayed for another sender", 3, good),
        ("names another sender", 1, [5, v, 3, m, idx, gen, off, length, meta]),
        ("segment index out of range", 1, [5, v, s, m, 1 << 20, gen, off, length, meta]),
        ("segment that does not exist", 1, [5, v, s, m, 7, gen, off, length, meta]),
        ("wrong generation", 1, [5, v, s, m, idx, gen ^ 1, off, length, meta]),
        ("offset past the segment", 1, [5, v, s, m, idx, gen, 1 << 40, length, meta]),
        ("region crosses the end", 1, [5, v, s, m, idx, gen, (64 << 20) - 64, length, meta]),
        ("unaligned offset", 1, [5, v, s, m, idx, gen, off + 1, length, meta]),
        ("length disagrees with meta", 1, [5, v, s, m, idx, gen, off, length + 8, meta]),
        ("meta of unknown kind", 1, [5, v, s, m, idx, gen, off, length, [9]]),
        ("object dtype", 1, [5, v, s, m, idx, gen, off, length, [1, 8, [["object", [1]]]]]),
        ("negative shape", 1, [5, v, s, m, idx, gen, off, length, [1, 8, [["int8", [-1]]]]]),
        ("huge shape", 1, [5, v, s, m, idx, gen, off, length, [1, 8, [["int8", [1 << 62] * 2]]]]),
        ("too many arrays", 1, [5, v, s, m, idx, gen, off, length, [1, 0, [["int8", [0]]] * 5000]]),
        ("call longer than region", 1, [5, v, s, m, idx, gen, off, length, [1, length + 1, []]]),
        ("plain meta too long", 1, [5, v, s, m, idx, gen, off, length, [0, length, 1]]),
    ]


def test_hostile_shm_descriptors_are_protocol_violations() -> None:
    group = f"hostile{os.getpid()}x{next(_ids)}"
    sender, good = _captured_shm_descriptor(group)
    landed: list[object] = []
    receiver = ShmPlane(group, 2, lambda to, f: None, lambda k, p: landed.append(p))
    try:
        for why, frm, desc in _hostile_descriptors(good):
            with pytest.raises(da.ProtocolViolation):
                receiver.receive(frm, desc, b"")
            assert landed == [], why
        # a descriptor of a view that ended here is moot: ignored, whatever it names
        from derecho_async.core import View, ViewInstalled

        receiver.on_event(ViewInstalled(View(1, (1, 2)), (), (), True))
        for _why, frm, desc in _hostile_descriptors(good)[2:]:
            receiver.receive(frm, desc, b"")
        assert landed == []
        receiver.on_event(ViewInstalled(View(0, (1, 2)), (), (), True))  # (test only: rewind)
        receiver.receive(1, good, b"")  # the genuine one still lands, intact
        (got,) = landed
        assert got.call == b"the call"  # type: ignore[attr-defined]
        np.testing.assert_array_equal(got.arrays[0], np.arange(1000, dtype=np.float32))  # type: ignore[attr-defined]
        # a segment that is not private to this user is refused
        path = sender.pool.segments[0].path
        os.chmod(path, 0o644)
        fresh = ShmPlane(group, 3, lambda to, f: None, lambda k, p: landed.append(p))
        with pytest.raises(da.ProtocolViolation):
            fresh.receive(1, good, b"")
        fresh.close()
    finally:
        receiver.close()
        sender.close()
    assert ShmTransport.segments(group) == []


def _block_frames(chain_targets: tuple[int, ...], nbytes: int) -> list[list[Any]]:
    from derecho_async.wire import envelope as env

    frames: list[tuple[int, bytes]] = []
    plane = ChainPlane(0, lambda to, f: frames.append((to, f)), lambda k, p: None, 4096)
    assert plane.start((2, 0, 9), b"\x07" * nbytes, chain_targets)
    if nbytes > 4096:
        assert {to for to, _ in frames} == {min(chain_targets)}
    else:
        assert [to for to, _ in frames] == sorted(chain_targets)
    return [env.decode(f) for _, f in frames]


def test_hostile_blocks_are_protocol_violations() -> None:
    import msgpack  # type: ignore[import-untyped]

    from derecho_async.core import View, ViewInstalled

    def in_view(plane: ChainPlane) -> ChainPlane:
        plane.on_event(ViewInstalled(View(2, (0, 1, 2, 3)), (), (), True))
        return plane

    good = _block_frames((1, 2), 10_000)  # 3 blocks of 4096, 4096, 1808
    assert [b[4] for b in good] == [0, 1, 2] and len(good[2][8]) == 1808
    head = msgpack.unpackb(good[0][7])

    def with_head(chain: object, meta: object, bs: object) -> bytes:
        out = msgpack.packb([chain, meta, bs])
        assert isinstance(out, bytes)
        return out

    def b0(**kw: Any) -> list[Any]:
        f = list(good[0])
        for i, name in enumerate(("view", "origin", "msg", "index", "count", "total", "head", "block"), 1):
            if name in kw:
                f[i] = kw[name]
        return f

    cases: list[tuple[str, int, list[list[Any]]]] = [
        ("first block from a non-predecessor", 2, [good[0]]),
        ("chain without me", 0, [b0(head=with_head([2, 3], head[1], 4096))]),
        ("chain holding the origin", 0, [b0(head=with_head([1, 0], head[1], 4096))]),
        ("duplicate chain ids", 0, [b0(head=with_head([1, 1, 2], head[1], 4096))]),
        ("block size too small", 0, [b0(head=with_head(head[0], head[1], 16))]),
        ("meta disagrees with total", 0, [b0(total=20_000)]),
        ("wrong block count", 0, [b0(count=2)]),
        ("short block", 0, [b0(block=b"\x07" * 100)]),
        ("undecodable head", 0, [b0(head=b"\xc1")]),
        ("head is not a list", 0, [b0(head=msgpack.packb({"a": 1}))]),
        ("block without block 0", 0, [good[1]]),
        ("block out of order", 0, [good[0], good[2]]),
        ("block 0 twice", 0, [good[0], good[0]]),
        ("later block with a head", 0, [good[0], [*good[1][:7], good[0][7], good[1][8]]]),
        ("later block changes the total", 0, [good[0], [*good[1][:6], 10_001, *good[1][7:]]]),
        ("chain not in its origin's order", 3, [b0(origin=0, head=with_head([3, 1, 2], head[1], 4096))]),
        ("another member's message injected", 3, [b0(origin=0, head=with_head([3, 1], head[1], 4096))]),
        ("chain member outside the view", 0, [b0(head=with_head([1, 7], head[1], 4096))]),
        ("a view far ahead", 0, [b0(view=9)]),
        ("a huge total", 0, [b0(total=1 << 40, count=(1 << 40) // 4096)]),
    ]
    for why, frm, frames in cases:
        landed: list[object] = []
        relayed: list[int] = []

        def relay(to: int, f: bytes, r: list[int] = relayed) -> None:
            r.append(to)

        def land(k: tuple[int, int, int], p: object, ld: list[object] = landed) -> None:
            ld.append(p)

        plane = in_view(ChainPlane(1, relay, land))
        with pytest.raises(da.ProtocolViolation):
            for f in frames:
                plane.receive(frm, f, b"raw")
        assert landed == [], why
        assert len(relayed) <= 1, why  # only an accepted first block was passed on
    # the genuine frames: member 1 relays each to 2 and lands the payload
    landed = []
    relayed = []
    plane = in_view(ChainPlane(1, lambda to, f: relayed.append(to), lambda k, p: landed.append(p)))
    for f in good:
        plane.receive(0, f, b"raw")
    assert relayed == [2, 2, 2] and landed == [b"\x07" * 10_000]
    # one block: the sender sends it to each target directly (a chain of one each)
    single = _block_frames((1, 2, 3), 4096)
    assert [msgpack.unpackb(f[7])[0] for f in single] == [[1], [2], [3]]
    one: list[object] = []
    plane = in_view(ChainPlane(2, lambda to, f: relayed.append(to), lambda k, p: one.append(p)))
    plane.receive(0, single[1], b"raw")
    assert one == [b"\x07" * 4096]
    tail: list[object] = []
    last = in_view(ChainPlane(2, lambda to, f: relayed.append(to), lambda k, p: tail.append(p)))
    with pytest.raises(da.ProtocolViolation):
        last.receive(0, good[0], b"raw")  # 2's predecessor is 1, not the origin
    for f in good:
        last.receive(1, f, b"raw")
    assert tail == [b"\x07" * 10_000] and relayed == [2, 2, 2]


# -- copies off the event loop -------------------------------------------------------------------


class _Gate(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor in these tests: each job waits until ``open`` is set, so a
    test can act while a copy is in flight."""

    def __init__(self) -> None:
        super().__init__(max_workers=4)
        self.open = threading.Event()

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        def gated() -> Any:
            self.open.wait(20)
            return fn(*args, **kwargs)

        return super().submit(gated)


@contextlib.contextmanager
def _gated() -> Iterator[_Gate]:
    loop = asyncio.get_running_loop()
    gate = _Gate()
    loop.set_default_executor(gate)
    try:
        yield gate
    finally:
        gate.open.set()
        gate.shutdown(wait=True)
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor())


async def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def _big(fill: int = 7) -> Any:
    """A call whose one array (a byte string's, as it travels) is over OFF_LOOP_BYTES."""
    from derecho_async.runtime.dataplane import OFF_LOOP_BYTES, OutOfBand

    return OutOfBand(b"big", (np.full(OFF_LOOP_BYTES, fill, np.uint8),))


def _view(view_id: int, members: tuple[int, ...]) -> Any:
    from derecho_async.core import View, ViewInstalled

    return ViewInstalled(View(view_id, members), (), (), True)


async def test_a_large_shm_write_sends_its_descriptor_after_it_and_frees_nothing_under_it(
) -> None:
    group = f"offloop{os.getpid()}x{next(_ids)}"
    sent: list[int] = []
    failed: list[Any] = []
    sender = ShmPlane(group, 1, lambda to, f: sent.append(to), lambda k, p: None,
                      staging_failed=lambda k, e: failed.append((k, e)))
    try:
        with _gated() as gate:
            assert sender.start((0, 1, 1), _big(), (2, 3))
            await asyncio.sleep(0.05)
            assert sent == [] and sender.pool.in_use > 0  # written first, then announced
            gate.open.set()
            await _until(lambda: sent)
            assert sent == [2, 3] and sender.copied_off_loop == 1
            # a newer view while a write is under way: its region stays allocated until the
            # write ends (then it is freed), and the moot message is not announced
            gate.open.clear()
            assert sender.start((0, 1, 2), _big(), (2, 3))
            sender.on_event(_view(1, (1, 2, 3)))
            assert (0, 1, 1) not in sender.outstanding and (0, 1, 2) in sender.outstanding
            assert sender.pool.in_use > 0
            gate.open.set()
            await _until(lambda: not sender.outstanding)
            assert sender.pool.in_use == 0 and sent == [2, 3]
            # closed while a write is under way: the pool is unmapped and unlinked after it
            gate.open.clear()
            assert sender.start((1, 1, 3), _big(), (2,))
            sender.close()
            assert ShmTransport.segments(group) != []
            gate.open.set()
            await _until(lambda: ShmTransport.segments(group) == [])
            assert sent == [2, 3] and failed == []
    finally:
        sender.close()
    assert ShmTransport.segments(group) == []


async def test_a_failed_large_shm_write_makes_the_sender_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from derecho_async.runtime import shmplane

    def broken(payload: object, layout: object, dst: memoryview) -> None:
        raise MemoryError("injected")

    monkeypatch.setattr(shmplane, "write_flat", broken)
    group = f"offloop{os.getpid()}x{next(_ids)}"
    sent: list[int] = []
    failed: list[Any] = []
    sender = ShmPlane(group, 1, lambda to, f: sent.append(to), lambda k, p: None,
                      staging_failed=lambda k, e: failed.append((k, e)))
    try:
        assert sender.start((0, 1, 1), _big(), (2,))
        await _until(lambda: failed)
        assert failed[0][0] == (0, 1, 1) and isinstance(failed[0][1], MemoryError)
        assert sent == [] and sender.pool.in_use == 0 and not sender.outstanding
    finally:
        sender.close()
    assert ShmTransport.segments(group) == []


async def _descriptors(group: str, payloads: list[tuple[tuple[int, int, int], object]]
                       ) -> tuple[ShmPlane, list[list[Any]]]:
    """A sender plane (member 1) and its descriptors to member 2, once all are written."""
    from derecho_async.wire import envelope as env

    frames: list[bytes] = []
    sender = ShmPlane(group, 1, lambda to, f: frames.append(f), lambda k, p: None)
    for key, payload in payloads:
        assert sender.start(key, payload, (2,))
    await _until(lambda: len(frames) == len(payloads))
    by_key = {tuple(msg[1:4]): msg for msg in map(env.decode, frames)}
    return sender, [by_key[key] for key, _ in payloads]


async def test_a_large_shm_copy_out_lands_in_order_and_unmaps_nothing_under_it() -> None:
    group = f"offloop{os.getpid()}x{next(_ids)}"
    big1, big2, big3 = _big(1), _big(2), _big(3)
    sender, (d1, d2, d3, d4) = await _descriptors(group, [
        ((0, 1, 1), big1), ((0, 1, 2), b"small" * 100), ((0, 1, 3), big2), ((0, 1, 4), big3)])
    landed: list[tuple[Any, Any]] = []
    receiver = ShmPlane(group, 2, lambda to, f: None, lambda k, p: landed.append((k, p)))
    other = None
    try:
        with _gated() as gate:
            receiver.receive(1, d1, b"")
            receiver.receive(1, d2, b"")  # small, but behind the large one of the same sender
            await asyncio.sleep(0.05)
            assert landed == []
            gate.open.set()
            await _until(lambda: len(landed) == 2)
            assert [k for k, _ in landed] == [(0, 1, 1), (0, 1, 2)]
            got = landed[0][1]
            assert got.call == b"big"
            np.testing.assert_array_equal(got.arrays[0], big1.arrays[0])
            assert landed[1][1] == b"small" * 100 and receiver.copied_off_loop == 1
            # a view without the sender while a copy is under way: its segment is unmapped
            # once the copy ends, and the message of the old view does not land
            gate.open.clear()
            receiver.receive(1, d3, b"")
            (seg,) = receiver._peers.values()
            receiver.on_event(_view(1, (2, 3)))
            assert not seg.mm.closed
            gate.open.set()
            await _until(lambda: seg.mm.closed)
            assert len(landed) == 2
            # closed while a copy is under way: the mappings go after it; nothing lands
            other = ShmPlane(group, 3, lambda to, f: None, lambda k, p: landed.append((k, p)))
            gate.open.clear()
            other.receive(1, d4, b"")
            (seg,) = other._peers.values()
            other.close()
            assert not seg.mm.closed
            gate.open.set()
            await _until(lambda: seg.mm.closed)
            await asyncio.sleep(0.02)
            assert len(landed) == 2
    finally:
        receiver.close()
        if other is not None:
            other.close()
        sender.close()
    assert ShmTransport.segments(group) == []


async def test_a_failed_large_shm_copy_out_is_reported_and_the_next_message_lands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from derecho_async.runtime import shmplane

    def broken(layout: object, data: object, buffers: object) -> object:
        raise MemoryError("injected")

    group = f"offloop{os.getpid()}x{next(_ids)}"
    sender, (d1, d2) = await _descriptors(group, [((0, 1, 1), _big()), ((0, 1, 2), b"after" * 100)])
    monkeypatch.setattr(shmplane, "copy_flat", broken)
    landed: list[Any] = []
    failed: list[Any] = []
    receiver = ShmPlane(group, 2, lambda to, f: None, lambda k, p: landed.append(k),
                        failed=lambda k, e: failed.append((k, e)))
    try:
        receiver.receive(1, d1, b"")
        receiver.receive(1, d2, b"")
        await _until(lambda: landed)
        assert landed == [(0, 1, 2)]
        assert failed[0][0] == (0, 1, 1) and isinstance(failed[0][1], MemoryError)
    finally:
        receiver.close()
        sender.close()
    assert ShmTransport.segments(group) == []


async def test_a_large_chain_call_is_laid_out_off_the_loop_before_its_blocks_go() -> None:
    from derecho_async.wire import envelope as env

    frames: list[tuple[int, list[Any]]] = []
    failed: list[Any] = []
    plane = ChainPlane(0, lambda to, f: frames.append((to, env.decode(f))), lambda k, p: None,
                       staging_failed=lambda k, e: failed.append(k))
    plane.on_event(_view(0, (0, 1, 2)))
    with _gated() as gate:
        assert plane.start((0, 0, 1), _big(5), (1, 2))
        await asyncio.sleep(0.05)
        assert frames == []
        gate.open.set()
        await _until(lambda: frames)
        blocks = [msg for _, msg in frames]
        assert {to for to, _ in frames} == {1} and len(blocks) == blocks[0][5]
        assert b"".join(m[8] for m in blocks)[64:] == bytes([5]) * len(_big().arrays[0])
        # superseded by a newer view, or closed, while being laid out: no block goes out
        frames.clear()
        gate.open.clear()
        assert plane.start((0, 0, 2), _big(), (1, 2))
        plane.on_event(_view(1, (0, 1, 2)))
        gate.open.set()
        await asyncio.sleep(0.1)
        assert frames == []
        gate.open.clear()
        assert plane.start((1, 0, 3), _big(), (1, 2))
        plane.close()
        gate.open.set()
        await asyncio.sleep(0.1)
        assert frames == [] and failed == []


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
        logs = [g.local(Sink).log for g in groups]  # type: ignore[attr-defined]
        assert len(logs[0]) == 4 and logs[0] == logs[1] == logs[2]  # the next plane moved them
    finally:
        for g in groups:
            await g.leave()
