"""Arrays in ordered calls: out of band on the data plane, validated on arrival."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgpack
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


async def test_numpy_arrays_anywhere_in_the_arguments_arrive_as_numpy() -> None:
    name = f"dp{next(_ids)}"
    groups = await asyncio.gather(
        *(
            da.Group.join(
                da.Config(
                    group=name, member_id=i, initial_members=3, transport="sim", max_payload=256
                ),
                actors=[Weights],
                timeout=10,
            )
            for i in range(3)
        )
    )
    try:
        big = np.ones((64, 64), np.float32)  # 16 KB: far beyond a slot
        calls = [
            groups[i % 3].subgroup(Weights).update(big * i, {"bias": np.full(64, 0.5, np.float32)})
            for i in range(12)
        ]
        replies = await asyncio.gather(*calls)
        finals = {float(g.local(Weights).w.sum()) for g in groups}  # type: ignore[attr-defined]
        assert len(finals) == 1
        # call i adds i to every element, and 0.5 from the bias
        assert finals.pop() == pytest.approx(64 * 64 * (sum(range(12)) + 12 * 0.5))
        assert all(len(set(r.values())) == 1 for r in replies)
        for g in groups:
            assert set(g.local(Weights).kinds) == {"ndarray/float32/(64,)"}  # type: ignore[attr-defined]
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
    body = HostStagingPlane._pack(OutOfBand(b"call", (arr,)))
    plane.receive((0, 1, 2), body)
    (got,) = landed
    assert isinstance(got, OutOfBand) and got.call == b"call"
    np.testing.assert_array_equal(got.arrays[0], arr)  # type: ignore[arg-type]
    assert got.arrays[0].flags.writeable  # type: ignore[attr-defined]
