"""The tcp transport's handshake: mutual proof of the group's secret, ids and addresses.

Theory of operation (DESIGN.md §5.3). Each message is a u32 length and a msgpack map (at most
4 KiB). The initiator proves first, and the acceptor sends nothing derived from the secret until
that proof checked out:

1. initiator -> acceptor: protocol tag, group, role, initiator id, listen address, 32-byte
   nonce Nc
2. acceptor -> initiator: acceptor id, listen address, nonce Ns (nothing secret-derived); or,
   to an initiator of another protocol, group or role, a refusal saying which (and the close)
3. initiator -> acceptor: HMAC-SHA256(K, protocol | "initiator" | transcript)
4. acceptor -> initiator: verdict "accept" | "dup" | "reject" | "busy" (+ why) and, only if
   the initiator's proof was valid, HMAC-SHA256(K, protocol | "acceptor" | transcript | verdict)

The transcript binds the group, the initiator's role, both ids, both listen addresses and both
nonces; the proofs' role tags stop reflection. The *role* says what the initiator is: a member
(:data:`MEMBER`, at a member port) or an external client (:data:`CLIENT`, at a member's client
port, proving the clients' secret); each port refuses the other role at once, so a client's
credentials never admit it as a member, and a member or client dialling the wrong port is told
so. A stranger who fails the proof gets a fixed "reject" and the close: no byte of
it depends on the secret, so one connection gives it nothing to test guesses against. K is the
secret stretched with scrypt, salted with the protocol and the group name (:func:`group_key`,
once per process, not per connection), so a guess costs an scrypt even to someone who recorded
a handshake. :func:`client_handshake` runs the initiator's side, :func:`server_handshake` the
acceptor's up to its verdict, which the transport decides (one stream per pair) and sends with
:meth:`Proven.answer`.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]

from derecho_async.errors import UsageError
from derecho_async.transport.tcp.framing import MAX_REASON, U63

__all__ = [
    "AUTH_FAILED",
    "CLIENT",
    "MEMBER",
    "NONCE",
    "PROTOCOL",
    "Address",
    "AuthError",
    "HandshakeError",
    "Proven",
    "Refused",
    "WrongRole",
    "check_address",
    "client_handshake",
    "field_addr",
    "field_bytes",
    "field_id",
    "group_key",
    "mac",
    "read_hs",
    "server_handshake",
    "transcript",
    "write_hs",
]

PROTOCOL = "derecho_async/tcp/4"
MEMBER = "member"
"""The role of a member dialling a member port."""
CLIENT = "client"
"""The role of an external client dialling a member's client port."""
_ROLES = (MEMBER, CLIENT)
AUTH_FAILED = "authentication failed"
"""The acceptor's reason for a failed proof (the same for every stranger)."""
_HS_LEN = struct.Struct("<I")
_HS_MAX = 4096
NONCE = 32
_MAC = 32
_VERDICTS = ("accept", "dup", "reject", "busy")
# scrypt cost: 2**14 x 8 x 128 bytes = 16 MiB and some tens of ms per guess
_KDF_N = 1 << 14
_KDF_R = 8
_KDF_P = 1

Address = tuple[str, int]


class HandshakeError(Exception):
    """The handshake failed (retryable)."""


class Refused(HandshakeError):
    """The peer refused us for good (not retried): ``auth`` when it serves another group or
    protocol (as a failed proof: :class:`AuthError`), else it refused the proven stream (our id
    is in use, our certificate names another member); ``wrong_port`` when it serves the other
    role (a member port dialled by a client, or a client port by a member)."""

    def __init__(self, message: str, *, auth: bool = False, wrong_port: bool = False) -> None:
        super().__init__(message)
        self.auth = auth
        self.wrong_port = wrong_port


