"""The transport conformance suite, as a function of a factory (DESIGN.md §5.1).

``await check_transport(factory)`` runs every case against transports the factory makes, as
trio's ``check_one_way_stream`` does for streams: a new transport passes it before the runtime
relies on it. A case builds small groups of members (``factory.make``), starts each with a
:class:`Recorder` as its handler, lets the factory connect them, drives them through the
:class:`~derecho_async.transport.base.Transport` interface and checks what the recorders saw.
What only a transport itself knows (addresses to exchange, a member it can never reach, the
resources it must release) the factory answers through the hooks of :class:`TransportFactory`.
A failed check raises ``AssertionError``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from derecho_async.errors import GroupClosed, UsageError
from derecho_async.transport.base import Transport

__all__ = [
    "CASES",
    "Cluster",
    "Recorder",
    "TransportFactory",
    "check_transport",
    "new_group",
    "open_fds",
]

ROW = 64
LOGGER = "derecho_async.transport"
WAIT = 30.0  # only bounds a hang; no case asserts speed


class TransportFactory(abc.ABC):
    """Makes the transports the suite checks; subclass it and implement :meth:`make`."""

    drops_offending_links: bool = False
    """The transport closes its link to a member whose push it refused, so that member sees a
    failure and its next traffic goes over a fresh link (tcp)."""

    @abc.abstractmethod
    def make(self, group: str, member: int, *, small_buffers: bool = False) -> Transport:
        """A new, unstarted transport of ``member`` in ``group``. ``small_buffers``: with the
        smallest buffers the transport allows, so the suite's bursts overrun them (a transport
        without such buffers ignores it)."""

    def connect(self, transports: Sequence[Transport]) -> None:  # noqa: B027 (optional hook)
        """Tell the started ``transports`` of one group how to reach each other (nothing to do
        for transports that address peers by member id alone)."""

    def make_unreachable(self, transport: Transport, member: int) -> None:  # noqa: B027
        """Make ``member`` a peer that ``transport`` (started) can never reach, and have it give
        up on such a peer quickly: a send to ``member`` must end in ``on_failure``."""

    def check_open(self, group: str, transports: Sequence[Transport]) -> None:  # noqa: B027
        """Assert that the started ``transports`` of ``group``, every one of which has sent to
        every other, hold what they should (such as their shared-memory segments)."""

    def check_released(self, group: str) -> None:  # noqa: B027
        """Assert that nothing of ``group`` is left once all its transports closed (beyond the
        sockets and /dev/shm files the suite checks itself)."""


@dataclass
class Recorder:
    """A TransportHandler that records everything, in order, and lets a check await conditions."""

    me: int = -1
    events: list[tuple[object, ...]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        self.events.append(("push", view_id, sender, offset, data))
        self._changed.set()

    def on_message(self, sender: int, payload: bytes) -> None:
        self.events.append(("msg", sender, payload))
        self._changed.set()

    def on_failure(self, member: int, reason: str) -> None:
        self.events.append(("fail", member, reason))
        self._changed.set()

    def pushes(self, sender: int | None = None) -> list[tuple[int, int, int, bytes]]:
        """``(view_id, sender, offset, data)`` of the pushes (from ``sender``), in order."""
        return [
            (e[1], e[2], e[3], e[4])  # type: ignore[misc]
            for e in self.events
            if e[0] == "push" and (sender is None or e[2] == sender)
        ]

    def messages(self, sender: int | None = None) -> list[bytes]:
        """The messages (from ``sender``), in order."""
        return [
            e[2]  # type: ignore[misc]
            for e in self.events
            if e[0] == "msg" and (sender is None or e[1] == sender)
        ]

    def failures(self, member: int | None = None) -> list[str]:
        """The reasons of the failures reported (about ``member``), in order."""
        return [
            e[2]  # type: ignore[misc]
            for e in self.events
            if e[0] == "fail" and (member is None or e[1] == member)
        ]

    def from_sender(self, sender: int) -> list[tuple[object, ...]]:
        """Pushes and messages from ``sender``, in arrival order."""
        return [
            e
            for e in self.events
            if (e[0] == "push" and e[2] == sender) or (e[0] == "msg" and e[1] == sender)
        ]

    async def wait_for(self, pred: Callable[[], bool], timeout: float = WAIT) -> None:
        """Return once ``pred()`` holds, checking it after every event recorded."""
        async with asyncio.timeout(timeout):
            while not pred():
                self._changed.clear()
                await self._changed.wait()


def new_group() -> str:
    """A fresh group name."""
    return "t" + uuid.uuid4().hex[:12]


def open_fds() -> set[str]:
    """This process's open sockets and shared-memory files (empty where /proc is missing)."""
    out: set[str] = set()
    if not os.path.isdir("/proc/self/fd"):
        return out
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("socket:", "/dev/shm/")):
            out.add(f"{fd}->{target}")
    return out


