"""A member's service to external clients: it relays their calls and streams what they follow.

Theory of operation (docs/DESIGN.md §7.16): a member with ``client_listen`` set listens there
once it is in its first view. A client proves the clients' secret (``client_secret``; in the TLS
mode it also presents a client certificate of the group's CA) with the members' handshake in the
client role, which only this port takes (a member port refuses it, and this port refuses a
member), says its id (HELLO) and hears the view and every member's client address (VIEW, again
at each view). Its ordered calls are checked here (known actor and method, arguments that
decode) and rejected at once otherwise; a good one is multicast as this member's own call,
tagged with the client's id and sequence number (``wire.client_call``), so every member applies
it once however many relays sent it (:mod:`.once`). Its outcome goes back as DONE; a call this
member could not see through (it left, was removed, wedged, or its queue was full) as FAIL with
``retry`` set: the client sends it again through another member. p2p calls are made from here
(``-1``: served here); subscriptions are this member's own ``subscribe()``, streamed.

Clients share the member in turns: when it has no room for another call (``max_queued_calls``,
``max_queued_mb``), a client's call waits in its connection's lane, and the lanes (this
member's own calls one of them) take turns, a call each (:mod:`.turns`), so a light client's
call goes ahead of a heavy client's backlog. A connection that closes takes its waiting calls
with it (never sent). A connection's frames already buffered are read ``_FRAMES_PER_TURN`` at a
time, the others served in between.

Bounds: what a stranger may cost follows the member port's rules (an
:class:`~derecho_async.transport.tcp.entrance.Entrance` with :data:`CLIENT_LIMITS`: TLS, the
handshake and the HELLO within 3 s, connections not yet proven capped per address and in all,
descriptors kept in reserve for the members' own links, refusals logged a few at a time then
as one summary per interval); ``max_clients`` connections; ``max_client_calls`` calls and p2p
calls in flight per connection (past it this member stops reading from it: tcp holds the
client back); frames of at most ``max_call_mb``; 16 subscriptions per connection, each dropped
with a reason when its client reads too slowly (``subscribe``'s backlog bound).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from derecho_async import wire
from derecho_async.api import client_wire as cw
from derecho_async.api.calls import CAST, HandlerError, Replies, exception_text, safe_text
from derecho_async.api.delivery import encode_outcome
from derecho_async.api.forward import Forwarder
from derecho_async.errors import (
    ConfigError,
    DerechoError,
    GroupClosed,
    MemberFailed,
    PartitionedError,
    ProtocolViolation,
    QueueFull,
    SubscriptionDropped,
    UsageError,
)
from derecho_async.transport.tcp.entrance import Entrance
from derecho_async.transport.tcp.handshake import (
    CLIENT,
    AuthError,
    HandshakeError,
    check_address,
    server_handshake,
)
from derecho_async.transport.tcp.identity import certified_client, client_context
from derecho_async.transport.tcp.limits import RefusalLog, TcpLimits
from derecho_async.transport.tcp.streams import Accepted, listen_sockets
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.api.actor import Actor, ActorSpec
    from derecho_async.api.calls import CallTable
    from derecho_async.api.logged_calls import HistoryEntry
    from derecho_async.api.membership import Membership
    from derecho_async.api.p2pcalls import P2PServer
    from derecho_async.core import View

__all__ = ["CLIENT_LIMITS", "Relay"]

log = logging.getLogger("derecho_async.clients")

CLIENT_LIMITS: Final = TcpLimits(handshake_s=3.0, max_pending=128, max_pending_per_host=16,
                                 fd_reserve=256)
"""What connections to the client port that are not yet proven may cost (the member port's
rules, :class:`~derecho_async.transport.tcp.limits.TcpLimits`), with twice its descriptor
reserve: accepting clients stops while the member port still accepts members."""
_HELLO_BYTES: Final = 4096  # the HELLO frame, at most
_MAX_SUBSCRIPTIONS: Final = 16  # per connection
_SUB_BACKLOG: Final = 65536  # deliveries a client's subscription may lag, at most
_HIGH_WATER: Final = 8 << 20  # bytes queued to a client before this member waits for it
_REASON: Final = 500  # characters of a reason sent to a client
_FRAMES_PER_TURN: Final = 64  # frames of one connection read before others get the loop

Subscribe = Callable[..., AsyncIterator["HistoryEntry"]]


def _close_socket(sock: socket.socket, _task: object) -> None:
    sock.close()


def _clip(text: str) -> str:
    return text if len(text) <= _REASON else text[: _REASON - 3] + "..."


class _Connection:
    """One client's connection."""

    def __init__(self, client: bytes, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, slots: int) -> None:
        self.client = client
        self.reader = reader
        self.writer = writer
        self.slots = asyncio.Semaphore(slots)
        self.subs: dict[int, asyncio.Task[None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def send(self, kind: int, *fields: object) -> None:
        if not self.writer.is_closing():
            cw.write_frame(self.writer, kind, *fields)


class Relay:
    """This member's client service (see the module header); made by the group when
    ``client_listen`` is set."""

    def __init__(self, state: Membership, specs: Mapping[str, ActorSpec], calls: CallTable,
                 p2p: P2PServer, subscribe: Subscribe, clock: Callable[[], int],
                 forwarder: Forwarder, sharded: Mapping[str, int] | None = None,
                 hosts: Callable[[str, int], tuple[int, ...]] | None = None) -> None:
        config = state.config
        self._state = state
        self._me = state.me
        self._specs = specs
        self._calls = calls
        self._p2p = p2p
        self._subscribe = subscribe
        self._clock = clock
        self._sharded = dict(sharded or {})  # sharded actor -> its number of shards
        self._hosts = hosts or (lambda _actor, _shard: ())  # (actor, shard) -> hosts now
        self._forwarder = forwarder
        self._group = config.group
        self._secret = (config.client_secret or "").encode()
        self._max_clients = config.max_clients
        self._slots = config.max_client_calls
        self._max_call = config.max_call_mb << 20  # a call's encoded bytes, at most
        self._max_frame = self._max_call + 4096
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[None]] = set()  # accept loops and connections
        self._conns: set[_Connection] = set()
        self._closed = False
        self.address: tuple[str, int] = (check_address(config.client_listen, "client_listen")
                                         if config.client_listen is not None else ("", 0))
        self.addresses: dict[int, tuple[str, int]] = {}
        """Every member's client address this member heard of (its own included)."""
        self._tls: ssl.SSLContext | None = None
        if (config.tls_cert is not None and config.tls_key is not None
                and config.tls_ca is not None):
            self._tls = client_context(config.tls_cert, config.tls_key, config.tls_ca)
        self.refusals = RefusalLog(self._me, log, CLIENT_LIMITS)
        """Refused and closed client connections, by reason (rate-limited logs)."""
        self._entrance: Entrance[_Connection] = Entrance(
            "client port", self.refusals, self._tls, self._greet, self._serve, self._spawn_task)

    @property
    def listening(self) -> bool:
        """Whether this member serves clients on :attr:`address`."""
        return bool(self._listeners) and not self._closed

    async def start(self) -> None:
        """Listen for clients. ``ConfigError("client_listen")`` when the address cannot be
        bound."""
        loop = asyncio.get_running_loop()
        host, port = self.address
        try:
            self._listeners = await listen_sockets(loop, host or None, port)
        except OSError as exc:
            raise ConfigError("client_listen", "an address this member can listen on",
                              f"{host}:{port} ({exc.strerror or exc})") from None
        self.address = (host, int(self._listeners[0].getsockname()[1]))
        self.addresses[self._me] = self.address
        self.refusals.bind(loop)
        for lsock in self._listeners:
            task = self._spawn_task(self._entrance.accept_loop(lsock))
            # (the socket is closed once its accept loop ended: its fd is unregistered then)
            task.add_done_callback(functools.partial(_close_socket, lsock))
        log.info("member %d: serving clients on %s:%d", self._me, *self.address)

    def close(self) -> None:
        """Stop listening and close every client's connection (they fail over)."""
        if self._closed:
            return
        self._closed = True
        self._entrance.closed = True
        for conn in list(self._conns):
            conn.writer.close()
            self._drop(conn)
        for task in list(self._tasks):
            task.cancel()
        if not self._tasks:
            for lsock in self._listeners:
                lsock.close()
        self.refusals.flush()

    def _drop(self, conn: _Connection) -> None:
        """``conn`` is closed: its calls waiting for room are never sent (its client sends them
        again, elsewhere), its p2p calls and subscriptions end."""
        self._conns.discard(conn)
        self._calls.drop_lane(conn, GroupClosed("the client's connection to its relay closed"))
        for task in [*conn.subs.values(), *conn.tasks]:
            task.cancel()

    def _spawn_task(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- the view --------------------------------------------------------------------------
    def view_frame(self, view: View) -> tuple[object, ...]:
        known = [[m, *self.addresses[m]] for m in view.members if m in self.addresses]
        return (view.view_id, list(view.members), known, self._max_call)

    def on_view(self, view: View) -> None:
        """A view is installed: every client hears of it."""
        for m in list(self.addresses):
            if m not in view.members:
                del self.addresses[m]
        frame = self.view_frame(view)
        for conn in self._conns:
            conn.send(cw.VIEW, *frame)

    def announce(self, members: Sequence[int]) -> None:
        """Tell ``members`` where this member serves clients (they tell their clients)."""
        driver = self._state.driver
        if not self.listening or driver is None or driver.closed:
            return
        msg = env.encode(env.CLIENT_ADDR, *self.address)
        for m in members:
            if m != self._me:
                driver.transport.send(m, msg)

    def heard(self, member: int, host: str, port: int) -> None:
        """``member`` serves clients at ``host:port`` (its CLIENT_ADDR message)."""
        self.addresses[member] = (host, port)
        view = self._state.view
        if view is not None and member in view.members:
            frame = self.view_frame(view)
            for conn in self._conns:
                conn.send(cw.VIEW, *frame)

    # -- a connection ----------------------------------------------------------------------
    async def _greet(self, acc: Accepted, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> _Connection | None:
        """A new connection's handshake (client role) and HELLO, within the entrance's
        deadline: the connection to serve, or None once it was refused."""
        proven = await server_handshake(reader, writer, secret=self._secret, my_id=self._me,
                                        my_addr=self.address, group=self._group, role=CLIENT)
        if self._tls is not None:  # (a member's certificate names no client: refused)
            try:
                certified_client(writer.get_extra_info("peercert"), self._group)
            except AuthError as exc:
                proven.answer(writer, "reject", str(exc))
                raise
        if self._closed or len(self._conns) >= self._max_clients:
            proven.answer(writer, "busy", f"member {self._me} serves "
                          f"{self._max_clients} clients already (max_clients)")
            self.refusals.note("max_clients", f"client port: refused a client from {acc.host}:"
                               f" {self._max_clients} clients already", logging.INFO)
            await writer.drain()
            return None
        proven.answer(writer, "accept")
        conn = _Connection(b"", reader, writer, self._slots)
        self._conns.add(conn)  # (counted against max_clients from here)
        try:
            try:
                hello = await cw.read_frame(reader, _HELLO_BYTES)
            except ProtocolViolation as exc:
                raise HandshakeError(f"a bad first frame: {exc}") from None
            if (hello[0] != cw.HELLO or type(hello[1]) is not bytes
                    or len(hello[1]) != wire.CLIENT_ID_BYTES):
                raise HandshakeError("the first frame is not a HELLO with a 16-byte id")
        except BaseException:
            self._conns.discard(conn)
            raise
        conn.client = hello[1]
        return conn

    async def _serve(self, acc: Accepted, conn: _Connection) -> None:
        """A client that said HELLO: its frames, until the connection ends."""
        self._entrance.admit(acc)
        reader, writer = conn.reader, conn.writer
        try:
            writer.transport.set_write_buffer_limits(high=_HIGH_WATER)
            view = self._state.view
            if view is not None:
                conn.send(cw.VIEW, *self.view_frame(view))
            frames = 0
            while True:
                frame = await cw.read_frame(reader, self._max_frame)
                frames += 1
                if frames % _FRAMES_PER_TURN == 0:  # (frames already buffered are read
                    await asyncio.sleep(0)  # without a pause: let the others run)
                kind = frame[0]
                if kind in (cw.CALL, cw.P2P):
                    await conn.slots.acquire()
                    if kind == cw.CALL:
                        self._call(conn, *frame[1:])
                    else:
                        self._spawn(conn, self._p2p_call(conn, *frame[1:]))
                elif kind == cw.SUB:
                    self._sub(conn, *frame[1:])
                elif kind == cw.UNSUB:
                    task = conn.subs.pop(frame[1], None)
                    if task is not None:
                        task.cancel()
                else:
                    raise ProtocolViolation(f"a client sent a frame of kind {kind}")
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, OSError):
            pass
        except ProtocolViolation as exc:
            self.refusals.note("client broke the protocol",
                               f"client port: a client from {acc.host} broke the protocol: {exc}")
        finally:
            writer.close()
            self._drop(conn)

    def _spawn(self, conn: _Connection, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        conn.tasks.add(task)
        task.add_done_callback(conn.tasks.discard)

    # -- ordered calls ---------------------------------------------------------------------
    def submit(self, client: bytes, actor: str, seq: int, body: bytes,
               shard: int = 0, forward: bool = True,
               lane: Hashable | None = None) -> asyncio.Future[Any]:
        """Relay a client's ordered call: ``body`` is the call as ``wire.encode_call`` made it
        (method ``<actor>.<m>`` or ``<actor>.<m>.cast``), ``seq`` the client's number for it
        (per actor and shard), ``shard`` the shard of a sharded actor it goes to (forwarded to
        a host when this member is not one: :mod:`.forward`), ``lane`` where it waits when this
        member has no room (its connection; default: the client's id), taking turns with
        other lanes (:mod:`.turns`). The future of its
        :class:`Replies` (or of its version, for a one-way call). Raises ``UsageError`` or
        ``ProtocolViolation`` for a call no member would run (unknown actor, method or shard,
        arguments that do not decode), ``GroupClosed`` / ``PartitionedError`` / ``QueueFull``
        when this member cannot send it now (another member may). Without ``forward`` (a call
        forwarded here) a shard this member does not host is ``GroupClosed``: the forwarder
        tries a host."""
        spec, one_way = self._checked(actor, seq, body, shard)
        if actor in self._sharded and self._me not in self._hosts(actor, shard):
            if not forward:
                raise GroupClosed(f"member {self._me} does not host shard {shard} of {actor}")
            return self._forwarder.forward(client, actor, shard, seq, body, one_way)
        return self._calls.relay(spec, wire.client_call(body, client, seq, self._clock()),
                                 one_way, client if lane is None else lane)

    def submit_hosted(self, client: bytes, actor: str, shard: int, seq: int,
                      body: bytes) -> asyncio.Future[Any]:
        """:meth:`submit` for a call forwarded here (the forwarder's ``serve``)."""
        return self.submit(client, actor, seq, body, shard, forward=False)

    def _checked(self, actor: str, seq: int, body: bytes,
                 shard: int) -> tuple[ActorSpec, bool]:
        spec = self._specs.get(actor)
        if spec is None:
            raise UsageError(f"the group has no actor {actor!r}")
        shards = self._sharded.get(actor, 1)
        if not 0 <= shard < shards:
            raise UsageError(f"{actor} has shards 0 to {shards - 1}, not {shard}")
        name, _args, _kwargs = wire.decode_call(body)
        one_way = name.endswith(CAST)
        owner, _, method = name.removesuffix(CAST).partition(".")
        if owner != actor or method not in spec.ordered:
            raise UsageError(f"actor {actor} has no @ordered method {method!r}")
        if body[:1] != b"\x93" or not 0 <= seq < 1 << 63:
            raise ProtocolViolation("a client's call is not a plain encoded call")
        return spec, one_way

    def _call(self, conn: _Connection, rid: int, actor: str, shard: int, seq: int,
              body: bytes) -> None:
        try:
            fut = self.submit(conn.client, actor, seq, body, shard, lane=conn)
        except (GroupClosed, PartitionedError, QueueFull) as exc:
            conn.slots.release()
            self._fail(conn, rid, True, exc)
            return
        except DerechoError as exc:
            conn.slots.release()
            self._fail(conn, rid, False, exc)
            return
        fut.add_done_callback(functools.partial(self._call_done, conn, rid))

    def _call_done(self, conn: _Connection, rid: int, fut: asyncio.Future[Any]) -> None:
        conn.slots.release()
        if fut.cancelled():
            self._fail(conn, rid, True, GroupClosed("the call was cancelled at its relay"))
            return
        exc = fut.exception()
        if exc is not None:  # this member could not see it through: another may
            self._fail(conn, rid, True, exc)
            return
        result = fut.result()
        if isinstance(result, Replies):
            conn.send(cw.DONE, rid, *result.version, cw.encode_outcomes(result))
        else:
            conn.send(cw.DONE, rid, result[0], result[1], [])

    def _fail(self, conn: _Connection, rid: int, retry: bool, exc: BaseException) -> None:
        name, text = exception_text(exc)  # (a p2p handler's own exception may come here)
        conn.send(cw.FAIL, rid, retry, name, _clip(text))

    # -- p2p calls -------------------------------------------------------------------------
    async def _p2p_call(self, conn: _Connection, rid: int, member: int, actor: str,
                        shard: int, body: bytes) -> None:
        try:
            spec = self._specs.get(actor)
            if spec is None:
                raise UsageError(f"the group has no actor {actor!r}")
            name, args, kwargs = wire.decode_call(body)
            owner, _, method = name.partition(".")
            if owner != actor or method not in spec.p2p:
                raise UsageError(f"actor {actor} has no @p2p method {method!r}")
            if actor in self._sharded:  # the shard's members only
                if not 0 <= shard < self._sharded[actor]:
                    raise UsageError(f"{actor} has shards 0 to {self._sharded[actor] - 1}")
                hosts = self._hosts(actor, shard)
                if member < 0:
                    member = self._me if self._me in hosts or not hosts else hosts[0]
                elif member not in hosts:
                    raise UsageError(f"member {member} does not host shard {shard} of {actor}")
            if member < 0:
                member = self._me
            got = await self._p2p.call(member, spec, method, args, kwargs)
        except (UsageError, ProtocolViolation) as exc:
            self._fail(conn, rid, False, exc)
            return
        except (GroupClosed, PartitionedError) as exc:
            self._fail(conn, rid, True, exc)
            return
        except MemberFailed as exc:
            self._fail(conn, rid, False, exc)
            return
        except HandlerError as exc:
            conn.send(cw.ANSWER, rid, False,
                      wire.encode([safe_text(exc.type_name), safe_text(exc.message)]), 0, 0)
            return
        except Exception as exc:
            ok, out = encode_outcome(False, exc)
            conn.send(cw.ANSWER, rid, ok, out, 0, 0)
            return
        finally:
            conn.slots.release()
        ok, out = encode_outcome(True, got.value)
        view_id, seq = got.version
        conn.send(cw.ANSWER, rid, ok, out, view_id, seq + 1)

    # -- subscriptions ---------------------------------------------------------------------
    def _sub(self, conn: _Connection, sid: int, actor: str, shard: int, since_view: int,
             since_seq1: int) -> None:
        spec = self._specs.get(actor)
        if sid in conn.subs:
            raise ProtocolViolation(f"subscription {sid} is already open")
        if spec is None:
            conn.send(cw.END, sid, f"UsageError: the group has no actor {actor!r}")
            return
        if actor in self._sharded and self._me not in self._hosts(actor, shard):
            conn.send(cw.END, sid, f"UsageError: member {self._me} does not host shard "
                                   f"{shard} of {actor}: subscribe through one that does")
            return
        if len(conn.subs) >= _MAX_SUBSCRIPTIONS:
            conn.send(cw.END, sid, f"UsageError: at most {_MAX_SUBSCRIPTIONS} subscriptions "
                                   "per client connection")
            return
        since = None if since_seq1 == 0 else (since_view, since_seq1 - 1)
        task = asyncio.get_running_loop().create_task(self._stream(conn, sid, spec, since))
        conn.subs[sid] = task
        task.add_done_callback(lambda _t: conn.subs.pop(sid, None))

    async def _stream(self, conn: _Connection, sid: int, spec: ActorSpec,
                      since: tuple[int, int] | None) -> None:
        writer = conn.writer
        try:
            cls: type[Actor] = spec.cls
            async for e in self._subscribe(cls, since=since, max_backlog=_SUB_BACKLOG):
                args = wire.encode([list(e.args), e.kwargs])
                conn.send(cw.EVENT, sid, e.version[0], e.version[1], round(e.time * 1e9),
                          e.method, args, e.one_way)
                if writer.transport.get_write_buffer_size() > _HIGH_WATER:
                    await writer.drain()
            reason = f"GroupClosed: {self._state.closed or 'the relay left the group'}"
        except (SubscriptionDropped, UsageError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        except (ConnectionError, OSError):
            return
        conn.send(cw.END, sid, _clip(reason))
