"""Clients sharing a member (issue 41, row 10): in-process members, clients over real tcp.

When the relay's calls are at ``max_queued_calls``, further calls wait at the relay; they wait
per connection and go in turns, one call of each waiting connection at a time, so a light
client's call goes ahead of a heavy client's backlog. A connection that closes takes its waiting
calls with it: they are never multicast (its client sends them again elsewhere). What waits
stays within ``max_queued_mb``. One connection's frames, however many arrived at once, do not
hold the member's loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import pytest

import derecho_async as da
from derecho_async import wire
from derecho_async.api import client_wire as cw
from derecho_async.transport.tcp import handshake

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

SECRET = da.new_secret()  # the members'
CLIENT_SECRET = da.new_secret()  # the clients'
_ids = itertools.count()

IN_FLIGHT = 16  # max_queued_calls: the relay's calls in flight, at most
FLOOD = 256  # calls each flooding connection keeps at the relay (max_client_calls)


class Work(da.Actor):
    """Ordered calls that take a moment each: the backlog drains at a known pace."""

    def __init__(self) -> None:
        self.runs = 0
        self.tags: list[str] = []

    @da.ordered
    async def work(self, tag: str) -> int:
        await asyncio.sleep(0.001)
        self.runs += 1
        self.tags.append(tag)
        return self.runs  # how many calls ran before this one, and this one

    def snapshot(self) -> list[Any]:
        return [self.runs, self.tags]

    def restore(self, state: list[Any]) -> None:
        self.runs, self.tags = state[0], list(state[1])


async def _member(name: str, **kw: Any) -> da.Group:
    config = da.Config(group=name, member_id=0, initial_members=1, transport="sim",
                       heartbeat_ms=5, suspect_after_ms=500, secret=SECRET,
                       client_listen="127.0.0.1:0", client_secret=CLIENT_SECRET,
                       max_queued_calls=IN_FLIGHT, **kw)
    return await da.Group.join(config, actors=[Work], timeout=10)


async def _connect(name: str, group: da.Group) -> da.Client:
    return await da.Client.connect(group=name, peers={0: str(group.client_address)},
                                   secret=CLIENT_SECRET)


async def _held(group: da.Group, at_least: int) -> None:
    """Until ``group``'s member holds ``at_least`` calls (in flight and waiting for room)."""
    deadline = time.monotonic() + 5
    while group.stats()["in_flight_calls"] < at_least:
        assert time.monotonic() < deadline, group.stats()
        await asyncio.sleep(0.01)


async def test_a_light_clients_call_goes_ahead_of_other_connections_backlogs() -> None:
    name = f"fair{next(_ids)}"
    group = await _member(name)
    heavy = [await _connect(name, group) for _ in range(6)]
    flood = [asyncio.gather(*(c.subgroup(Work).work(f"heavy{k}") for _ in range(FLOOD)),
                            return_exceptions=True) for k, c in enumerate(heavy)]
    await _held(group, len(heavy) * FLOOD - 64)  # most of them wait at the relay
    async with await _connect(name, group) as light:
        ran = group.local(Work).runs
        t0 = time.monotonic()
        replies = await light.subgroup(Work).work("light")
        waited = time.monotonic() - t0
    ahead = replies[0] - ran - 1  # the calls that ran after it was made, before it
    # the calls in flight and one call of each heavy connection (their turns came first), and
    # the few that completed while the call was on its way to the relay
    assert ahead <= IN_FLIGHT + 2 * len(heavy), (ahead, waited)
    assert waited < 1.0, (ahead, waited)
    for c in heavy:
        await c.close()
    await asyncio.gather(*flood)
    await group.leave()


async def test_a_connections_waiting_calls_leave_with_it() -> None:
    name = f"fair{next(_ids)}"
    group = await _member(name)
    heavy = await _connect(name, group)
    flood = asyncio.gather(*(heavy.subgroup(Work).work("heavy") for _ in range(FLOOD)),
                           return_exceptions=True)
    await _held(group, FLOOD - 16)
    await heavy.close()  # its calls fail here; those waiting at the relay are dropped there
    assert all(isinstance(r, da.GroupClosed | da.Replies) for r in await flood)
    deadline = time.monotonic() + 5
    while group.stats()["in_flight_calls"] > 0:
        assert time.monotonic() < deadline, group.stats()
        await asyncio.sleep(0.01)
    async with await _connect(name, group) as light:  # the member serves the next client
        position = (await light.subgroup(Work).work("light"))[0]
    assert position <= FLOOD // 2, position  # the calls dropped at the relay never ran
    await group.leave()


async def test_closing_the_relay_fails_the_calls_waiting_there() -> None:
    name = f"fair{next(_ids)}"
    group = await _member(name)
    heavy = await _connect(name, group)
    flood = asyncio.gather(*(heavy.subgroup(Work).work("heavy") for _ in range(FLOOD)),
                           return_exceptions=True)
    await _held(group, FLOOD - 16)
    group.relay.close()
    assert group.stats()["in_flight_calls"] <= IN_FLIGHT  # none waits for room any more
    await heavy.close()
    await flood
    await group.leave()


async def test_what_waits_stays_within_max_queued_mb_and_refused_calls_come_again() -> None:
    name = f"fair{next(_ids)}"
    group = await _member(name, max_queued_mb=1)
    heavy = [await _connect(name, group) for _ in range(2)]
    arg = "x" * 4096  # about 240 such calls fit in 1 MiB
    flood = [asyncio.gather(*(c.subgroup(Work).work(arg) for _ in range(FLOOD)))
             for c in heavy]
    most = 0
    while not all(f.done() for f in flood):
        most = max(most, group.stats()["in_flight_calls"])
        await asyncio.sleep(0.005)
    assert 200 <= most <= IN_FLIGHT + (1 << 20) // 4096, most
    assert group.local(Work).runs == 2 * FLOOD  # every refused call came again, and ran once
    for c in heavy:
        await c.close()
    await group.leave()

async def test_one_connections_burst_of_frames_does_not_hold_the_loop() -> None:
    name = f"fair{next(_ids)}"
    group = await _member(name)
    host, port = group.relay.address
    reader, writer = await asyncio.open_connection(host, port)
    await handshake.client_handshake(reader, writer, secret=CLIENT_SECRET.encode(), my_id=1,
                                     my_addr=("client", 0), expect=None, group=name,
                                     role=handshake.CLIENT)
    cw.write_frame(writer, cw.HELLO, b"c" * wire.CLIENT_ID_BYTES)
    turns = 0

    async def other() -> None:  # what else the member's loop serves
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    ticker = asyncio.get_running_loop().create_task(other())
    body = wire.encode_call("Nope.m", (), {})
    count = 20000  # calls answered at once (no such actor): none waits for room
    for rid in range(count):
        cw.write_frame(writer, cw.CALL, rid, "Nope", 0, rid, body)
    turns = 0
    while (await cw.read_frame(reader, 1 << 20))[:2] != [cw.FAIL, count - 1]:
        pass  # (each answered in turn: the last answer comes after all the others)
    ticker.cancel()
    assert turns >= count // 128, turns  # the loop served others every 64 frames or so
    writer.close()
    await group.leave()
