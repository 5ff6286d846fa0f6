"""Attacks on a running 3-member tcp group of real processes (issue 26, finding 3).

One group (``LocalRun``: three member processes appending as fast as they can) serves the module.
Each test measures the group's delivered rate at the attacked member (member 0, the contact)
for a while, then attacks it from this process over real sockets and measures again, reading
the member's RSS (``/proc/<pid>/status``) and, for floods, its open descriptors as it goes (the
members run with the common soft limit of 1024 descriptors).
Every attack asserts: the rate under attack is at least half the unattacked rate of the same
test, the member's RSS stays within a bound, and nobody installed another view. The last test
times a join with and without a connection flood. Attackers connect from 127.0.0.2 and up (all
of 127/8 is loopback on Linux): a stranger is another host than the members.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from derecho_async.launch import free_ports
from derecho_async.localrun import LocalRun
from derecho_async.transport.tcp import framing, handshake
from tests.runtime.run_support import wait_for

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

#: what a member may grow by under any attack (a 1 GiB announcement once grew it by 615 MiB)
RSS_BOUND = 48 << 20
#: descriptors an attacked member may hold beyond its own (TcpLimits.max_pending and a margin)
FD_BOUND = 128 + 32
#: the members' descriptor limit (a flood must not pin them at it)
NOFILE = 1024
#: seconds each of an attack's four connection loops waits between connections (at most about
#: 200 hostile connections a second: this process shares the machine's cores with the group, and
#: the test is about what the member does with them, not about who gets the CPU)
PACE = 0.02

Attack = Callable[[threading.Event, "Stats"], Coroutine[Any, Any, None]]


@dataclass
class Group:
    """The module's running group and what the tests read of it."""

    run: LocalRun
    port: int
    secret: bytes

    @property
    def pid(self) -> int:
        return int(self.run.procs[0].pid)

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def watch(self, seconds: float) -> Window:
        """Poll the members for ``seconds``: member 0's delivered rate, its peak RSS and peak
        open descriptors meanwhile."""
        w = Window(rss=self.rss(), fds=self.fds())
        samples: list[tuple[float, int]] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            before = self.run.progress.get(0)
            self.run.poll(0.05)
            now = self.run.progress.get(0)
            if now is not None and now != before:
                samples.append((time.monotonic(), now))
            w.rss = max(w.rss, self.rss())
            w.fds = max(w.fds, self.fds())
        if len(samples) >= 2:  # else none: member 0 did not get to report any progress
            (t0, n0), (t1, n1) = samples[0], samples[-1]
            w.rate = (n1 - n0) / (t1 - t0)
        return w

    def assert_one_view(self) -> None:
        assert not self.run.errors, self.run.errors
        assert self.run.alive() == [0, 1, 2]
        assert all(v == (0, [0, 1, 2]) for v in self.run.views.values()), self.run.views


@dataclass
class Window:
    rss: int
    fds: int
    rate: float = 0.0


@contextlib.contextmanager
def serving(
    member_fields: Callable[[str, int], Mapping[str, Any]] | None = None,
) -> Iterator[tuple[LocalRun, int]]:
    """The group a module attacks: three member processes appending as fast as they can, at
    the common descriptor limit, all delivering; yields the run and member 0's port, and stops
    the members after. ``member_fields`` adds each member's settings (``LocalRun``'s)."""
    run = LocalRun(
        3, "tcp", 10**8, 64, 8, 3, heartbeat_ms=25, suspect_after_ms=1000, linger=600.0,
        member_fields=member_fields,
    )
    try:
        for p in run.procs.values():  # the usual default, whatever this shell allows
            _soft, hard = resource.prlimit(p.pid, resource.RLIMIT_NOFILE)
            resource.prlimit(p.pid, resource.RLIMIT_NOFILE, (min(NOFILE, hard), hard))
        wait_for(run, lambda: len(run.progress) == 3 and min(run.progress.values()) > 0, 60)
        yield run, int(run.base["peers"][0].rsplit(":", 1)[1])
    finally:
        run.release()
        for p in run.procs.values():
            if p.is_alive():
                p.kill()
        run.finish(5)


@pytest.fixture(scope="module")
def group() -> Iterator[Group]:
    with serving() as (run, port):
        yield Group(run, port, run.base["secret"].encode())


@dataclass
class Stats:
    counts: dict[str, int] = field(default_factory=dict)
    times: list[float] = field(default_factory=list)

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


@contextlib.contextmanager
def attacking(attack: Attack) -> Iterator[Stats]:
    """Run ``attack`` on an event loop of its own in a thread until the block ends."""
    stop = threading.Event()
    stats = Stats()
    failure: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(attack(stop, stats))
        except BaseException as exc:  # reported by the test
            failure.append(exc)

    thread = threading.Thread(target=main, name="attacker", daemon=True)
    thread.start()
    try:
        yield stats
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive(), "the attacker did not stop"
    assert not failure, f"the attacker failed: {failure[0]!r}"