@dataclass
class Cluster:
    """Started transports of one group (members 0..n-1) and their recording handlers."""

    group: str
    transports: list[Transport]
    recs: list[Recorder]

    def __getitem__(self, i: int) -> Transport:
        return self.transports[i]

    def set_view(
        self, view_id: int, members: list[int], row_bytes: int, at: list[int] | None = None
    ) -> None:
        for i in at if at is not None else range(len(self.transports)):
            self.transports[i].set_view(view_id, members, row_bytes)


@contextlib.asynccontextmanager
async def _cluster(
    factory: TransportFactory, n: int = 3, *, small_buffers: bool = False
) -> AsyncIterator[Cluster]:
    """``n`` started transports (members 0..n-1) of one group, all knowing each other."""
    group = new_group()
    ts = [factory.make(group, i, small_buffers=small_buffers) for i in range(n)]
    recs = [Recorder(me=i) for i in range(n)]
    try:
        for t, r in zip(ts, recs, strict=True):
            await t.start(r)
        factory.connect(ts)
        yield Cluster(group, ts, recs)
    finally:
        for t in ts:
            await t.close()
        await asyncio.sleep(0)
    factory.check_released(group)


@contextlib.contextmanager
def _transport_warnings() -> Iterator[list[str]]:
    """The transport logger's warnings (and worse) while the block runs."""
    logger = logging.getLogger(LOGGER)
    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = _Keep(logging.WARNING)
    level = logger.level
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _raises(exc: type[BaseException], fn: Callable[[], object], what: str) -> None:
    try:
        fn()
    except exc:
        return
    raise AssertionError(f"{what}: expected {exc.__name__}")


async def _raises_async(exc: type[BaseException], aw: Awaitable[object], what: str) -> None:
    try:
        await aw
    except exc:
        return
    raise AssertionError(f"{what}: expected {exc.__name__}")


def _word(i: int) -> bytes:
    return i.to_bytes(8, "little")


# -- the cases -----------------------------------------------------------------------------------
async def fifo_per_link_with_interleaved_messages(factory: TransportFactory) -> None:
    """Pushes and messages on each (sender, target) link arrive in the order sent."""
    async with _cluster(factory) as c:
        c.set_view(1, [0, 1, 2], ROW)
        sent: dict[int, dict[int, list[tuple[object, ...]]]] = {s: {} for s in range(3)}
        for i in range(300):
            for s in range(3):
                others = [t for t in range(3) if t != s]
                off = s * ROW + (i % 8) * 8
                c[s].push(1, off, _word(i), others)
                for t in others:
                    sent[s].setdefault(t, []).append(("push", 1, s, off, _word(i)))
                if i % 3 == s:
                    t = others[i % 2]
                    c[s].send(t, b"msg %d from %d" % (i, s))
                    sent[s][t].append(("msg", s, b"msg %d from %d" % (i, s)))
        for t in range(3):
            rec = c.recs[t]
            for s in range(3):
                if s != t:
                    want = sent[s][t]

                    def caught_up(rec: Recorder = rec, s: int = s,
                                  want: list[tuple[object, ...]] = want) -> bool:
                        return len(rec.from_sender(s)) >= len(want)

                    await rec.wait_for(caught_up)
                    assert rec.from_sender(s) == want
            assert rec.failures() == []


