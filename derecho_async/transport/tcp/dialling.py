"""The dialling side of the tcp transport: one dialler task per link (bounded retries with
backoff), the client handshake, and installing a stream on its link. Theory of operation:
docs/DESIGN.md §5.3.
"""

from __future__ import annotations

import asyncio

from derecho_async.errors import (
    AuthenticationError,
    DerechoError,
    JoinRefused,
    ProtocolViolation,
    UsageError,
)
from derecho_async.transport.base import check_member_id, log
from derecho_async.transport.tcp.handshake import (
    Address,
    AuthError,
    HandshakeError,
    Refused,
    check_address,
    client_handshake,
)
from derecho_async.transport.tcp.identity import certified_member
from derecho_async.transport.tcp.streams import (
    Conn,
    Duplicate,
    Link,
    TcpCore,
    tune,
)


class DiallingSide(TcpCore):
    """Dialling peers and installing streams (a side of :class:`~.transport.TcpTransport`)."""

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

    async def identify(self, address: object, timeout: float) -> int:
        """Dial ``address`` (a member whose id this member does not know: the ``contact`` key)
        until a member there proves the secret, and return its id; the stream stays as that
        member's link. Dials are retried with backoff for ``timeout`` seconds, then
        :class:`ConnectionError`; a refusal raises :class:`AuthenticationError` or
        :class:`JoinRefused` at once."""
        self._check_usable()
        addr = check_address(address, "contact")
        assert self._loop is not None
        deadline = self._loop.time() + timeout
        delays = iter(self.retry_delays)
        last = "no attempt made"
        while True:
            try:
                conn = await self._dial(None, addr)
            except Refused as exc:
                why = f"{exc} (at {addr[0]}:{addr[1]})"
                log.error("member %d: %s", self.member_id, why)
                raise _refusal(exc, why) from None
            except (OSError, TimeoutError, asyncio.IncompleteReadError, HandshakeError,
                    Duplicate) as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                peer = conn.peer
                if self._closed:
                    conn.writer.close()
                    self._check_usable()
                link = self._link(peer)
                link.addr = addr
                if link.conn is None:
                    self._install(link, conn)
                    conn.task = self._spawn(self._read_loop(conn))
                else:  # (it dialled us meanwhile: keep that stream)
                    conn.writer.close()
                return peer
            left = deadline - self._loop.time()
            if left <= 0:
                raise ConnectionError(
                    f"the contact {addr[0]}:{addr[1]} is unreachable: {last}")
            await asyncio.sleep(min(next(delays, self.retry_delays[-1]), left))

    def _ensure_dialler(self, link: Link) -> None:
        if self._closed:
            return
        if link.dialler is None or link.dialler.done():
            link.dialler = self._spawn(self._dial_loop(link))

    async def _dial_loop(self, link: Link) -> None:
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
            except Refused as exc:
                why = f"{exc} (at {addr[0]}:{addr[1]})"
                self._link_failed(link, why, refused=_refusal(exc, why))
                return
            except Duplicate:
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

    async def _dial(self, peer: int | None, addr: Address) -> Conn:
        """One dial of ``addr``, expecting member ``peer`` (None: whoever proves the secret
        there); the stream, whose ``peer`` is the member that answered."""
        host, port = addr
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(
                host, port, ssl=self._ssl_client, server_hostname=host if self._ssl_client else None
            ),
            self.handshake_timeout,
        )
        ok = False
        try:
            named = None
            if self._cert_ids:  # (before our proof: never to a member we did not dial)
                named = certified_member(writer.get_extra_info("peercert"), self._group)
                if peer is not None and named != peer:
                    raise AuthError(
                        f"authentication failed: the certificate at {host}:{port} names member"
                        f" {named}, not member {peer}"
                    )
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
            if self._cert_ids and named != s_id:
                raise AuthError(f"authentication failed: the certificate at {host}:{port} "
                                f"names member {named}, not member {s_id}")
            if verdict == "dup":
                raise Duplicate()
            if verdict != "accept":  # (a refused proof raised AuthError in client_handshake)
                raise Refused(f"member {s_id} refused the stream: {why}")
            ok = True
            return Conn(s_id, self.member_id, reader, writer)
        finally:
            if not ok:
                writer.close()

    def _install(self, link: Link, conn: Conn) -> None:
        """Make ``conn`` the link's stream (synchronously with the verdict) and flush the queue."""
        old = link.conn
        link.conn = conn
        tune(conn.writer)
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
        self._announce_beacon(conn)
        if link.queue:
            conn.writer.writelines(link.queue)
            link.queue.clear()
        link.established.set()
        self.unreachable.reached(link.peer)  # (a later outage is logged again at once)
        self._resolve(link, None)

    def _resolve(self, link: Link, exc: BaseException | None) -> None:
        waiters, link.waiters = link.waiters, []
        for fut in waiters:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

    def _link_failed(
        self, link: Link, reason: str, *, refused: DerechoError | None = None
    ) -> None:
        dropped = len(link.queue) // 2
        link.queue.clear()
        if refused is not None:
            log.error("member %d: %s", self.member_id, reason)
            exc: BaseException = ProtocolViolation(reason, link.peer)
        else:
            log.log(self.unreachable.level(link.peer),
                    "member %d: %s (%d frames dropped)", self.member_id, reason, dropped)
            exc = ConnectionError(reason)
        self._resolve(link, exc)
        if refused is not None:
            self._report_refusal(link.peer, refused)
        else:
            self._report_failure(link.peer, reason)


def _refusal(exc: Refused, why: str) -> DerechoError:
    """The error a refusal means to the user: another secret or group, or a refused stream."""
    return AuthenticationError(why) if exc.auth else JoinRefused(why)
