"""What a listening socket lets in before its peer is known: accept, judge, greet in time.

Theory of operation (DESIGN.md §5.3, "Strangers"). An :class:`Entrance` accepts on the listening
sockets of one service of a member (the tcp transport's member port, the client port of
:mod:`derecho_async.api.relay`). Each accepted connection is judged before a byte of it is read
(:class:`~.limits.PendingTable`: a cap per address and in total, the descriptor reserve, the
oldest connection of the biggest holder evicted for a newcomer from a smaller one). Then the
owner's *greeting* (TLS, the handshake, whatever the service reads first) runs within
``limits.handshake_s``; a greeting that fails, runs out of time or is cut off is counted and
logged by cause through the owner's rate-limited :class:`~.limits.RefusalLog`. What the greeting
returns the owner then *serves*, outside the deadline; the connection stays pending (counted
against the caps, and evictable) until the owner calls :meth:`Entrance.admit`. An accept that
fails for want of descriptors pauses accepting for a moment, logged once per interval, not once
per try.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from derecho_async.transport.tcp.handshake import AuthError, HandshakeError, WrongRole
from derecho_async.transport.tcp.limits import PendingTable, RefusalLog, descriptor_limit
from derecho_async.transport.tcp.streams import Accepted, abort_transport, reset_socket

__all__ = ["Entrance"]

log = logging.getLogger("derecho_async.transport")

T = TypeVar("T")

#: accepts taken in a row before the accept loop yields to the others
_ACCEPT_BURST = 16
#: errors of accept() that mean "out of descriptors or memory": wait, then accept again
_ACCEPT_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: seconds accepting pauses after such an error
_EXHAUSTED_PAUSE_S = 0.1

Greet = Callable[[Accepted, asyncio.StreamReader, asyncio.StreamWriter], Awaitable["T | None"]]
Serve = Callable[[Accepted, T], Awaitable[None]]
Spawn = Callable[[Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class Entrance(Generic[T]):
    """The door of one listening service (see the module header).

    ``what`` names the service in logs ("member port", "client port"); ``refusals`` counts and
    logs what is refused (its ``limits`` are the bounds applied); ``tls`` wraps every accepted
    stream (its handshake inside the deadline); ``greet`` reads the peer's first words and
    returns what ``serve`` then serves, or None when it answered and is done (the stream is
    closed); ``spawn`` starts a task the owner tracks (and cancels at close); ``on_evict`` tells
    the owner a pending connection is being closed to make room.
    """

    def __init__(self, what: str, refusals: RefusalLog, tls: ssl.SSLContext | None,
                 greet: Greet[T], serve: Serve[T], spawn: Spawn,
                 on_evict: Callable[[Accepted], None] | None = None) -> None:
        self.what = what
        self.refusals = refusals
        self.limits = refusals.limits
        self.pending: PendingTable[Accepted] = PendingTable(self.limits)
        self._tls = tls
        self._greet = greet
        self._serve = serve
        self._spawn = spawn
        self._on_evict = on_evict
        self.closed = False

    # -- accepting ---------------------------------------------------------------------------
    async def accept_loop(self, lsock: socket.socket) -> None:
        """Accept connections on ``lsock`` until :attr:`closed`; each is judged before anything
        is read from it."""
        loop = asyncio.get_running_loop()
        burst = 0
        while not self.closed:
            try:
                sock, peer = await loop.sock_accept(lsock)
            except OSError as exc:
                if self.closed:
                    return
                if exc.errno in _ACCEPT_EXHAUSTED:
                    self.refusals.note(
                        "descriptor limit",
                        f"{self.what}: accept failed: {exc}; accepting again in"
                        f" {_EXHAUSTED_PAUSE_S:g} s",
                        logging.ERROR,
                    )
                else:
                    self.refusals.note("accept failed", f"{self.what}: accept failed: {exc!r}")
                await asyncio.sleep(_EXHAUSTED_PAUSE_S)
                continue
            self.offer(sock, peer)
            burst += 1
            if burst >= _ACCEPT_BURST:  # a backlog of connections must not hog the loop
                burst = 0
                await asyncio.sleep(0)

    def offer(self, sock: socket.socket, peer: object) -> None:
        """Hold or refuse a connection just accepted (synchronously: nothing read yet)."""
        host = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
        if self.closed:
            reset_socket(sock)
            return
        pending = self.pending
        reason, victim = pending.offer(host, sock.fileno(), descriptor_limit())
        if reason is not None:
            self.refusals.note(
                reason,
                f"{self.what}: refused a connection from {host}: {reason} ({len(pending)}"
                f" pending, {pending.count(host)} from that address)",
            )
            reset_socket(sock)
            return
        if victim is not None:
            self.refusals.note(
                "evicted",
                f"{self.what}: closed a pending connection from {victim.host} (held since it"
                f" connected) to make room for one from {host}",
            )
            self.evict(victim)
        sock.setblocking(False)
        acc = Accepted(host, peer, sock)
        pending.add(acc, host)
        acc.task = self._spawn(self._run(acc))

    def evict(self, acc: Accepted) -> None:
        """Close a pending connection now (its descriptor is freed at once)."""
        self.pending.discard(acc)
        if self._on_evict is not None:
            self._on_evict(acc)
        if acc.writer is not None:
            abort_transport(acc.writer.transport)
        elif acc.sock is not None:
            reset_socket(acc.sock)
            acc.sock = None
        if acc.task is not None:
            acc.task.cancel()

    def admit(self, acc: Accepted | None) -> None:
        """``acc``'s peer is admitted: it no longer counts against the caps."""
        if acc is not None:
            self.pending.discard(acc)

    # -- one connection ----------------------------------------------------------------------
    async def _run(self, acc: Accepted) -> None:
        """An accepted connection: TLS and the greeting within the deadline, then service."""
        assert acc.sock is not None
        loop = asyncio.get_running_loop()
        got: T | None = None
        try:
            try:
                async with asyncio.timeout(self.limits.handshake_s):
                    reader = asyncio.StreamReader(limit=1 << 16, loop=loop)
                    protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
                    tls: dict[str, Any] = {}
                    if self._tls is not None:  # (the deadline above ends it first)
                        tls = {"ssl": self._tls,
                               "ssl_handshake_timeout": 2 * self.limits.handshake_s}
                    # the transport owns the socket from here, and closes it if this fails
                    sock, acc.sock = acc.sock, None
                    transport, _ = await loop.connect_accepted_socket(
                        lambda: protocol, sock, **tls
                    )
                    writer = asyncio.StreamWriter(transport, protocol, reader, loop)
                    acc.writer = writer
                    got = await self._greet(acc, reader, writer)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, HandshakeError) as exc:
                self.failed(acc, exc)
                return
            if got is not None:
                await self._serve(acc, got)
        except asyncio.CancelledError:
            # close() or an eviction cancels the stream handlers; on Python 3.11 asyncio would
            # log a cancelled handler as an error, so end quietly (the stream is torn down).
            pass
        finally:
            self.pending.discard(acc)
            if got is None and acc.writer is not None:
                acc.writer.close()
            elif acc.sock is not None:
                reset_socket(acc.sock)
                acc.sock = None

    def failed(self, acc: Accepted, exc: BaseException) -> None:
        """Count and log (rate-limited) a greeting that failed, ran out of time or was cut
        off; close the stream."""
        where = f"{self.what}: handshake with {acc.peer}"
        if isinstance(exc, AuthError):
            self.refusals.note("authentication failed",
                               f"{self.what}: refused a stream from {acc.peer}: {exc}",
                               logging.ERROR)
        elif isinstance(exc, WrongRole):
            self.refusals.note("wrong port", f"{where} failed: {exc}")
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
            self.refusals.note("bad handshake", f"{where} failed: {type(exc).__name__}: {exc}")
        if acc.writer is not None:
            acc.writer.close()
