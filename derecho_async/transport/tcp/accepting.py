"""The accepting side of the tcp transport: the member port's handshake and its stream's frames.
Accepting, judging before reading, TLS and the deadline are the :class:`~.entrance.Entrance`'s.
Theory of operation: docs/DESIGN.md §5.3 (strangers: :mod:`.limits`, :mod:`.entrance`).
"""

from __future__ import annotations

import asyncio
import logging

from derecho_async.transport.tcp.entrance import Entrance
from derecho_async.transport.tcp.handshake import AuthError, server_handshake
from derecho_async.transport.tcp.identity import certified_member
from derecho_async.transport.tcp.streams import WILDCARDS, Accepted, Conn, TcpCore


class AcceptingSide(TcpCore):
    """Accepting on the listening sockets (a side of :class:`~.transport.TcpTransport`)."""

    _entrance: Entrance[Conn]

    def _make_entrance(self) -> Entrance[Conn]:
        """The member port's entrance (made once, by the transport)."""
        return Entrance("member port", self.refusals, self._ssl_server,
                        self._accept_handshake, self._serve_accepted, self._spawn,
                        on_evict=self._evicted)

    def _evicted(self, acc: Accepted) -> None:
        """A pending connection is closed to make room (the entrance's ``on_evict``)."""
        conn = acc.conn
        if conn is not None:
            self._lost(conn, "evicted: pending connections at their cap", hostile=False)

    async def _serve_accepted(self, acc: Accepted, conn: Conn) -> None:
        """A stream whose handshake was accepted: its frames, until it ends."""
        conn.task = acc.task
        try:
            await self._read_loop(conn)
        finally:
            self._unadmitted.discard(conn)
            if acc.writer is not None and (conn.closed or self._closed):
                acc.writer.close()

    async def _accept_handshake(
        self, acc: Accepted, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
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
            self._entrance.admit(acc)
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
