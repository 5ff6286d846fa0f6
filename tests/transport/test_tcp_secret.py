"""The tcp handshake's secret mode against strangers: the initiator proves first, the acceptor
answers a failed proof with nothing derived from the secret, and proves itself only after a
valid one (issue 26, finding 1)."""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from transport_support import SECRET, Recorder

from derecho_async.errors import ProtocolViolation
from derecho_async.transport.tcp import TcpTransport, handshake

OTHER_SECRET = b"y7Qe2Lm9Xc4Vt1Bn8Rk3Pz6Hw0Js5Fd2Ga9Ku4Yi7To"
FIXED_NONCE = bytes(range(32))
HELLO = {"proto": handshake.PROTOCOL, "group": "", "role": handshake.MEMBER, "id": 7,
         "addr": ["127.0.0.1", 1]}


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TcpTransport, "retry_delays", (0.0, 0.01, 0.02, 0.05))


def _messages(data: bytes) -> list[dict[str, Any]]:
    """Every handshake message in ``data`` (u32 length + msgpack map), which they fill exactly."""
    out = []
    pos = 0
    while pos < len(data):
        (n,) = struct.unpack_from("<I", data, pos)
        body = data[pos + 4 : pos + 4 + n]
        assert len(body) == n, "a torn message"
        msg = msgpack.unpackb(body, raw=False)
        assert isinstance(msg, dict)
        out.append(msg)
        pos += 4 + n
    return out


async def _stranger(port: int, proto: str = handshake.PROTOCOL, prove: bool = True) -> bytes:
    """Play the initiator without the secret (a fixed nonce, then a made-up proof unless not
    ``prove``); return every byte the acceptor sent until it closed the stream."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        handshake.write_hs(writer, {**HELLO, "proto": proto, "nonce": FIXED_NONCE})
        (n,) = struct.unpack("<I", await asyncio.wait_for(reader.readexactly(4), 10))
        first = struct.pack("<I", n) + await asyncio.wait_for(reader.readexactly(n), 10)
        if prove:
            handshake.write_hs(writer, {"mac": bytes(32)})
        rest = await asyncio.wait_for(reader.read(), 10)  # until the acceptor closes
        return first + rest
    finally:
        writer.close()


async def _answers_to_a_stranger(secret: bytes) -> list[dict[str, Any]]:
    t = TcpTransport(0, ("127.0.0.1", 0), secret=secret)
    await t.start(Recorder(me=0))
    try:
        return _messages(await _stranger(t.address[1]))
    finally:
        await t.close()


async def test_a_stranger_gets_nothing_that_depends_on_the_secret() -> None:
    """Two members with different secrets answer the same stranger the same way: nothing it
    receives depends on the secret, so it has nothing to test guesses against offline."""
    a = await _answers_to_a_stranger(SECRET)
    b = await _answers_to_a_stranger(OTHER_SECRET)

    def blank(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # the acceptor's own nonce is random and its address has its own port
        return [{k: "<varies>" if k in ("nonce", "addr") else v for k, v in m.items()}
                for m in msgs]

    assert blank(a) == blank(b)
    assert all("mac" not in m for m in a), a
    assert a[-1] == {"verdict": "reject", "why": "authentication failed"}


async def test_a_failed_proof_is_refused_and_logged_and_the_member_carries_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="derecho_async.transport")
    rec = Recorder(me=0)
    t = TcpTransport(0, ("127.0.0.1", 0), secret=SECRET)
    await t.start(rec)
    other = TcpTransport(1, ("127.0.0.1", 0), secret=SECRET)
    rec1 = Recorder(me=1)
    await other.start(rec1)
    try:
        for _ in range(3):
            msgs = _messages(await _stranger(t.address[1]))
            assert msgs[-1]["verdict"] == "reject"
        assert "authentication failed" in caplog.text
        other.add_peer(0, t.address)
        other.send(0, b"still here")
        await rec.wait_for(lambda: rec.messages(1) == [b"still here"])
        assert rec.failures() == []
    finally:
        await other.close()
        await t.close()


async def test_another_protocol_version_is_told_which_one_without_a_proof() -> None:
    t = TcpTransport(0, ("127.0.0.1", 0), secret=SECRET)
    await t.start(Recorder(me=0))
    try:
        msgs = _messages(await _stranger(t.address[1], proto="derecho_async/tcp/1", prove=False))
    finally:
        await t.close()
    assert msgs == [{"why": f"expected protocol {handshake.PROTOCOL}"}]


async def _fake_acceptor(mode: str, seen: list[int]) -> tuple[asyncio.Server, int]:
    """A server answering as member 1 without knowing the secret: it runs the handshake to the
    initiator's proof, then says "accept" with no proof, a random one, or the initiator's own
    proof reflected back."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(1)
        try:
            await handshake.read_hs(reader)
            handshake.write_hs(
                writer, {"proto": handshake.PROTOCOL, "id": 1, "addr": ["127.0.0.1", port],
                         "nonce": FIXED_NONCE},
            )
            proof = (await handshake.read_hs(reader))["mac"]
            verdict: dict[str, Any] = {"verdict": "accept", "why": ""}
            if mode == "random proof":
                verdict["mac"] = bytes(range(100, 132))
            elif mode == "reflected proof":
                verdict["mac"] = proof
            handshake.write_hs(writer, verdict)
            await writer.drain()
            await reader.read()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    return server, port


@pytest.mark.parametrize("mode", ["no proof", "random proof", "reflected proof"])
async def test_an_acceptor_that_does_not_prove_the_secret_is_refused(mode: str) -> None:
    seen: list[int] = []
    server, port = await _fake_acceptor(mode, seen)
    rec = Recorder(me=0)
    t = TcpTransport(0, ("127.0.0.1", 0), secret=SECRET, peers={1: ("127.0.0.1", port)})
    await t.start(rec)
    try:
        with pytest.raises(ProtocolViolation, match="did not prove the shared secret"):
            await t.connect(1)
        assert seen == [1], "an authentication failure is not retried"
        assert "authentication failed" in rec.failures(1)[0]
    finally:
        await t.close()
        server.close()
        await server.wait_closed()


async def test_members_of_another_group_with_the_same_secret_are_refused() -> None:
    a = TcpTransport(0, ("127.0.0.1", 0), secret=SECRET, group="left")
    b = TcpTransport(1, ("127.0.0.1", 0), secret=SECRET, group="right")
    c = TcpTransport(2, ("127.0.0.1", 0), secret=SECRET, group="left")
    recs = [Recorder(me=i) for i in range(3)]
    for t, r in zip((a, b, c), recs, strict=True):
        await t.start(r)
    try:
        a.add_peer(1, b.address)
        with pytest.raises(ProtocolViolation, match="group"):  # permanent: not retried
            await a.connect(1)
        assert recs[1].messages() == []
        a.add_peer(2, c.address)
        a.send(2, b"same group")
        await recs[2].wait_for(lambda: recs[2].messages(0) == [b"same group"])
    finally:
        for t in (a, b, c):
            await t.close()


def test_the_key_is_stretched_once_per_secret_and_group() -> None:
    k = handshake.group_key(SECRET, "g")
    assert handshake.group_key(SECRET, "g") is k  # cached: once per process, not per connection
    assert len(k) == 32 and k not in (SECRET, handshake.group_key(SECRET, "h"))
    assert handshake.group_key(OTHER_SECRET, "g") != k
