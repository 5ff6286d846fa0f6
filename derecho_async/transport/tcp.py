# Theory of operation
# -------------------
# Members on several hosts. Each pair of members shares one TCP stream (optionally TLS), used in
# both directions; pushes and messages share it, so every (sender, target) link is FIFO.
#
# Handshake (each message: u32 length + msgpack map, at most 4 KiB, 5 s timeout):
#   1. initiator -> acceptor: protocol tag, initiator id, listen address, 32-byte nonce Nc
#   2. acceptor  -> initiator: acceptor id, listen address, nonce Ns,
#                              HMAC-SHA256(secret, "server" | transcript)
#   3. initiator -> acceptor: HMAC-SHA256(secret, "client" | transcript)
#   4. acceptor  -> initiator: verdict "accept" | "dup" | "reject" (+ why)
# The transcript binds both ids, both listen addresses and both nonces, and the role tags stop
# reflection; nothing but HMACs of fresh nonces crosses the wire, so the secret never does. A
# side whose check fails logs "authentication failed" and refuses; the connecting side reports
# ``on_failure(member, "authentication failed ...")`` and does not retry.
#
# One stream per pair. A member dials a peer only when it has no stream to it. When both dial at
# once, the stream dialled by the lower id wins: the lower id answers "dup" to the higher id's
# dial while its own dial is in progress or established; the higher id accepts the lower id's
# dial, aborting its own. A "dup" loser waits for the winner's stream. A dial from a peer that
# the winner rule allows replaces an established stream (the peer only dials when it lost it).
# The verdict is decided and the stream installed synchronously, and data frames follow the
# verdict on the same stream, so no frame is ever sent on a stream that is then dropped by rule.
#
# Frames: a 32-byte ``struct`` header (type u32, flags u32 = 0, view_id u64, offset u64,
# length u64) and ``length`` payload bytes. Types: PUSH (view_id, table offset), MSG (view_id =
# offset = 0), BYE (graceful goodbye, empty), CLOSE (the peer closes on us; payload = UTF-8
# reason). Every header is checked before its payload is read (known type, zero flags, length
# <= max_frame, zero fields where they must be zero); pushes are checked against the sender's
# row by the PushGate. A bad frame, a truncated frame at EOF, or a push outside the sender's row
# closes that stream (a CLOSE frame tells the peer why), is logged, and is reported with
# ``on_failure(sender, reason)``; the other streams carry on, and the peer may dial again.
#
# Sending never blocks: frames go to the stream's write buffer, or, while there is no stream,
# to the link's queue, and a dialler task connects (bounded retries with backoff) and flushes
# the queue first, preserving order. A stream that dies without BYE is reported as lost (frames
# in flight may be gone); the next send dials again. Pushes longer than ``max_frame`` are split
# at 8-byte aligned table offsets (the push contract allows partial landing); a message longer
# than ``max_frame`` is refused with UsageError.
"""TCP transport (optionally TLS) for members on several hosts."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import socket
import ssl
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack  # type: ignore[import-untyped]

from derecho_async.errors import ConfigError, ProtocolViolation, UsageError
from derecho_async.transport.base import (
    GROUP_MESSAGE_LIMIT,
    Transport,
    TransportHandler,
    check_member_id,
    log,
)

if TYPE_CHECKING:
    from derecho_async.config import Config

__all__ = ["TcpTransport", "from_config"]

PROTOCOL = "derecho_async/tcp/1"
FRAME = struct.Struct("<IIQQQ")  # type, flags, view_id, offset, length
F_PUSH, F_MSG, F_BYE, F_CLOSE = 1, 2, 3, 4
_HS_LEN = struct.Struct("<I")
_HS_MAX = 4096
_NONCE = 32
_MAX_REASON = 1024
_U63 = 1 << 63
_WILDCARDS = {"", "0.0.0.0", "::"}

Address = tuple[str, int]


class _HandshakeError(Exception):
    """The handshake failed (retryable)."""


class _AuthError(_HandshakeError):
    """The peer did not prove the shared secret (not retried)."""


class _Duplicate(Exception):
    """The peer keeps its own stream to us (simultaneous dial)."""


def _check_address(addr: object, what: str) -> Address:
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


def _mac(secret: bytes, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(
        secret, PROTOCOL.encode() + b"|" + role + b"|" + transcript, hashlib.sha256
    ).digest()


def _transcript(
    c_id: int, c_addr: Address, nc: bytes, s_id: int, s_addr: Address, ns: bytes
) -> bytes:
    packed: bytes = msgpack.packb([c_id, list(c_addr), nc, s_id, list(s_addr), ns])
    return packed


def _write_hs(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    data: bytes = msgpack.packb(obj)
    writer.write(_HS_LEN.pack(len(data)) + data)


async def _read_hs(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = _HS_LEN.unpack(await reader.readexactly(_HS_LEN.size))
    if n > _HS_MAX:
        raise _HandshakeError(f"handshake message of {n} bytes (at most {_HS_MAX})")
    raw = await reader.readexactly(n)
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:
        raise _HandshakeError(f"undecodable handshake message: {exc}") from exc
    if not isinstance(obj, dict):
        raise _HandshakeError("handshake message is not a map")
    return obj


def _field_id(obj: dict[str, Any], key: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U63:
        raise _HandshakeError(f"handshake field {key!r} is not a member id: {v!r}")
    return v


def _field_bytes(obj: dict[str, Any], key: str, n: int) -> bytes:
    v = obj.get(key)
    if not isinstance(v, bytes) or len(v) != n:
        raise _HandshakeError(f"handshake field {key!r} is not {n} bytes")
    return v


def _field_addr(obj: dict[str, Any], key: str) -> Address:
    v = obj.get(key)
    try:
        addr = _check_address(v, key)
    except UsageError as exc:
        raise _HandshakeError(str(exc)) from exc
    if len(addr[0]) > 255:
        raise _HandshakeError("announced host name too long")
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

    Returns (peer id, peer listen address, verdict, why). Raises ``_AuthError`` if the peer did
    not prove the secret, ``_HandshakeError`` for malformed or unexpected answers. Used by
    :class:`TcpTransport`; public within the package so tests can drive raw streams.
    """
    nc = os.urandom(_NONCE)
    _write_hs(writer, {"proto": PROTOCOL, "id": my_id, "addr": list(my_addr), "nonce": nc})
    ch = await _read_hs(reader)
    if ch.get("proto") != PROTOCOL:
        why = ch.get("why") if isinstance(ch.get("why"), str) else "unknown protocol"
        raise _HandshakeError(f"peer refused the handshake: {why}")
    s_id = _field_id(ch, "id")
    s_addr = _field_addr(ch, "addr")
    ns = _field_bytes(ch, "nonce", _NONCE)
    s_mac = _field_bytes(ch, "mac", 32)
    transcript = _transcript(my_id, my_addr, nc, s_id, s_addr, ns)
    ok = hmac.compare_digest(s_mac, _mac(secret, b"server", transcript))
    _write_hs(writer, {"mac": _mac(secret, b"client", transcript)})
    if not ok:
        raise _AuthError(
            f"authentication failed: member {s_id} did not prove the shared secret"
            " (is the secret the same on both sides?)"
        )
    if expect is not None and s_id != expect:
        raise _HandshakeError(f"the address answers as member {s_id}, not member {expect}")
    vd = await _read_hs(reader)
    verdict = vd.get("verdict")
    why = vd.get("why", "")
    if verdict not in ("accept", "dup", "reject") or not isinstance(why, str):
        raise _HandshakeError(f"bad handshake verdict {verdict!r}")
    return s_id, s_addr, verdict, why[:_MAX_REASON]


