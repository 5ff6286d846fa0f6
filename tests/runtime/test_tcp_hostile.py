"""Hostile input against a running tcp group: every bad connection is closed with a logged
reason, the group keeps working and nothing is lost. (Attacks on a group of member processes,
with rates and memory measured: test_tcp_attacks.py.)"""

from __future__ import annotations

import asyncio
import logging
import os
import struct

import pytest

import derecho_async as da
from derecho_async.launch import free_ports
from derecho_async.transport.tcp import framing, handshake
from derecho_async.workload import ReplicatedLog

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

SECRET = "dasec1.4iaLwXtTuX_i-kEufiGv2Bzyw0FfMGCRIs6-Nx0j4Vw.hd4cXr"


async def _tcp_group(n: int) -> list[da.Group]:
    ports = free_ports(n)
    peers = {i: f"127.0.0.1:{p}" for i, p in enumerate(ports)}
    configs = [
        da.Config(
            group="hostile",
            member_id=i,
            initial_members=n,
            transport="tcp",
            peers=peers,
            listen=peers[i],
            secret=SECRET,
            heartbeat_ms=20,
            suspect_after_ms=1000,
        )
        for i in range(n)
    ]
    return list(
        await asyncio.gather(
            *(da.Group.join(c, actors=[ReplicatedLog], timeout=20) for c in configs)
        )
    )


async def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; return what came back before it was closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.read(65536), 5.0)
    writer.close()
    return got


async def _authenticated(port: int, my_id: int, frames: list[bytes]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    _peer, _addr, verdict, why = await handshake.client_handshake(
        reader,
        writer,
        secret=SECRET.encode(),
        my_id=my_id,
        my_addr=("127.0.0.1", 1),
        expect=None,
        group="hostile",
    )
    assert verdict == "accept", why
    for f in frames:
        writer.write(f)
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()


async def test_garbage_wrong_secret_bad_frames_do_not_hurt_the_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="derecho_async")
    groups = await _tcp_group(3)
    try:
        port = int(groups[0].config.listen.rsplit(":", 1)[1])
        log = groups[1].subgroup(ReplicatedLog)
        calls = [asyncio.ensure_future(log.append(b"before %d" % i)) for i in range(20)]
        # each of these connections is closed by the member (read returns at EOF)
        await _raw(port, os.urandom(3000))
        await _raw(port, struct.pack("<I", 1 << 30) + b"x" * 10)  # oversized length
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x00\x00")  # truncated handshake, then EOF
        writer.write_eof()
        await asyncio.wait_for(reader.read(), 5.0)
        writer.close()
        # a member that does not know the secret
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(handshake.AuthError):
            await handshake.client_handshake(
                reader,
                writer,
                secret=b"Wrong-Secret_Rq8Lz3Vn6Kt1Hb9Xm4Pd7Jc2Yf5Gs0",
                my_id=42,
                my_addr=("127.0.0.1", 1),
                expect=None,
                group="hostile",
            )
        writer.close()
        # an authenticated impostor (not in the view) sending junk frames
        await _authenticated(
            port,
            42,
            [
                framing.FRAME.pack(99, 0, 0, 0, 0),  # unknown frame type
            ],
        )
        await _authenticated(
            port,
            43,
            [
                framing.FRAME.pack(framing.F_PUSH, 0, 0, 0, 1 << 40),  # oversized length
            ],
        )
        await _authenticated(
            port,
            44,
            [
                framing.FRAME.pack(framing.F_PUSH, 0, 0, 0, 64) + b"\0" * 64,  # push into row 0
            ],
        )
        await _authenticated(port, 45, [framing.FRAME.pack(framing.F_MSG, 0, 0, 0, 100) + b"short"])
        calls += [asyncio.ensure_future(log.append(b"after %d" % i)) for i in range(20)]
        replies = await asyncio.wait_for(asyncio.gather(*calls), 20)
        assert all(set(r) == {0, 1, 2} for r in replies)
        logs = [g.local(ReplicatedLog).items for g in groups]
        assert logs[0] == logs[1] == logs[2] and len(logs[0]) == 40
        assert all(g.view.view_id == 0 for g in groups), "nobody was removed"
    finally:
        for g in groups:
            await g.leave()
    # a few logged one by one, the rest counted by reason in a summary (at the latest on leave)
    text = caplog.text.lower()
    assert "authentication failed" in text
    assert "bad frame before admission: 4" in text
