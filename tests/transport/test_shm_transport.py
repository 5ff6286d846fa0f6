"""Shared-memory transport: hostile ring contents, segment lifetime, configuration, which
members run."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable

import pytest
from transport_support import Recorder, new_group

from derecho_async._hotpath_pure.shmring import _RING as _HEADER
from derecho_async._hotpath_pure.shmring import _ring_write as ring_write
from derecho_async.errors import ConfigError, UsageError
from derecho_async.transport.shm import ShmTransport, census, doorbell, files, ring
from derecho_async.transport.shm import pool as shmpool

LOGGER = "derecho_async.transport"
ROW = 64


class FakeProducer:
    """Writes raw records into a ring ``sender -> receiver``, like a buggy peer would."""

    def __init__(self, group: str, sender: int, receiver: int, *, alive: bool = True) -> None:
        self.group, self.sender, self.receiver = group, sender, receiver
        self.inc = 12345
        path = ring.ring_path(group, sender, receiver)
        self.ring = ring.create_ring(path, sender, receiver, 64 << 10, self.inc)
        self.head = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if alive:
            self.sock.bind(doorbell.doorbell_name(group, sender))

    def record(
        self, typ: int, a: int, b: int, payload: bytes, *, flags: int = 0, length: int | None = None
    ) -> None:
        # forged by hand (ring_put only writes well-formed headers): any flags, any length
        n = len(payload) if length is None else length
        ring_write(self.ring.data, self.ring.capacity, self.head, _HEADER.pack(typ, flags, a, b, n))
        ring_write(self.ring.data, self.ring.capacity, self.head + 32, payload)
        self.head += 32 + ((len(payload) + 7) & ~7)

    def publish(self, head: int | None = None) -> None:
        self.ring.words[ring.W_HEAD] = self.head if head is None else head
        self.sock.sendto(
            doorbell.DG.pack(doorbell.D_DATA, 0, self.sender, self.inc),
            doorbell.doorbell_name(self.group, self.receiver),
        )

    def close(self) -> None:
        self.ring.close()
        self.sock.close()
        files.unlink_file(self.ring.path)


R_PUSH, R_MSG = ring.R_PUSH, ring.R_MSG
GARBAGE = {
    "unknown record type": lambda p: p.record(99, 0, 0, b"x"),
    "flags": lambda p: p.record(R_MSG, 1, 0, b"x", flags=4),
    "overruns published data": lambda p: p.record(R_MSG, 3000, 0, b"abc", length=3000),
    "out of order": lambda p: p.record(R_MSG, 10, 5, b"x"),
    "exceeds max_message": lambda p: p.record(R_MSG, 1 << 20, 0, b"x"),
    "does not fit the message": lambda p: p.record(R_MSG, 2, 0, b"xyz"),
}


@pytest.mark.parametrize("case", [*GARBAGE, "head beyond the ring"])
async def test_corrupt_ring_is_abandoned_and_reported(
    case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    group = new_group()
    r0, r1 = Recorder(), Recorder()
    t0 = ShmTransport(group, 0)
    t1 = ShmTransport(group, 1, max_message=1 << 16)
    await t0.start(r0)
    await t1.start(r1)
    fake = FakeProducer(group, 7, 1)
    try:
        t1.set_view(1, [0, 1, 7], ROW)
        fake.record(R_MSG, 2, 0, b"ok")  # good records before the garbage are delivered
        fake.record(R_PUSH, 1, 2 * ROW, b"rowdata!")
        fake.record(R_PUSH, 1, 0, b"intrude!")  # outside its row: dropped, ring stays usable
        fake.record(R_MSG, 5, 0, b"after")
        if case == "head beyond the ring":
            fake.publish(fake.head + (1 << 20))
            expect = "not within the ring"
        else:
            GARBAGE[case](fake)
            fake.publish()
            expect = case
        await r1.wait_for(lambda: any(expect in f for f in r1.failures(7)))
        if case != "head beyond the ring":
            assert r1.messages(7) == [b"ok", b"after"]
            assert r1.pushes(7) == [(1, 7, 2 * ROW, b"rowdata!")]
            assert any("outside member 7's row" in f for f in r1.failures(7))
        assert expect in caplog.text
        assert fake.ring.words[ring.W_CCLOSED] == 1  # the producer is told
        # the group carries on
        t0.send(1, b"still working")
        await r1.wait_for(lambda: r1.messages(0) == [b"still working"])
    finally:
        fake.close()
        await t0.close()
        await t1.close()
    assert ShmTransport.segments(group) == []


async def test_ring_written_before_the_consumer_started_is_delivered() -> None:
    group = new_group()
    r0, r1 = Recorder(), Recorder()
    t0 = ShmTransport(group, 0)
    await t0.start(r0)
    t1 = ShmTransport(group, 1)
    try:
        t0.send(1, b"early bird")  # member 1 is not running yet: the data waits in the ring
        for _ in range(3):
            await asyncio.sleep(0)
        await t1.start(r1)
        await r1.wait_for(lambda: r1.messages(0) == [b"early bird"])
        assert r0.failures() == []
    finally:
        await t0.close()
        await t1.close()


async def test_spinning_consumer_sleeps_between_sparse_arrivals() -> None:
    """Heartbeat-like traffic (arrivals further apart than five spin windows) buys no spin."""
    group = new_group()
    r = Recorder()
    t = ShmTransport(group, 1, spin_us=2000.0)
    await t.start(r)
    fake = FakeProducer(group, 0, 1)
    try:
        for n, word in enumerate((b"one", b"two")):
            fake.record(R_MSG, 3, 0, word)
            fake.publish()

            def arrived(n: int = n) -> bool:
                return len(r.messages(0)) == n + 1

            await r.wait_for(arrived)
            await asyncio.sleep(0.015)  # > 5 x 2 ms
        assert fake.ring.words[ring.W_CSLEEP] == 1
    finally:
        fake.close()
        await t.close()


@pytest.mark.parametrize("spin_us", [0.0, 1e6])
async def test_spinning_consumer_needs_no_doorbell(spin_us: float) -> None:
    """With ``spin_us`` the consumer keeps polling after an arrival in dense traffic (a record
    published without a doorbell still arrives at once, well before the 50 ms sweep); without
    it, it sleeps and says so in the ring, so producers ring its doorbell."""
    group = new_group()
    r = Recorder()
    t = ShmTransport(group, 1, spin_us=spin_us)
    await t.start(r)
    fake = FakeProducer(group, 0, 1)
    try:
        for n, word in enumerate((b"first", b"second")):  # two arrivals: dense traffic
            fake.record(R_MSG, len(word), 0, word)
            fake.publish()

            def arrived(n: int = n) -> bool:
                return len(r.messages(0)) == n + 1

            await r.wait_for(arrived)
        await asyncio.sleep(0.005)
        assert fake.ring.words[ring.W_CSLEEP] == (0 if spin_us else 1)
        if spin_us:
            fake.record(R_MSG, 5, 0, b"third")
            fake.ring.words[ring.W_HEAD] = fake.head  # published, no doorbell
            await asyncio.wait_for(r.wait_for(lambda: len(r.messages(0)) == 3), 0.03)
            assert r.messages(0) == [b"first", b"second", b"third"]
    finally:
        fake.close()
        await t.close()


async def test_start_removes_segments_of_dead_producers() -> None:
    group = new_group()
    dead = FakeProducer(group, 5, 6, alive=False)
    dead.ring.close()
    dead.sock.close()
    assert len(ShmTransport.segments(group)) == 1
    t = ShmTransport(group, 0)
    await t.start(Recorder())
    try:
        assert ShmTransport.segments(group) == []
    finally:
        await t.close()


async def test_configuration_and_usage_errors() -> None:
    group = new_group()
    with pytest.raises(ConfigError):
        ShmTransport("bad/name", 0)
    with pytest.raises(ConfigError):
        ShmTransport("", 0)
    with pytest.raises(ConfigError):
        ShmTransport(group, 0, ring_bytes=1000)
    for spin in (-1.0, float("nan"), True, "5"):
        with pytest.raises(ConfigError, match="spin_us"):
            ShmTransport(group, 0, spin_us=spin)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        ShmTransport(group, -1)
    with pytest.raises(ConfigError):
        ShmTransport.cleanup_group("../etc")
    t = ShmTransport(group, 0)
    twin = ShmTransport(group, 0)
    await t.start(Recorder())
    try:
        with pytest.raises(UsageError, match="already running"):
            await twin.start(Recorder())
        t.add_peer(1, None)
        t.add_peer(1, ("127.0.0.1", 5))  # addresses mean nothing here: ignored
        with pytest.raises(UsageError):
            t.add_peer(-1, None)
        big = ShmTransport(group, 9, max_message=10)
        await big.start(Recorder())
        with pytest.raises(UsageError, match="max_message"):
            big.send(0, b"x" * 11)
        await big.close()
    finally:
        await t.close()
        await twin.close()
    assert ShmTransport.segments(group) == []


async def test_segments_are_private_and_named_from_group_and_ids() -> None:
    group = new_group()
    r0, r1 = Recorder(), Recorder()
    t0, t1 = ShmTransport(group, 0), ShmTransport(group, 1)
    await t0.start(r0)
    await t1.start(r1)
    try:
        t0.send(1, b"a")
        t1.send(0, b"b")
        await r1.wait_for(lambda: bool(r1.messages()))
        await r0.wait_for(lambda: bool(r0.messages()))
        paths = ShmTransport.segments(group)
        assert [os.path.basename(p) for p in paths] == [
            f"derecho_async.{group}.0.1",
            f"derecho_async.{group}.1.0",
        ]
        for p in paths:
            st = os.stat(p)
            assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
    finally:
        await t0.close()
        await t1.close()
    assert ShmTransport.segments(group) == []


async def _until(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_a_view_change_removes_every_segment_of_departed_members_once_dead() -> None:
    """Issue 26 finding 4: the survivors remove the rings from and to every dead departed
    member, the ring pair between two of them included, and their pool segments; a departed
    member still alive (its doorbell bound) keeps its segments until it dies."""
    group = new_group()
    t = ShmTransport(group, 0, ring_bytes=64 << 10)
    rec = Recorder()
    live3 = doorbell.Doorbell(group, 3, 9)  # member 3's process is alive; 1 and 2 will die
    try:
        t.set_view(0, [0, 1, 2, 3], ROW)
        await t.start(rec)
        # what members 1, 2 and 3 made while the view lasted (1 and 2 then died)
        for s, r in ((1, 2), (2, 1), (1, 0), (2, 0), (1, 3), (3, 1), (3, 4)):
            ring.create_ring(ring.ring_path(group, s, r), s, r, 64 << 10, 7).close()
        shmpool.create_pool_segment(group, 2, 0, shmpool.MIN_CAPACITY).close()
        shmpool.create_pool_segment(group, 3, 0, shmpool.MIN_CAPACITY).close()
        t.send(3, b"to three")  # my ring to member 3
        assert len(ShmTransport.segments(group)) == 10
        t.set_view(1, [0], ROW)  # 1, 2 and 3 departed
        left = {os.path.basename(p).removeprefix(f"derecho_async.{group}.")
                for p in ShmTransport.segments(group)}
        assert left == {"0.3", "3.4", "3.pool0"}  # only the live member's, and mine to it
        live3.close()  # member 3 dies: the next sweep finds it dead
        assert await _until(lambda: ShmTransport.segments(group) == [], 10.0)
        assert not rec.failures()
    finally:
        live3.close()
        await t.close()
        ShmTransport.cleanup_group(group)
    assert ShmTransport.segments(group) == []


async def test_live_members_are_the_running_members_of_this_users_group() -> None:
    """Issue 41 row 4: a joiner whose contact is not running asks the members that are. They
    are found by their bound doorbells (a member alone in its view has no segment) and the
    group's files; a stale file of a dead member, a same-named group of another user and a
    group whose name starts the same are not members that run."""
    group = new_group()
    t1, t2 = ShmTransport(group, 1), ShmTransport(group, 2)
    lone = doorbell.Doorbell(group, 7, 1)  # running, no segment of its own yet
    other_group = doorbell.Doorbell(group + "x", 5, 1)
    other_user = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    other_user.bind(f"\0dasync/{os.getuid() + 1}/{group}/4")
    try:
        await t1.start(Recorder())
        await t2.start(Recorder())
        assert t1.live_members() == [2, 7] and t2.live_members() == [1, 7]
        # what members 6 and 8 left when they died, and a ring to 9, which never started
        ring.create_ring(ring.ring_path(group, 6, 1), 6, 1, 64 << 10, 7).close()
        shmpool.create_pool_segment(group, 8, 0, shmpool.MIN_CAPACITY).close()
        t1.send(9, b"to nobody")
        assert len(ShmTransport.segments(group)) == 3
        assert t1.live_members() == [2, 7]
        lone.close()  # member 7 dies
        assert t1.live_members() == [2] and t2.live_members() == [1]
    finally:
        lone.close()
        other_group.close()
        other_user.close()
        await t1.close()
        await t2.close()
        ShmTransport.cleanup_group(group)
    assert ShmTransport.segments(group) == []


async def test_live_members_are_found_by_their_files_where_proc_lists_no_socket() -> None:
    # /proc/net/unix may be hidden (a restricted /proc): the members with segments still count
    group = new_group()
    t0, t1 = ShmTransport(group, 0), ShmTransport(group, 1)
    lone = doorbell.Doorbell(group, 7, 1)
    try:
        await t0.start(Recorder())
        await t1.start(Recorder())
        t0.send(1, b"x")
        ring.create_ring(ring.ring_path(group, 6, 0), 6, 0, 64 << 10, 7).close()  # dead 6
        assert census.live_members(group, "/nonexistent/net/unix") == [0, 1]
        assert census.live_members(group) == [0, 1, 7]
    finally:
        lone.close()
        await t0.close()
        await t1.close()
        ShmTransport.cleanup_group(group)


def test_transports_that_cannot_tell_name_no_live_member() -> None:
    from derecho_async.transport.tcp import TcpTransport

    assert TcpTransport(0, ("127.0.0.1", 0), secret=b"s" * 43).live_members() == ()
