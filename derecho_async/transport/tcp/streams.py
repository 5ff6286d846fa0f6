"""The tcp transport's shared pieces: streams, links, pending accepts, socket helpers, and the
state :class:`TcpCore` that the transport's sides (:mod:`.dialling`, :mod:`.accepting`,
:mod:`.transport`) share. Theory of operation: docs/DESIGN.md §5.3.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl
import struct
from dataclasses import dataclass, field
from typing import Any

from derecho_async.errors import UsageError
from derecho_async.transport.base import Transport
from derecho_async.transport.tcp.handshake import Address
from derecho_async.transport.tcp.limits import RefusalLog, TcpLimits
from derecho_async.transport.unreachable import UnreachableLog

WILDCARDS = {"", "0.0.0.0", "::"}


class Duplicate(Exception):
    """The peer keeps its own stream to us (simultaneous dial)."""


#: payloads up to this size are read in one piece; longer ones in pieces of this size
PIECE = 1 << 20
#: a payload cut short at close is freed on the loop up to this size, off the loop above it
FREE_ON_LOOP = 8 << 20


class Truncated(Exception):
    """A payload read in pieces ended at EOF after ``got`` of ``want`` bytes."""

    def __init__(self, got: int, want: int) -> None:
        super().__init__(f"{got} of {want} bytes")
        self.got = got
        self.want = want


@dataclass(eq=False)
class Conn:
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
    accepted: Accepted | None = None
    host: str = ""


@dataclass(eq=False)
class Accepted:
    """An accepted connection, pending from accept until its peer is admitted (or it ends)."""

    host: str
    peer: object
    sock: socket.socket | None
    writer: asyncio.StreamWriter | None = None
    conn: Conn | None = None
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class Link:
    """Everything about one peer: address, current stream, dialler, queued frames, waiters."""

    peer: int
    addr: Address | None = None
    conn: Conn | None = None
    dialler: asyncio.Task[None] | None = None
    handshaking: bool = False
    queue: list[bytes] = field(default_factory=list)
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    established: asyncio.Event = field(default_factory=asyncio.Event)


class TcpCore(Transport):
    """The state :class:`~.transport.TcpTransport` keeps, declared once for its sides
    (:class:`~.dialling.DiallingSide`, :class:`~.accepting.AcceptingSide`), and the methods
    each side calls on another."""

    retry_delays: tuple[float, ...]
    handshake_timeout: float
    dup_wait: float
    max_frame: int
    limits: TcpLimits
    admission: bool
    refusals: RefusalLog
    #: how loudly a peer that stays unreachable is logged (once per interval at WARNING)
    unreachable: UnreachableLog
    _listen: Address
    _secret: bytes
    _group: str
    _ssl_server: ssl.SSLContext | None
    _ssl_client: ssl.SSLContext | None
    _cert_ids: bool
    _links: dict[int, Link]
    _given: set[int]
    _views: dict[int, frozenset[int]]
    _newest_view: int
    _unadmitted: set[Conn]
    _listeners: list[socket.socket]
    _address: Address | None
    _tasks: set[asyncio.Task[None]]

    @property
    def address(self) -> Address:
        """The bound listen address (host, port); available after :meth:`start`."""
        if self._address is None:
            raise UsageError("the transport is not started: no address yet")
        return self._address

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        assert self._loop is not None
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _link(self, peer: int) -> Link:
        link = self._links.get(peer)
        if link is None:
            link = self._links[peer] = Link(peer)
        return link

    # -- provided by TcpTransport --------------------------------------------------------------
    def _is_admitted(self, peer: int) -> bool:
        raise NotImplementedError

    async def _read_loop(self, conn: Conn) -> None:
        raise NotImplementedError

    def _retire(self, conn: Conn) -> None:
        raise NotImplementedError

    def _lost(self, conn: Conn, reason: str, *, hostile: bool = True) -> None:
        raise NotImplementedError

    def _announce_beacon(self, conn: Conn) -> None:
        raise NotImplementedError

    # -- provided by DiallingSide --------------------------------------------------------------
    def _install(self, link: Link, conn: Conn) -> None:
        raise NotImplementedError


async def read_payload(reader: asyncio.StreamReader, length: int) -> bytes:
    """``length`` payload bytes. Above :data:`PIECE` they are read in pieces as they arrive:
    memory follows what the peer really sent, never the length its header announced, and a
    stream cut short leaves pieces that are freed off the loop (raises :class:`Truncated`)."""
    if length <= PIECE:
        return await reader.readexactly(length)
    pieces: list[bytes] = []
    got = 0
    try:
        while got < length:
            piece = await reader.read(min(length - got, PIECE))
            if not piece:
                raise Truncated(got, length)
            pieces.append(piece)
            got += len(piece)
        return b"".join(pieces)
    finally:
        if got < length and got > FREE_ON_LOOP:
            free_off_loop(pieces)


def free_off_loop(pieces: list[bytes]) -> None:
    """Drop ``pieces`` in a worker thread: freeing hundreds of MiB page by page is not the
    loop's work (a stream closed mid-frame must not stall the member)."""
    with contextlib.suppress(RuntimeError):  # no running loop: free here
        asyncio.get_running_loop().run_in_executor(None, pieces.clear)
        return
    pieces.clear()


async def listen_sockets(
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


def reset_socket(sock: socket.socket) -> None:
    """Close ``sock`` at once with a reset (no lingering state for a refused connection)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def abort_transport(transport: asyncio.WriteTransport) -> None:
    """Abort ``transport`` with a reset (see :func:`reset_socket`)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def tune(writer: asyncio.StreamWriter) -> None:
    """TCP_NODELAY + keepalive; drain() waits for an empty write buffer (over TLS: for an empty
    TLS buffer; asyncio's TLS layer pauses at size >= high, so high=0 would never resume)."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        except OSError:
            pass
    with contextlib.suppress(AttributeError, NotImplementedError, ValueError):
        if writer.get_extra_info("ssl_object") is None:
            writer.transport.set_write_buffer_limits(high=0)
        else:
            writer.transport.set_write_buffer_limits(high=1, low=0)
