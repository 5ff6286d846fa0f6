"""Members in separate real processes (shm and tcp), including a SIGKILLed member."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import cast

import msgpack  # type: ignore[import-untyped]
import pytest
from member_process import ROW, expected_from
from transport_support import SECRET, Recorder, new_group

from derecho_async.transport import Transport
from derecho_async.transport.shm import ShmTransport
from derecho_async.transport.tcp import TcpTransport

SCRIPT = Path(__file__).with_name("member_process.py")


def loop_name() -> str:
    return "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "asyncio"


async def spawn(kind: str, mode: str, member: int, arg: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        kind,
        loop_name(),
        mode,
        str(member),
        arg,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


def decoded(rec: Recorder, sender: int) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for e in rec.from_sender(sender):
        if e[0] == "push":
            out.append(("push", e[1], e[3], e[4]))
        else:
            out.append(("msg", msgpack.unpackb(e[2], raw=False, strict_map_key=False)))
    return out


async def parent(kind: str) -> tuple[Transport, str, str]:
    """Member 0 in this process; returns (transport, the children's ARG, group)."""
    group = new_group()
    if kind == "shm":
        return ShmTransport(group, 0, ring_bytes=64 << 10), group, group
    t = TcpTransport(0, ("127.0.0.1", 0), secret=SECRET)
    return t, "", group


@pytest.mark.parametrize("kind", ["shm", "tcp"])
async def test_three_processes_exchange_in_order(kind: str) -> None:
    t, arg, group = await parent(kind)
    rec = Recorder()
    await t.start(rec)
    t.set_view(1, [0, 1, 2], ROW)
    if isinstance(t, TcpTransport):
        arg = f"{t.address[0]}:{t.address[1]}:{SECRET.hex()}"
    procs = [await spawn(kind, "run", m, arg) for m in (1, 2)]
    try:
        async with asyncio.timeout(60):
            await rec.wait_for(lambda: all(rec.messages(m) for m in (1, 2)))
            peers: dict[int, object] = {}
            if isinstance(t, TcpTransport):
                peers = {m: list(t._links[m].addr or ()) for m in (1, 2)}
                peers[0] = list(t.address)
            else:
                peers = {0: None, 1: None, 2: None}
            for m in (1, 2):
                t.send(m, msgpack.packb(["go", peers]))
            reports: dict[int, list[object]] = {}

            def reported() -> bool:
                for m in (1, 2):
                    for e in decoded(rec, m):
                        msg = e[1]
                        if e[0] == "msg" and isinstance(msg, list) and msg[0] == "report":
                            reports[m] = msg
                return len(reports) == 2

            await rec.wait_for(reported, timeout=60)
            for m in (1, 2):
                assert reports[m][1] is True, reports[m]
                got = [e for e in decoded(rec, m) if not (e[0] == "msg" and e[1][0] == "report")]  # type: ignore[index]
                assert got == expected_from(m, 0)
                t.send(m, msgpack.packb(["bye"]))
            for p in procs:
                assert await p.wait() == 0, (await p.stderr.read()).decode() if p.stderr else ""
        assert rec.failures() == []
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await t.close()
    if kind == "shm":
        assert ShmTransport.segments(group) == []


async def crashed_child(kind: str) -> tuple[Transport, Recorder, str, asyncio.subprocess.Process]:
    """Member 0 here and a member 1 child that pushed 50 words to us and was then SIGKILLed."""
    t, arg, group = await parent(kind)
    rec = Recorder()
    await t.start(rec)
    t.set_view(1, [0, 1, 2], ROW)
    if isinstance(t, TcpTransport):
        arg = f"{t.address[0]}:{t.address[1]}:{SECRET.hex()}"
    proc = await spawn(kind, "crash", 1, arg)
    try:
        async with asyncio.timeout(60):
            await rec.wait_for(lambda: bool(rec.messages(1)))
            peer = {0: None} if kind == "shm" else {0: list(cast(TcpTransport, t).address)}
            t.send(1, msgpack.packb(["go", peer]))
            await rec.wait_for(lambda: any(b"crash-ready" in m for m in rec.messages(1)))
    except BaseException:
        proc.kill()
        await proc.wait()
        await t.close()
        raise
    assert len(rec.pushes(1)) == 50
    os.kill(proc.pid, signal.SIGKILL)
    await proc.wait()
    return t, rec, group, proc


async def test_sigkilled_tcp_member_is_reported() -> None:
    t, rec, _group, _proc = await crashed_child("tcp")
    try:
        await rec.wait_for(lambda: bool(rec.failures(1)))
        assert "connection lost" in rec.failures(1)[0]
    finally:
        await t.close()


async def test_sigkilled_shm_member_then_cleanup_group() -> None:
    t, _rec, group, _proc = await crashed_child("shm")
    try:
        names = {os.path.basename(p) for p in ShmTransport.segments(group)}
        assert names == {f"derecho_async.{group}.{s}.{r}" for s, r in ((1, 0), (1, 2), (0, 1))}
        for p in ShmTransport.segments(group):
            assert os.stat(p).st_mode & 0o777 == 0o600
        # the dead member's rings, and my ring it had attached, are stale
        assert ShmTransport.cleanup_group(group) == 3
        assert ShmTransport.segments(group) == []
    finally:
        await t.close()
    assert ShmTransport.segments(group) == []


async def test_restarted_shm_member_cleans_up_and_reconnects() -> None:
    t, rec, group, _proc = await crashed_child("shm")
    rec1 = Recorder()
    t1 = ShmTransport(group, 1)  # a new incarnation of member 1
    try:
        await t1.start(rec1)
        # it removed the rings of its previous incarnation, and told member 0
        assert ShmTransport.segments(group) == []
        await rec.wait_for(lambda: bool(rec.failures(1)))
        assert "restarted" in rec.failures(1)[0]
        t.send(1, b"hello again")
        t1.send(0, b"hello to you")
        await rec1.wait_for(lambda: rec1.messages(0) == [b"hello again"])
        await rec.wait_for(lambda: b"hello to you" in rec.messages(1))
    finally:
        await t1.close()
        await t.close()
    assert ShmTransport.segments(group) == []