async def big_messages_and_bursts_beyond_ring_capacity(factory: TransportFactory) -> None:
    """Messages of several MB and bursts several times the buffers arrive intact, in order."""
    rnd = random.Random(7)
    big1 = rnd.randbytes(6 << 20)
    big2 = rnd.randbytes(3 << 20)
    async with _cluster(factory, small_buffers=True) as c:
        c.set_view(1, [0, 1, 2], ROW)
        want: list[tuple[object, ...]] = [("msg", 0, big1)]
        c[0].send(1, big1)
        c[0].send(2, big1)
        c[2].send(1, big2)  # a concurrent big message on another link
        for burst in range(4):
            for i in range(2500):  # ~240 KB of records per burst: several times a small ring
                n = burst * 2500 + i
                off = (n % 8) * 8
                c[0].push(1, off, _word(n), [1, 2])
                want.append(("push", 1, 0, off, _word(n)))
            c[0].send(1, b"end of burst %d" % burst)
            c[0].send(2, b"end of burst %d" % burst)
            want.append(("msg", 0, b"end of burst %d" % burst))
            await asyncio.sleep(0)
        c[0].send(1, big2)
        c[0].send(2, big2)
        want.append(("msg", 0, big2))
        for t in (1, 2):
            rec = c.recs[t]

            def caught_up(rec: Recorder = rec) -> bool:
                return len(rec.from_sender(0)) >= len(want)

            await rec.wait_for(caught_up)
            got = rec.from_sender(0)
            assert len(got) == len(want)
            assert got == want  # intact and in order
        await c.recs[1].wait_for(lambda: c.recs[1].messages(2) == [big2])
        await c[0].drain()
        assert all(not r.failures() for r in c.recs)


async def push_larger_than_a_record_lands_whole(factory: TransportFactory) -> None:
    """A push larger than a buffer's record lands whole, or in pieces cut at aligned offsets."""
    row = 256 << 10
    data = random.Random(3).randbytes(200 << 10)
    async with _cluster(factory, small_buffers=True) as c:
        c.set_view(1, [0, 1, 2], row)
        off = 2 * row + 12  # unaligned start inside member 2's row
        c[2].push(1, off, data, [0])
        table = bytearray(3 * row)
        rec = c.recs[0]

        def landed() -> bool:
            for _v, s, o, d in rec.pushes(2):
                assert s == 2 and 2 * row <= o and o + len(d) <= 3 * row
                table[o : o + len(d)] = d
            return bytes(table[off : off + len(data)]) == data

        await rec.wait_for(landed)
        # pieces, if any, split on aligned table offsets so no aligned word is torn
        for _v, _s, o, _d in rec.pushes(2)[1:]:
            assert o % 8 == 0


async def push_outside_senders_row_is_dropped_logged_reported(factory: TransportFactory) -> None:
    """A push outside its sender's row is dropped, logged and reported; the rest carries on."""
    with _transport_warnings() as warnings:
        async with _cluster(factory) as c:
            c.set_view(1, [0, 1, 2], ROW, at=[1, 2])  # member 0 does not check: it misbehaves
            c[0].push(1, ROW + 8, b"intruder", [1, 2])  # into member 1's row
            c[0].push(1, 3 * ROW - 4, b"overflow", [1])  # runs past the table
            for t in (1, 2):

                def failed(t: int = t) -> bool:
                    return bool(c.recs[t].failures(0))

                await c.recs[t].wait_for(failed)
                assert "outside member 0's row" in c.recs[t].failures(0)[0]
                assert c.recs[t].pushes(0) == []
            assert any("outside member 0's row" in w for w in warnings)
            # the group carries on: the other links deliver
            c[2].push(1, 2 * ROW, _word(5), [1])
            await c.recs[1].wait_for(lambda: bool(c.recs[1].pushes(2)))
            assert c.recs[1].pushes(2) == [(1, 2, 2 * ROW, _word(5))]
            # the offender, now behaving, gets through again (on a fresh link where the old
            # one was dropped)
            if factory.drops_offending_links:
                await c.recs[0].wait_for(
                    lambda: bool(c.recs[0].failures(1)) and bool(c.recs[0].failures(2))
                )
            c.set_view(1, [0, 1, 2], ROW, at=[0])
            c[0].push(1, 0, _word(9), [1, 2])
            for t in (1, 2):

                def pushed(t: int = t) -> bool:
                    return bool(c.recs[t].pushes(0))

                await c.recs[t].wait_for(pushed)
                assert c.recs[t].pushes(0) == [(1, 0, 0, _word(9))]