def _attacked(group: Group, attack: Attack, seconds: float = 2.0) -> tuple[Window, Window, Stats]:
    """Unattacked window, then an attacked one; checks rate, RSS and the view."""
    base = group.watch(1.5)
    with attacking(attack) as stats:
        under = group.watch(seconds)
    after = group.watch(0.5)  # an expulsion shows up as a view change
    print(
        f"\nunattacked {base.rate:.0f}/s, attacked {under.rate:.0f}/s;"
        f" RSS {base.rss >> 20} -> {max(under.rss, after.rss) >> 20} MiB;"
        f" fds {base.fds} -> {under.fds}; attacker {stats.counts}; views {group.run.views}"
    )
    group.assert_one_view()
    assert max(under.rss, after.rss) - base.rss < RSS_BOUND, (base.rss, under.rss, after.rss)
    assert base.rate > 0 and under.rate >= base.rate / 2, (base.rate, under.rate)
    return base, under, stats


def closed_by_the_member(stats: Stats, count: int, what: str, within: float) -> None:
    """Each of ``count`` timed connections (``stats.times``) was closed by the member, all
    within ``within`` seconds."""
    assert len(stats.times) == count, f"every one of the {what} was closed by the member"
    print(f"{what} closed after {min(stats.times):.2f}-{max(stats.times):.2f} s")
    assert max(stats.times) < within, sorted(stats.times)


async def _until_closed(reader: asyncio.StreamReader, timeout: float) -> None:
    """Read until the member closes the stream (EOF or reset)."""
    with contextlib.suppress(OSError):
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass


def _src(i: int) -> str:
    return f"127.0.0.{2 + i % 200}"


