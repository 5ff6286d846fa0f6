"""TCP transport: what strangers may cost (issue 26, finding 3), on real sockets in-process.

The pending-connection policy and the rate-limited log are checked as pure objects first; then
a started transport: frames before admission, the handshake deadline (TLS included), the caps
on pending connections, the descriptor reserve, the log volume of a flood, and a stream closed
in the middle of a large frame. The process-level attacks are tests/runtime/test_tcp_attacks.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from transport_support import SECRET, Recorder, close_reason, dial_as

from derecho_async.errors import ConfigError
from derecho_async.transport.tcp import TcpTransport
from derecho_async.transport.tcp.framing import F_MSG, F_PUSH, FRAME
from derecho_async.transport.tcp.limits import PendingTable, RefusalLog, TcpLimits

LOGGER = "derecho_async.transport"
ROW = 64


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TcpTransport, "retry_delays", (0.0, 0.01, 0.02, 0.05))


# -- the policy, pure ------------------------------------------------------------------------
def test_pending_table_caps_per_host_and_in_total_and_evicts_fairly() -> None:
    table: PendingTable[str] = PendingTable(TcpLimits(max_pending=4, max_pending_per_host=3))
    for key in ("a1", "a2", "a3"):
        assert table.offer("A", 10, 1024) == (None, None)
        table.add(key, "A")
    assert table.offer("A", 10, 1024) == ("per-address cap", None)
    assert table.offer("B", 10, 1024) == (None, None)
    table.add("b1", "B")
    # full: the oldest connection of the host holding the most (A: 3) makes room for C (0)
    assert table.offer("C", 10, 1024) == (None, "a1")
    table.discard("a1")
    table.add("c1", "C")
    # B would hold 2, as many as A: nobody is evicted for it
    assert table.offer("B", 10, 1024) == ("connection cap", None)
    assert len(table) == 4 and table.count("A") == 2 and "a1" not in table
    for key in ("a2", "a3", "b1", "c1"):
        table.discard(key)
    assert len(table) == 0 and table.count("A") == 0


def test_pending_table_keeps_descriptors_in_reserve() -> None:
    table: PendingTable[str] = PendingTable(TcpLimits(fd_reserve=100))
    assert table.offer("A", 899, 1000) == (None, None)
    assert table.offer("A", 900, 1000) == ("descriptor reserve", None)  # nothing to evict
    table.add("a1", "A")
    table.add("a2", "A")
    assert table.offer("B", 950, 1000) == (None, "a1")
    # at most half the limit is kept in reserve
    assert table.offer("B", 60, 128) == (None, None)


def test_limits_are_checked() -> None:
    with pytest.raises(ConfigError):
        TcpLimits(max_pending=0)
    with pytest.raises(ConfigError):
        TcpLimits(handshake_s=0)
    with pytest.raises(ConfigError):
        TcpLimits(pre_admission_frame=True)


def test_refusal_log_logs_a_few_then_one_summary_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    now = [100.0]
    rl = RefusalLog(
        3, logging.getLogger(LOGGER), TcpLimits(log_interval_s=10, log_detailed=2), lambda: now[0]
    )
    for i in range(500):
        rl.note("handshake deadline" if i % 5 else "per-address cap", f"event {i}")
    assert [r.getMessage() for r in caplog.records] == ["member 3: event 0", "member 3: event 1"]
    now[0] += 10  # the next interval: its first event brings the summary of the last
    rl.note("bad handshake", "event 500")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 4 and msgs[3] == "member 3: event 500"
    assert "498 more connections refused or closed before admission" in msgs[2]
    assert "handshake deadline: 399" in msgs[2] and "per-address cap: 99" in msgs[2]
    rl.flush()  # nothing suppressed since: nothing to say
    assert len(caplog.records) == 4
    assert rl.counts == {"handshake deadline": 400, "per-address cap": 100, "bad handshake": 1}


# -- a started transport -----------------------------------------------------------------------
async def started(member: int, rec: Recorder, **kw: object) -> TcpTransport:
    t = TcpTransport(member, ("127.0.0.1", 0), secret=SECRET, **kw)  # type: ignore[arg-type]
    await t.start(rec)
    return t


async def closed_after(reader: asyncio.StreamReader, timeout: float = 10) -> float:
    """Seconds until the peer closes the stream (EOF or reset)."""
    t0 = time.monotonic()
    with contextlib.suppress(ConnectionError):
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
    return time.monotonic() - t0


async def test_a_stranger_may_send_only_handshake_sized_frames() -> None:
    rec = Recorder()
    t = await started(0, rec, admission=True, max_frame=1 << 30)
    try:
        t.set_view(1, [0, 1], ROW)
        reader, writer = await dial_as(t, 42)
        writer.write(FRAME.pack(F_MSG, 0, 0, 0, 1 << 30))  # announces 1 GiB
        reason = await close_reason(reader)
        assert "frame of 1073741824 bytes before admission" in reason
        assert "member 42 is in no recent view" in reason
        writer.close()
        assert rec.messages() == [] and t._links.get(42) is None  # nothing kept of it
        assert t.refusals.counts["bad frame before admission"] == 1
        # a stranger's small message gets through (a join request is one) ...
        reader, writer = await dial_as(t, 43)
        writer.write(FRAME.pack(F_MSG, 0, 0, 0, 5) + b"hello")
        await rec.wait_for(lambda: rec.messages(43) == [b"hello"])
        # ... but not more than pre_admission_bytes in all
        body = bytes(t.limits.pre_admission_frame)
        with contextlib.suppress(ConnectionError):  # it may close with some of it unread
            for _ in range(t.limits.pre_admission_bytes // len(body) + 1):
                writer.write(FRAME.pack(F_MSG, 0, 0, 0, len(body)) + body)
                await writer.drain()
        await rec.wait_for(lambda: bool(rec.failures(43)))
        assert "bytes sent before admission" in rec.failures(43)[0]
        assert len(rec.messages(43)) == 1 + t.limits.pre_admission_bytes // (len(body) + 32)
        writer.close()
        # a peer the owner gave an address to is admitted: large frames are fine
        t.add_peer(44, ("127.0.0.1", 9))
        reader, writer = await dial_as(t, 44)
        big = os.urandom(3 << 20)
        writer.write(FRAME.pack(F_MSG, 0, 0, 0, len(big)) + big)
        await rec.wait_for(lambda: rec.messages(44) == [big])
        writer.close()
    finally:
        await t.close()


async def test_a_joiner_is_admitted_by_the_view_that_names_it() -> None:
    rec = Recorder()
    t = await started(0, rec, admission=True)
    try:
        t.set_view(1, [0, 1], ROW)
        _reader, writer = await dial_as(t, 5)
        # a push for the view the joiner expects waits; its messages do not
        writer.write(FRAME.pack(F_PUSH, 0, 2, 2 * ROW, 8) + b"joinword")
        writer.write(FRAME.pack(F_MSG, 0, 0, 0, 4) + b"join")
        await rec.wait_for(lambda: rec.messages(5) == [b"join"])
        assert rec.pushes(5) == []
        t.set_view(2, [0, 1, 5], ROW)
        assert rec.pushes(5) == []  # never from inside the driver's call
        await rec.wait_for(lambda: rec.pushes(5) == [(2, 5, 2 * ROW, b"joinword")])
        big = os.urandom(1 << 20)  # admitted: the frame limit is lifted
        writer.write(FRAME.pack(F_MSG, 0, 0, 0, len(big)) + big)
        await rec.wait_for(lambda: rec.messages(5) == [b"join", big])
        # a push from a stranger for a view it is not in is a violation at once
        _reader2, writer2 = await dial_as(t, 6)
        writer2.write(FRAME.pack(F_PUSH, 0, 2, 0, 8) + b"12345678")
        await rec.wait_for(lambda: bool(rec.failures(6)))
        assert "push for view 2 from member 6, which is not in it" in rec.failures(6)[0]
        writer.close()
        writer2.close()
        assert rec.failures(0) == [] and rec.failures(1) == []
    finally:
        await t.close()


async def test_handshakes_have_a_deadline(tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    limits = TcpLimits(handshake_s=0.5)
    plain = await started(0, Recorder(), limits=limits)
    tls = await started(1, Recorder(), limits=limits, ssl_server=server)
    try:
        for t in (plain, tls):
            silent = await asyncio.open_connection(*t.address)  # never speaks
            slow = await asyncio.open_connection(*t.address)
            slow[1].write(b"\x16\x03")  # the start of a length prefix (or of a TLS record)
            assert await closed_after(silent[0]) < 2.5
            assert await closed_after(slow[0]) < 2.5
            silent[1].close()
            slow[1].close()
            assert t.refusals.counts["handshake deadline"] == 2
    finally:
        await plain.close()
        await tls.close()


async def _silent(port: int, src: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))


async def test_pending_connections_are_capped_and_a_member_still_gets_through() -> None:
    ra, rb = Recorder(), Recorder()
    limits = TcpLimits(max_pending=8, max_pending_per_host=4, handshake_s=10)
    a = await started(0, ra, limits=limits)
    b = await started(1, rb)
    port = a.address[1]
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(5):
            streams.append(await _silent(port, "127.0.0.2"))
        for _ in range(4):
            streams.append(await _silent(port, "127.0.0.3"))
        await asyncio.sleep(0.2)
        # four from each address are held, the fifth from .2 is refused at once
        assert a.refusals.counts == {"per-address cap": 1}
        assert await closed_after(streams[4][0], 2) < 2
        assert len(a._entrance.pending) == 8
        # full: a member dialling from another address (127.0.0.1) takes the place of the
        # oldest connection of a flooding address
        b.add_peer(0, a.address)
        b.send(0, b"still welcome")
        await ra.wait_for(lambda: ra.messages(1) == [b"still welcome"])
        assert a.refusals.counts == {"per-address cap": 1, "evicted": 1}
        assert await closed_after(streams[0][0], 2) < 2
        assert rb.failures() == []
    finally:
        for _r, w in streams:
            w.close()
        await a.close()
        await b.close()


async def test_accepting_stops_short_of_the_descriptor_limit() -> None:
    ra, rb = Recorder(), Recorder()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    a = await started(
        0, ra, limits=TcpLimits(max_pending=1000, max_pending_per_host=1000, fd_reserve=40,
                                handshake_s=10)
    )
    b = await started(1, rb, limits=TcpLimits(fd_reserve=0))
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    in_use = len(os.listdir("/proc/self/fd"))
    # both ends of each connection are in this process: it holds about 20 pending, then
    # refuses what would leave fewer than 40 descriptors free
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 80, hard))
    try:
        for i in range(30):
            streams.append(await _silent(a.address[1], f"127.0.0.{2 + i}"))
        await asyncio.sleep(0.2)
        assert a.refusals.counts["descriptor reserve"] >= 5
        assert 10 <= len(a._entrance.pending) <= 22
        a.add_peer(1, b.address)  # the reserve keeps a descriptor for the member's own link
        a.send(1, b"own link")
        await rb.wait_for(lambda: rb.messages(0) == [b"own link"])
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for _r, w in streams:
            w.close()
        await a.close()
        await b.close()


async def test_a_flood_of_hostile_connections_logs_a_bounded_number_of_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    t = await started(0, Recorder())
    try:
        for i in range(150):
            reader, writer = await asyncio.open_connection(*t.address)
            writer.write(b"GET / HTTP/1.1\r\n\r\n" if i % 2 else b"\x04\x00\x00\x00junk")
            await closed_after(reader)
            writer.close()
    finally:
        await t.close()
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(lines) <= t.limits.log_detailed + 1, lines
    assert "147 more connections refused or closed before admission" in lines[-1]
    assert t.refusals.counts["bad handshake"] == 150


async def test_closing_a_stream_mid_frame_does_not_stall_the_loop() -> None:
    rec = Recorder()
    t = await started(0, rec, max_frame=1 << 30)
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.ensure_future(ticker())
    try:
        t.add_peer(1, ("127.0.0.1", 9))  # an admitted member that dies mid-frame
        _reader, writer = await dial_as(t, 1)
        writer.write(FRAME.pack(F_MSG, 0, 0, 0, 1 << 30))
        chunk = bytes(1 << 20)
        for _ in range(256):
            writer.write(chunk)
            await writer.drain()
        gaps.clear()  # what matters is the close and what follows
        writer.transport.abort()
        await rec.wait_for(lambda: bool(rec.failures(1)))
        await asyncio.sleep(0.3)
        assert "truncated frame at EOF" in rec.failures(1)[0] or "lost" in rec.failures(1)[0]
        assert max(gaps) < 0.25, f"the loop stalled {max(gaps):.3f} s"
    finally:
        stop.set()
        await tick
        await t.close()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate and key for 127.0.0.1 (as in test_tcp_transport.py)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a test certificate")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    r = subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        capture_output=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip("openssl cannot make a test certificate here")
    return cert, key


def test_source_addresses_of_loopback_are_usable() -> None:
    """The tests above connect from 127.0.0.x, as hosts other than the member."""
    with socket.socket() as s:
        s.bind(("127.0.0.7", 0))
