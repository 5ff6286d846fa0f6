"""Attacks on a running 3-member group in the TLS mode (issue 26, findings 2 and 3).

The group (three member processes appending as fast as they can, tcp with mutual TLS and no
shared secret: ids come from certificates made by ``derecho_async.certs``) serves the module.
As in ``test_tcp_attacks``, each attack runs from this process against member 0 over real
sockets, and asserts: the delivered rate under attack is at least half the unattacked rate of
the same test, member 0's RSS stays within a bound, and nobody installed another view. The
attacker holds a valid certificate of the group's CA, for member 5, and uses it to claim to be
live members. The last test joins a member with its own certificate.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from derecho_async.certs import MemberFiles, issue
from derecho_async.transport.tcp import handshake
from derecho_async.transport.tcp.identity import contexts
from tests.runtime.test_tcp_attacks import (
    PACE,
    Group,
    Stats,
    _attacked,
    _join,
    _src,
    _until_closed,
    closed_by_the_member,
    serving,
)

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

#: the member whose certificate the attacker holds (never in the group)
ATTACKER = 5


@dataclass
class TlsGroup(Group):
    """The module's group and the files of its CA's members (the attacker's included)."""

    files: dict[int, MemberFiles] = field(default_factory=dict)

    def attacker_ctx(self) -> ssl.SSLContext:
        f = self.files[ATTACKER]
        return contexts(str(f.cert), str(f.key), str(f.ca))[1]


@pytest.fixture(scope="module")
def tls_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsGroup]:
    directory = tmp_path_factory.mktemp("certs")
    files: dict[int, MemberFiles] = {}

    def member_fields(group: str, member: int) -> dict[str, Any]:
        if not files:  # members 0-2, a joiner (3) and the attacker's (5)
            files.update({f.member_id: f for f in issue(directory, group, [0, 1, 2, 3, 5])})
        f = files[member]
        return {"secret": None, "tls_cert": str(f.cert), "tls_key": str(f.key),
                "tls_ca": str(f.ca)}

    with serving(member_fields) as (run, port):
        yield TlsGroup(run, port, b"", files)


def test_a_certificate_cannot_speak_as_another_member(tls_group: TlsGroup) -> None:
    """Finding 2: a holder of the group's credentials claims live members' ids."""
    g = tls_group
    ctx = g.attacker_ctx()

    async def attack(stop: threading.Event, stats: Stats) -> None:
        async def one(i: int) -> None:
            while not stop.is_set():
                claimed = 1 + i % 2  # live members 1 and 2
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", g.port, local_addr=(_src(i), 0), ssl=ctx,
                    server_hostname="127.0.0.1",
                )
                try:
                    _peer, _addr, verdict, why = await handshake.client_handshake(
                        reader, writer, secret=b"", my_id=claimed, my_addr=(_src(i), 1),
                        expect=0, group=g.run.base["group"],
                    )
                    stats.add(f"{verdict}: {why}")
                    await _until_closed(reader, 10)
                finally:
                    writer.close()
                await asyncio.sleep(2 * PACE)

        await asyncio.gather(*(one(i) for i in range(4)))

    _base, _under, stats = _attacked(g, attack)
    refused = stats.counts.get(f"reject: your certificate names member {ATTACKER}", 0)
    assert refused >= 20 and refused == sum(stats.counts.values()), stats.counts


def test_silent_tls_connections_are_cut_off_at_the_handshake_deadline(tls_group: TlsGroup) -> None:
    """Finding 3 with TLS on: a connection that never starts its TLS handshake was held 60 s."""
    g = tls_group

    async def attack(stop: threading.Event, stats: Stats) -> None:
        async def one(i: int) -> None:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", g.port, local_addr=(_src(i % 4), 0)
            )
            t0 = time.monotonic()
            with contextlib.suppress(OSError, TimeoutError):
                await asyncio.wait_for(reader.read(), 20)  # never a byte from us
            stats.times.append(time.monotonic() - t0)
            writer.close()

        await asyncio.gather(*(one(i) for i in range(40)))

    _base, _under, stats = _attacked(g, attack, seconds=4.0)
    # TcpLimits.handshake_s = 3 s
    closed_by_the_member(stats, 40, "silent TLS connections", within=4.5)


def test_a_joiner_with_its_own_certificate_joins(tls_group: TlsGroup) -> None:
    """Last in the module: the join changes the view."""
    f = tls_group.files[3]
    base = dict(tls_group.run.base)
    tls_group.run.base = dict(
        base, secret=None, tls_cert=str(f.cert), tls_key=str(f.key), tls_ca=str(f.ca)
    )
    try:
        took = _join(tls_group, 3)
    finally:
        tls_group.run.base = base
    print(f"\njoin over mutual TLS: {took:.3f} s")
    assert set(tls_group.run.alive()) == {0, 1, 2}

