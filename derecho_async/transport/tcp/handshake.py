"""The tcp transport's handshake: mutual proof of the group's secret, ids and addresses.

Theory of operation (DESIGN.md §5.3). Each message is a u32 length and a msgpack map (at most
4 KiB):

1. initiator -> acceptor: protocol tag, initiator id, listen address, 32-byte nonce Nc
2. acceptor -> initiator: acceptor id, listen address, nonce Ns,
   HMAC-SHA256(secret, "server" | transcript)
3. initiator -> acceptor: HMAC-SHA256(secret, "client" | transcript)
4. acceptor -> initiator: verdict "accept" | "dup" | "reject" (+ why)

The transcript binds both ids, both listen addresses and both nonces, and the role tags stop
reflection; nothing but HMACs of fresh nonces crosses the wire, so the secret never does.
:func:`client_handshake` runs the initiator's side, :func:`server_handshake` the acceptor's up
to the verdict, which the transport decides (one stream per pair) and sends with
:func:`send_verdict`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]

from derecho_async.errors import UsageError
from derecho_async.transport.tcp.framing import MAX_REASON, U63

__all__ = [
    "NONCE",
    "PROTOCOL",
    "Address",
    "AuthError",
    "HandshakeError",
    "check_address",
    "client_handshake",
    "field_addr",
    "field_bytes",
    "field_id",
    "mac",
    "read_hs",
    "send_verdict",
    "server_handshake",
    "transcript",
    "write_hs",
]

PROTOCOL = "derecho_async/tcp/1"
_HS_LEN = struct.Struct("<I")
_HS_MAX = 4096
NONCE = 32

Address = tuple[str, int]


class HandshakeError(Exception):
    """The handshake failed (retryable)."""


class AuthError(HandshakeError):
    """The peer did not prove the shared secret (not retried)."""


def check_address(addr: object, what: str) -> Address:
    """A (host, port) pair from a pair or a ``"host:port"`` / ``"[v6]:port"`` string."""
    if isinstance(addr, str):
        host, sep, port_text = addr.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if sep and host and port_text.isascii() and port_text.isdigit() and len(port_text) <= 5:
            addr = (host, int(port_text))
    if (
        isinstance(addr, tuple | list)
        and len(addr) == 2
        and isinstance(addr[0], str)
        and isinstance(addr[1], int)
        and not isinstance(addr[1], bool)
        and 0 <= addr[1] <= 65535
    ):
        return (addr[0], addr[1])
    raise UsageError(f"{what} must be a (host, port) pair or a 'host:port' string, got {addr!r}")


def mac(secret: bytes, role: bytes, transcript: bytes) -> bytes:
    """HMAC-SHA256 of ``transcript`` under ``secret``, tagged with the protocol and ``role``."""
    return hmac.new(
        secret, PROTOCOL.encode() + b"|" + role + b"|" + transcript, hashlib.sha256
    ).digest()


def transcript(
    c_id: int, c_addr: Address, nc: bytes, s_id: int, s_addr: Address, ns: bytes
) -> bytes:
    """What both MACs cover: both ids, both listen addresses, both nonces."""
    packed: bytes = msgpack.packb([c_id, list(c_addr), nc, s_id, list(s_addr), ns])
    return packed


def write_hs(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    """Write one handshake message."""
    data: bytes = msgpack.packb(obj)
    writer.write(_HS_LEN.pack(len(data)) + data)


async def read_hs(reader: asyncio.StreamReader) -> dict[str, Any]:
    """Read one handshake message (a map of at most 4 KiB), else :class:`HandshakeError`."""
    (n,) = _HS_LEN.unpack(await reader.readexactly(_HS_LEN.size))
    if n > _HS_MAX:
        raise HandshakeError(f"handshake message of {n} bytes (at most {_HS_MAX})")
    raw = await reader.readexactly(n)
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise HandshakeError(f"undecodable handshake message: {exc}") from exc
    if not isinstance(obj, dict):
        raise HandshakeError("handshake message is not a map")
    return obj


def field_id(obj: dict[str, Any], key: str) -> int:
    """Field ``key`` of a handshake message as a member id, else :class:`HandshakeError`."""
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < U63:
        raise HandshakeError(f"handshake field {key!r} is not a member id: {v!r}")
    return v


def field_bytes(obj: dict[str, Any], key: str, n: int) -> bytes:
    """Field ``key`` as exactly ``n`` bytes, else :class:`HandshakeError`."""
    v = obj.get(key)
    if not isinstance(v, bytes) or len(v) != n:
        raise HandshakeError(f"handshake field {key!r} is not {n} bytes")
    return v


def field_addr(obj: dict[str, Any], key: str) -> Address:
    """Field ``key`` as a listen address, else :class:`HandshakeError`."""
    v = obj.get(key)
    try:
        addr = check_address(v, key)
    except UsageError as exc:
        raise HandshakeError(str(exc)) from exc
    if len(addr[0]) > 255:
        raise HandshakeError("announced host name too long")
    return addr


async def client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    secret: bytes,
    my_id: int,
    my_addr: Address,
    expect: int | None,
) -> tuple[int, Address, str, str]:
    """Run the initiator's side of the handshake on an open stream.

    Returns (peer id, peer listen address, verdict, why). Raises :class:`AuthError` if the peer
    did not prove the secret, :class:`HandshakeError` for malformed or unexpected answers. Used
    by :class:`~.transport.TcpTransport`; tests drive raw streams with it.
    """
    nc = os.urandom(NONCE)
    write_hs(writer, {"proto": PROTOCOL, "id": my_id, "addr": list(my_addr), "nonce": nc})
    ch = await read_hs(reader)
    if ch.get("proto") != PROTOCOL:
        why = ch.get("why") if isinstance(ch.get("why"), str) else "unknown protocol"
        raise HandshakeError(f"peer refused the handshake: {why}")
    s_id = field_id(ch, "id")
    s_addr = field_addr(ch, "addr")
    ns = field_bytes(ch, "nonce", NONCE)
    s_mac = field_bytes(ch, "mac", 32)
    script = transcript(my_id, my_addr, nc, s_id, s_addr, ns)
    ok = hmac.compare_digest(s_mac, mac(secret, b"server", script))
    write_hs(writer, {"mac": mac(secret, b"client", script)})
    if not ok:
        raise AuthError(
            f"authentication failed: member {s_id} did not prove the shared secret"
            " (is the secret the same on both sides?)"
        )
    if expect is not None and s_id != expect:
        raise HandshakeError(f"the address answers as member {s_id}, not member {expect}")
    vd = await read_hs(reader)
    verdict = vd.get("verdict")
    why = vd.get("why", "")
    if verdict not in ("accept", "dup", "reject") or not isinstance(why, str):
        raise HandshakeError(f"bad handshake verdict {verdict!r}")
    return s_id, s_addr, verdict, why[:MAX_REASON]


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    secret: bytes,
    my_id: int,
    my_addr: Address,
) -> tuple[int, Address]:
    """Run the acceptor's side of the handshake up to the verdict on an accepted stream.

    Returns (peer id, peer's announced listen address); the caller decides the verdict and
    sends it with :func:`send_verdict`. Raises :class:`AuthError` (after sending a "reject"
    verdict) if the peer did not prove the secret, :class:`HandshakeError` for malformed
    messages.
    """
    hello = await read_hs(reader)
    if hello.get("proto") != PROTOCOL:
        write_hs(writer, {"why": f"expected protocol {PROTOCOL}"})
        raise HandshakeError(f"unknown protocol {hello.get('proto')!r}")
    c_id = field_id(hello, "id")
    c_addr = field_addr(hello, "addr")
    nc = field_bytes(hello, "nonce", NONCE)
    ns = os.urandom(NONCE)
    script = transcript(c_id, c_addr, nc, my_id, my_addr, ns)
    write_hs(
        writer,
        {
            "proto": PROTOCOL,
            "id": my_id,
            "addr": list(my_addr),
            "nonce": ns,
            "mac": mac(secret, b"server", script),
        },
    )
    proof = await read_hs(reader)
    c_mac = field_bytes(proof, "mac", 32)
    if not hmac.compare_digest(c_mac, mac(secret, b"client", script)):
        send_verdict(writer, "reject", "authentication failed")
        raise AuthError(
            f"authentication failed: the peer claiming to be member {c_id} did not prove"
            " the shared secret"
        )
    return c_id, c_addr


def send_verdict(writer: asyncio.StreamWriter, verdict: str, why: str = "") -> None:
    """Send the acceptor's verdict: "accept", "dup" (the peer keeps its own stream to us) or
    "reject", with the reason ``why``."""
    write_hs(writer, {"verdict": verdict, "why": why})
