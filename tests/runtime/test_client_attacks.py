"""Attacks on the client port of a running 3-member tcp group of real processes (issue 41, rows
1 and 2).

As in ``test_tcp_attacks`` (whose machinery this module uses), three member processes append as
fast as they can at the common limit of 1024 descriptors, and every member also serves clients
(``client_listen``, a ``client_secret``). Each test measures member 0's delivered rate, RSS and
open descriptors without the attack and under it, from this process over real sockets, while an
honest client in this process (from 127.0.0.1; the attackers use 127.0.0.2 and up) connects to
member 0 alone and makes calls; it prints the load the attack held, the member's descriptors and
RSS, and how long the honest client waited. Asserted: the rate under attack is at least half the
unattacked one, RSS and descriptors stay within bounds, the honest client is served within a
second, nobody installed another view. One group runs the plain client port, one the TLS mode
(client certificates); the last test joins a member during a flood.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import derecho_async as da
from derecho_async.api.relay import CLIENT_LIMITS
from derecho_async.launch import free_ports
from derecho_async.workload import ReplicatedLog
from tests.runtime.test_tcp_attacks import (
    FD_BOUND,
    RSS_BOUND,
    Group,
    Stats,
    Window,
    _join,
    _src,
    attacking,
    serving,
)

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

#: an honest client's connection and first call during an attack, at most (seconds)
SERVED_WITHIN = 1.0
#: connections the kernel queues for the member before it accepts them (``listen``'s backlog):
#: they look open to the attacker but cost the member nothing yet
BACKLOG = 128


@dataclass
class ClientGroup(Group):
    """The module's group as its clients see it: member 0's client port and credentials."""

    client_port: int = 0
    client_secret: str = ""
    client_tls: ssl.SSLContext | None = None
    files: dict[Any, Any] = field(default_factory=dict)


def _fields(ports: list[int], client_secret: str, extra: dict[int, dict[str, Any]] | None = None,
            ) -> Any:
    def member_fields(_group: str, member: int) -> dict[str, Any]:
        return {"client_listen": f"127.0.0.1:{ports[member]}", "client_secret": client_secret,
                **(extra or {}).get(member, {})}

    return member_fields


@pytest.fixture(scope="module")
def plain() -> Iterator[ClientGroup]:
    ports = free_ports(3)
    secret = da.new_secret()
    with serving(_fields(ports, secret)) as (run, port):
        yield ClientGroup(run, port, run.base["secret"].encode(), ports[0], secret)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClientGroup]:
    pytest.importorskip("cryptography")
    from derecho_async.certs import issue, issue_clients

    directory = tmp_path_factory.mktemp("certs")
    ports = free_ports(3)
    secret = da.new_secret()
    files: dict[Any, Any] = {}

    def member_fields(group: str, member: int) -> dict[str, Any]:
        if not files:
            files.update({f.member_id: f for f in issue(directory, group, [0, 1, 2, 3])})
            files.update({f.name: f for f in issue_clients(directory, group, ["honest"])})
        f = files[member]
        return {"client_listen": f"127.0.0.1:{ports[member]}", "client_secret": secret,
                "secret": None, "tls_cert": str(f.cert), "tls_key": str(f.key),
                "tls_ca": str(f.ca)}

    with serving(member_fields) as (run, port):
        honest = files["honest"]
        ctx = ssl.create_default_context(cafile=str(honest.ca))
        ctx.check_hostname = False
        ctx.load_cert_chain(str(honest.cert), str(honest.key))
        yield ClientGroup(run, port, b"", ports[0], secret, ctx, files)


@dataclass
class Served:
    """What the honest client saw: seconds to connect and make its first call, then each
    further call's."""

    first: float = float("inf")
    calls: list[float] = field(default_factory=list)
    error: BaseException | None = None


@contextlib.contextmanager
def honest_client(g: ClientGroup, after: float = 0.5, calls: int = 20) -> Iterator[Served]:
    """A client in a thread of its own, from 127.0.0.1, that knows only member 0: it connects
    ``after`` seconds into the block and makes ``calls`` calls."""
    served = Served()

    async def main() -> None:
        await asyncio.sleep(after)
        t0 = time.monotonic()
        async with await da.Client.connect(
            group=g.run.group, peers={0: f"127.0.0.1:{g.client_port}"}, secret=g.client_secret,
            tls=g.client_tls, timeout=20,
        ) as c:
            log = c.subgroup(ReplicatedLog)
            await log.append(b"honest")
            served.first = time.monotonic() - t0
            for _ in range(calls):
                t1 = time.monotonic()
                await log.append(b"honest")
                served.calls.append(time.monotonic() - t1)

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:  # reported by the test
            served.error = exc

    thread = threading.Thread(target=run, name="honest client", daemon=True)
    thread.start()
    try:
        yield served
    finally:
        thread.join(30)
    assert served.error is None, f"the honest client failed: {served.error!r}"


