"""An external client: uses a group's actors without joining it.

Theory of operation (docs/DESIGN.md §7.16): a :class:`Client` keeps one connection to a member
it can reach (its relay), authenticated with the group's secret (:mod:`.relay` is the other
end; :mod:`.client_wire` the frames). It is never in a view and never holds back stability. It
numbers its ordered calls per actor and keeps each until it is answered; when its relay fails
(the connection drops, or the relay answers that it could not see a call through) it connects
to another member it knows of (the ``peers`` it was given and the addresses each view brings)
and sends every unanswered call again with the same number. Members apply a call once per
number (:mod:`.once`), so a call is applied exactly once however many relays carried it, and
its answer is the first delivery's outcome. A call is never sent while one at least
:data:`~derecho_async.api.once.WINDOW` numbers before it is unanswered, so the members' table
stays bounded. Subscriptions and p2p calls are made again at the new relay too (a subscription
from the last version it gave, which a durable group replays from its log).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import ssl
from collections.abc import AsyncIterator, Awaitable, Coroutine, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, ParamSpec, Self, TypeVar, overload

from derecho_async import wire
from derecho_async.api import client_wire as cw
from derecho_async.api.actor import Actor, ActorSpec, actor_spec
from derecho_async.api.calls import CAST, Replies, decode_result
from derecho_async.api.handles import check_version, p2p_usage, typed_method
from derecho_async.api.logged_calls import HistoryEntry
from derecho_async.api.once import Numbering
from derecho_async.api.p2pcalls import Versioned
from derecho_async.core.view import View
from derecho_async.errors import (
    AuthenticationError,
    DerechoError,
    GroupClosed,
    MemberFailed,
    ProtocolViolation,
    SubscriptionDropped,
    UsageError,
)
from derecho_async.transport.tcp.handshake import (
    CLIENT,
    Address,
    HandshakeError,
    Refused,
    check_address,
    client_handshake,
)

if TYPE_CHECKING:
    from derecho_async.api.actor import OrderedDef, P2PDef

__all__ = ["Client", "ClientHandle", "ClientOrderedMethod", "ClientP2PCall", "ClientP2PMethod"]

A = TypeVar("A", bound=Actor)
A_co = TypeVar("A_co", bound=Actor, covariant=True)
P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("derecho_async.client")

_RETRY_S: Final = 0.05  # the first pause before another member is tried; doubles to 1 s
_MAX_FRAME: Final = 1 << 30  # bytes of one frame from a relay, at most
_ERRORS: Final[dict[str, type[DerechoError]]] = {
    "UsageError": UsageError, "ProtocolViolation": ProtocolViolation,
    "GroupClosed": GroupClosed,
}


@dataclass(slots=True)
class _Call:
    rid: int
    frame: tuple[object, ...]  # what is sent (again after a failover)
    future: asyncio.Future[Any]
    one_way: bool  # a one-way ordered call: answered with its version


class _Subscription:
    def __init__(self, sid: int, actor: str, shard: int, since: tuple[int, int] | None,
                 max_backlog: int) -> None:
        self.sid = sid
        self.actor = actor
        self.shard = shard
        self.since = since  # after a failover: the last version given
        self.queue: asyncio.Queue[HistoryEntry | BaseException] = asyncio.Queue()
        self.max_backlog = max_backlog
        self.ended = False

    def frame(self) -> tuple[object, ...]:
        since = self.since
        return (self.sid, self.actor, self.shard,
                *((since[0], since[1] + 1) if since else (0, 0)))

    def end(self, exc: BaseException) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(exc)


class Client:
    """An external client of a group (see the module header). Make one with :meth:`connect`;
    ``async with`` closes it."""

    def __init__(self, group: str, peers: Mapping[int, Address], secret: bytes,
                 tls: ssl.SSLContext | None, timeout: float) -> None:
        self.group = group
        self._peers: dict[int, Address] = dict(peers)
        self._secret = secret
        self._tls = tls
        self._timeout = timeout
        self.client_id = os.urandom(wire.CLIENT_ID_BYTES)
        """This client's id: every member applies its ordered calls once per number."""
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._numbers: dict[tuple[str, int], Numbering] = {}
        self._subs: dict[int, _Subscription] = {}
        self._specs: dict[str, ActorSpec] = {}
        self._writer: asyncio.StreamWriter | None = None
        self.relay: int | None = None
        """The member relaying this client's calls now (None while it has none)."""
        self._view: View | None = None
        self._view_waiters: list[asyncio.Queue[View | None]] = []
        self._ready: asyncio.Event = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._failovers = 0
        self._last_error = ""  # why the last member tried did not take this client
        self._max_call = 1 << 30  # a call's encoded bytes, at most (the relay says)

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    async def connect(cls, *, group: str, peers: Mapping[int, str | Address],
                      secret: str | bytes | None = None, tls: ssl.SSLContext | None = None,
                      timeout: float = 30.0, client_id: bytes | None = None) -> Self:
        """Connect to a member of ``group`` among ``peers`` (member id -> the ``host:port``
        of its ``client_listen``) and return once one accepted this client.

        ``secret``: the group's ``client_secret`` (not the members' own ``secret``: a member
        port refuses clients); ``tls``: a client-side context to speak TLS with members that
        serve clients over it, holding a client certificate of the group's CA (``derecho-async
        certs --clients``; then ``secret`` is needed only where the members set
        ``client_secret``); ``timeout``: seconds without any reachable member after
        which the client closes (its calls then fail with :class:`GroupClosed`);
        ``client_id``: 16 bytes naming this client (default: random). Members apply each
        ordered call once per client id and call number, and a client numbers its calls per
        actor from 0: give an id only to resume exactly where a client of that id stopped.
        :class:`AuthenticationError` at once if a member refuses the secret, the certificate
        or the group name; :class:`UsageError` at once if an address is not a client port."""
        if not peers:
            raise UsageError("Client.connect needs peers: member id -> 'host:port'")
        checked = {int(m): check_address(a, f"peers[{m}]") for m, a in peers.items()}
        if secret is None and tls is None:
            raise UsageError("Client.connect needs the group's client_secret (or tls= with a "
                             "client certificate)")
        key = (b"" if secret is None else secret.encode() if isinstance(secret, str)
               else bytes(secret))
        if timeout <= 0:
            raise UsageError(f"timeout must be positive, got {timeout!r}")
        client = cls(group, checked, key, tls, timeout)
        if client_id is not None:
            if type(client_id) is not bytes or len(client_id) != wire.CLIENT_ID_BYTES:
                raise UsageError(f"client_id must be {wire.CLIENT_ID_BYTES} bytes")
            client.client_id = client_id
        client._task = asyncio.get_running_loop().create_task(client._run())
        ready: asyncio.Future[object] = asyncio.ensure_future(client._ready.wait())
        closed: asyncio.Future[object] = client._closed  # type: ignore[assignment]
        try:
            await asyncio.wait([ready, closed], timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # (cancelled: nothing of this client may outlive the call)
            ready.cancel()
            await asyncio.shield(client.close())
            raise
        ready.cancel()
        if not client._closed.done() and not client._ready.is_set():
            client._shut(GroupClosed(
                f"no member of group {group!r} took this client within {timeout} s (tried "
                f"{sorted(checked)}; last: {client._last_error or 'no answer yet'})"))
        if client._closed.done():
            await client.close()
            client._closed.result()  # raises why
        return client

    async def close(self) -> None:
        """Close the connection; calls not answered fail with :class:`GroupClosed`."""
        self._shut(GroupClosed("the client was closed"))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    @property
    def closed(self) -> asyncio.Future[None]:
        """Set once the client is closed: its exception says why (closed by hand, refused,
        no member reachable for ``timeout`` seconds)."""
        return self._closed

    @property
    def view(self) -> View:
        """The latest view this client heard of."""
        if self._view is None:
            raise UsageError("the client has not heard of a view yet")
        return self._view

    def views(self) -> AsyncIterator[View]:
        """Every view the client hears of from now on (from this call, not the first step),
        in order; ends when it closes."""
        queue: asyncio.Queue[View | None] = asyncio.Queue()
        self._view_waiters.append(queue)
        return self._follow_views(queue)

    async def _follow_views(self, queue: asyncio.Queue[View | None]) -> AsyncIterator[View]:
        try:
            while True:
                view = await queue.get()
                if view is None:
                    return
                yield view
        finally:
            with contextlib.suppress(ValueError):
                self._view_waiters.remove(queue)

    def subgroup(self, actor: type[A], shard: int | None = None) -> ClientHandle[A]:
        """The handle for calls into ``actor``'s subgroup, or into shard ``shard`` of a sharded
        actor (as a member's :meth:`Group.subgroup`): ``await h.m(...)``,
        ``await h.m.cast(...)``, ``await h.m.at(member)(...)``, ``await h.m.any()(...)``, and
        ``h[Actor.m]`` typed from the handler's signature. The relay forwards a call to a shard
        it does not host to a member that does."""
        if shard is not None and (type(shard) is not int or shard < 0):
            raise UsageError(f"a shard is a non-negative int, not {shard!r}")
        return ClientHandle(self, self._spec(actor), shard or 0)

    def subscribe(self, actor: type[Actor], *, shard: int = 0,
                  since: tuple[int, int] | None = None,
                  max_backlog: int = 65536) -> AsyncIterator[HistoryEntry]:
        """``actor``'s stable deliveries, in the group's order, as a member delivers them
        (:meth:`Group.subscribe`): from this call on, or after version ``since`` (the group
        needs ``data_dir``); of a sharded actor, of shard ``shard`` (the relay must host it).
        Ends with :class:`SubscriptionDropped` when the relay dropped it, or when more than
        ``max_backlog`` deliveries wait here unread."""
        spec = self._spec(actor)
        self._check_open()
        if since is not None:
            since = check_version(since)
        if type(max_backlog) is not int or max_backlog < 1:
            raise UsageError(f"max_backlog must be a positive int, got {max_backlog!r}")
        sub = _Subscription(next(self._ids), spec.name, shard, since, max_backlog)
        self._subs[sub.sid] = sub
        self._send(cw.SUB, *sub.frame())
        return self._follow(sub)

    async def _follow(self, sub: _Subscription) -> AsyncIterator[HistoryEntry]:
        try:
            while True:
                item = await sub.queue.get()
                if isinstance(item, BaseException):
                    if isinstance(item, GroupClosed) and self._closed.done():
                        return
                    raise item
                yield item
        finally:
            if self._subs.pop(sub.sid, None) is not None and not sub.ended:
                self._send(cw.UNSUB, sub.sid)

    # -- calls -----------------------------------------------------------------------------
    def _spec(self, actor: type[Actor]) -> ActorSpec:
        spec = self._specs.get(getattr(actor, "__name__", ""))
        if spec is None or spec.cls is not actor:
            spec = actor_spec(actor)
            self._specs[spec.name] = spec
        return spec

    def _check_open(self) -> None:
        if self._closed.done():
            raise self._closed.exception() or GroupClosed("the client is closed")

    async def ordered(self, spec: ActorSpec, shard: int, method: str, one_way: bool,
                      args: tuple[object, ...], kwargs: dict[str, object]) -> Any:
        """An ordered call (see :class:`ClientHandle`)."""
        self._check_open()
        name = f"{spec.name}.{method}{CAST if one_way else ''}"
        body = wire.encode_call(name, _on_host(args), _on_host(kwargs))
        numbers = self._numbers.get((spec.name, shard))
        if numbers is None:
            numbers = self._numbers[(spec.name, shard)] = Numbering()
        seq = await numbers.take()
        try:
            return await self._request((cw.CALL, spec.name, shard, seq, body), one_way)
        finally:
            numbers.answered(seq)

    async def p2p(self, spec: ActorSpec, shard: int, method: str, member: int,
                  args: tuple[object, ...], kwargs: dict[str, object]) -> Versioned[Any]:
        """A p2p call to ``member`` (-1: the relay itself, or a host of ``shard``)."""
        self._check_open()
        body = wire.encode_call(f"{spec.name}.{method}", _on_host(args), _on_host(kwargs))
        frame = (cw.P2P, member, spec.name, shard, body)
        return await self._request(frame, False)  # type: ignore[no-any-return]

    async def _request(self, frame: tuple[object, ...], one_way: bool) -> Any:
        body = frame[-1]
        assert isinstance(body, bytes)
        if len(body) > self._max_call:  # (the relay would refuse the frame, and the next too)
            raise UsageError(f"a call of {len(body)} bytes encoded is over the members' bound "
                             f"of {self._max_call} bytes (max_call_mb)")
        rid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        kind, *fields = frame
        call = _Call(rid, (kind, rid, *fields), fut, one_way)
        self._calls[rid] = call
        try:
            self._send(*call.frame)
            return await fut
        finally:
            self._calls.pop(rid, None)

    def _send(self, kind: object, *fields: object) -> None:
        writer = self._writer
        if writer is not None and not writer.is_closing():
            cw.write_frame(writer, kind, *fields)  # type: ignore[arg-type]

    # -- the connection --------------------------------------------------------------------
    def _order(self) -> list[int]:
        """Members to try, the current relay first, then the others in a random order."""
        others = [m for m in self._peers if m != self.relay]
        random.shuffle(others)
        return ([self.relay] if self.relay in self._peers else []) + others

    async def _run(self) -> None:
        pause = _RETRY_S
        lost_at = asyncio.get_running_loop().time()
        while not self._closed.done():
            for member in self._order():
                try:
                    reader, writer = await self._dial(member)
                except (AuthenticationError, UsageError) as exc:  # refused for good
                    self._shut(exc)
                    return
                except (OSError, HandshakeError, TimeoutError, asyncio.IncompleteReadError,
                        ProtocolViolation) as exc:
                    log.debug("client: member %d not reachable: %r", member, exc)
                    self._last_error = f"member {member}: {exc or type(exc).__name__}"
                    continue
                pause = _RETRY_S
                if await self._serve(member, reader, writer):  # (a relay took this client)
                    lost_at = asyncio.get_running_loop().time()
                if self._closed.done():
                    return
            if asyncio.get_running_loop().time() - lost_at > self._timeout:
                self._shut(GroupClosed(
                    f"no member of group {self.group!r} took this client for {self._timeout} "
                    f"s (tried {sorted(self._peers)}; last: {self._last_error})"))
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    async def _dial(self, member: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = self._peers[member]
        where = f"member {member} at {host}:{port}"
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=self._tls, limit=1 << 16), 5.0)
        except ssl.SSLError as exc:
            _refused_certificate(where, exc)
            raise
        try:
            _sid, _addr, verdict, why = await asyncio.wait_for(client_handshake(
                reader, writer, secret=self._secret, my_id=random.getrandbits(62),
                my_addr=("client", 0), expect=None, group=self.group, role=CLIENT), 10.0)
            if verdict == "busy":  # (at its max_clients: another member may take it)
                raise HandshakeError(f"{where} is busy: {why}")
            if verdict != "accept":
                raise AuthenticationError(f"{where} refused this client: {why}")
            cw.write_frame(writer, cw.HELLO, self.client_id)
        except ssl.SSLError as exc:  # (TLS 1.3: a refused certificate shows at the first read)
            writer.close()
            _refused_certificate(where, exc)
            raise
        except Refused as exc:
            writer.close()
            if exc.wrong_port:
                raise UsageError(f"{where} is not a client port (give the client the "
                                 f"addresses members serve clients on, their client_listen): "
                                 f"{exc}") from None
            raise AuthenticationError(f"{where}: {exc}") from None
        except BaseException:
            writer.close()
            raise
        return reader, writer

    async def _serve(self, member: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> bool:
        """Use ``member`` as the relay until its connection ends; whether it took this client
        (told it a view)."""
        if self.relay is not None and self.relay != member:
            self._failovers += 1
            log.info("client: relay %d gone; member %d relays now", self.relay, member)
        self.relay = member
        self._writer = writer
        for call in list(self._calls.values()):  # every call not answered, again
            cw.write_frame(writer, *call.frame)  # type: ignore[arg-type]
        for sub in self._subs.values():
            cw.write_frame(writer, cw.SUB, *sub.frame())
        took = False
        try:
            while True:
                frame = await cw.read_frame(reader, _MAX_FRAME)
                self._on_frame(member, frame)
                took = took or self._ready.is_set()
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except ProtocolViolation as exc:
            log.warning("client: member %d broke the protocol: %s", member, exc)
        finally:
            self._writer = None
            self._ready.clear()
            writer.close()
        return took

    def _on_frame(self, member: int, frame: list[Any]) -> None:
        kind = frame[0]
        if kind == cw.VIEW:
            _, view_id, members, known, self._max_call = frame
            for row in known:
                if (isinstance(row, list) and len(row) == 3 and type(row[0]) is int
                        and isinstance(row[1], str) and type(row[2]) is int):
                    self._peers[row[0]] = (row[1], row[2])
            view = View(view_id, tuple(int(m) for m in members))
            if self._view is None or view.view_id > self._view.view_id:
                self._view = view
                for queue in self._view_waiters:
                    queue.put_nowait(view)
            self._ready.set()
            return
        if kind == cw.EVENT:
            _, sid, view_id, seq, t_ns, method, body, one_way = frame
            sub = self._subs.get(sid)
            if sub is None or sub.ended:
                return
            if sub.since is not None and (view_id, seq) <= sub.since:
                return  # given before a failover
            decoded = wire.decode(body)
            if not (isinstance(decoded, list | tuple) and len(decoded) == 2):
                raise ProtocolViolation("an event's arguments are not [args, kwargs]")
            args, kwargs = decoded
            sub.since = (view_id, seq)
            if sub.queue.qsize() >= sub.max_backlog:
                sub.end(SubscriptionDropped(f"more than {sub.max_backlog} deliveries waited "
                                            "unread at this client"))
                self._send(cw.UNSUB, sid)
                return
            sub.queue.put_nowait(HistoryEntry((view_id, seq), t_ns / 1e9, method,
                                              tuple(args), dict(kwargs), one_way))
            return
        if kind == cw.END:
            sub = self._subs.get(frame[1])
            if sub is not None:
                sub.end(SubscriptionDropped(f"member {member} ended the subscription: "
                                            f"{frame[2]}"))
            return
        call = self._calls.get(frame[1])
        if call is None or call.future.done():
            return
        if kind == cw.DONE:
            _, _rid, view_id, seq, items = frame
            if call.one_way:
                call.future.set_result((view_id, seq))
                return
            call.future.set_result(Replies(cw.outcomes_of(items), (view_id, seq)))
        elif kind == cw.FAIL:
            _, _rid, retry, type_name, message = frame
            if retry:  # this relay could not see it through: again, here or at the next
                loop = asyncio.get_running_loop()
                loop.call_later(_RETRY_S, self._resend, call.rid)
                return
            if type_name == "MemberFailed":
                call.future.set_exception(MemberFailed(-1, message))
            else:
                error = _ERRORS.get(type_name, DerechoError)
                call.future.set_exception(error(f"member {member}: {type_name}: {message}"))
        elif kind == cw.ANSWER:
            _, _rid, ok, body, view_id, seq1 = frame
            value = decode_result(member, ok, body)
            if isinstance(value, BaseException):
                call.future.set_exception(value)
            else:
                call.future.set_result(Versioned(value, (view_id, seq1 - 1)))

    def _resend(self, rid: int) -> None:
        call = self._calls.get(rid)
        if call is not None and not call.future.done():
            self._send(*call.frame)

    def _shut(self, exc: BaseException) -> None:
        if self._closed.done():
            return
        self._closed.set_exception(exc)
        self._closed.exception()  # (retrieved: nobody need wait for it)
        for call in list(self._calls.values()):
            if not call.future.done():
                call.future.set_exception(exc)
        for sub in self._subs.values():
            sub.end(exc)
        for queue in self._view_waiters:
            queue.put_nowait(None)
        if self._writer is not None:
            self._writer.close()


def _refused_certificate(where: str, exc: ssl.SSLError) -> None:
    """Raise :class:`AuthenticationError` where a TLS error means a certificate was refused,
    either way (no retry can mend that); return for any other TLS error."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        raise AuthenticationError(f"{where}: its certificate did not verify against the "
                                  f"client's TLS context: {exc.verify_message}") from None
    if "CERTIFICATE" in str(getattr(exc, "reason", "")) or "UNKNOWN_CA" in str(
            getattr(exc, "reason", "")):
        raise AuthenticationError(f"{where} refused this client's certificate ({exc.reason}): "
                                  "present a client certificate of the group's CA (`derecho-"
                                  "async certs --clients`)") from None


def _on_host(value: Any) -> Any:
    """Device (CuPy) arrays in a client's call travel through host memory: copied to numpy."""
    if isinstance(value, tuple):
        return tuple(_on_host(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_on_host(v) for v in value]
    if wire.is_cupy_array(value):
        return value.get()
    return value


class _Method:
    """A method of a client's handle: the client, the actor, the shard, the method's name."""

    __slots__ = ("_client", "_method", "_shard", "_spec")

    def __init__(self, client: Client, spec: ActorSpec, shard: int, method: str) -> None:
        self._client = client
        self._spec = spec
        self._shard = shard
        self._method = method


class ClientOrderedMethod(_Method, Generic[P, R]):
    """An ``@ordered`` method of a client's handle (as a member's
    :class:`~derecho_async.api.handles.OrderedMethod`)."""

    __slots__ = ()

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[Replies[R]]:
        return self._client.ordered(self._spec, self._shard, self._method, False, args, kwargs)

    def cast(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[tuple[int, int]]:
        """A one-way ordered call: its version once delivered at the relay (or the member
        the relay forwarded it to)."""
        return self._client.ordered(self._spec, self._shard, self._method, True, args, kwargs)


class ClientP2PCall(_Method, Generic[P, R]):
    """A p2p method of a client's handle bound to a member (as a member's
    :class:`~derecho_async.api.handles.P2PCall`)."""

    __slots__ = ("_member",)

    def __init__(self, client: Client, spec: ActorSpec, shard: int, method: str,
                 member: int) -> None:
        super().__init__(client, spec, shard, method)
        self._member = member

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        got: Versioned[R] = await self._client.p2p(self._spec, self._shard, self._method,
                                                   self._member, args, kwargs)
        return got.value

    def versioned(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[Versioned[R]]:
        """The call, answered with the version of the state the handler read."""
        return self._client.p2p(self._spec, self._shard, self._method, self._member, args,
                                kwargs)


class ClientP2PMethod(_Method, Generic[P, R]):
    """A ``@p2p`` method of a client's handle: bound with :meth:`at` or :meth:`any`, not called
    itself (as a member's :class:`~derecho_async.api.handles.P2PMethod`)."""

    __slots__ = ()

    if not TYPE_CHECKING:  # (to a type checker it is not callable at all)
        def __call__(self, *args: object, **kwargs: object) -> None:
            raise UsageError(p2p_usage(self._spec.name, self._method))

    def at(self, member: int) -> ClientP2PCall[P, R]:
        """The call bound to ``member`` (made from the relay; for a shard, one of its
        members)."""
        if type(member) is not int or member < 0:
            raise UsageError(f"a member id is a non-negative int, not {member!r}")
        return ClientP2PCall(self._client, self._spec, self._shard, self._method, member)

    def any(self) -> ClientP2PCall[P, R]:
        """The call served by the relay (for a shard it does not host, by one of the shard's
        members)."""
        return ClientP2PCall(self._client, self._spec, self._shard, self._method, -1)


class ClientHandle(Generic[A_co]):
    """A client's calls into one actor's subgroup (or one shard of it): the same methods as a
    member's :class:`~derecho_async.api.handles.SubgroupHandle` (``.at(m)`` and ``.any()``
    for p2p), and the same typed access, ``handle[KV.method]``."""

    def __init__(self, client: Client, spec: ActorSpec, shard: int = 0) -> None:
        self._client = client
        self._spec = spec
        self.shard = shard
        self._typed: dict[object, ClientOrderedMethod[Any, Any] | ClientP2PMethod[Any, Any]] = {}

    @overload
    def __getitem__(
        self, method: OrderedDef[A_co, P, Coroutine[Any, Any, R]]
    ) -> ClientOrderedMethod[P, R]: ...
    @overload
    def __getitem__(self, method: OrderedDef[A_co, P, R]) -> ClientOrderedMethod[P, R]: ...
    @overload
    def __getitem__(
        self, method: P2PDef[A_co, P, Coroutine[Any, Any, R]]
    ) -> ClientP2PMethod[P, R]: ...
    @overload
    def __getitem__(self, method: P2PDef[A_co, P, R]) -> ClientP2PMethod[P, R]: ...

    def __getitem__(
        self, method: object
    ) -> ClientOrderedMethod[Any, Any] | ClientP2PMethod[Any, Any]:
        """``handle[KV.method]``: ``handle.method``, typed from the handler's signature."""
        return typed_method(self, self._typed, self._spec, method)

    def __getattr__(self, name: str) -> Any:
        kind = self._spec.kind_of(name)
        method: ClientOrderedMethod[Any, Any] | ClientP2PMethod[Any, Any]
        if kind == "ordered":
            method = ClientOrderedMethod(self._client, self._spec, self.shard, name)
        elif kind == "p2p":
            method = ClientP2PMethod(self._client, self._spec, self.shard, name)
        else:
            raise AttributeError(f"actor {self._spec.name} has no @ordered or @p2p method "
                                 f"{name!r}")
        self.__dict__[name] = method
        return method
