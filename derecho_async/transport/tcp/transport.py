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

This module holds the lifecycle, admission, sending and reading; dialling is in
:mod:`.dialling`, accepting in :mod:`.accepting`, the shared state and helpers in :mod:`.streams`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import ssl
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from derecho_async.errors import ConfigError, UsageError
from derecho_async.transport.base import (
    GROUP_MESSAGE_LIMIT,
    KEEP_VIEWS,
    TransportHandler,
    check_member_id,
    log,
)
from derecho_async.transport.tcp.accepting import AcceptingSide
from derecho_async.transport.tcp.beacon import UdpBeacon
from derecho_async.transport.tcp.dialling import DiallingSide
from derecho_async.transport.tcp.framing import (
    F_BEACON,
    F_BYE,
    F_MSG,
    F_PUSH,
    FRAME,
    beacon_frame,
    bye_frame,
    check_header,
    close_frames,
)
from derecho_async.transport.tcp.handshake import check_address, group_key
from derecho_async.transport.tcp.identity import (
    certified_by_file,
    contexts,
    requires_peer_certificates,
)
from derecho_async.transport.tcp.limits import RefusalLog, TcpLimits
from derecho_async.transport.tcp.streams import (
    WILDCARDS,
    Conn,
    Truncated,
    listen_sockets,
    read_payload,
)
from derecho_async.transport.unreachable import UnreachableLog

if TYPE_CHECKING:
    from derecho_async.config import Config

__all__ = ["TcpTransport", "from_config", "security"]