def _under_attack(g: ClientGroup, attack: Any, seconds: float) -> tuple[Window, Window, Stats,
                                                                        Served]:
    """Unattacked window, then an attacked one with an honest client; checks rate, RSS,
    descriptors, the honest client and the view; prints the figures."""
    base = g.watch(1.5)
    with attacking(attack) as stats, honest_client(g) as served:
        under = g.watch(seconds)
    after = g.watch(0.5)
    calls = sorted(served.calls)
    print(
        f"\nunattacked {base.rate:.0f}/s, attacked {under.rate:.0f}/s; RSS {base.rss >> 20} ->"
        f" {max(under.rss, after.rss) >> 20} MiB; fds {base.fds} -> {under.fds}; load held"
        f" {stats.counts.get('held at most', 0)} of {stats.counts.get('opened', 0)} opened;"
        f" honest client served in {served.first * 1000:.0f} ms, its calls p50"
        f" {calls[len(calls) // 2] * 1000 if calls else float('nan'):.1f} ms; attacker"
        f" {stats.counts}"
    )
    g.assert_one_view()
    assert max(under.rss, after.rss) - base.rss < RSS_BOUND, (base.rss, under.rss, after.rss)
    assert base.rate > 0 and under.rate >= base.rate / 2, (base.rate, under.rate)
    assert under.fds - base.fds < FD_BOUND, (base.fds, under.fds)
    assert served.first < SERVED_WITHIN, served.first
    return base, under, stats, served


async def _hold_idle(port: int, stop: threading.Event, stats: Stats, count: int,
                     per_second: float, sources: list[str]) -> None:
    """Open up to ``count`` connections to ``port`` from ``sources`` in turn, ``per_second``,
    that never send a byte; keep each until the member closes it or the attack ends. Counts
    those opened, those the member closed, and the most held open at once."""
    loop = asyncio.get_running_loop()
    held: list[socket.socket] = []
    opened = 0
    t0 = time.monotonic()
    try:
        while not stop.is_set():
            if opened < count and opened < (time.monotonic() - t0) * per_second:
                s = socket.socket()
                s.setblocking(False)
                s.bind((sources[opened % len(sources)], 0))
                try:
                    await asyncio.wait_for(loop.sock_connect(s, ("127.0.0.1", port)), 2)
                except (OSError, TimeoutError):
                    s.close()
                    stats.add("connect failed")
                    continue
                opened += 1
                held.append(s)
                stats.add("opened")
                continue
            keep: list[socket.socket] = []
            for s in held:
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
            stats.counts["held at most"] = max(stats.counts.get("held at most", 0), len(held))
            await asyncio.sleep(0.02)
    finally:
        for s in held:
            s.close()


def test_slowloris_on_the_plain_client_port(plain: ClientGroup) -> None:
    """Row 2: 100 idle connections from one address no longer keep out a client that knows
    only that member: at most the per-address cap is held, each for the handshake deadline."""

    async def attack(stop: threading.Event, stats: Stats) -> None:
        await _hold_idle(plain.client_port, stop, stats, 100, 400, ["127.0.0.2"])

    _base, _under, stats, _served = _under_attack(plain, attack, seconds=4.0)
    assert stats.counts["opened"] == 100
    assert stats.counts["held at most"] <= CLIENT_LIMITS.max_pending_per_host + BACKLOG
    assert stats.counts.get("closed by the member", 0) == 100


def test_silent_connections_to_the_tls_client_port_are_bounded(tls: ClientGroup) -> None:
    """Row 1: 1,100 connections that never start TLS, from 32 addresses, against a member at
    1024 descriptors: held at most the pending cap, each for the deadline, while an honest
    client with its certificate is served at once."""

    async def attack(stop: threading.Event, stats: Stats) -> None:
        await _hold_idle(tls.client_port, stop, stats, 1100, 400,
                         [_src(40 + i) for i in range(32)])

    _base, _under, stats, _served = _under_attack(tls, attack, seconds=4.0)
    assert stats.counts["opened"] >= 1000
    assert stats.counts["held at most"] <= CLIENT_LIMITS.max_pending + BACKLOG
    assert stats.counts.get("closed by the member", 0) >= 900


def test_a_member_joins_during_a_client_port_flood(tls: ClientGroup) -> None:
    """Last in the module (the join changes the view): the member port's handshake goes
    through while the client port is flooded (it kept members out for 15 s)."""

    async def attack(stop: threading.Event, stats: Stats) -> None:
        await _hold_idle(tls.client_port, stop, stats, 10**6, 400,
                         [_src(40 + i) for i in range(32)])

    f = tls.files[3]
    base = dict(tls.run.base)
    tls.run.base = dict(base, secret=None, tls_cert=str(f.cert), tls_key=str(f.key),
                        tls_ca=str(f.ca))
    try:
        with attacking(attack) as stats:
            time.sleep(3.0)  # (at 400 a second, well past a limit of 1024 descriptors)
            took = _join(tls, 3)
    finally:
        tls.run.base = base
    print(f"\njoin during a client-port flood: {took:.3f} s ({stats.counts})")
    assert stats.counts.get("opened", 0) >= 1000
    assert set(tls.run.alive()) == {0, 1, 2}
