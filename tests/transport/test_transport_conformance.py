"""The conformance suite every transport passes (loopback, shm, tcp; stock asyncio and uvloop)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket

import pytest
from transport_support import KINDS, Recorder, cluster, make_transport, new_group, open_fds

from derecho_async.errors import GroupClosed, UsageError
from derecho_async.transport import Transport
from derecho_async.transport.loopback import LoopbackFabric
from derecho_async.transport.shm import ShmTransport
from derecho_async.transport.tcp import TcpTransport

ROW = 64
LOGGER = "derecho_async.transport"


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def word(i: int) -> bytes:
    return i.to_bytes(8, "little")


async def test_fifo_per_link_with_interleaved_messages(kind: str) -> None:
    async with cluster(kind) as c:
        c.set_view(1, [0, 1, 2], ROW)
        sent: dict[int, dict[int, list[tuple[object, ...]]]] = {s: {} for s in range(3)}
        for i in range(300):
            for s in range(3):
                others = [t for t in range(3) if t != s]
                off = s * ROW + (i % 8) * 8
                c[s].push(1, off, word(i), others)
                for t in others:
                    sent[s].setdefault(t, []).append(("push", 1, s, off, word(i)))
                if i % 3 == s:
                    t = others[i % 2]
                    c[s].send(t, b"msg %d from %d" % (i, s))
                    sent[s][t].append(("msg", s, b"msg %d from %d" % (i, s)))
        for t in range(3):
            rec = c.recs[t]
            for s in range(3):
                if s != t:
                    want = sent[s][t]

                    def caught_up(rec: Recorder = rec, s: int = s,
                                  want: list[tuple[object, ...]] = want) -> bool:
                        return len(rec.from_sender(s)) >= len(want)

                    await rec.wait_for(caught_up)
                    assert rec.from_sender(s) == want
            assert rec.failures() == []


async def test_big_messages_and_bursts_beyond_ring_capacity(kind: str) -> None:
    rnd = random.Random(7)
    big1 = rnd.randbytes(6 << 20)
    big2 = rnd.randbytes(3 << 20)
    async with cluster(kind, ring_bytes=64 << 10) as c:
        c.set_view(1, [0, 1, 2], ROW)
        want: list[tuple[object, ...]] = [("msg", 0, big1)]
        c[0].send(1, big1)
        c[0].send(2, big1)
        c[2].send(1, big2)  # a concurrent big message on another link
        for burst in range(4):
            for i in range(2500):  # ~240 KB of records per burst: several times the ring
                n = burst * 2500 + i
                off = (n % 8) * 8
                c[0].push(1, off, word(n), [1, 2])
                want.append(("push", 1, 0, off, word(n)))
            c[0].send(1, b"end of burst %d" % burst)
            c[0].send(2, b"end of burst %d" % burst)
            want.append(("msg", 0, b"end of burst %d" % burst))
            await asyncio.sleep(0)
        c[0].send(1, big2)
        c[0].send(2, big2)
        want.append(("msg", 0, big2))
        for t in (1, 2):
            rec = c.recs[t]

            def caught_up(rec: Recorder = rec) -> bool:
                return len(rec.from_sender(0)) >= len(want)

            await rec.wait_for(caught_up)
            got = rec.from_sender(0)
            assert len(got) == len(want)
            assert got == want  # intact and in order
        await c.recs[1].wait_for(lambda: c.recs[1].messages(2) == [big2])
        await c[0].drain()
        assert all(not r.failures() for r in c.recs)


async def test_push_larger_than_a_record_lands_whole(kind: str) -> None:
    row = 256 << 10
    data = random.Random(3).randbytes(200 << 10)
    async with cluster(kind, ring_bytes=64 << 10) as c:
        c.set_view(1, [0, 1, 2], row)
        off = 2 * row + 12  # unaligned start inside member 2's row
        c[2].push(1, off, data, [0])
        table = bytearray(3 * row)
        rec = c.recs[0]

        def landed() -> bool:
            for _v, s, o, d in rec.pushes(2):
                assert s == 2 and 2 * row <= o and o + len(d) <= 3 * row
                table[o : o + len(d)] = d
            return bytes(table[off : off + len(data)]) == data

        await rec.wait_for(landed)
        # pieces, if any, split on aligned table offsets so no aligned word is torn
        for _v, _s, o, _d in rec.pushes(2)[1:]:
            assert o % 8 == 0


async def test_push_outside_senders_row_is_dropped_logged_reported(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with cluster(kind) as c:
        c.set_view(1, [0, 1, 2], ROW, at=[1, 2])  # member 0 does not check: it misbehaves
        c[0].push(1, ROW + 8, b"intruder", [1, 2])  # into member 1's row
        c[0].push(1, 3 * ROW - 4, b"overflow", [1])  # runs past the table
        for t in (1, 2):

            def failed(t: int = t) -> bool:
                return bool(c.recs[t].failures(0))

            await c.recs[t].wait_for(failed)
            assert "outside member 0's row" in c.recs[t].failures(0)[0]
            assert c.recs[t].pushes(0) == []
        assert "outside member 0's row" in caplog.text
        # the group carries on: the other links deliver
        c[2].push(1, 2 * ROW, word(5), [1])
        await c.recs[1].wait_for(lambda: bool(c.recs[1].pushes(2)))
        assert c.recs[1].pushes(2) == [(1, 2, 2 * ROW, word(5))]
        # the offender, now behaving, gets through again (tcp: on a fresh stream)
        if kind == "tcp":
            await c.recs[0].wait_for(
                lambda: bool(c.recs[0].failures(1)) and bool(c.recs[0].failures(2))
            )
        c.set_view(1, [0, 1, 2], ROW, at=[0])
        c[0].push(1, 0, word(9), [1, 2])
        for t in (1, 2):

            def pushed(t: int = t) -> bool:
                return bool(c.recs[t].pushes(0))

            await c.recs[t].wait_for(pushed)
            assert c.recs[t].pushes(0) == [(1, 0, 0, word(9))]


async def test_pushes_for_future_view_are_held_until_set_view(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with cluster(kind) as c:
        c.set_view(1, [0, 1, 2], ROW)
        c.set_view(2, [0, 1, 2], 2 * ROW, at=[0])
        c[0].push(2, 0, word(1), [1, 2])
        c[0].push(2, 8, word(2), [1, 2])
        c[1].push(2, 0, b"bad-held", [2])  # member 1 writes member 0's row of view 2
        c[0].send(1, b"install view 2")
        c[0].send(2, b"install view 2")
        rec1, rec2 = c.recs[1], c.recs[2]
        await rec1.wait_for(lambda: rec1.messages(0) == [b"install view 2"])
        await rec2.wait_for(lambda: rec2.messages(0) == [b"install view 2"])
        # messages overtake held pushes; nothing for view 2 was delivered yet
        assert rec1.pushes() == [] and rec2.pushes() == []
        c.set_view(2, [0, 1, 2], 2 * ROW, at=[1, 2])
        c[0].push(2, 16, word(3), [1, 2])  # after set_view: queued behind the held ones
        want = [(2, 0, 0, word(1)), (2, 0, 8, word(2)), (2, 0, 16, word(3))]
        for rec in (rec1, rec2):

            def all_three(rec: Recorder = rec) -> bool:
                return len(rec.pushes(0)) == 3

            await rec.wait_for(all_three)
            assert rec.pushes(0) == want
        await rec2.wait_for(lambda: bool(rec2.failures(1)))
        assert "outside member 1's row" in rec2.failures(1)[0]
        assert rec2.pushes(1) == []
        assert "outside member 1's row" in caplog.text


async def test_pushes_for_views_older_than_kept_are_dropped(kind: str) -> None:
    async with cluster(kind) as c:
        c.set_view(1, [0, 1, 2], ROW, at=[0])
        for v in (1, 2, 3, 4):  # the receiver keeps only the newest few
            c.set_view(v, [0, 1, 2], ROW, at=[1])
        c[0].push(1, 0, word(1), [1])
        c[0].send(1, b"barrier")  # FIFO: had the push been accepted, it would be first
        await c.recs[1].wait_for(lambda: bool(c.recs[1].messages(0)))
        assert c.recs[1].pushes() == [] and c.recs[1].failures() == []


async def test_messages_to_self_and_pushes_to_self(kind: str) -> None:
    async with cluster(kind, n=2) as c:
        c.set_view(1, [0, 1], ROW)
        c[0].push(1, 0, word(1), [0, 1])  # self is skipped
        c[0].send(0, b"note to self")
        await c.recs[0].wait_for(lambda: bool(c.recs[0].messages(0)))
        await c.recs[1].wait_for(lambda: bool(c.recs[1].pushes(0)))
        assert c.recs[0].pushes() == []
        assert c.recs[0].messages(0) == [b"note to self"]


async def test_send_to_absent_member_reports_failure(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TcpTransport, "retry_delays", (0.0, 0.01, 0.02))
    monkeypatch.setattr(ShmTransport, "unreachable_after", 0.2)
    async with cluster(kind, n=2) as c:
        if kind == "tcp":
            with socket.socket() as sock:  # a port nobody listens on
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            c[0].add_peer(9, ("127.0.0.1", port))
        c[0].send(9, b"anyone?")
        await c.recs[0].wait_for(lambda: bool(c.recs[0].failures(9)))
        c[0].send(1, b"still fine")
        await c.recs[1].wait_for(lambda: c.recs[1].messages(0) == [b"still fine"])


async def test_drain_then_everything_arrives(kind: str) -> None:
    async with cluster(kind, ring_bytes=64 << 10) as c:
        c.set_view(1, [0, 1, 2], ROW)
        payload = os.urandom(1000)
        for _ in range(300):
            c[0].send(1, payload)
        await c[0].drain()
        await c.recs[1].wait_for(lambda: len(c.recs[1].messages(0)) == 300)
        assert set(c.recs[1].messages(0)) == {payload}


async def test_lifecycle_and_usage_errors(kind: str) -> None:
    group = new_group()
    fabric = LoopbackFabric()
    t = make_transport(kind, 0, group=group, fabric=fabric)
    rec = Recorder()
    with pytest.raises(UsageError):
        t.send(1, b"not started")
    t.set_view(1, [0, 1], ROW)  # allowed before start
    await t.start(rec)
    try:
        with pytest.raises(UsageError):
            await t.start(rec)
        with pytest.raises(UsageError):
            t.push(1, ROW, b"x", [1])  # outside my own row of a view I know
        with pytest.raises(UsageError):
            t.push(1, -1, b"x", [1])
        with pytest.raises(UsageError):
            t.push(1, 0, b"x", [-3])
        with pytest.raises(UsageError):
            t.set_view(1, [0, 2], ROW)  # same id, other members
        with pytest.raises(UsageError):
            t.set_view(0, [0, 1], ROW)  # going back
        with pytest.raises(UsageError):
            t.set_view(5, [0, 0], ROW)
        t.set_view(1, [0, 1], ROW)  # repeating the same view is fine
    finally:
        await t.close()
    await t.close()  # idempotent
    with pytest.raises(GroupClosed):
        t.send(1, b"x")
    with pytest.raises(GroupClosed):
        t.push(1, 0, b"x", [1])
    with pytest.raises(GroupClosed):
        t.set_view(2, [0, 1], ROW)
    with pytest.raises(GroupClosed):
        await t.start(rec)


async def test_close_releases_everything(kind: str) -> None:
    before = open_fds()
    ports: list[int] = []
    group = ""
    async with cluster(kind) as c:
        group = c.group
        c.set_view(1, [0, 1, 2], ROW)
        for s in range(3):
            for t in range(3):
                if s != t:
                    c[s].send(t, b"hi")
            c[s].push(1, s * ROW, word(s), [0, 1, 2])
        for r in c.recs:

            def all_in(r: Recorder = r) -> bool:
                return len(r.messages()) == 2 and len(r.pushes()) == 2

            await r.wait_for(all_in)
        if kind == "shm":
            assert len(ShmTransport.segments(group)) == 6
        if kind == "tcp":
            ports = [t.address[1] for t in c.transports if isinstance(t, TcpTransport)]
        transports: list[Transport] = list(c.transports)
    assert all(t.closed for t in transports)
    await asyncio.sleep(0)
    assert open_fds() <= before
    if kind == "shm":
        assert ShmTransport.segments(group) == []
        with open("/proc/self/maps") as f:
            assert group not in f.read()
    for port in ports:  # nobody listens on the ports any more
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
