"""Arrays in ordered calls: out of band on the data plane, validated on arrival."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import pytest

import derecho_async as da
from derecho_async.runtime.dataplane import HostStagingPlane, OutOfBand, array_info

_ids = itertools.count()


class Weights(da.Actor):
    def __init__(self) -> None:
        self.w = np.zeros((64, 64), np.float32)
        self.kinds: list[str] = []

    @da.ordered
    def update(self, delta: Any, extra: dict[str, Any]) -> float:
        self.kinds.append(f"{type(delta).__name__}/{delta.dtype}/{extra['bias'].shape}")
        self.w += delta + extra["bias"]
        return float(self.w.sum())


async def _sim_group(n: int, actor: type[da.Actor], max_payload: int) -> list[da.Group]:
    name = f"dp{next(_ids)}"
    configs = [
        da.Config(group=name, member_id=i, initial_members=n, transport="sim",
                  max_payload=max_payload)
        for i in range(n)
    ]
    return list(
        await asyncio.gather(*(da.Group.join(c, actors=[actor], timeout=10) for c in configs))
    )


async def test_numpy_arrays_anywhere_in_the_arguments_arrive_as_numpy() -> None:
    groups = await _sim_group(3, Weights, max_payload=256)
    try:
        big = np.ones((64, 64), np.float32)  # 16 KB: far beyond a slot
        calls = [
            groups[i % 3].subgroup(Weights).update(big * i, {"bias": np.full(64, 0.5, np.float32)})
            for i in range(12)
        ]
        replies = await asyncio.gather(*calls)
        finals = {float(g.local(Weights).w.sum()) for g in groups}
        assert len(finals) == 1
        # call i adds i to every element, and 0.5 from the bias
        assert finals.pop() == pytest.approx(64 * 64 * (sum(range(12)) + 12 * 0.5))
        assert all(len(set(r.values())) == 1 for r in replies)
        for g in groups:
            assert set(g.local(Weights).kinds) == {"ndarray/float32/(64,)"}
    finally:
        for g in groups:
            await g.leave()


class Probe(da.Actor):
    def __init__(self) -> None:
        self.seen: list[str] = []

    @da.ordered
    def take(self, arrays: list[Any]) -> int:
        for a in arrays:
            assert isinstance(a, np.ndarray) and a.flags.writeable and a.flags.c_contiguous
            a[...] = a.copy()  # owned and writeable: writing must not fail
            self.seen.append(f"{a.dtype.name}{a.shape}:{a.astype(a.dtype.newbyteorder('=')).tolist()}")
        return len(arrays)


async def test_small_numpy_arrays_ride_in_the_slot_and_large_ones_on_the_data_plane() -> None:
    """Arrays whose call fits a slot travel inline (no data-plane transfer, no landing report);
    either way every member's handler sees the same owned numpy arrays, in the same order."""
    groups = await _sim_group(2, Probe, max_payload=512)
    try:
        driver = groups[0]._driver
        assert driver is not None
        started: list[object] = []
        real_start = driver.start_transfer

        def start_transfer(key: tuple[int, int, int], payload: object,
                           targets: tuple[int, ...]) -> None:
            started.append(key)
            real_start(key, payload, targets)

        driver.start_transfer = start_transfer  # type: ignore[method-assign]
        small = [
            np.arange(6, dtype=np.int16).reshape(2, 3),
            np.arange(8, dtype=">f8")[::2],  # big-endian and strided
            np.array(True),
        ]
        large = [np.arange(200, dtype=np.int32)]  # 800 bytes: beyond the slot
        proxy = groups[0].subgroup(Probe)
        assert dict(await proxy.take(small)) == {0: 3, 1: 3}
        assert started == []  # the small call never touched a data plane
        assert dict(await proxy.take(large)) == {0: 1, 1: 1}
        assert len(started) == 1
        assert np.array_equal(small[1], [0.0, 2.0, 4.0, 6.0])  # the sender's arrays untouched
        seen = [g.local(Probe).seen for g in groups]
        assert seen[0] == seen[1] and len(seen[0]) == 4
        assert seen[0][:3] == ["int16(2, 3):[[0, 1, 2], [3, 4, 5]]", "float64(4,):[0.0, 2.0, 4.0, 6.0]",
                               "bool():True"]
    finally:
        for g in groups:
            await g.leave()


def test_array_info_describes_host_arrays() -> None:
    a = np.arange(12, dtype=np.int16).reshape(3, 4)
    info = array_info(a)
    assert (info.lib, info.dtype, info.shape, info.nbytes, info.is_gpu) == (
        "numpy",
        "int16",
        (3, 4),
        24,
        False,
    )
    with pytest.raises(TypeError):
        array_info(b"bytes")


def _frame(body: object) -> bytes:
    out = msgpack.packb(body, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


@pytest.mark.parametrize(
    "body",
    [
        [7, b"x"],
        [0, "not bytes"],
        [1, b"call", [["numpy", "float32", [2], b"\0" * 7]]],  # 7 bytes for 2 float32
        [1, b"call", [["numpy", "object", [1], b"\0" * 8]]],
        [1, b"call", [["pickle", "float32", [1], b"\0" * 4]]],
        [1, b"call", [["numpy", "float32", [-1], b""]]],
        [1, b"call", "not a list"],
    ],
)
def test_malformed_data_frames_are_protocol_violations(body: object) -> None:
    landed: list[object] = []
    plane = HostStagingPlane(lambda to, b: None, lambda k, p: landed.append(p), lambda k, b: b)
    with pytest.raises(da.ProtocolViolation):
        plane.receive((0, 1, 2), _frame(body))
    with pytest.raises(da.ProtocolViolation):
        plane.receive((0, 1, 2), b"\xc1 not msgpack")
    assert landed == []


def test_a_valid_frame_lands_a_rebuilt_call() -> None:
    landed: list[object] = []
    plane = HostStagingPlane(lambda to, b: None, lambda k, p: landed.append(p), lambda k, b: b)
    arr = np.arange(6, dtype=np.float64).reshape(2, 3)
    body = HostStagingPlane.pack(OutOfBand(b"call", (arr,)))
    plane.receive((0, 1, 2), body)
    (got,) = landed
    assert isinstance(got, OutOfBand) and got.call == b"call"
    np.testing.assert_array_equal(got.arrays[0], arr)
    assert got.arrays[0].flags.writeable  # type: ignore[attr-defined]