@dataclass(eq=False)
class _Conn:
    """One authenticated stream to ``peer``; ``initiator`` is the id that dialled it."""

    peer: int
    initiator: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    closed: bool = False
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class _Link:
    """Everything about one peer: address, current stream, dialler, queued frames, waiters."""

    peer: int
    addr: Address | None = None
    conn: _Conn | None = None
    dialler: asyncio.Task[None] | None = None
    handshaking: bool = False
    queue: list[bytes] = field(default_factory=list)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    established: asyncio.Event = field(default_factory=asyncio.Event)


class TcpTransport(Transport):
    """Transport over TCP (optionally TLS): one authenticated stream per pair of members.

    ``listen`` is the (host, port) to bind (port 0 picks a free port; see :attr:`address`).
    ``secret`` is the group's shared secret; ``peers`` maps member ids to listen addresses,
    (host, port) or ``"host:port"`` (more with :meth:`add_peer`; a peer that dials in is learned
    automatically).
    ``ssl_server``/``ssl_client`` enable TLS for accepted/dialled streams. ``max_frame`` bounds
    one frame's payload: received frames above it are protocol violations.
    """

    #: delays before each dial attempt (bounded retries with backoff); tests may shorten them
    retry_delays: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
    #: seconds one handshake may take
    handshake_timeout: float = 5.0
    #: seconds a "dup" loser waits for the winning stream before dialling again
    dup_wait: float = 2.0

    def __init__(
        self,
        member_id: int,
        listen: tuple[str, int],
        *,
        secret: bytes,
        peers: Mapping[int, tuple[str, int] | str] = {},
        ssl_server: ssl.SSLContext | None = None,
        ssl_client: ssl.SSLContext | None = None,
        max_frame: int = 64 << 20,
    ) -> None:
        super().__init__(member_id)
        try:
            self._listen = _check_address(listen, "listen")
        except UsageError as exc:
            raise ConfigError("listen", "a (host: str, port: int) pair", listen) from exc
        if not isinstance(secret, bytes) or not secret:
            raise ConfigError("secret", "non-empty bytes", "<hidden>")
        self._secret = secret
        if isinstance(max_frame, bool) or not isinstance(max_frame, int):
            raise ConfigError("max_frame", "an int from 4096 to 2**32", max_frame)
        if not 4096 <= max_frame <= 1 << 32:
            raise ConfigError("max_frame", "an int from 4096 to 2**32", max_frame)
        self.max_frame = max_frame
        self._ssl_server = ssl_server
        self._ssl_client = ssl_client
        self._links: dict[int, _Link] = {}
        for pid, paddr in peers.items():
            try:
                self._link(check_member_id(pid, "peer id")).addr = _check_address(paddr, "address")
            except UsageError as exc:
                raise ConfigError("peers", "a mapping of member id to (host, port)", peers) from exc
        self._server: asyncio.Server | None = None
        self._address: Address | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def address(self) -> Address:
        """The bound listen address (host, port); available after :meth:`start`."""
        if self._address is None:
            raise UsageError("the transport is not started: no address yet")
        return self._address

    async def start(self, handler: TransportHandler) -> None:
        """Bind the listen address and start accepting streams."""
        self._begin_start(handler)
        host, port = self._listen
        try:
            self._server = await asyncio.start_server(
                self._on_accept, host or None, port, ssl=self._ssl_server, reuse_address=True
            )
        except BaseException:
            self._closed = True
            raise
        sockname = self._server.sockets[0].getsockname()
        self._address = (host if host in _WILDCARDS else str(sockname[0]), int(sockname[1]))

    async def close(self) -> None:
        """Say goodbye on every stream, close them and the listener; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        conns = []
        for link in self._links.values():
            link.queue.clear()
            self._resolve(link, None)
            if link.dialler is not None:
                link.dialler.cancel()
            if link.conn is not None:
                conns.append(link.conn)
                link.conn = None
        for conn in conns:
            conn.closed = True
            if not conn.writer.transport.is_closing():
                conn.writer.write(FRAME.pack(F_BYE, 0, 0, 0, 0))
            conn.writer.close()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        for conn in conns:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(conn.writer.wait_closed(), 2)
        if self._server is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        self._gate.clear()

    async def drain(self) -> None:
        """Wait until queued frames reached a stream (or failed) and every write buffer is empty."""
        self._check_usable()
        assert self._loop is not None
        futs = []
        for link in self._links.values():
            if link.queue:
                fut: asyncio.Future[None] = self._loop.create_future()
                link.waiters.append(fut)
                futs.append(fut)
        if futs:
            await asyncio.gather(*futs, return_exceptions=True)
        for link in list(self._links.values()):
            conn = link.conn
            if conn is not None and not conn.closed:
                with contextlib.suppress(ConnectionError, OSError):
                    await conn.writer.drain()

    async def flushed(self, peer: int) -> None:
        """Wait until every frame queued to ``peer`` so far was handed to the kernel (or its
        link failed). Bulk senders (the chain data plane) pace themselves with it, so control
        frames on the same stream never queue behind more than a few blocks."""
        self._check_usable()
        link = self._links.get(peer)
        if link is None:
            return
        if link.queue:
            assert self._loop is not None
            fut: asyncio.Future[None] = self._loop.create_future()
            link.waiters.append(fut)
            with contextlib.suppress(Exception):
                await fut
        conn = link.conn
        if conn is not None and not conn.closed:
            with contextlib.suppress(ConnectionError, OSError):
                await conn.writer.drain()

    # -- peers -------------------------------------------------------------------------------
    def add_peer(self, member_id: int, address: object) -> None:
        """Learn (or update) the listen address of ``member_id``.

        ``address`` is a (host, port) pair or a ``"host:port"`` string; None keeps what is
        known (a peer that dialled in announced its address in the handshake).
        """
        check_member_id(member_id)
        if address is None:
            self._link(member_id)
            return
        addr = _check_address(address, "address")
        if not self._closed:
            self._link(member_id).addr = addr

    async def connect(self, member_id: int) -> None:
        """Establish the stream to ``member_id`` now (streams are otherwise dialled on demand).

        Raises :class:`ProtocolViolation` if authentication fails and :class:`ConnectionError`
        if the peer stays unreachable.
        """
        self._check_usable()
        check_member_id(member_id)
        if member_id == self.member_id:
            raise UsageError("cannot connect to myself")
        link = self._link(member_id)
        if link.conn is not None:
            return
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        link.waiters.append(fut)
        self._ensure_dialler(link)
        await fut
        if link.conn is None:
            raise ConnectionError(f"member {member_id} is not connected")

    def _link(self, peer: int) -> _Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = _Link(peer)
        return link

    # -- sending ----------------------------------------------------------------------------
    def push(
        self, view_id: int, offset: int, data: bytes | memoryview, targets: Sequence[int]
    ) -> None:
        """Send PUSH frames (split at aligned offsets above ``max_frame``) to every target."""
        mv, remote = self._check_push(view_id, offset, data, targets)
        if not remote:
            return
        n = len(mv)
        if n <= self.max_frame:
            frames = [FRAME.pack(F_PUSH, 0, view_id, offset, n), bytes(mv)]
        else:
            frames = []
            for pos, end in self._aligned_pieces(offset, n, self.max_frame & ~7):
                frames += [
                    FRAME.pack(F_PUSH, 0, view_id, offset + pos, end - pos),
                    bytes(mv[pos:end]),
                ]
        for t in remote:
            self._emit(t, frames)

    def send(self, to: int, payload: bytes) -> None:
        """Send one MSG frame to ``to`` (at most ``max_frame`` bytes)."""
        mv = self._check_send(to, payload, self.max_frame, f"max_frame={self.max_frame}")
        if mv is None:
            return
        body = payload if type(payload) is bytes else bytes(mv)  # bytes: no copy needed
        self._emit(to, [FRAME.pack(F_MSG, 0, 0, 0, len(mv)), body])

    def _emit(self, peer: int, frames: list[bytes]) -> None:
        link = self._link(peer)
        conn = link.conn
        if conn is not None and conn.writer.transport.is_closing():
            self._lost(conn, "connection lost (transport closing)")
            conn = link.conn
        if conn is not None:
            conn.writer.writelines(frames)
        else:
            link.queue.extend(frames)
            self._ensure_dialler(link)

    # -- dialling ----------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        assert self._loop is not None
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _ensure_dialler(self, link: _Link) -> None:
        if self._closed:
            return
        if link.dialler is None or link.dialler.done():
            link.dialler = self._spawn(self._dial_loop(link))

    async def _dial_loop(self, link: _Link) -> None:
        last = "no attempt made"
        attempts = 0
        for delay in self.retry_delays:
            if delay:
                await asyncio.sleep(delay)
            if self._closed or link.conn is not None:
                return
            if link.addr is None:
                last = "no address known for it"
                continue
            attempts += 1
            addr = link.addr
            link.handshaking = True
            try:
                conn = await self._dial(link.peer, addr)
            except _AuthError as exc:
                self._link_failed(link, f"{exc} (at {addr[0]}:{addr[1]})", auth=True)
                return
            except _Duplicate:
                link.handshaking = False
                try:
                    await asyncio.wait_for(link.established.wait(), self.dup_wait)
                except TimeoutError:
                    last = "it kept a duplicate stream that never arrived"
                    continue
                return
            except (OSError, TimeoutError, asyncio.IncompleteReadError, _HandshakeError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                log.debug(
                    "member %d: dial to member %d failed: %s", self.member_id, link.peer, last
                )
                continue
            finally:
                link.handshaking = False
            if self._closed:
                conn.writer.close()
                return
            self._install(link, conn)
            conn.task = self._spawn(self._read_loop(conn))
            return
        self._link_failed(
            link, f"member {link.peer} unreachable after {attempts} dial attempts: {last}"
        )

    async def _dial(self, peer: int, addr: Address) -> _Conn:
        host, port = addr
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                host, port, ssl=self._ssl_client, server_hostname=host if self._ssl_client else None
            ),
            self.handshake_timeout,
        )
        ok = False
        try:
            async with asyncio.timeout(self.handshake_timeout):
                s_id, _s_addr, verdict, why = await client_handshake(
                    reader,
                    writer,
                    secret=self._secret,
                    my_id=self.member_id,
                    my_addr=self.address,
                    expect=peer,
                )
            if verdict == "dup":
                raise _Duplicate()
            if verdict != "accept":
                if "authentication" in why:
                    raise _AuthError(f"authentication failed: member {s_id} refused us: {why}")
                raise _HandshakeError(f"member {s_id} refused the stream: {why}")
            ok = True
            return _Conn(peer, self.member_id, reader, writer)
        finally:
            if not ok:
                writer.close()

    def _install(self, link: _Link, conn: _Conn) -> None:
        """Make ``conn`` the link's stream (synchronously with the verdict) and flush the queue."""
        old = link.conn
        link.conn = conn
        _tune(conn.writer)
        if old is not None and old is not conn:
            self._retire(old)
            reason = (
                "connection replaced by a newer one from the peer (frames in flight may be lost)"
            )
            log.warning("member %d: member %d: %s", self.member_id, link.peer, reason)
            assert self._loop is not None
            self._loop.call_soon(self._report_failure, link.peer, reason)
        if link.queue:
            conn.writer.writelines(link.queue)
            link.queue.clear()
        link.established.set()
        self._resolve(link, None)

    def _resolve(self, link: _Link, exc: BaseException | None) -> None:
        waiters, link.waiters = link.waiters, []
        for fut in waiters:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

    def _link_failed(self, link: _Link, reason: str, *, auth: bool = False) -> None:
        dropped = len(link.queue) // 2
        link.queue.clear()
        if auth:
            log.error("member %d: %s", self.member_id, reason)
            exc: BaseException = ProtocolViolation(reason, link.peer)
        else:
            log.warning("member %d: %s (%d frames dropped)", self.member_id, reason, dropped)
            exc = ConnectionError(reason)
        self._resolve(link, exc)
        self._report_failure(link.peer, reason)

    # -- accepting ---------------------------------------------------------------------------
    async def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        peername = writer.get_extra_info("peername")
        try:
            try:
                conn = await self._accept_handshake(reader, writer, peername)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, _HandshakeError) as exc:
                if isinstance(exc, _AuthError):
                    log.error(
                        "member %d: refused stream from %s: %s", self.member_id, peername, exc
                    )
                elif isinstance(exc, asyncio.IncompleteReadError | ConnectionError):
                    # the dialler went away mid-handshake (e.g. it lost a simultaneous dial)
                    log.info(
                        "member %d: handshake with %s ended early: %r",
                        self.member_id,
                        peername,
                        exc,
                    )
                else:
                    log.warning(
                        "member %d: handshake with %s failed: %s: %s",
                        self.member_id,
                        peername,
                        type(exc).__name__,
                        exc,
                    )
                writer.close()
                return
            if conn is None:
                writer.close()
                return
            conn.task = task
            await self._read_loop(conn)
        except asyncio.CancelledError:
            # close() cancels the stream handlers; on Python 3.11 asyncio would log a
            # cancelled handler as an error, so end quietly (the stream is being torn down).
            writer.close()
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def _accept_handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peername: object
    ) -> _Conn | None:
        async with asyncio.timeout(self.handshake_timeout):
            hello = await _read_hs(reader)
            if hello.get("proto") != PROTOCOL:
                _write_hs(writer, {"why": f"expected protocol {PROTOCOL}"})
                raise _HandshakeError(f"unknown protocol {hello.get('proto')!r}")
            c_id = _field_id(hello, "id")
            c_addr = _field_addr(hello, "addr")
            nc = _field_bytes(hello, "nonce", _NONCE)
            ns = os.urandom(_NONCE)
            my_addr = self.address
            transcript = _transcript(c_id, c_addr, nc, self.member_id, my_addr, ns)
            _write_hs(
                writer,
                {
                    "proto": PROTOCOL,
                    "id": self.member_id,
                    "addr": list(my_addr),
                    "nonce": ns,
                    "mac": _mac(self._secret, b"server", transcript),
                },
            )
            proof = await _read_hs(reader)
            c_mac = _field_bytes(proof, "mac", 32)
            if not hmac.compare_digest(c_mac, _mac(self._secret, b"client", transcript)):
                _write_hs(writer, {"verdict": "reject", "why": "authentication failed"})
                raise _AuthError(
                    f"authentication failed: the peer claiming to be member {c_id} did not prove"
                    " the shared secret"
                )
        if c_id == self.member_id:
            _write_hs(writer, {"verdict": "reject", "why": "same member id as the acceptor"})
            log.warning("member %d: refused a stream claiming my own id from %s", c_id, peername)
            return None
        if self._closed:
            return None
        # decide and install synchronously: no await from here to the installed stream
        link = self._link(c_id)
        if self.member_id < c_id and (
            link.handshaking or (link.conn is not None and link.conn.initiator == self.member_id)
        ):
            _write_hs(writer, {"verdict": "dup", "why": "lower id's stream wins"})
            return None
        host, port = c_addr
        if host in _WILDCARDS and isinstance(peername, tuple):
            host = str(peername[0])
        link.addr = (host, port)
        _write_hs(writer, {"verdict": "accept", "why": ""})
        conn = _Conn(c_id, c_id, reader, writer)
        if link.dialler is not None and not link.dialler.done() and link.handshaking:
            link.dialler.cancel()  # the lower id's stream (this one) wins
            link.handshaking = False
        self._install(link, conn)
        return conn

    # -- receiving ----------------------------------------------------------------------------
    def _check_header(
        self, typ: int, flags: int, view_id: int, offset: int, length: int
    ) -> str | None:
        if typ not in (F_PUSH, F_MSG, F_BYE, F_CLOSE):
            return f"unknown frame type {typ}"
        if flags:
            return f"frame flags {flags:#x} are not zero"
        if length > self.max_frame:
            return f"frame length {length} exceeds max_frame={self.max_frame}"
        if typ == F_PUSH:
            if view_id >= _U63 or offset >= _U63:
                return f"push view {view_id} / offset {offset} out of range"
        elif view_id or offset:
            return f"frame type {typ} has non-zero view/offset fields"
        if typ == F_BYE and length:
            return "goodbye frame with a payload"
        if typ == F_CLOSE and length > _MAX_REASON:
            return f"close reason of {length} bytes"
        return None

    async def _read_loop(self, conn: _Conn) -> None:
        reader = conn.reader
        try:
            while not conn.closed:
                try:
                    hdr = await reader.readexactly(FRAME.size)
                except asyncio.IncompleteReadError as exc:
                    if exc.partial:
                        self._violate(
                            conn,
                            f"truncated frame header at EOF ({len(exc.partial)} of {FRAME.size} bytes)",
                        )
                    else:
                        self._lost(conn, "connection lost (EOF without goodbye)")
                    return
                typ, flags, view_id, offset, length = FRAME.unpack(hdr)
                problem = self._check_header(typ, flags, view_id, offset, length)
                if problem is not None:
                    self._violate(conn, problem)
                    return
                try:
                    payload = await reader.readexactly(length) if length else b""
                except asyncio.IncompleteReadError as exc:
                    self._violate(
                        conn,
                        f"truncated frame at EOF ({len(exc.partial)} of {length} payload bytes)",
                    )
                    return
                if conn.closed:
                    return
                if typ == F_PUSH:
                    self._gate.push_arrived(view_id, conn.peer, offset, payload)
                elif typ == F_MSG:
                    self._deliver_message(conn.peer, payload)
                elif typ == F_BYE:
                    log.info("member %d: member %d said goodbye", self.member_id, conn.peer)
                    self._detach(conn)
                    return
                else:
                    reason = payload.decode("utf-8", "replace")
                    self._lost(conn, f"member {conn.peer} closed the stream: {reason}")
                    return
        except (ConnectionError, OSError) as exc:
            self._lost(conn, f"connection lost: {type(exc).__name__}: {exc}")

    def _detach(self, conn: _Conn) -> bool:
        """Close ``conn``; True if it was its link's current stream."""
        current = False
        link = self._links.get(conn.peer)
        if link is not None and link.conn is conn:
            link.conn = None
            link.established.clear()
            current = True
        self._retire(conn)
        return current

    def _retire(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.writer.close()

    def _lost(self, conn: _Conn, reason: str) -> None:
        if conn.closed:
            return
        if self._detach(conn) and not self._closed:
            log.warning("member %d: stream to member %d: %s", self.member_id, conn.peer, reason)
            self._report_failure(conn.peer, reason)

    def _violate(self, conn: _Conn, why: str) -> None:
        """Close ``conn`` because its peer broke the protocol; tell it why, log, report."""
        if conn.closed:
            return
        reason = f"protocol violation by member {conn.peer}: {why}"
        log.warning(
            "member %d: closing stream from member %d: %s", self.member_id, conn.peer, reason
        )
        if not conn.writer.transport.is_closing():
            msg = reason.encode()[:_MAX_REASON]
            conn.writer.writelines([FRAME.pack(F_CLOSE, 0, 0, 0, len(msg)), msg])
        self._detach(conn)
        self._report_failure(conn.peer, reason)

    def _on_violation(self, sender: int, reason: str) -> None:
        link = self._links.get(sender)
        if link is not None and link.conn is not None:
            conn = link.conn
            if conn.closed:
                return
            if not conn.writer.transport.is_closing():
                msg = reason.encode()[:_MAX_REASON]
                conn.writer.writelines([FRAME.pack(F_CLOSE, 0, 0, 0, len(msg)), msg])
            self._detach(conn)
        self._report_failure(sender, reason)


def _tune(writer: asyncio.StreamWriter) -> None:
    """TCP_NODELAY + keepalive; drain() waits for an empty write buffer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        except OSError:
            pass
    with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
        writer.transport.set_write_buffer_limits(high=0)


def from_config(config: Config) -> TcpTransport:
    """The tcp transport of the member ``config`` describes (see ``transport.registry``),
    with TLS where ``tls_cert`` is set."""
    from derecho_async.config import parse_hostport

    assert config.secret is not None  # Config requires it for a networked transport
    server_ctx = client_ctx = None
    if config.tls_cert:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=config.tls_ca)
        server_ctx.load_cert_chain(config.tls_cert, config.tls_key)
        client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.tls_ca)
        client_ctx.check_hostname = False
    return TcpTransport(
        config.member_id,
        parse_hostport(config.listen, "listen"),
        secret=config.secret.encode(),
        peers={m: parse_hostport(a, "peers") for m, a in config.peers.items()},
        ssl_server=server_ctx,
        ssl_client=client_ctx,
        max_frame=GROUP_MESSAGE_LIMIT,
    )
