"""Helpers shared by the transport tests: small in-process clusters of one kind, and the
conformance suite's recording handler (``Recorder``) and group names."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from derecho_async.testing.conformance import WAIT, Cluster, Recorder, new_group
from derecho_async.transport import Transport
from derecho_async.transport.loopback import LoopbackFabric
from derecho_async.transport.rdma import RdmaTransport
from derecho_async.transport.shm import ShmTransport
from derecho_async.transport.tcp import TcpTransport
from derecho_async.transport.tcp.framing import F_CLOSE, FRAME
from derecho_async.transport.tcp.handshake import client_handshake

__all__ = [
    "SECRET",
    "WAIT",
    "Cluster",
    "Recorder",
    "close_reason",
    "cluster",
    "dial_as",
    "make_transport",
    "new_group",
]

SECRET = b"dasec1.HaO3bfki-dc8qIt0SRQ_Y352E-hD7wUBDy0MvRWEiCU.3OX7ih"


def make_transport(
    kind: str,
    member: int,
    *,
    group: str,
    fabric: LoopbackFabric | None = None,
    ring_bytes: int = 64 << 10,
    secret: bytes = SECRET,
    max_frame: int = 64 << 20,
) -> Transport:
    if kind == "loopback":
        assert fabric is not None
        return fabric.transport(member)
    if kind == "shm":
        return ShmTransport(group, member, ring_bytes=ring_bytes)
    if kind == "tcp":
        return TcpTransport(member, ("127.0.0.1", 0), secret=secret, max_frame=max_frame)
    raise AssertionError(kind)


@contextlib.asynccontextmanager
async def cluster(kind: str, n: int = 3, **opts: object) -> AsyncIterator[Cluster]:
    """``n`` started transports (members 0..n-1) of one group, all knowing each other."""
    group = new_group()
    fabric = LoopbackFabric()
    ts = [make_transport(kind, i, group=group, fabric=fabric, **opts) for i in range(n)]  # type: ignore[arg-type]
    recs = [Recorder(me=i) for i in range(n)]
    for t, r in zip(ts, recs, strict=True):
        await t.start(r)
    if kind == "tcp":
        for t in ts:
            for u in ts:
                if u is not t:
                    assert isinstance(u, TcpTransport)
                    t.add_peer(u.member_id, u.address)
    try:
        yield Cluster(group, ts, recs)
    finally:
        for t in ts:
            await t.close()
        if kind == "shm":
            assert ShmTransport.segments(group) == []


async def dial_as(
    target: TcpTransport | RdmaTransport,
    claimed_id: int,
    *,
    secret: bytes = SECRET,
    src: str = "127.0.0.1",
    group: str = "",
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An authenticated raw stream to ``target`` (rdma: its tcp channel) of ``group`` from
    ``src`` claiming ``claimed_id`` (it knows ``secret``): what a stranger or a buggy member
    can do with the secret."""
    host, port = target.address
    reader, writer = await asyncio.open_connection(host, port, local_addr=(src, 0))
    _sid, _addr, verdict, why = await client_handshake(
        reader, writer, secret=secret, my_id=claimed_id, my_addr=(src, 1),
        expect=target.member_id, group=group,
    )
    assert verdict == "accept", why
    return reader, writer


async def close_reason(reader: asyncio.StreamReader) -> str:
    """Read frames until CLOSE; its reason."""
    async with asyncio.timeout(10):
        while True:
            typ, _f, _v, _o, length = FRAME.unpack(await reader.readexactly(FRAME.size))
            payload = await reader.readexactly(length)
            if typ == F_CLOSE:
                return payload.decode()