async def _stranger(
    group: Group, my_id: int, src: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An authenticated stream to member 0 from a stranger that knows the secret."""
    reader, writer = await asyncio.open_connection("127.0.0.1", group.port, local_addr=(src, 0))
    _peer, _addr, verdict, why = await handshake.client_handshake(
        reader,
        writer,
        secret=group.secret,
        my_id=my_id,
        my_addr=(src, 1),
        expect=None,
        group=group.run.base["group"],
    )
    assert verdict == "accept", why
    return reader, writer


GARBAGE = [
    b"GET / HTTP/1.1\r\nHost: member\r\n\r\n",
    struct.pack("<I", 200) + b"\xc1" * 200,  # a handshake-sized message that is not msgpack
    struct.pack("<I", 8) + b"\x93\x01\x02\x03" * 2,  # msgpack, but not a map
]


def _raw_connections(group: Group, message: Callable[[int], bytes]) -> Attack:
    """Four sources, each in a loop: connect, send ``message(n)`` (n counts from 1), wait
    until the member closes the connection, count it."""

    async def attack(stop: threading.Event, stats: Stats) -> None:
        async def one(src: str) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", group.port, local_addr=(src, 0)
                )
                writer.write(message(n))
                await _until_closed(reader, 10)
                writer.close()
                stats.add("closed by the member")
                await asyncio.sleep(PACE)

        await asyncio.gather(*(one(_src(i)) for i in range(4)))

    return attack


def test_garbage_bytes(group: Group) -> None:
    attack = _raw_connections(group, lambda n: GARBAGE[n % len(GARBAGE)] + os.urandom(1000))
    _base, _under, stats = _attacked(group, attack)
    assert stats.counts.get("closed by the member", 0) >= 50


def test_oversized_length_prefix_before_the_handshake(group: Group) -> None:
    attack = _raw_connections(group, lambda _n: struct.pack("<I", 1 << 30) + bytes(60_000))
    _base, _under, stats = _attacked(group, attack)
    assert stats.counts.get("closed by the member", 0) >= 50


def test_oversized_length_prefix_after_the_handshake(group: Group) -> None:
    async def attack(stop: threading.Event, stats: Stats) -> None:
        async def one(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                reader, writer = await _stranger(group, 5000 + 100 * n + i, _src(i))
                writer.write(framing.FRAME.pack(framing.F_PUSH, 0, 9, 0, 1 << 40))
                await _until_closed(reader, 10)
                writer.close()
                stats.add("closed by the member")
                await asyncio.sleep(2 * PACE)

        await asyncio.gather(*(one(i) for i in range(4)))

    _base, _under, stats = _attacked(group, attack)
    assert stats.counts.get("closed by the member", 0) >= 50


def test_slowloris_is_cut_off_at_the_handshake_deadline(group: Group) -> None:
    hello = struct.pack("<I", 60) + bytes(60)  # never completed: a byte per second

    async def attack(stop: threading.Event, stats: Stats) -> None:
        async def one(i: int) -> None:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", group.port, local_addr=(_src(i % 4), 0)
            )
            t0 = time.monotonic()
            try:
                for b in hello:
                    writer.write(bytes([b]))
                    try:
                        if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                            break
                    except TimeoutError:
                        continue
            except OSError:
                pass
            stats.times.append(time.monotonic() - t0)
            writer.close()

        await asyncio.gather(*(one(i) for i in range(40)))

    _base, _under, stats = _attacked(group, attack, seconds=5.0)
    # the deadline (TcpLimits.handshake_s = 3 s) plus the attacker's one-second pacing
    closed_by_the_member(stats, 40, "slow connections", within=4.5)


async def _flood(
    group: Group, stop: threading.Event, stats: Stats, count: int, per_second: float
) -> None:
    """Open up to ``count`` connections from 32 addresses, ``per_second``, that never speak;
    keep them open until the member closes them or the attack ends."""
    loop = asyncio.get_running_loop()
    held: list[socket.socket] = []
    opened = 0
    t0 = time.monotonic()
    try:
        while not stop.is_set():
            if opened < count and opened < (time.monotonic() - t0) * per_second:
                s = socket.socket()
                s.setblocking(False)
                s.bind((_src(10 + opened % 32), 0))
                try:
                    await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", group.port)), 2)
                except (OSError, TimeoutError):
                    s.close()
                    stats.add("connect failed")
                    continue
                opened += 1
                held.append(s)
                stats.add("opened")
                continue
            keep: list[socket.socket] = []
            for s in held:  # those the member closed (EOF or reset) are closed here too
                try:
                    if s.recv(1) == b"":
                        s.close()
                        stats.add("closed by the member")
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    stats.add("closed by the member")
                    continue
                keep.append(s)
            held = keep
            await asyncio.sleep(0.02)
    finally:
        for s in held:
            s.close()


def test_connection_flood_is_bounded_in_count_and_time(group: Group) -> None:
    async def attack(stop: threading.Event, stats: Stats) -> None:
        await _flood(group, stop, stats, count=600, per_second=300)

    base, under, stats = _attacked(group, attack, seconds=3.0)
    assert stats.counts.get("opened", 0) >= 500
    assert under.fds - base.fds < FD_BOUND, (base.fds, under.fds)
    # the member closed them (refused at once, or at the handshake deadline), not the attacker
    assert stats.counts.get("closed by the member", 0) >= 400


def test_stranger_with_the_secret_announcing_one_gib(group: Group) -> None:
    async def attack(stop: threading.Event, stats: Stats) -> None:
        _reader, writer = await _stranger(group, 4242, _src(0))
        writer.write(framing.FRAME.pack(framing.F_MSG, 0, 0, 0, 1 << 30))
        chunk = bytes(1 << 20)
        sent = 0
        try:
            while not stop.is_set() and sent < 1 << 30:
                writer.write(chunk)
                await asyncio.wait_for(writer.drain(), 3)
                sent += len(chunk)
        except (OSError, TimeoutError):
            pass
        stats.add("MiB the member took", sent >> 20)
        writer.close()

    _base, _under, stats = _attacked(group, attack, seconds=2.5)
    # refused at the header: nothing but the socket buffers took any of it
    assert stats.counts["MiB the member took"] < 64, stats.counts


def _joiner(fields: dict[str, Any], q: Any) -> None:
    """Process target: join, report how long the join took, leave."""
    import uvloop

    import derecho_async as da
    from derecho_async.workload import ReplicatedLog

    async def go() -> None:
        t0 = time.monotonic()
        g = await da.Group.join(da.Config(**fields), actors=[ReplicatedLog], timeout=30)
        q.put(("joined", fields["member_id"], time.monotonic() - t0, list(g.view.members)))
        await g.leave()

    uvloop.run(go())


def _join(group: Group, member: int) -> float:
    run = group.run
    fields = dict(run.base, member_id=member, listen=f"127.0.0.1:{free_ports(1)[0]}")
    p = run.ctx.Process(target=_joiner, args=(fields, run.q))
    p.start()
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            for m in run.poll(0.1):
                if m[0] == "joined" and m[1] == member:
                    assert member in m[3]
                    return float(m[2])
            assert p.is_alive() or p.exitcode == 0, f"joiner {member} exited {p.exitcode}"
        raise AssertionError(f"member {member} did not join: {run.errors}")
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()


def test_a_join_completes_during_a_connection_flood(group: Group) -> None:
    """Last in the module: joins change the view."""
    quiet = _join(group, 7)

    async def attack(stop: threading.Event, stats: Stats) -> None:
        await _flood(group, stop, stats, count=10**6, per_second=400)

    with attacking(attack) as stats:
        # long enough for a member holding every connection for 5 s to reach its limit of 1024
        time.sleep(3.0)
        flooded = _join(group, 8)
    print(f"\njoin: {quiet:.3f} s unattacked, {flooded:.3f} s during a flood ({stats.counts})")
    assert stats.counts.get("opened", 0) >= 1000
    assert set(group.run.alive()) == {0, 1, 2}, "the founders are still there"