class AuthError(Refused):
    """The peer did not prove the shared secret, or refused our proof (not retried)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, auth=True)


class WrongRole(HandshakeError):
    """The initiator has the other role than the port serves (a client at a member port, a
    member at a client port): it was told which port this is."""


_WRONG_PORT = {
    MEMBER: "this is a member port: external clients connect to a member's client_listen"
            " address",
    CLIENT: "this is a client port (client_listen): members connect to each other's listen"
            " address",
}


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


@functools.lru_cache(maxsize=32)
def group_key(secret: bytes, group: str) -> bytes:
    """The key the handshake's MACs use: ``secret`` stretched by scrypt (16 MiB, tens of ms),
    salted with the protocol tag and ``group``. Cached: a process pays it once per group, not
    per connection; a guesser pays it per guess."""
    salt = f"{PROTOCOL}|{group}".encode()
    return hashlib.scrypt(secret, salt=salt, n=_KDF_N, r=_KDF_R, p=_KDF_P, dklen=32)


def mac(key: bytes, role: bytes, transcript: bytes) -> bytes:
    """HMAC-SHA256 of ``transcript`` under ``key``, tagged with the protocol and ``role``."""
    return hmac.new(
        key, PROTOCOL.encode() + b"|" + role + b"|" + transcript, hashlib.sha256
    ).digest()


def transcript(
    group: str, role: str, c_id: int, c_addr: Address, nc: bytes, s_id: int, s_addr: Address,
    ns: bytes,
) -> bytes:
    """What both proofs cover: the group, the initiator's role, both ids, both listen
    addresses, both nonces."""
    packed: bytes = msgpack.packb([group, role, c_id, list(c_addr), nc, s_id, list(s_addr), ns])
    return packed


def _verdict_script(script: bytes, verdict: str, why: str) -> bytes:
    """What the acceptor's proof covers: the transcript and its verdict."""
    packed: bytes = msgpack.packb([script, verdict, why])
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
    group: str = "",
    role: str = MEMBER,
) -> tuple[int, Address, str, str]:
    """Run the initiator's side of the handshake on an open stream, as a ``role``.

    Returns (peer id, peer listen address, verdict, why). Raises :class:`AuthError` if the peer
    refused our proof or did not prove the secret itself, :class:`Refused` (``wrong_port``) if
    it serves the other role, :class:`HandshakeError` for malformed or unexpected answers.
    ``group`` salts the key and is part of the transcript. Used by
    :class:`~.transport.TcpTransport` and :class:`~derecho_async.api.client.Client`; tests drive
    raw streams with it.
    """
    if role not in _ROLES:
        raise ValueError(f"not a role: {role!r}")
    key = group_key(secret, group)
    nc = os.urandom(NONCE)
    write_hs(writer, {"proto": PROTOCOL, "group": group, "role": role, "id": my_id,
                      "addr": list(my_addr), "nonce": nc})
    ch = await read_hs(reader)
    if ch.get("proto") != PROTOCOL:
        why = ch.get("why") if isinstance(ch.get("why"), str) else "unknown protocol"
        if ch.get("serves") in _ROLES and ch.get("serves") != role:
            raise Refused(f"the peer refused the handshake: {str(why)[:MAX_REASON]}",
                          wrong_port=True)
        raise Refused(
            f"the peer refused the handshake of group {group!r}: {str(why)[:MAX_REASON]}",
            auth=True,
        )
    s_id = field_id(ch, "id")
    s_addr = field_addr(ch, "addr")
    ns = field_bytes(ch, "nonce", NONCE)
    script = transcript(group, role, my_id, my_addr, nc, s_id, s_addr, ns)
    write_hs(writer, {"mac": mac(key, b"initiator", script)})
    vd = await read_hs(reader)
    verdict = vd.get("verdict")
    why = vd.get("why", "")
    if verdict not in _VERDICTS or not isinstance(why, str):
        raise HandshakeError(f"bad handshake verdict {verdict!r}")
    why = why[:MAX_REASON]
    s_mac = vd.get("mac")
    if s_mac is None and verdict == "reject":
        raise AuthError(
            f"authentication failed: member {s_id} refused our proof ({why});"
            " is the secret the same on both sides?"
        )
    expected = mac(key, b"acceptor", _verdict_script(script, verdict, why))
    if not isinstance(s_mac, bytes) or not hmac.compare_digest(s_mac, expected):
        raise AuthError(
            f"authentication failed: member {s_id} did not prove the shared secret"
            " (is the secret the same on both sides?)"
        )
    if expect is not None and s_id != expect:
        raise HandshakeError(f"the address answers as member {s_id}, not member {expect}")
    return s_id, s_addr, verdict, why


