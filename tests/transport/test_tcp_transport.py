"""TCP transport: authentication, hostile input, stream deduplication, reconnects, TLS."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
from transport_support import SECRET, Recorder, close_reason, cluster, dial_as

from derecho_async.errors import ConfigError, ProtocolViolation, UsageError
from derecho_async.transport.tcp import TcpTransport
from derecho_async.transport.tcp.framing import F_MSG, F_PUSH, FRAME

LOGGER = "derecho_async.transport"
ROW = 64


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TcpTransport, "retry_delays", (0.0, 0.01, 0.02, 0.05))


async def started(member: int, rec: Recorder, **kw: object) -> TcpTransport:
    t = TcpTransport(member, ("127.0.0.1", 0), secret=kw.pop("secret", SECRET), **kw)  # type: ignore[arg-type]
    await t.start(rec)
    return t


async def read_close_reason(reader: asyncio.StreamReader) -> str:
    """Read frames until CLOSE; return its reason (the stream must end right after)."""
    reason = await close_reason(reader)
    async with asyncio.timeout(10):
        assert await reader.read() == b""
    return reason


async def test_wrong_secret_is_refused_with_clear_errors(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    ra, rb = Recorder(), Recorder()
    a = await started(0, ra, secret=SECRET)
    b = await started(1, rb, secret=b"Qn6-Tz3Hb8Wx1_Lk5Ry9Mc2Vd7Fp4Gs0Ja3Ue8Io6Yt")
    try:
        a.add_peer(1, b.address)
        a.send(1, b"let me in")
        await ra.wait_for(lambda: bool(ra.failures(1)))
        assert "authentication failed" in ra.failures(1)[0]
        with pytest.raises(ProtocolViolation, match="authentication failed"):
            await a.connect(1)
        assert rb.messages() == [] and rb.failures() == []
        # the accepting side logged its refusal too
        assert any(
            r.levelno == logging.ERROR
            and "authentication failed" in r.getMessage()
            and "member 0" in r.getMessage()
            for r in caplog.records
        )
    finally:
        await a.close()
        await b.close()


HOSTILE = {
    "random bytes": os.urandom(40) + b"\xff" * 8,
    "unknown frame type": FRAME.pack(77, 0, 0, 0, 0),
    "nonzero flags": FRAME.pack(F_MSG, 5, 0, 0, 0),
    "oversized length": FRAME.pack(F_MSG, 0, 0, 0, 1 << 40),
    "message with view fields": FRAME.pack(F_MSG, 0, 3, 8, 0),
    "truncated header": FRAME.pack(F_MSG, 0, 0, 0, 4)[:13],
    "truncated payload": FRAME.pack(F_MSG, 0, 0, 0, 100) + b"only ten b",
    "push outside row": FRAME.pack(F_PUSH, 0, 1, 0, 8) + b"12345678",
}
EXPECT = {
    "random bytes": "protocol violation by member 2",
    "unknown frame type": "unknown frame type 77",
    "nonzero flags": "flags",
    "oversized length": "exceeds max_frame",
    "message with view fields": "non-zero view/offset",
    "truncated header": "truncated frame header at EOF",
    "truncated payload": "truncated frame at EOF",
    "push outside row": "outside member 2's row",
}


@pytest.mark.parametrize("case", list(HOSTILE))
async def test_hostile_frames_close_that_stream_only(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with cluster("tcp", n=3) as c:
        c.set_view(1, [0, 1, 2], ROW)
        target, rec = c[0], c.recs[0]
        assert isinstance(target, TcpTransport)
        reader, writer = await dial_as(target, 2)  # an authenticated but buggy member 2
        writer.write(HOSTILE[case])
        if case.startswith("truncated"):
            writer.write_eof()
        await rec.wait_for(lambda: bool(rec.failures(2)))
        assert EXPECT[case] in rec.failures(2)[0]
        assert EXPECT[case] in caplog.text
        if not case.startswith("truncated"):
            assert EXPECT[case] in await read_close_reason(reader)
        writer.close()
        assert rec.messages(2) == [] and rec.pushes(2) == []
        # the group carries on: member 1 still delivers to member 0 ...
        c[1].send(0, b"from 1")
        await rec.wait_for(lambda: rec.messages(1) == [b"from 1"])
        # ... and a fresh, well-behaved stream from member 2 works
        _reader2, writer2 = await dial_as(target, 2)
        writer2.writelines(
            [
                FRAME.pack(F_PUSH, 0, 1, 2 * ROW, 8),
                b"good row",
                FRAME.pack(F_MSG, 0, 0, 0, 2),
                b"ok",
            ]
        )
        await rec.wait_for(lambda: rec.messages(2) == [b"ok"])
        assert rec.pushes(2) == [(1, 2, 2 * ROW, b"good row")]
        writer2.close()


async def test_garbage_before_handshake_is_logged_and_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    async with cluster("tcp", n=2) as c:
        t = c[0]
        assert isinstance(t, TcpTransport)
        reader, writer = await asyncio.open_connection(*t.address)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(10):
            assert await reader.read() == b""
        writer.close()
        assert "handshake with" in caplog.text
        assert c.recs[0].failures() == []
        c[1].send(0, b"still here")
        await c.recs[0].wait_for(lambda: c.recs[0].messages(1) == [b"still here"])


async def test_simultaneous_dials_keep_one_stream_per_pair() -> None:
    for _round in range(5):
        async with cluster("tcp", n=3) as c:
            for s in range(3):  # everyone dials everyone in the same loop iteration
                for t in range(3):
                    if s != t:
                        for i in range(20):
                            c[s].send(t, b"%d>%d #%d" % (s, t, i))
            for t in range(3):
                rec = c.recs[t]
                for s in range(3):
                    if s != t:
                        want = [b"%d>%d #%d" % (s, t, i) for i in range(20)]

                        def caught_up(rec: Recorder = rec, s: int = s,
                                      want: list[bytes] = want) -> bool:
                            return len(rec.messages(s)) >= len(want)

                        await rec.wait_for(caught_up)
                        assert rec.messages(s) == want
                assert rec.failures() == []
            for s in range(3):
                for t in range(s + 1, 3):
                    a, b = c[s], c[t]
                    assert isinstance(a, TcpTransport) and isinstance(b, TcpTransport)
                    ca, cb = a._links[t].conn, b._links[s].conn
                    assert ca is not None and cb is not None
                    assert ca.initiator == cb.initiator  # both ends agree on the same stream


async def test_reconnects_on_demand_after_a_dropped_stream() -> None:
    async with cluster("tcp", n=2) as c:
        c.set_view(1, [0, 1], ROW)
        a = c[0]
        assert isinstance(a, TcpTransport)
        a.send(1, b"first")
        await c.recs[1].wait_for(lambda: c.recs[1].messages(0) == [b"first"])
        conn = a._links[1].conn
        assert conn is not None
        conn.writer.transport.abort()  # the network drops the stream
        await c.recs[0].wait_for(lambda: bool(c.recs[0].failures(1)))
        assert "connection lost" in c.recs[0].failures(1)[0]
        a.push(1, 0, b"12345678", [1])
        a.send(1, b"second")
        await c.recs[1].wait_for(lambda: c.recs[1].messages(0) == [b"first", b"second"])
        assert c.recs[1].pushes(0) == [(1, 0, 0, b"12345678")]
        assert a._links[1].conn is not conn


async def test_peer_restarting_on_same_address() -> None:
    ra, rb, rb2 = Recorder(), Recorder(), Recorder()
    a = await started(0, ra)
    b = await started(1, rb)
    addr = b.address
    try:
        a.add_peer(1, addr)
        a.send(1, b"hello")
        await rb.wait_for(lambda: rb.messages(0) == [b"hello"])
        await b.close()  # graceful: a goodbye, no failure report yet
        await asyncio.sleep(0.05)
        assert ra.failures() == []
        a.send(1, b"anyone?")  # nobody listens: bounded retries, then a failure report
        await ra.wait_for(lambda: bool(ra.failures(1)))
        assert "unreachable" in ra.failures(1)[0]
        b = TcpTransport(1, addr, secret=SECRET)
        await b.start(rb2)
        a.send(1, b"welcome back")
        await rb2.wait_for(lambda: rb2.messages(0) == [b"welcome back"])
    finally:
        await a.close()
        await b.close()


async def test_big_push_is_split_and_big_message_refused() -> None:
    async with cluster("tcp", n=2, max_frame=4096) as c:
        row = 1 << 16
        c.set_view(1, [0, 1], row)
        data = os.urandom(10_000)
        c[1].push(1, row + 4, data, [0])
        rec = c.recs[0]
        await rec.wait_for(lambda: sum(len(p[3]) for p in rec.pushes(1)) == len(data))
        got = rec.pushes(1)
        assert len(got) > 1 and all(len(p[3]) <= 4096 for p in got)
        assert b"".join(p[3] for p in got) == data
        assert next(p[2] for p in got) == row + 4 and all(p[2] % 8 == 0 for p in got[1:])
        with pytest.raises(UsageError, match="max_frame"):
            c[1].send(0, bytes(5000))


async def test_connect_helper_and_config_errors() -> None:
    with pytest.raises(ConfigError):
        TcpTransport(0, ("127.0.0.1", 0), secret=b"")
    with pytest.raises(ConfigError):
        TcpTransport(0, ("127.0.0.1", 0), secret=b"x", max_frame=10)
    with pytest.raises(ConfigError):
        TcpTransport(0, ("127.0.0.1", "80"), secret=b"x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TcpTransport(0, ("127.0.0.1", 0), secret=b"x", peers={1: "nowhere"})
    ra, rb = Recorder(), Recorder()
    a = await started(0, ra)
    b = await started(1, rb)
    try:
        with pytest.raises(UsageError):
            a.add_peer(1, "no port")
        with pytest.raises(UsageError):
            a.add_peer(1, ("host", 70000))
        a.add_peer(1, "[::1]:80")
        assert a._links[1].addr == ("::1", 80)
        a.add_peer(1, f"{b.address[0]}:{b.address[1]}")
        a.add_peer(1, None)  # keeps what is known
        assert a._links[1].addr == b.address
        await a.connect(1)
        assert a._links[1].conn is not None
        await b.close()
        await ra.wait_for(lambda: a._links[1].conn is None)
        with pytest.raises(ConnectionError):
            await a.connect(1)
    finally:
        await a.close()
        await b.close()


def _make_cert(tmp: Path) -> tuple[Path, Path] | None:
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    r = subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        capture_output=True,
        check=False,
    )
    return (cert, key) if r.returncode == 0 else None


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    made = _make_cert(tmp_path_factory.mktemp("tls"))
    if made is None:
        pytest.skip("openssl cannot make a test certificate here")
    return made


async def test_tls_streams(tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(cert))
    recs = [Recorder(), Recorder()]
    ts = [
        TcpTransport(i, ("127.0.0.1", 0), secret=SECRET, ssl_server=server, ssl_client=client)
        for i in range(2)
    ]
    for t, r in zip(ts, recs, strict=True):
        await t.start(r)
    try:
        ts[0].add_peer(1, ts[1].address)
        ts[1].add_peer(0, ts[0].address)
        ts[0].set_view(1, [0, 1], ROW)
        ts[1].set_view(1, [0, 1], ROW)
        big = os.urandom(3 << 20)
        ts[0].send(1, big)
        ts[0].push(1, 0, b"tls-word", [1])
        ts[1].send(0, b"back")
        await recs[1].wait_for(lambda: recs[1].messages(0) == [big] and len(recs[1].pushes(0)) == 1)
        await recs[0].wait_for(lambda: recs[0].messages(1) == [b"back"])
        conn = ts[0]._links[1].conn
        assert conn is not None and conn.writer.get_extra_info("ssl_object") is not None
        # drain() returns over TLS too (with high=0 asyncio's TLS layer never resumed writing)
        ts[0].send(1, big)
        await asyncio.wait_for(ts[0].drain(), 10)
    finally:
        for t in ts:
            await t.close()
