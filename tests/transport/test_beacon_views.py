"""The beacons of the shm and tcp transports, between started transports in one process: a
peer's beacon counts at every tick while both are in the same view, never once the peer has
gone on to a view this member is not in (a removed member must suspect its former peers and
wedge, not wait on their beacons), and again when both are in one view."""

from __future__ import annotations

import asyncio

import pytest
from transport_support import SECRET, Recorder, new_group

from derecho_async.transport import Transport
from derecho_async.transport.shm import ShmTransport
from derecho_async.transport.tcp import TcpTransport

ROW = 64


def _make(kind: str, member: int, group: str) -> Transport:
    if kind == "shm":
        return ShmTransport(group, member, ring_bytes=64 << 10, beacon_s=0.005, hold_s=60)
    return TcpTransport(member, ("127.0.0.1", 0), secret=SECRET, beacon_s=0.005, hold_s=60)


async def _heard(t: Transport, within: float = 0.15) -> set[int]:
    seen: set[int] = set()
    for _ in range(int(within / 0.01)):
        await asyncio.sleep(0.01)
        seen.update(t.beacon_tick())
    return seen


@pytest.mark.parametrize("kind", ["shm", "tcp"])
async def test_a_beacon_counts_only_within_one_view(kind: str) -> None:
    group = new_group()
    a, b = _make(kind, 0, group), _make(kind, 1, group)
    await a.start(Recorder(me=0))
    await b.start(Recorder(me=1))
    try:
        assert a.beacon_on and b.beacon_on
        if isinstance(a, TcpTransport) and isinstance(b, TcpTransport):
            a.add_peer(1, b.address)
            b.add_peer(0, a.address)
        for t in (a, b):
            t.set_view(1, [0, 1], ROW)
        # traffic both ways makes the links (rings, streams) the beacons travel beside
        a.push(1, 0, b"x" * 8, [1])
        b.push(1, ROW, b"y" * 8, [0])
        await asyncio.sleep(0.2)
        assert await _heard(a) == {1}
        assert await _heard(b) == {0}
        a.set_view(2, [0], ROW)  # a went on without b: b must not hear a any more, nor a b
        await asyncio.sleep(0.03)
        b.beacon_tick()  # (datagrams a's thread sent before it moved on, read late under load)
        assert await _heard(b) == set()
        assert await _heard(a) == set()
        b.set_view(2, [0, 1], ROW)  # both in view 2 again
        assert await _heard(a) == {1}
        assert await _heard(b) == {0}
    finally:
        await a.close()
        await b.close()