@dataclass(frozen=True, slots=True)
class Proven:
    """An initiator whose proof checked out: its id and announced listen address.

    :meth:`answer` sends the acceptor's verdict with the acceptor's own proof.
    """

    member: int
    addr: Address
    _key: bytes = field(repr=False)
    _script: bytes = field(repr=False)

    def answer(self, writer: asyncio.StreamWriter, verdict: str, why: str = "") -> None:
        """Send the verdict: "accept", "dup" (the peer keeps its own stream to us), "reject"
        (for good) or "busy" (a client port at its capacity: try another member), with the
        reason ``why``, and the acceptor's proof over the transcript and verdict."""
        if verdict not in _VERDICTS:
            raise ValueError(f"not a verdict: {verdict!r}")
        why = why[:MAX_REASON]
        proof = mac(self._key, b"acceptor", _verdict_script(self._script, verdict, why))
        write_hs(writer, {"verdict": verdict, "why": why, "mac": proof})


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    secret: bytes,
    my_id: int,
    my_addr: Address,
    group: str = "",
    role: str = MEMBER,
) -> Proven:
    """Run the acceptor's side of the handshake up to the verdict on an accepted stream of a
    port that serves initiators of ``role``.

    Returns the proven initiator; the caller decides the verdict and sends it with
    :meth:`Proven.answer`. Nothing sent before that depends on the secret. Raises
    :class:`AuthError` (after a plain "reject", no proof of ours) if the peer did not prove the
    secret, :class:`WrongRole` (after saying which port this is) for an initiator of the other
    role, :class:`HandshakeError` for malformed messages or another protocol or group.
    """
    if role not in _ROLES:
        raise ValueError(f"not a role: {role!r}")
    hello = await read_hs(reader)
    if hello.get("proto") != PROTOCOL:
        write_hs(writer, {"why": f"expected protocol {PROTOCOL}"})
        raise HandshakeError(f"unknown protocol {str(hello.get('proto'))[:64]!r}")
    if hello.get("role") != role:
        other = hello.get("role")
        write_hs(writer, {"why": _WRONG_PORT[role], "serves": role})
        raise WrongRole(f"an initiator of role {str(other)[:16]!r} dialled this {role} port")
    if hello.get("group") != group:
        write_hs(writer, {"why": "the group name differs"})
        raise HandshakeError("the peer names another group")
    c_id = field_id(hello, "id")
    c_addr = field_addr(hello, "addr")
    nc = field_bytes(hello, "nonce", NONCE)
    ns = os.urandom(NONCE)
    write_hs(writer, {"proto": PROTOCOL, "id": my_id, "addr": list(my_addr), "nonce": ns})
    proof = await read_hs(reader)
    c_mac = field_bytes(proof, "mac", _MAC)
    key = group_key(secret, group)
    script = transcript(group, role, c_id, c_addr, nc, my_id, my_addr, ns)
    if not hmac.compare_digest(c_mac, mac(key, b"initiator", script)):
        write_hs(writer, {"verdict": "reject", "why": AUTH_FAILED})
        raise AuthError(
            f"authentication failed: the peer claiming to be member {c_id} did not prove"
            " the shared secret"
        )
    return Proven(c_id, c_addr, key, script)
