"""The accepting side of the tcp transport: accept, judge before reading, TLS and handshake
within the deadline, then the stream's frames. Theory of operation: docs/DESIGN.md §5.3
(strangers: :mod:`.limits`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import ssl
from typing import Any

from derecho_async.transport.base import log
from derecho_async.transport.tcp.handshake import AuthError, HandshakeError, server_handshake
from derecho_async.transport.tcp.identity import certified_member
from derecho_async.transport.tcp.limits import descriptor_limit
from derecho_async.transport.tcp.streams import (
    WILDCARDS,
    Accepted,
    Conn,
    TcpCore,
    abort_transport,
    reset_socket,
)

#: accepts taken in a row before the accept loop yields to the others
_ACCEPT_BURST = 16
#: errors of accept() that mean "out of descriptors or memory": wait, then accept again
_ACCEPT_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class AcceptingSide(TcpCore):
    """Accepting on the listening sockets (a side of :class:`~.transport.TcpTransport`)."""

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
            reset_socket(sock)
            return
        reason, victim = self._pending.offer(host, sock.fileno(), descriptor_limit())
        if reason is not None:
            self.refusals.note(
                reason,
                f"refused a connection from {host}: {reason} ({len(self._pending)} pending,"
                f" {self._pending.count(host)} from that address)",
            )
            reset_socket(sock)
            return
        if victim is not None:
            self.refusals.note(
                "evicted",
                f"closed a pending connection from {victim.host} (held since it connected) to"
                f" make room for one from {host}",
            )
            self._evict(victim)
        sock.setblocking(False)
        acc = Accepted(host, peer, sock)
        self._pending.add(acc, host)
        acc.task = self._spawn(self._serve(acc))

    def _evict(self, acc: Accepted) -> None:
        """Close a pending connection now (its descriptor is freed at once)."""
        self._pending.discard(acc)
        conn = acc.conn
        if conn is not None:
            self._lost(conn, "evicted: pending connections at their cap", hostile=False)
        if acc.writer is not None:
            abort_transport(acc.writer.transport)
        elif acc.sock is not None:
            reset_socket(acc.sock)
            acc.sock = None
        if acc.task is not None:
            acc.task.cancel()

    async def _serve(self, acc: Accepted) -> None:
        """An accepted connection: TLS and handshake within the deadline, then its frames."""
        assert self._loop is not None and acc.sock is not None
        loop = self._loop
        conn: Conn | None = None
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
                reset_socket(acc.sock)
                acc.sock = None

    def _handshake_failed(self, acc: Accepted, exc: BaseException) -> None:
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
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, acc: Accepted
    ) -> Conn | None:
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
        if self._cert_ids:
            try:
                named = certified_member(writer.get_extra_info("peercert"), self._group)
            except AuthError as exc:
                peer.answer(writer, "reject", str(exc))
                raise
            if named != c_id:
                peer.answer(writer, "reject", f"your certificate names member {named}")
                self.refusals.note(
                    "forged id",
                    f"refused a stream from {peername} claiming member {c_id}: its certificate"
                    f" names member {named}",
                    logging.ERROR,
                )
                return None
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
        if host in WILDCARDS and isinstance(peername, tuple):
            host = str(peername[0])
        live = link.conn
        if (
            live is not None and live.admitted and not live.closed
            and link.addr is not None and link.addr != (host, port)
        ):  # a second process with a member's id: the member keeps its stream
            known = f"{link.addr[0]}:{link.addr[1]}"
            peer.answer(writer, "reject", f"member id {c_id} is in use by a live member at "
                        f"{known} (if that member is gone, retry once the group removed it)")
            self.refusals.note("id in use", f"refused a stream from {peername} claiming "
                               f"member {c_id}, which is live at {known}", logging.ERROR)
            return None
        link.addr = (host, port)
        peer.answer(writer, "accept")
        conn = Conn(c_id, c_id, reader, writer, host=acc.host)
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