async def pushes_for_future_view_are_held_until_set_view(factory: TransportFactory) -> None:
    """Pushes for a view not set yet wait for it (messages overtake them), then are checked."""
    with _transport_warnings() as warnings:
        async with _cluster(factory) as c:
            c.set_view(1, [0, 1, 2], ROW)
            c.set_view(2, [0, 1, 2], 2 * ROW, at=[0])
            c[0].push(2, 0, _word(1), [1, 2])
            c[0].push(2, 8, _word(2), [1, 2])
            c[1].push(2, 0, b"bad-held", [2])  # member 1 writes member 0's row of view 2
            c[0].send(1, b"install view 2")
            c[0].send(2, b"install view 2")
            rec1, rec2 = c.recs[1], c.recs[2]
            await rec1.wait_for(lambda: rec1.messages(0) == [b"install view 2"])
            await rec2.wait_for(lambda: rec2.messages(0) == [b"install view 2"])
            # messages overtake held pushes; nothing for view 2 was delivered yet
            assert rec1.pushes() == [] and rec2.pushes() == []
            c.set_view(2, [0, 1, 2], 2 * ROW, at=[1, 2])
            c[0].push(2, 16, _word(3), [1, 2])  # after set_view: queued behind the held ones
            want = [(2, 0, 0, _word(1)), (2, 0, 8, _word(2)), (2, 0, 16, _word(3))]
            for rec in (rec1, rec2):

                def all_three(rec: Recorder = rec) -> bool:
                    return len(rec.pushes(0)) == 3

                await rec.wait_for(all_three)
                assert rec.pushes(0) == want
            await rec2.wait_for(lambda: bool(rec2.failures(1)))
            assert "outside member 1's row" in rec2.failures(1)[0]
            assert rec2.pushes(1) == []
            assert any("outside member 1's row" in w for w in warnings)


async def pushes_for_views_older_than_kept_are_dropped(factory: TransportFactory) -> None:
    """Pushes for a view older than the newest few a receiver keeps are dropped silently."""
    async with _cluster(factory) as c:
        c.set_view(1, [0, 1, 2], ROW, at=[0])
        for v in (1, 2, 3, 4):  # the receiver keeps only the newest few
            c.set_view(v, [0, 1, 2], ROW, at=[1])
        c[0].push(1, 0, _word(1), [1])
        c[0].send(1, b"barrier")  # FIFO: had the push been accepted, it would be first
        await c.recs[1].wait_for(lambda: bool(c.recs[1].messages(0)))
        assert c.recs[1].pushes() == [] and c.recs[1].failures() == []


async def messages_to_self_and_pushes_to_self(factory: TransportFactory) -> None:
    """A message to oneself arrives; a push names oneself among its targets is skipped there."""
    async with _cluster(factory, n=2) as c:
        c.set_view(1, [0, 1], ROW)
        c[0].push(1, 0, _word(1), [0, 1])  # self is skipped
        c[0].send(0, b"note to self")
        await c.recs[0].wait_for(lambda: bool(c.recs[0].messages(0)))
        await c.recs[1].wait_for(lambda: bool(c.recs[1].pushes(0)))
        assert c.recs[0].pushes() == []
        assert c.recs[0].messages(0) == [b"note to self"]


async def send_to_absent_member_reports_failure(factory: TransportFactory) -> None:
    """A send to a member that cannot be reached ends in ``on_failure``; other links go on."""
    async with _cluster(factory, n=2) as c:
        factory.make_unreachable(c[0], 9)
        c[0].send(9, b"anyone?")
        await c.recs[0].wait_for(lambda: bool(c.recs[0].failures(9)))
        c[0].send(1, b"still fine")
        await c.recs[1].wait_for(lambda: c.recs[1].messages(0) == [b"still fine"])


async def drain_then_everything_arrives(factory: TransportFactory) -> None:
    """After ``drain()`` returns, everything sent before it arrives."""
    async with _cluster(factory, small_buffers=True) as c:
        c.set_view(1, [0, 1, 2], ROW)
        payload = os.urandom(1000)
        for _ in range(300):
            c[0].send(1, payload)
        await c[0].drain()
        await c.recs[1].wait_for(lambda: len(c.recs[1].messages(0)) == 300)
        assert set(c.recs[1].messages(0)) == {payload}