class TcpTransport(DiallingSide, AcceptingSide):
    """Transport over TCP (optionally TLS): one authenticated stream per pair of members.

    ``listen`` is the (host, port) to bind (port 0 picks a free port; see :attr:`address`).
    ``secret`` is the group's shared secret and ``group`` its name (the handshake's key is the
    secret stretched once, salted with the group; a peer of another group is refused); ``peers``
    maps member ids to listen addresses,
    (host, port) or ``"host:port"`` (more with :meth:`add_peer`; a peer that dials in is learned
    automatically).
    ``ssl_server``/``ssl_client`` enable TLS for accepted/dialled streams. With ``cert_ids``
    on (both contexts must require the peer's certificate, as :func:`.identity.contexts` makes
    them), a peer's certificate must name the member id it claims, on every stream, both ways;
    ``secret`` may then be None (identity comes from the certificates). ``max_frame`` bounds
    one frame's payload: received frames above it are protocol violations.

    ``limits`` bounds what connections that are not admitted may cost (:class:`TcpLimits`).
    With ``admission`` on, an authenticated peer is admitted only if it is in ``peers``, was
    given an address with :meth:`add_peer`, or is a member of one of the last views set with
    :meth:`set_view` (or :meth:`admit_view`); until then it may send only frames of
    ``limits.pre_admission_frame`` bytes (``limits.pre_admission_bytes`` in all). The runtime
    turns it on (``from_config``, and the rdma transport's ``from_config`` for its channel).
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
        secret: bytes | None,
        group: str = "",
        peers: Mapping[int, tuple[str, int] | str] = {},
        ssl_server: ssl.SSLContext | None = None,
        ssl_client: ssl.SSLContext | None = None,
        cert_ids: bool = False,
        max_frame: int = 64 << 20,
        limits: TcpLimits | None = None,
        admission: bool = False,
        beacon_s: float = 0.0,
        hold_s: float = 0.0,
    ) -> None:
        super().__init__(member_id)
        try:
            self._listen = check_address(listen, "listen")
        except UsageError as exc:
            raise ConfigError("listen", "a (host: str, port: int) pair", listen) from exc
        self._cert_ids = bool(cert_ids)
        if self._cert_ids and not requires_peer_certificates(ssl_server, ssl_client):
            raise ConfigError(
                "cert_ids",
                "TLS contexts on both sides that require the peer's certificate",
                "ssl_server/ssl_client",
            )
        if secret is None and self._cert_ids:
            secret = b""  # the handshake's MACs then prove nothing; the certificates do
        elif not isinstance(secret, bytes) or not secret:
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
        self._links = {}
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
        self._unadmitted: set[Conn] = set()
        self.refusals = RefusalLog(member_id, log, self.limits)
        self._entrance = self._make_entrance()
        self.unreachable = UnreachableLog()
        self._listeners = []
        self._address = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: liveness datagrams from a native thread (none when ``beacon_s`` is 0)
        self._beacon = UdpBeacon(member_id, beacon_s, hold_s) if beacon_s else None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, handler: TransportHandler) -> None:
        """Bind the listen address and start accepting streams."""
        loop = self._begin_start(handler)
        self.refusals.bind(loop)
        host, port = self._listen
        try:
            self._listeners = await listen_sockets(loop, host or None, port)
        except BaseException as exc:
            self._closed = True
            if isinstance(exc, OSError) and exc.errno in _BIND_ERRNOS:
                raise ConfigError("listen", "an address this member can listen on",
                                  f"{host}:{port} ({exc.strerror})") from None
            raise
        sockname = self._listeners[0].getsockname()
        self._address = (host if host in WILDCARDS else str(sockname[0]), int(sockname[1]))
        for lsock in self._listeners:
            self._spawn(self._entrance.accept_loop(lsock))
        if self._beacon is not None:
            first = self._listeners[0]
            try:
                self._beacon.start(first.family, str(first.getsockname()[0]), self._address[1])
            except OSError as exc:  # heartbeats alone then tell liveness, as without one
                log.warning("member %d: no beacon (cannot bind a UDP socket: %s)",
                            self.member_id, exc)
                self._beacon = None

    async def close(self) -> None:
        """Say goodbye on every stream, close them and the listener; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._entrance.closed = True
        if self._beacon is not None:
            self._beacon.close()
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

    def known_addresses(self) -> dict[int, tuple[str, int]]:
        """The listen addresses of the links that have one, and this member's own (unless it
        listens on a wildcard address, which says nothing to others)."""
        known = {peer: link.addr for peer, link in self._links.items() if link.addr is not None}
        if self._address is not None and self._address[0] not in WILDCARDS:
            known[self.member_id] = self._address
        return known

    def learn_address(self, member_id: int, address: tuple[str, int]) -> None:
        """Use ``address`` for ``member_id`` if none is known; wake its dialler if frames wait."""
        if self._closed or member_id == self.member_id:
            return
        link = self._link(member_id)
        if link.addr is None:
            link.addr = address
            if link.conn is None and (link.queue or link.waiters):
                self._ensure_dialler(link)

    def set_view(self, view_id: int, members: Sequence[int], row_bytes: int) -> None:
        """Install view ``view_id`` for validating pushes; its members are admitted."""
        super().set_view(view_id, members, row_bytes)
        self.admit_view(view_id, members)
        self.beacon_view(view_id)

    def beacon_view(self, view_id: int) -> None:
        """This member installed ``view_id``: its beacons carry it, and only peers' beacons of
        it count (the rdma transport calls this for its channel)."""
        if self._beacon is not None:
            self._beacon.set_view(view_id)

    def admit_view(self, view_id: int, members: Sequence[int]) -> None:
        """Admit the members of view ``view_id`` (``set_view`` does; a transport that uses
        this one as its channel calls it alone)."""
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

    def _admit(self, conn: Conn) -> None:
        """``conn``'s peer is admitted now: lift the limits; its held pushes go to the gate
        (from a loop callback: never from inside the driver's call)."""
        conn.admitted = True
        self._unadmitted.discard(conn)
        if conn.accepted is not None:
            self._entrance.admit(conn.accepted)
            conn.accepted = None
        if conn.held and self._loop is not None:
            self._loop.call_soon(self._release_held, conn)

    def _release_held(self, conn: Conn) -> None:
        held, conn.held = conn.held, []
        if conn.closed:
            return
        for view_id, offset, data in held:
            self._gate.push_arrived(view_id, conn.peer, offset, data)

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

    # -- receiving ----------------------------------------------------------------------------
    async def _read_loop(self, conn: Conn) -> None:
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
                    payload = await read_payload(reader, length) if length else b""
                except asyncio.IncompleteReadError as exc:
                    self._violate(
                        conn,
                        f"truncated frame at EOF ({len(exc.partial)} of {length} payload bytes)",
                    )
                    return
                except Truncated as exc:
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
                elif typ == F_BEACON:
                    problem = self._beacon_announced(conn, payload)
                    if problem is not None:
                        self._violate(conn, problem)
                        return
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

    # -- beacon --------------------------------------------------------------------------------
    @property
    def beacon_on(self) -> bool:
        """Whether my beacon thread runs (from start to close, unless ``beacon_s`` is 0)."""
        return self._beacon is not None

    def beacon_tick(self) -> Sequence[int]:
        """The loop runs; the peers whose beacon datagrams arrived since the last call."""
        return () if self._beacon is None else self._beacon.tick()

    def _announce_beacon(self, conn: Conn) -> None:
        """Tell the peer of a new stream where my beacons come from and how they are signed
        (first on the stream, before anything queued)."""
        if self._beacon is not None:
            conn.writer.writelines(beacon_frame(self._beacon.announcement()))

    def _beacon_announced(self, conn: Conn, payload: bytes) -> str | None:
        if self._beacon is None:
            return None
        peername = conn.writer.get_extra_info("peername")
        host = str(peername[0]) if isinstance(peername, tuple) else ""
        return self._beacon.announced(conn.peer, host, payload)

    def _before_admission(self, conn: Conn, typ: int, view_id: int, length: int) -> str | None:
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

    def _detach(self, conn: Conn) -> bool:
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
            if self._beacon is not None:
                self._beacon.forget(conn.peer)
        return current

    def _retire(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._unadmitted.discard(conn)
        conn.held.clear()
        if conn.accepted is not None:
            self._entrance.admit(conn.accepted)
            conn.accepted = None
        conn.writer.close()

    def _lost(self, conn: Conn, reason: str, *, hostile: bool = True) -> None:
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

    def _violate(self, conn: Conn, why: str) -> None:
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


_BIND_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES})
"""What binding the listen address fails with when the address is wrong (in use, not this
host's, a privileged port): a ConfigError naming ``listen``, not a retryable failure."""


