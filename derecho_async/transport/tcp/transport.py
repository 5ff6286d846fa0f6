"""TcpTransport: members on several hosts, one authenticated stream (optionally TLS) per pair.

Theory of operation (DESIGN.md §5.3): each pair of members shares one TCP stream, used in both
directions; pushes and messages share it, so every (sender, target) link is FIFO. A stream
starts with the handshake (:mod:`.handshake`); a side whose check fails logs "authentication
failed" and refuses; the dialling side reports ``on_failure(member, "authentication failed
...")`` and does not retry. One stream per pair: a member dials a peer only when it has no
stream to it; when both dial at once the stream dialled by the lower id wins (the lower id
answers "dup" while its own dial is in progress or established; the higher id accepts the
lower id's dial, aborting its own), and a dial the winner rule allows replaces an established
stream. The verdict is decided and the stream installed synchronously, and data frames follow
the verdict, so no frame is ever sent on a stream that is then dropped by rule. Then frames
(:mod:`.framing`): a bad frame, a truncated frame at EOF or a push outside the sender's row
(the PushGate) closes that stream with a CLOSE frame saying why, and is reported; the other
streams carry on. Sending never blocks: frames go to the stream's write buffer or, while there
is no stream, to the link's queue, which a dialler task (bounded retries with backoff) flushes
first once connected. A stream that dies without BYE is reported as lost; the next send dials
again. Pushes longer than ``max_frame`` are split at 8-byte aligned table offsets; a longer
message is refused with UsageError.

Strangers (DESIGN.md §5.3, :mod:`.limits`): the transport accepts on its own listening sockets
and decides at accept time, before reading a byte, whether to hold a connection (caps per peer
address and in total, descriptors kept free); the handshake, TLS included, must end within
``TcpLimits.handshake_s``. With ``admission`` on (the runtime's setting), a peer that
authenticated but is neither given an address by the owner nor a member of a recent view may
send only handshake-sized frames until a view names it (pushes held meanwhile, all of it
bounded). Payloads above 1 MiB are read in pieces as they arrive, never into one buffer sized
from the header, and what a closed stream leaves behind is freed off the loop. Refused and
closed hostile connections are logged through a rate-limited :class:`~.limits.RefusalLog`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from derecho_async.errors import ConfigError, ProtocolViolation, UsageError
from derecho_async.transport.base import (
    GROUP_MESSAGE_LIMIT,
    KEEP_VIEWS,
    Transport,
    TransportHandler,
    check_member_id,
    log,
)
from derecho_async.transport.tcp.framing import (
    F_BYE,
    F_MSG,
    F_PUSH,
    FRAME,
    bye_frame,
    check_header,
    close_frames,
)
from derecho_async.transport.tcp.handshake import (
    Address,
    AuthError,
    HandshakeError,
    check_address,
    client_handshake,
    group_key,
    server_handshake,
)
from derecho_async.transport.tcp.limits import (
    PendingTable,
    RefusalLog,
    TcpLimits,
    descriptor_limit,
)

if TYPE_CHECKING:
    from derecho_async.config import Config

__all__ = ["TcpTransport", "from_config"]

_WILDCARDS = {"", "0.0.0.0", "::"}


class _Duplicate(Exception):
    """The peer keeps its own stream to us (simultaneous dial)."""


#: payloads up to this size are read in one piece; longer ones in pieces of this size
_PIECE = 1 << 20
#: a payload cut short at close is freed on the loop up to this size, off the loop above it
_FREE_ON_LOOP = 8 << 20
#: accepts taken in a row before the accept loop yields to the others
_ACCEPT_BURST = 16
#: errors of accept() that mean "out of descriptors or memory": wait, then accept again
_ACCEPT_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Truncated(Exception):
    """A payload read in pieces ended at EOF after ``got`` of ``want`` bytes."""

    def __init__(self, got: int, want: int) -> None:
        super().__init__(f"{got} of {want} bytes")
        self.got = got
        self.want = want


@dataclass(eq=False)
class _Conn:
    """One authenticated stream to ``peer``; ``initiator`` is the id that dialled it.

    ``admitted`` is False while the peer may send only handshake-sized frames (``budget``
    bytes in all); its pushes wait in ``held`` until it is admitted. ``accepted`` is the
    pending-connection record of an accepted stream until admission."""

    peer: int
    initiator: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    closed: bool = False
    task: asyncio.Task[None] | None = None
    admitted: bool = True
    budget: int = 0
    held: list[tuple[int, int, bytes]] = field(default_factory=list)
    accepted: _Accepted | None = None
    host: str = ""


@dataclass(eq=False)
class _Accepted:
    """An accepted connection, pending from accept until its peer is admitted (or it ends)."""

    host: str
    peer: object
    sock: socket.socket | None
    writer: asyncio.StreamWriter | None = None
    conn: _Conn | None = None
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
    ``secret`` is the group's shared secret and ``group`` its name (the handshake's key is the
    secret stretched once, salted with the group; a peer of another group is refused); ``peers``
    maps member ids to listen addresses,
    (host, port) or ``"host:port"`` (more with :meth:`add_peer`; a peer that dials in is learned
    automatically).
    ``ssl_server``/``ssl_client`` enable TLS for accepted/dialled streams. ``max_frame`` bounds
    one frame's payload: received frames above it are protocol violations.

    ``limits`` bounds what connections that are not admitted may cost (:class:`TcpLimits`).
    With ``admission`` on, an authenticated peer is admitted only if it is in ``peers``, was
    given an address with :meth:`add_peer`, or is a member of one of the last views set with
    :meth:`set_view`; until then it may send only frames of ``limits.pre_admission_frame``
    bytes (``limits.pre_admission_bytes`` in all). The runtime turns it on (``from_config``); a
    transport that is never told the views (such as rdma's channel) leaves it off.
    :attr:`refusals` counts refused and closed hostile connections by reason.
    """

    #: delays before each dial attempt (bounded retries with backoff); tests may shorten them
    retry_delays: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
    #: seconds one handshake this member dials may take (accepted ones: ``limits.handshake_s``)
    handshake_timeout: float = 5.0
    #: seconds a "dup" loser waits for the winning stream before dialling again
    dup_wait: float = 2.0

    def __init__(
        self,
        member_id: int,
        listen: tuple[str, int],
        *,
        secret: bytes,
        group: str = "",
        peers: Mapping[int, tuple[str, int] | str] = {},
        ssl_server: ssl.SSLContext | None = None,
        ssl_client: ssl.SSLContext | None = None,
        max_frame: int = 64 << 20,
        limits: TcpLimits | None = None,
        admission: bool = False,
    ) -> None:
        super().__init__(member_id)
        try:
            self._listen = check_address(listen, "listen")
        except UsageError as exc:
            raise ConfigError("listen", "a (host: str, port: int) pair", listen) from exc
        if not isinstance(secret, bytes) or not secret:
            raise ConfigError("secret", "non-empty bytes", "<hidden>")
        if not isinstance(group, str):
            raise ConfigError("group", "a group name", group)
        self._secret = secret
        self._group = group
        group_key(secret, group)  # stretched once, here, rather than at the first handshake
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
                self._link(check_member_id(pid, "peer id")).addr = check_address(paddr, "address")
            except UsageError as exc:
                raise ConfigError("peers", "a mapping of member id to (host, port)", peers) from exc
        self.limits = limits if limits is not None else TcpLimits()
        self.admission = bool(admission)
        # ids admitted without a view: the owner gave their address (peers, add_peer)
        self._given: set[int] = set(self._links)
        self._views: dict[int, frozenset[int]] = {}  # the last KEEP_VIEWS views set
        self._newest_view = -1
        self._unadmitted: set[_Conn] = set()
        self._pending: PendingTable[_Accepted] = PendingTable(self.limits)
        self.refusals = RefusalLog(member_id, log, self.limits)
        self._listeners: list[socket.socket] = []
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
        loop = self._begin_start(handler)
        self.refusals.bind(loop)
        host, port = self._listen
        try:
            self._listeners = await _listen(loop, host or None, port)
        except BaseException:
            self._closed = True
            raise
        sockname = self._listeners[0].getsockname()
        self._address = (host if host in _WILDCARDS else str(sockname[0]), int(sockname[1]))
        for lsock in self._listeners:
            self._spawn(self._accept_loop(lsock))

    async def close(self) -> None:
        """Say goodbye on every stream, close them and the listener; idempotent."""
        if self._closed:
            return
        self._closed = True
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
                conn.writer.write(bye_frame())
            conn.writer.close()
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        for lsock in self._listeners:  # after the accept loops ended (their fds unregistered)
            lsock.close()
        for conn in conns:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(conn.writer.wait_closed(), 2)
        self._gate.clear()
        self.refusals.flush()

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
        addr = check_address(address, "address")
        if not self._closed:
            self._link(member_id).addr = addr
            self._given.add(member_id)
            self._admit_waiting()

    def set_view(self, view_id: int, members: Sequence[int], row_bytes: int) -> None:
        """Install view ``view_id`` for validating pushes; its members are admitted."""
        super().set_view(view_id, members, row_bytes)
        if view_id > self._newest_view:
            self._views[view_id] = frozenset(members)
            self._newest_view = view_id
            while len(self._views) > KEEP_VIEWS:
                del self._views[min(self._views)]
            self._admit_waiting()

    # -- admission ---------------------------------------------------------------------------
    def _is_admitted(self, peer: int) -> bool:
        if not self.admission or peer in self._given:
            return True
        return any(peer in members for members in self._views.values())

    def _admit_waiting(self) -> None:
        for conn in list(self._unadmitted):
            if self._is_admitted(conn.peer):
                self._admit(conn)

    def _admit(self, conn: _Conn) -> None:
        """``conn``'s peer is admitted now: lift the limits; its held pushes go to the gate
        (from a loop callback: never from inside the driver's call)."""
        conn.admitted = True
        self._unadmitted.discard(conn)
        if conn.accepted is not None:
            self._pending.discard(conn.accepted)
            conn.accepted = None
        if conn.held and self._loop is not None:
            self._loop.call_soon(self._release_held, conn)

    def _release_held(self, conn: _Conn) -> None:
        held, conn.held = conn.held, []
        if conn.closed:
            return
        for view_id, offset, data in held:
            self._gate.push_arrived(view_id, conn.peer, offset, data)

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
            except AuthError as exc:
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
            except (OSError, TimeoutError, asyncio.IncompleteReadError, HandshakeError) as exc:
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
                    group=self._group,
                )
            if verdict == "dup":
                raise _Duplicate()
            if verdict != "accept":
                if "authentication" in why:
                    raise AuthError(f"authentication failed: member {s_id} refused us: {why}")
                raise HandshakeError(f"member {s_id} refused the stream: {why}")
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
            if conn.admitted:
                log.warning("member %d: member %d: %s", self.member_id, link.peer, reason)
            else:
                self.refusals.note(
                    "replaced before admission",
                    f"member {link.peer} (not admitted, from {conn.host}): {reason}",
                )
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
    async def _accept_loop(self, lsock: socket.socket) -> None:
        """Accept connections on ``lsock`` until close; each is judged before anything is read."""
        assert self._loop is not None
        loop = self._loop
        burst = 0
        while not self._closed:
            try:
                sock, peer = await loop.sock_accept(lsock)
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in _ACCEPT_EXHAUSTED:
                    self.refusals.note(
                        "descriptor limit",
                        f"accept failed: {exc}; accepting again in 0.1 s",
                        logging.ERROR,
                    )
                else:
                    log.warning("member %d: accept failed: %r", self.member_id, exc)
                await asyncio.sleep(0.1)
                continue
            self._on_accepted(sock, peer)
            burst += 1
            if burst >= _ACCEPT_BURST:  # a backlog of connections must not hog the loop
                burst = 0
                await asyncio.sleep(0)

    def _on_accepted(self, sock: socket.socket, peer: object) -> None:
        """Hold or refuse a connection just accepted (synchronously: nothing read yet)."""
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        if self._closed:
            _reset(sock)
            return
        reason, victim = self._pending.offer(host, sock.fileno(), descriptor_limit())
        if reason is not None:
            self.refusals.note(
                reason,
                f"refused a connection from {host}: {reason} ({len(self._pending)} pending,"
                f" {self._pending.count(host)} from that address)",
            )
            _reset(sock)
            return
        if victim is not None:
            self.refusals.note(
                "evicted",
                f"closed a pending connection from {victim.host} (held since it connected) to"
                f" make room for one from {host}",
            )
            self._evict(victim)
        sock.setblocking(False)
        acc = _Accepted(host, peer, sock)
        self._pending.add(acc, host)
        acc.task = self._spawn(self._serve(acc))

    def _evict(self, acc: _Accepted) -> None:
        """Close a pending connection now (its descriptor is freed at once)."""
        self._pending.discard(acc)
        conn = acc.conn
        if conn is not None:
            self._lost(conn, "evicted: pending connections at their cap", hostile=False)
        if acc.writer is not None:
            _abort(acc.writer.transport)
        elif acc.sock is not None:
            _reset(acc.sock)
            acc.sock = None
        if acc.task is not None:
            acc.task.cancel()

    async def _serve(self, acc: _Accepted) -> None:
        """An accepted connection: TLS and handshake within the deadline, then its frames."""
        assert self._loop is not None and acc.sock is not None
        loop = self._loop
        conn: _Conn | None = None
        try:
            try:
                async with asyncio.timeout(self.limits.handshake_s):
                    reader = asyncio.StreamReader(loop=loop)
                    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
                    tls: dict[str, Any] = {}
                    if self._ssl_server is not None:  # (the deadline above ends it first)
                        tls = {
                            "ssl": self._ssl_server,
                            "ssl_handshake_timeout": 2 * self.limits.handshake_s,
                        }
                    # the transport owns the socket from here, and closes it if this fails
                    sock, acc.sock = acc.sock, None
                    transport, _ = await loop.connect_accepted_socket(
                        lambda: protocol, sock, **tls
                    )
                    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
                    acc.writer = writer
                    conn = await self._accept_handshake(reader, writer, acc)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, HandshakeError) as exc:
                self._handshake_failed(acc, exc)
                return
            if conn is None:
                return
            conn.task = acc.task
            await self._read_loop(conn)
        except asyncio.CancelledError:
            # close() or an eviction cancels the stream handlers; on Python 3.11 asyncio would
            # log a cancelled handler as an error, so end quietly (the stream is torn down).
            pass
        finally:
            self._pending.discard(acc)
            if conn is not None:
                self._unadmitted.discard(conn)
            if acc.writer is not None and (conn is None or conn.closed or self._closed):
                acc.writer.close()
            elif acc.sock is not None:
                _reset(acc.sock)
                acc.sock = None

    def _handshake_failed(self, acc: _Accepted, exc: BaseException) -> None:
        """Log (rate-limited) a handshake that failed, ran out of time or was cut off; close."""
        where = f"handshake with {acc.peer}"
        if isinstance(exc, AuthError):
            self.refusals.note(
                "authentication failed", f"refused stream from {acc.peer}: {exc}", logging.ERROR
            )
        elif isinstance(exc, TimeoutError):
            self.refusals.note(
                "handshake deadline",
                f"{where} failed: not done within {self.limits.handshake_s:g} s",
            )
        elif isinstance(exc, ssl.SSLError):
            self.refusals.note("TLS handshake failed", f"{where} failed: TLS: {exc}")
        elif isinstance(exc, asyncio.IncompleteReadError | ConnectionError):
            # the dialler went away mid-handshake (e.g. it lost a simultaneous dial)
            self.refusals.note(
                "ended during handshake", f"{where} ended early: {exc!r}", logging.INFO
            )
        else:
            self.refusals.note(
                "bad handshake", f"{where} failed: {type(exc).__name__}: {exc}"
            )
        if acc.writer is not None:
            acc.writer.close()

    async def _accept_handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, acc: _Accepted
    ) -> _Conn | None:
        peername = acc.peer
        peer = await server_handshake(
            reader,
            writer,
            secret=self._secret,
            my_id=self.member_id,
            my_addr=self.address,
            group=self._group,
        )
        c_id, c_addr = peer.member, peer.addr
        if c_id == self.member_id:
            peer.answer(writer, "reject", "same member id as the acceptor")
            self.refusals.note(
                "claimed my own id", f"refused a stream claiming my own id from {peername}"
            )
            return None
        if self._closed:
            return None
        # decide and install synchronously: no await from here to the installed stream
        link = self._link(c_id)
        if self.member_id < c_id and (
            link.handshaking or (link.conn is not None and link.conn.initiator == self.member_id)
        ):
            peer.answer(writer, "dup", "lower id's stream wins")
            return None
        host, port = c_addr
        if host in _WILDCARDS and isinstance(peername, tuple):
            host = str(peername[0])
        link.addr = (host, port)
        peer.answer(writer, "accept")
        conn = _Conn(c_id, c_id, reader, writer, host=acc.host)
        acc.conn = conn
        if self._is_admitted(c_id):
            self._pending.discard(acc)
        else:
            conn.admitted = False
            conn.budget = self.limits.pre_admission_bytes
            conn.accepted = acc
            self._unadmitted.add(conn)
        if link.dialler is not None and not link.dialler.done() and link.handshaking:
            link.dialler.cancel()  # the lower id's stream (this one) wins
            link.handshaking = False
        self._install(link, conn)
        return conn

    # -- receiving ----------------------------------------------------------------------------
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
                problem = check_header(typ, flags, view_id, offset, length, self.max_frame)
                if problem is None and not conn.admitted:
                    problem = self._before_admission(conn, typ, view_id, length)
                if problem is not None:
                    self._violate(conn, problem)
                    return
                try:
                    payload = await _read_payload(reader, length) if length else b""
                except asyncio.IncompleteReadError as exc:
                    self._violate(
                        conn,
                        f"truncated frame at EOF ({len(exc.partial)} of {length} payload bytes)",
                    )
                    return
                except _Truncated as exc:
                    self._violate(
                        conn, f"truncated frame at EOF ({exc.got} of {exc.want} payload bytes)"
                    )
                    return
                if conn.closed:
                    return
                if typ == F_PUSH:
                    if not conn.admitted:  # held until a view names it (bounded by budget)
                        conn.held.append((view_id, offset, payload))
                        continue
                    if conn.held:  # admitted meanwhile: what it sent before goes first
                        self._release_held(conn)
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

    def _before_admission(self, conn: _Conn, typ: int, view_id: int, length: int) -> str | None:
        """What is wrong with a frame from a peer not admitted yet (None: nothing); charges its
        bytes to the stream's budget."""
        lim = self.limits
        if length > lim.pre_admission_frame:
            return (
                f"frame of {length} bytes before admission (member {conn.peer} is in no recent"
                f" view; at most {lim.pre_admission_frame} bytes per frame until it is)"
            )
        conn.budget -= FRAME.size + length
        if conn.budget < 0:
            return (
                f"more than {lim.pre_admission_bytes} bytes sent before admission (member"
                f" {conn.peer} is in no recent view)"
            )
        if typ == F_PUSH and view_id <= self._newest_view:
            return f"push for view {view_id} from member {conn.peer}, which is not in it"
        return None

    def _detach(self, conn: _Conn) -> bool:
        """Close ``conn``; True if it was its link's current stream."""
        current = False
        link = self._links.get(conn.peer)
        if link is not None and link.conn is conn:
            link.conn = None
            link.established.clear()
            current = True
        self._retire(conn)
        if (
            link is not None
            and link.conn is None
            and not link.queue
            and not link.waiters
            and (link.dialler is None or link.dialler.done())
            and not self._is_admitted(conn.peer)
        ):
            # a peer that never was admitted leaves nothing behind (strangers come in any number)
            del self._links[conn.peer]
        return current

    def _retire(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._unadmitted.discard(conn)
        conn.held.clear()
        if conn.accepted is not None:
            self._pending.discard(conn.accepted)
            conn.accepted = None
        conn.writer.close()

    def _lost(self, conn: _Conn, reason: str, *, hostile: bool = True) -> None:
        if conn.closed:
            return
        admitted = conn.admitted
        if self._detach(conn) and not self._closed:
            if admitted:
                log.warning(
                    "member %d: stream to member %d: %s", self.member_id, conn.peer, reason
                )
            elif hostile:
                self.refusals.note(
                    "closed before admission",
                    f"stream from {conn.host} claiming member {conn.peer} (not admitted): {reason}",
                    logging.INFO,
                )
            self._report_failure(conn.peer, reason)

    def _violate(self, conn: _Conn, why: str) -> None:
        """Close ``conn`` because its peer broke the protocol; tell it why, log, report."""
        if conn.closed:
            return
        reason = f"protocol violation by member {conn.peer}: {why}"
        if conn.admitted:
            log.warning(
                "member %d: closing stream from member %d: %s", self.member_id, conn.peer, reason
            )
        else:
            self.refusals.note(
                "bad frame before admission",
                f"closing stream from {conn.host} claiming member {conn.peer} (not admitted):"
                f" {reason}",
            )
        if not conn.writer.transport.is_closing():
            conn.writer.writelines(close_frames(reason))
        self._detach(conn)
        self._report_failure(conn.peer, reason)

    def _on_violation(self, sender: int, reason: str) -> None:
        link = self._links.get(sender)
        if link is not None and link.conn is not None:
            conn = link.conn
            if conn.closed:
                return
            if not conn.writer.transport.is_closing():
                conn.writer.writelines(close_frames(reason))
            self._detach(conn)
        self._report_failure(sender, reason)


async def _read_payload(reader: asyncio.StreamReader, length: int) -> bytes:
    """``length`` payload bytes. Above :data:`_PIECE` they are read in pieces as they arrive:
    memory follows what the peer really sent, never the length its header announced, and a
    stream cut short leaves pieces that are freed off the loop (raises :class:`_Truncated`)."""
    if length <= _PIECE:
        return await reader.readexactly(length)
    pieces: list[bytes] = []
    got = 0
    try:
        while got < length:
            piece = await reader.read(min(length - got, _PIECE))
            if not piece:
                raise _Truncated(got, length)
            pieces.append(piece)
            got += len(piece)
        return b"".join(pieces)
    finally:
        if got < length and got > _FREE_ON_LOOP:
            _free_off_loop(pieces)


def _free_off_loop(pieces: list[bytes]) -> None:
    """Drop ``pieces`` in a worker thread: freeing hundreds of MiB page by page is not the
    loop's work (a stream closed mid-frame must not stall the member)."""
    with contextlib.suppress(RuntimeError):  # no running loop: free here
        asyncio.get_running_loop().run_in_executor(None, pieces.clear)
        return
    pieces.clear()


async def _listen(
    loop: asyncio.AbstractEventLoop, host: str | None, port: int
) -> list[socket.socket]:
    """Listening sockets for ``host`` (None: every interface) and ``port`` (0: a free one, the
    same for every address family where it can be), as ``asyncio.start_server`` binds them."""
    infos = await loop.getaddrinfo(
        host, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    seen: set[tuple[int, object]] = set()
    socks: list[socket.socket] = []
    try:
        for family, type_, proto, _canon, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            if socks and port == 0:  # the port the first family got
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            try:
                sock = socket.socket(family, type_, proto)
            except OSError:
                continue  # a family this host does not have
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
            except OSError as exc:
                sock.close()
                if socks and (port == 0 or exc.errno == errno.EADDRNOTAVAIL):
                    continue  # another family is listening: it suffices
                raise
            sock.listen(128)
            sock.setblocking(False)
            socks.append(sock)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    if not socks:
        raise OSError(f"no address to listen on for {host!r}:{port}")
    return socks


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` at once with a reset (no lingering state for a refused connection)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _abort(transport: asyncio.WriteTransport) -> None:
    """Abort ``transport`` with a reset (see :func:`_reset`)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


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
        group=config.group,
        peers={m: parse_hostport(a, "peers") for m, a in config.peers.items()},
        ssl_server=server_ctx,
        ssl_client=client_ctx,
        max_frame=GROUP_MESSAGE_LIMIT,
        admission=True,
    )