async def lifecycle_and_usage_errors(factory: TransportFactory) -> None:
    """Misuse raises UsageError; a closed transport raises GroupClosed; close is idempotent."""
    group = new_group()
    t = factory.make(group, 0)
    rec = Recorder()
    _raises(UsageError, lambda: t.send(1, b"not started"), "send before start")
    t.set_view(1, [0, 1], ROW)  # allowed before start
    await t.start(rec)
    try:
        await _raises_async(UsageError, t.start(rec), "a second start")
        _raises(UsageError, lambda: t.push(1, ROW, b"x", [1]), "a push outside my row")
        _raises(UsageError, lambda: t.push(1, -1, b"x", [1]), "a negative offset")
        _raises(UsageError, lambda: t.push(1, 0, b"x", [-3]), "a negative target")
        _raises(UsageError, lambda: t.set_view(1, [0, 2], ROW), "same view id, other members")
        _raises(UsageError, lambda: t.set_view(0, [0, 1], ROW), "going back a view")
        _raises(UsageError, lambda: t.set_view(5, [0, 0], ROW), "a member twice")
        t.set_view(1, [0, 1], ROW)  # repeating the same view is fine
    finally:
        await t.close()
    await t.close()  # idempotent
    _raises(GroupClosed, lambda: t.send(1, b"x"), "send after close")
    _raises(GroupClosed, lambda: t.push(1, 0, b"x", [1]), "push after close")
    _raises(GroupClosed, lambda: t.set_view(2, [0, 1], ROW), "set_view after close")
    await _raises_async(GroupClosed, t.start(rec), "start after close")
    factory.check_released(group)


async def close_releases_everything(factory: TransportFactory) -> None:
    """Closing every transport of a group releases its sockets, files and mappings."""
    before = open_fds()
    group = ""
    async with _cluster(factory) as c:
        group = c.group
        c.set_view(1, [0, 1, 2], ROW)
        for s in range(3):
            for t in range(3):
                if s != t:
                    c[s].send(t, b"hi")
            c[s].push(1, s * ROW, _word(s), [0, 1, 2])
        for r in c.recs:

            def all_in(r: Recorder = r) -> bool:
                return len(r.messages()) == 2 and len(r.pushes()) == 2

            await r.wait_for(all_in)
        factory.check_open(group, c.transports)
        transports: list[Transport] = list(c.transports)
    assert all(t.closed for t in transports)
    assert open_fds() <= before
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as f:
            assert group not in f.read()


_CASES: dict[str, Callable[[TransportFactory], Awaitable[None]]] = {
    fn.__name__: fn
    for fn in (
        fifo_per_link_with_interleaved_messages,
        big_messages_and_bursts_beyond_ring_capacity,
        push_larger_than_a_record_lands_whole,
        push_outside_senders_row_is_dropped_logged_reported,
        pushes_for_future_view_are_held_until_set_view,
        pushes_for_views_older_than_kept_are_dropped,
        messages_to_self_and_pushes_to_self,
        send_to_absent_member_reports_failure,
        drain_then_everything_arrives,
        lifecycle_and_usage_errors,
        close_releases_everything,
    )
}

CASES: tuple[str, ...] = tuple(_CASES)
"""The names of the cases, in the order :func:`check_transport` runs them."""


async def check_transport(
    factory: TransportFactory, *, only: Collection[str] | None = None
) -> None:
    """Run the conformance cases (all, or those named in ``only``) against ``factory``'s
    transports, one after the other; ``AssertionError`` names the first that fails.

    What they check, on groups of two or three members:

    - each (sender, target) link is FIFO across pushes and messages;
    - messages of several MB and bursts of pushes several times the buffers arrive intact and
      in order, and ``drain()`` returns only once what was sent is on its way;
    - a push larger than a record lands whole, or in pieces cut at 8-byte aligned offsets;
    - a push outside its sender's row of the view is dropped, logged on the
      ``derecho_async.transport`` logger and reported with ``on_failure``, and the group carries
      on (the offender too, once it behaves);
    - pushes for a view not set yet are held until ``set_view`` names it (messages overtake
      them), then checked like any other; pushes for views older than those kept are dropped;
    - a message to oneself arrives, a push to oneself is skipped;
    - a send to a member that cannot be reached ends in ``on_failure`` and the other links go on;
    - misuse raises ``UsageError``, a closed transport ``GroupClosed``, ``close`` is idempotent;
    - closing every member releases its sockets, shared-memory files and mappings.
    """
    names = CASES if only is None else tuple(only)
    unknown = [n for n in names if n not in _CASES]
    if unknown:
        raise UsageError(f"no conformance case {', '.join(unknown)}; known: {', '.join(CASES)}")
    for name in names:
        try:
            await _CASES[name](factory)
        except AssertionError as exc:
            raise AssertionError(f"conformance case {name} failed: {exc}") from exc
