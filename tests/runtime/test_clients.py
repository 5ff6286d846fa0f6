"""External clients through the public API: members in this process, clients over real tcp.

Exactly once is shown the way a retry makes it happen: a second client given the first's id
sends calls with the same numbers (as the first would after its relay failed), through any
member, after a join, after a restart from files; none is applied again and each is answered
with the first delivery's outcome.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import derecho_async as da
from derecho_async.testing.simnet import SimNetwork, crash_group

SECRET = "dasec1.3udV6eyHs_deYIHMcgpFIx-iPkrPCE-0hEYpY66oayw._nFzQO"  # da.new_secret()
OTHER_SECRET = "dasec1.Mjp0Fk0I2qSV1lMbrAN4mSchb2qUZ2Eb45KQda3WsKQ.HqbLmO"
CLIENT_SECRET = da.new_secret()  # what clients prove: not the members' SECRET
_ids = itertools.count()


class Counter(da.Actor):
    def __init__(self) -> None:
        self.total = 0
        self.seen: list[int] = []

    @da.ordered
    def bump(self, n: int) -> int:
        self.total += n
        self.seen.append(n)
        return self.total

    @da.ordered
    async def slow_bump(self, n: int) -> int:
        await asyncio.sleep(0.001)
        self.total += n
        self.seen.append(n)
        return self.total

    @da.ordered
    def fail(self, why: str) -> None:
        raise ValueError(why)

    @da.p2p
    def read(self) -> int:
        return self.total

    def snapshot(self) -> list[Any]:
        return [self.total, self.seen]

    def restore(self, state: list[Any]) -> None:
        self.total, self.seen = state[0], list(state[1])


def cfg(name: str, member: int, n: int = 3, data_dir: Path | None = None,
        **kw: Any) -> da.Config:
    return da.Config(group=name, member_id=member, initial_members=n, transport="sim",
                     heartbeat_ms=5, suspect_after_ms=500, secret=SECRET,
                     client_listen="127.0.0.1:0", client_secret=CLIENT_SECRET,
                     data_dir=None if data_dir is None else str(data_dir), **kw)


async def start(name: str, n: int = 3, data_dir: Path | None = None,
                net: SimNetwork | None = None, **kw: Any) -> list[da.Group]:
    return list(await asyncio.gather(*(
        da.Group.join(cfg(name, m, n, data_dir, **kw), actors=[Counter], timeout=10,
                      transport=None if net is None else net.transport(m))
        for m in range(n))))


def peers(groups: list[da.Group]) -> dict[int, str]:
    return {g.member_id: str(g.client_address) for g in groups}


def total(group: da.Group) -> int:
    actor = group.local(Counter)
    return actor.total


async def leave(groups: list[da.Group]) -> None:
    for g in groups:
        await g.leave()


async def test_a_client_calls_like_a_member() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name)
    async with await da.Client.connect(group=name, peers={1: peers(groups)[1]},
                                       secret=CLIENT_SECRET) as client:
        assert client.view.members == (0, 1, 2)
        counter = client.subgroup(Counter)
        replies = await counter.bump(5)
        assert dict(replies) == {0: 5, 1: 5, 2: 5}
        version = await counter.bump.cast(2)
        assert version > replies.version
        assert await counter.read.at(2)() in (5, 7)  # (member 2 may not have run it yet)
        await counter.bump(0)  # every member ran the cast before this one
        assert await counter.read.at(0)() == 7
        assert await counter.read.any()() == 7
        got = await counter.read.at(0).versioned()
        assert got.value == 7 and got.version[0] == replies.version[0]
        failed = await counter.fail("no")
        assert all(isinstance(v, da.HandlerError) and v.type_name == "ValueError"
                   for v in failed.values())
        with pytest.raises(AttributeError):
            counter.nothing  # noqa: B018
        assert counter[Counter.bump] is counter.bump  # typed access: the same method
        assert (await counter[Counter.bump](0)).raise_on_error() == {0: 7, 1: 7, 2: 7}
        assert await counter[Counter.read].at(1)() == 7
        with pytest.raises(da.UsageError, match=r"handle\.read\.at\(member\)"):
            counter.read()
        with pytest.raises(da.HandlerError):
            failed.raise_on_error()
        assert set(client._peers) == {0, 1, 2}  # every member's address came with the view
    assert [total(g) for g in groups] == [7, 7, 7]
    await leave(groups)


async def test_a_retried_call_is_applied_once_and_answered_with_the_first_outcome() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name)
    addrs = peers(groups)
    first = await da.Client.connect(group=name, peers={0: addrs[0]}, secret=CLIENT_SECRET)
    a = first.subgroup(Counter)
    assert dict(await a.bump(1)) == {0: 1, 1: 1, 2: 1}
    assert dict(await a.slow_bump(10)) == {0: 11, 1: 11, 2: 11}
    # a client given the same id numbers its calls from 0 again: the same calls, retried
    again = await da.Client.connect(group=name, peers={2: addrs[2]}, secret=CLIENT_SECRET,
                                    client_id=first.client_id)
    b = again.subgroup(Counter)
    assert dict(await b.bump(100)) == {0: 1, 1: 1, 2: 1}  # the kept outcome, not run again
    assert dict(await b.bump(100)) == {0: 11, 1: 11, 2: 11}
    assert dict(await b.bump(1000)) == {0: 1011, 1: 1011, 2: 1011}  # a new number: runs
    assert dict(await a.bump(7)) == {0: 1011, 1: 1011, 2: 1011}  # seq 2 ran already
    assert [total(g) for g in groups] == [1011] * 3
    await first.close()
    await again.close()
    await leave(groups)


async def test_a_joiner_receives_the_table_with_the_state() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name)
    first = await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET)
    for i in range(5):
        await first.subgroup(Counter).bump(i + 1)
    joiner = await da.Group.join(cfg(name, 3), actors=[Counter], timeout=10)
    groups.append(joiner)
    again = await da.Client.connect(group=name, peers={3: peers(groups)[3]}, secret=CLIENT_SECRET,
                                    client_id=first.client_id)
    replies = await again.subgroup(Counter).bump(50)  # seq 0 again, relayed by the joiner
    assert dict(replies) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert [total(g) for g in groups] == [15] * 4
    await first.close()
    await again.close()
    await leave(groups)


async def test_the_table_survives_a_restart_from_the_files(tmp_path: Path) -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name, data_dir=tmp_path, snapshot_every=3)
    first = await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET)
    for i in range(8):  # snapshots hold part of the table, the log the rest
        await first.subgroup(Counter).bump(i + 1)
    await first.close()
    await leave(groups)
    groups = await start(name, data_dir=tmp_path, snapshot_every=3)
    assert [total(g) for g in groups] == [36] * 3
    again = await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET,
                                    client_id=first.client_id)
    counter = again.subgroup(Counter)
    assert dict(await counter.bump(100)) == {0: 1, 1: 1, 2: 1}
    assert dict(await counter.bump(100)) == {0: 3, 1: 3, 2: 3}
    assert [total(g) for g in groups] == [36] * 3
    await again.close()
    await leave(groups)


async def test_calls_go_on_through_another_member_when_the_relay_crashes() -> None:
    net = SimNetwork(random.Random(3), max_delay_s=0.0005)
    name = f"cl{next(_ids)}"
    groups = await start(name, net=net)
    client = await da.Client.connect(group=name, peers={0: peers(groups)[0]}, secret=CLIENT_SECRET)
    assert client.relay == 0
    counter = client.subgroup(Counter)
    calls = [asyncio.ensure_future(counter.slow_bump(1)) for _ in range(200)]
    while total(groups[1]) < 50:
        await asyncio.sleep(0.001)
    crash_group(net, groups[0])  # calls in flight: delivered or not, the client retries them
    replies = await asyncio.wait_for(asyncio.gather(*calls), 30)
    assert client.relay in (1, 2)
    assert [total(g) for g in groups[1:]] == [200, 200]
    seen = groups[1].local(Counter).seen
    assert len(seen) == 200
    # every call was answered with the total it made: 1 .. 200, each once
    totals = sorted(r[1] if 1 in r and not isinstance(r[1], da.MemberFailed) else r[2]
                    for r in replies)
    assert totals == list(range(1, 201))
    await client.close()
    await leave(groups[1:])


async def test_a_wrong_secret_fails_at_once() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name, n=1)
    began = time.monotonic()
    with pytest.raises(da.AuthenticationError, match="secret"):
        await da.Client.connect(group=name, peers=peers(groups),
                                secret=OTHER_SECRET)
    assert time.monotonic() - began < 5
    await leave(groups)


async def test_a_call_no_member_would_run_is_rejected_at_once() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name, n=1)

    class Counter(da.Actor):  # the client's idea of the actor has a method the group's lacks
        @da.ordered
        def explode(self) -> None: ...

        @da.p2p
        def peek(self) -> None: ...

    async with await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET) as c:
        with pytest.raises(da.UsageError, match="no @ordered method 'explode'"):
            await c.subgroup(Counter).explode()
        with pytest.raises(da.UsageError, match="no @p2p method 'peek'"):
            await c.subgroup(Counter).peek.any()()
    await leave(groups)


async def test_a_member_serves_at_most_max_clients() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name, n=1, max_clients=1)
    async with await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET):
        with pytest.raises(da.GroupClosed, match="max_clients"):
            await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET,
                                    timeout=0.5)
    await leave(groups)


async def test_a_client_follows_views_and_deliveries() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name)
    client = await da.Client.connect(group=name, peers={0: peers(groups)[0]}, secret=CLIENT_SECRET)
    views = client.views()
    sub = client.subscribe(Counter)
    nxt = asyncio.ensure_future(anext(sub))
    await asyncio.sleep(0.05)  # the subscription is open at the relay
    counter = client.subgroup(Counter)
    versions = [(await counter.bump(i)).version for i in range(5)]
    got = [await asyncio.wait_for(nxt, 5)]
    got += [await asyncio.wait_for(anext(sub), 5) for _ in range(4)]
    assert [e.version for e in got] == versions
    assert [e.args for e in got] == [(i,) for i in range(5)]
    assert {e.method for e in got} == {"bump"}
    await groups[2].leave()
    view = await asyncio.wait_for(anext(views), 5)
    assert view.members == (0, 1) and client.view == view
    await client.close()
    with pytest.raises(da.GroupClosed, match="closed"):
        await client.closed
    await leave(groups[:2])


async def test_a_slow_subscriber_is_dropped_not_buffered_without_bound() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name, n=1)
    client = await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET)
    sub = client.subscribe(Counter, max_backlog=5)
    first = asyncio.ensure_future(anext(sub))
    await asyncio.sleep(0.05)
    for i in range(20):
        await client.subgroup(Counter).bump(i)
    assert (await first).args == (0,)
    with pytest.raises(da.SubscriptionDropped, match="more than 5"):
        while True:
            await asyncio.wait_for(anext(sub), 5)
    await client.close()
    await leave(groups)


async def test_a_call_over_the_members_bound_is_refused_at_the_client() -> None:
    name = f"cl{next(_ids)}"
    groups = await start(name, n=1, max_call_mb=1)
    async with await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET) as c:
        with pytest.raises(da.UsageError, match="max_call_mb"):
            await c.subgroup(Counter).fail("x" * (2 << 20))
        assert dict(await c.subgroup(Counter).bump(1)) == {0: 1}  # the client goes on
    await leave(groups)


async def test_clients_speak_tls_with_members_that_have_certificates(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from derecho_async.certs import issue, issue_clients

    name = f"cl{next(_ids)}"
    files = issue(tmp_path, name, [0])
    (mine,) = issue_clients(tmp_path, name, ["frontend"])
    groups = await start(name, n=1, tls_cert=str(files[0].cert), tls_key=str(files[0].key),
                         tls_ca=str(files[0].ca))

    def context(cert: Path | None, key: Path | None) -> ssl.SSLContext:
        tls = ssl.create_default_context(cafile=str(files[0].ca))
        tls.check_hostname = False  # (the certificate names the member, not the host)
        if cert is not None and key is not None:
            tls.load_cert_chain(str(cert), str(key))
        return tls

    async with await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET,
                                       tls=context(mine.cert, mine.key)) as c:
        assert dict(await c.subgroup(Counter).bump(3)) == {0: 3}
    # refused at once, never retried: no certificate, or a member's (it names no client)
    for cert, key in ((None, None), (files[0].cert, files[0].key)):
        began = time.monotonic()
        with pytest.raises(da.AuthenticationError, match="certificate"):
            await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET,
                                    tls=context(cert, key), timeout=20)
        assert time.monotonic() - began < 5
    with pytest.raises(da.GroupClosed, match="no member"):  # plain tcp: no handshake at all
        await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET,
                                timeout=0.5)
    await leave(groups)


async def test_a_subscription_resumes_at_the_next_relay_from_the_log(tmp_path: Path) -> None:
    net = SimNetwork(random.Random(5), max_delay_s=0.0005)
    name = f"cl{next(_ids)}"
    groups = await start(name, data_dir=tmp_path, net=net)
    client = await da.Client.connect(group=name, peers=peers(groups), secret=CLIENT_SECRET)
    relay = client.relay
    assert relay is not None
    sub = client.subscribe(Counter)
    first = asyncio.ensure_future(anext(sub))
    await asyncio.sleep(0.05)
    counter = client.subgroup(Counter)
    versions = [(await counter.bump(i)).version for i in range(3)]
    assert (await first).version == versions[0]
    crash_group(net, groups[relay])  # the relay goes: the subscription moves with the client
    versions += [(await counter.bump(i)).version for i in range(3, 8)]
    got = [await asyncio.wait_for(anext(sub), 10) for _ in range(7)]
    assert [e.version for e in got] == versions[1:]  # nothing missed, nothing twice
    assert client.relay != relay
    await client.close()
    await leave([g for g in groups if g.member_id != relay])


def test_the_client_example_runs() -> None:
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "examples/kv_client.py"], capture_output=True,
                       text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "22 writes applied" in r.stdout and "exit codes: [" in r.stdout
    assert "20 more puts through member" in r.stdout