def from_config(config: Config) -> TcpTransport:
    """The tcp transport of the member ``config`` describes (see ``transport.registry``),
    with mutual TLS and ids bound to certificates where ``tls_cert`` is set."""
    from derecho_async.config import parse_hostport

    beacon_s, hold_s = beacon_settings(config)
    return TcpTransport(
        config.member_id,
        parse_hostport(config.listen, "listen"),
        group=config.group,
        peers={m: parse_hostport(a, "peers") for m, a in config.peers.items()},
        max_frame=GROUP_MESSAGE_LIMIT,
        admission=True,
        beacon_s=beacon_s,
        hold_s=hold_s,
        **security(config),
    )


def beacon_settings(config: Config) -> tuple[float, float]:
    """The beacon's period and hold limit in seconds (:class:`UdpBeacon`): a datagram per peer
    four times per ``suspect_after_ms`` (at most every ``heartbeat_ms``) while the loop ran
    within ``max_loop_hold_ms``; (0, 0), no beacon, when that is 0 (the rdma transport's
    channel takes the same)."""
    hold = config.max_loop_hold_ms / 1000.0
    if not hold:
        return 0.0, 0.0
    period = max(config.heartbeat_ms, config.suspect_after_ms / 4) / 1000.0
    return max(period, 0.001), hold


def security(config: Config) -> dict[str, Any]:
    """The keyword arguments that secure a member's streams as ``config`` says: the secret,
    and with ``tls_cert`` mutual TLS whose certificates bind member ids (the rdma transport's
    channel takes the same)."""
    secret = None if config.secret is None else config.secret.encode()
    if config.tls_cert is None:
        assert secret is not None  # Config requires a secret or TLS for a networked transport
        return {"secret": secret}
    assert config.tls_key is not None and config.tls_ca is not None  # Config's rules
    named = certified_by_file(config.tls_cert)
    if named is not None and named != [(config.group, config.member_id)]:
        raise ConfigError(
            "tls_cert",
            f"a certificate that names member {config.member_id} of group {config.group!r}"
            f" and nobody else (it names {named or 'no member'})",
            config.tls_cert,
        )
    try:
        server, client = contexts(config.tls_cert, config.tls_key, config.tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            "tls_cert", f"readable PEM files for tls_cert, tls_key and tls_ca ({exc})",
            config.tls_cert,
        ) from exc
    return {"secret": secret, "ssl_server": server, "ssl_client": client, "cert_ids": True}
