"""An external client's call of device arrays, on a real device (marker ``gpu``): the client
copies them to host memory, and the members' handlers get numpy arrays of the same values."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import derecho_async as da
from tests.gpu import need_cupy

pytestmark = pytest.mark.gpu

SECRET = "dasec1.gJ2vvAckakhoRFUXDWO0T4GBw98AjL8veUcoZfwli1k.TiataN"


class Weights(da.Actor):
    def __init__(self) -> None:
        self.got: list[Any] = []

    @da.ordered
    def load(self, w: Any, named: Any = None) -> str:
        self.got.append((w, named))
        return f"{type(w).__module__}:{w.dtype}{w.shape}:{float(w.sum())}"


async def test_a_clients_device_arrays_are_staged_through_host_memory() -> None:
    cp = need_cupy()
    groups = list(await asyncio.gather(*(
        da.Group.join(da.Config(group="gpuclient", member_id=m, initial_members=2,
                                transport="sim", client_secret=SECRET,
                                client_listen="127.0.0.1:0",
                                heartbeat_ms=5, suspect_after_ms=500),
                      actors=[Weights], timeout=10) for m in range(2))))
    peers = {g.member_id: str(g.client_address) for g in groups}
    async with await da.Client.connect(group="gpuclient", peers=peers, secret=SECRET) as c:
        w = cp.arange(12, dtype=cp.float32).reshape(3, 4)
        replies = await c.subgroup(Weights).load(w, named=[cp.ones(2, dtype=cp.int16)])
    assert set(replies.values()) == {"numpy:float32(3, 4):66.0"}
    for g in groups:
        got, named = g.local(Weights).got[0]
        assert isinstance(got, np.ndarray) and np.array_equal(got, np.arange(12).reshape(3, 4))
        assert isinstance(named[0], np.ndarray) and named[0].dtype == np.int16
        await g.leave()
