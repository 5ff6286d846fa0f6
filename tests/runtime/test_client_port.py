"""A member's client port under misuse and attack, in-process over real tcp (issue 41, rows 2,
5 and 10): the member port's rules hold there too (a deadline for TLS, the handshake and the
HELLO; caps per address and in all; refusals logged a few at a time), clients and members each
have a port of their own and a secret of their own, and a client's mistakes fail at once.
The attacks on member processes, with the figures, are in ``test_client_attacks.py``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

import derecho_async as da
from derecho_async.api.relay import CLIENT_LIMITS
from derecho_async.launch import free_ports
from derecho_async.transport.tcp import handshake
from derecho_async.workload import ReplicatedLog

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

SECRET = da.new_secret()  # the members'
CLIENT_SECRET = da.new_secret()  # the clients'


def _config(member: int, peers: dict[int, str], **kw: Any) -> da.Config:
    fields: dict[str, Any] = {
        "group": "clientport", "member_id": member, "transport": "tcp", "peers": peers,
        "secret": SECRET, "client_secret": CLIENT_SECRET, "client_listen": "127.0.0.1:0",
        "heartbeat_ms": 20, "suspect_after_ms": 1000, **kw}
    return da.Config(**fields)


@pytest.fixture
async def member() -> AsyncIterator[da.Group]:
    """A one-member tcp group serving clients."""
    port = free_ports(1)[0]
    group = await da.Group.join(_config(0, {0: f"127.0.0.1:{port}"}),
                                actors=[ReplicatedLog], timeout=20)
    yield group
    await group.leave()


def _client_port(group: da.Group) -> int:
    return group.relay.address[1]


def _member_port(group: da.Group) -> int:
    return int(group.config.peers[0].rsplit(":", 1)[1])


async def _call(group: da.Group, **kw: Any) -> float:
    """Connect a client to ``group``'s member alone, make one call; the seconds it took."""
    t0 = time.monotonic()
    async with await da.Client.connect(group="clientport",
                                       peers={0: str(group.client_address)},
                                       secret=CLIENT_SECRET, **kw) as c:
        await c.subgroup(ReplicatedLog).append(b"x")
    return time.monotonic() - t0


def _idle(port: int, src: str, count: int) -> list[socket.socket]:
    """``count`` connections from ``src`` to ``port`` that never send a byte."""
    socks = []
    for _ in range(count):
        s = socket.socket()
        s.bind((src, 0))
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        socks.append(s)
    return socks


def _open(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the member still holds open (no EOF, no reset)."""
    n = 0
    for s in socks:
        try:
            if s.recv(1) == b"":
                continue
        except BlockingIOError:
            n += 1
        except OSError:
            continue
    return n


async def test_idle_connections_from_one_address_are_capped_and_cut_at_the_deadline(
    member: da.Group, caplog: pytest.LogCaptureFixture,
) -> None:
    """Row 2: 100 idle connections from one address hold at most the per-address cap, and
    only until the handshake deadline; a client from another address is served at once."""
    caplog.set_level(logging.INFO, logger="derecho_async")
    socks = _idle(_client_port(member), "127.0.0.2", 100)
    try:
        await asyncio.sleep(0.3)
        took = await _call(member)
        assert took < 1.0, took
        held = _open(socks)
        assert held <= CLIENT_LIMITS.max_pending_per_host, held
        await asyncio.sleep(CLIENT_LIMITS.handshake_s + 0.5)
        assert _open(socks) == 0  # the member cut them at the deadline
    finally:
        for s in socks:
            s.close()
    counts = member.relay.refusals.counts
    assert counts["per-address cap"] >= 100 - CLIENT_LIMITS.max_pending_per_host, counts
    assert counts["handshake deadline"] >= 1, counts
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) <= 2 * (CLIENT_LIMITS.log_detailed + 1), [r.message for r in warned]


async def test_a_client_at_a_member_port_is_told_at_once_and_timeout_is_honoured(
    member: da.Group,
) -> None:
    """Row 5: a member port refuses the client role at once (not as a would-be member)."""
    t0 = time.monotonic()
    with pytest.raises(da.UsageError, match="not a client port"):
        await da.Client.connect(group="clientport",
                                peers={0: f"127.0.0.1:{_member_port(member)}"},
                                secret=CLIENT_SECRET, timeout=3)
    assert time.monotonic() - t0 < 1.0
    assert member.relay.refusals.counts == {}  # (the member port refused it, not this one)
    # a silent port: connect gives up at its timeout, not later
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        t0 = time.monotonic()
        with pytest.raises(da.GroupClosed, match="within 1"):
            await da.Client.connect(group="clientport",
                                    peers={0: f"127.0.0.1:{silent.getsockname()[1]}"},
                                    secret=CLIENT_SECRET, timeout=1)
        assert time.monotonic() - t0 < 2.0
    finally:
        silent.close()


async def test_client_and_member_credentials_do_not_cross(member: da.Group) -> None:
    """Row 5: the members' secret does not admit a client, the clients' secret does not admit
    a member, and a member dialling a client port is refused for good."""
    began = time.monotonic()
    with pytest.raises(da.AuthenticationError):
        await da.Client.connect(group="clientport", peers={0: str(member.client_address)},
                                secret=SECRET)
    assert time.monotonic() - began < 2.0
    # a would-be member proving the clients' secret at the member port
    reader, writer = await asyncio.open_connection("127.0.0.1", _member_port(member))
    try:
        with pytest.raises(handshake.AuthError):
            await handshake.client_handshake(reader, writer, secret=CLIENT_SECRET.encode(),
                                             my_id=9, my_addr=("127.0.0.1", 1), expect=None,
                                             group="clientport")
    finally:
        writer.close()
    # a member whose peers name a client port is refused at once, saying so
    began = time.monotonic()
    with pytest.raises(da.JoinRefused, match="client port"):
        await da.Group.join(_config(1, {0: str(member.client_address)}, client_listen=None,
                                    client_secret=None, listen="127.0.0.1:0"),
                            actors=[ReplicatedLog], timeout=20)
    assert time.monotonic() - began < 2.0


async def test_a_wrong_group_name_is_an_authentication_error_at_once(member: da.Group) -> None:
    """Row 10: not a GroupClosed after the timeout."""
    began = time.monotonic()
    with pytest.raises(da.AuthenticationError, match="group"):
        await da.Client.connect(group="another", peers={0: str(member.client_address)},
                                secret=CLIENT_SECRET, timeout=10)
    assert time.monotonic() - began < 2.0


async def test_a_cancelled_connect_leaves_no_task_behind() -> None:
    """Row 10: a cancelled ``Client.connect`` leaves nothing running."""
    before = asyncio.all_tasks()
    port = free_ports(1)[0]  # nobody listens: the client keeps retrying
    task = asyncio.ensure_future(da.Client.connect(
        group="clientport", peers={0: f"127.0.0.1:{port}"}, secret=CLIENT_SECRET, timeout=30))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    left = asyncio.all_tasks() - before - {asyncio.current_task()}
    assert not left, left
