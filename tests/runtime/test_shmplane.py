"""The shm pool plane alone (write once, copy out at each receiver): the pool's allocator,
hostile descriptors, and large copies off the event loop."""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

import numpy as np
import pytest

import derecho_async as da
from derecho_async.runtime.shmplane import ShmPlane
from derecho_async.transport.shm import ShmTransport
from tests.runtime.offloop import big_call, gated_executor, view_installed, wait_until

_ids = itertools.count()


# -- the pool ---------------------------------------------------------------------------------


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


# -- copies off the event loop -------------------------------------------------------------------


async def test_a_large_shm_write_sends_its_descriptor_after_it_and_frees_nothing_under_it(
) -> None:
    group = f"offloop{os.getpid()}x{next(_ids)}"
    sent: list[int] = []
    failed: list[Any] = []
    sender = ShmPlane(group, 1, lambda to, f: sent.append(to), lambda k, p: None,
                      staging_failed=lambda k, e: failed.append((k, e)))
    try:
        with gated_executor() as gate:
            assert sender.start((0, 1, 1), big_call(), (2, 3))
            await asyncio.sleep(0.05)
            assert sent == [] and sender.pool.in_use > 0  # written first, then announced
            gate.open.set()
            await wait_until(lambda: sent)
            assert sent == [2, 3] and sender.copied_off_loop == 1
            # a newer view while a write is under way: its region stays allocated until the
            # write ends (then it is freed), and the moot message is not announced
            gate.open.clear()
            assert sender.start((0, 1, 2), big_call(), (2, 3))
            sender.on_event(view_installed(1, (1, 2, 3)))
            assert (0, 1, 1) not in sender.outstanding and (0, 1, 2) in sender.outstanding
            assert sender.pool.in_use > 0
            gate.open.set()
            await wait_until(lambda: not sender.outstanding)
            assert sender.pool.in_use == 0 and sent == [2, 3]
            # closed while a write is under way: the pool is unmapped and unlinked after it
            gate.open.clear()
            assert sender.start((1, 1, 3), big_call(), (2,))
            sender.close()
            assert ShmTransport.segments(group) != []
            gate.open.set()
            await wait_until(lambda: ShmTransport.segments(group) == [])
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
        assert sender.start((0, 1, 1), big_call(), (2,))
        await wait_until(lambda: failed)
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
    await wait_until(lambda: len(frames) == len(payloads))
    by_key = {tuple(msg[1:4]): msg for msg in map(env.decode, frames)}
    return sender, [by_key[key] for key, _ in payloads]


async def test_a_large_shm_copy_out_lands_in_order_and_unmaps_nothing_under_it() -> None:
    group = f"offloop{os.getpid()}x{next(_ids)}"
    big1, big2, big3 = big_call(1), big_call(2), big_call(3)
    sender, (d1, d2, d3, d4) = await _descriptors(group, [
        ((0, 1, 1), big1), ((0, 1, 2), b"small" * 100), ((0, 1, 3), big2), ((0, 1, 4), big3)])
    landed: list[tuple[Any, Any]] = []
    receiver = ShmPlane(group, 2, lambda to, f: None, lambda k, p: landed.append((k, p)))
    other = None
    try:
        with gated_executor() as gate:
            receiver.receive(1, d1, b"")
            receiver.receive(1, d2, b"")  # small, but behind the large one of the same sender
            await asyncio.sleep(0.05)
            assert landed == []
            gate.open.set()
            await wait_until(lambda: len(landed) == 2)
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
            receiver.on_event(view_installed(1, (2, 3)))
            assert not seg.mm.closed
            gate.open.set()
            await wait_until(lambda: seg.mm.closed)
            assert len(landed) == 2
            # closed while a copy is under way: the mappings go after it; nothing lands
            other = ShmPlane(group, 3, lambda to, f: None, lambda k, p: landed.append((k, p)))
            gate.open.clear()
            other.receive(1, d4, b"")
            (seg,) = other._peers.values()
            other.close()
            assert not seg.mm.closed
            gate.open.set()
            await wait_until(lambda: seg.mm.closed)
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
    sender, (d1, d2) = await _descriptors(group, [((0, 1, 1), big_call()), ((0, 1, 2), b"after" * 100)])
    monkeypatch.setattr(shmplane, "copy_flat", broken)
    landed: list[Any] = []
    failed: list[Any] = []
    receiver = ShmPlane(group, 2, lambda to, f: None, lambda k, p: landed.append(k),
                        failed=lambda k, e: failed.append((k, e)))
    try:
        receiver.receive(1, d1, b"")
        receiver.receive(1, d2, b"")
        await wait_until(lambda: landed)
        assert landed == [(0, 1, 2)]
        assert failed[0][0] == (0, 1, 1) and isinstance(failed[0][1], MemoryError)
    finally:
        receiver.close()
        sender.close()
    assert ShmTransport.segments(group) == []


async def test_a_state_chunks_region_outlives_a_view_change_until_its_sponsor_frees_it() -> None:
    """A joiner may read a state chunk sent under a view its sponsor has since left behind (no
    frozen shard ignores a chunk's landing): the region must not be reused under it."""
    from derecho_async.runtime.statexfer.wire import chunk_msg_no
    from derecho_async.wire import envelope as env

    group = f"chunks{os.getpid()}x{next(_ids)}"
    frames: list[bytes] = []
    sender = ShmPlane(group, 0, lambda to, f: frames.append(f), lambda k, p: None)
    landed: list[tuple[Any, Any]] = []
    joiner = ShmPlane(group, 1, lambda to, f: None, lambda k, p: landed.append((k, p)))
    first, second = (0, 0, chunk_msg_no(1, 0)), (1, 0, chunk_msg_no(2, 0))
    try:
        assert sender.start(first, da_oob(b"transfer 1", (np.full(64, 1, np.uint8),)), (1,))
        sender.on_event(view_installed(1, (0, 1, 2)))  # another joiner: a new view
        assert sender.start(second, da_oob(b"transfer 2", (np.full(64, 2, np.uint8),)), (2,))
        joiner.receive(0, env.decode(frames[0]), b"")  # the first descriptor, read late
        ((key, got),) = landed
        assert key == first and got.call == b"transfer 1"
        np.testing.assert_array_equal(got.arrays[0], np.full(64, 1, np.uint8))
        for key in (first, second):  # acknowledged: the sponsor frees them
            sender.on_own_delivered(key)
        assert sender.pool.in_use == 0 and not sender.outstanding
    finally:
        joiner.close()
        sender.close()
    assert ShmTransport.segments(group) == []
