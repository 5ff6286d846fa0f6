"""The bulk host data planes over real shared memory and real sockets: the shm pool (write once,
copy out at each receiver) and the tcp chain (pipelined blocks, relayed member to member)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import secrets
from typing import Any

import numpy as np
import pytest

import derecho_async as da
from derecho_async.cli import _free_ports
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
        ports = _free_ports(n)
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
