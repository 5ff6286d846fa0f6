"""SimNetwork / SimTransport on the virtual-time loop: FIFO links, faults, determinism."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from derecho_async.errors import UsageError
from derecho_async.testing.simnet import SimNetwork, SimTransport, TraceEvent
from derecho_async.testing.vloop import run_virtual

ROW = 256


@dataclass
class Timed:
    """A TransportHandler recording ("push", sender, offset, data) / ("msg", sender, payload)
    with the virtual time of each arrival."""

    events: list[tuple[float, tuple[object, ...]]] = field(default_factory=list)
    failures: list[tuple[int, str]] = field(default_factory=list)
    on_arrival: Callable[[], object] | None = None

    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        self._add(("push", sender, offset, data))

    def on_message(self, sender: int, payload: bytes) -> None:
        self._add(("msg", sender, payload))

    def on_failure(self, member: int, reason: str) -> None:
        self.failures.append((member, reason))

    def _add(self, what: tuple[object, ...]) -> None:
        self.events.append((asyncio.get_running_loop().time(), what))
        if self.on_arrival is not None:
            self.on_arrival()

    def from_sender(self, sender: int) -> list[tuple[object, ...]]:
        return [e for _, e in self.events if e[1] == sender]


async def started(
    network: SimNetwork, n: int, row: int = ROW
) -> tuple[list[SimTransport], list[Timed]]:
    ts = [network.transport(i) for i in range(n)]
    recs = [Timed() for _ in range(n)]
    for t, r in zip(ts, recs, strict=True):
        t.set_view(1, list(range(n)), row)
        await t.start(r)
    return ts, recs


def word(i: int) -> bytes:
    return i.to_bytes(8, "little")


def run(main: Callable[[], Awaitable[None]]) -> None:
    run_virtual(main, max_virtual_s=600.0)


def test_links_are_fifo_across_pushes_and_messages_under_random_delays() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(1), max_delay_s=0.05, min_delay_s=0.001)
        net.set_link(2, 0, extra_delay_s=0.02, jitter_s=0.03)
        ts, recs = await started(net, 3)
        loop = asyncio.get_running_loop()
        sent: dict[tuple[int, int], list[tuple[object, ...]]] = {}
        send_order: list[tuple[object, ...]] = []  # what member 0 is sent, in send order
        for i in range(400):
            s = i % 3
            others = [t for t in range(3) if t != s]
            off = s * ROW + (i % 16) * 8
            buf = bytearray(word(i))
            ts[s].push(1, off, buf, others)
            buf[:] = b"\xff" * 8  # the caller may reuse its buffer at once
            for t in others:
                sent.setdefault((s, t), []).append(("push", s, off, word(i)))
            if 0 in others:
                send_order.append(("push", s, off, word(i)))
            if i % 4 == 0:
                msg = bytearray(b"m%d" % i)
                ts[s].send(others[i % 2], msg)
                msg[:1] = b"X"
                sent[(s, others[i % 2])].append(("msg", s, b"m%d" % i))
                if others[i % 2] == 0:
                    send_order.append(("msg", s, b"m%d" % i))
            if i % 50 == 0:
                await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)
        for (s, t), want in sent.items():
            assert recs[t].from_sender(s) == want
        # the delays were real: at member 0, items from 1 and 2 did not arrive in send order
        # (one link overtook the other), and arrivals spread over many instants
        arrived = [e for _, e in recs[0].events]
        assert arrived != [e for e in send_order if e in arrived]
        assert len({tm for tm, _ in recs[0].events}) > 20
        assert net.in_flight() == 0
        assert loop.time() > 1.0
        assert all(r.failures == [] for r in recs)

    run(main)


def test_split_pushes_land_word_aligned_in_order_at_distinct_instants() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(2), max_delay_s=0.01, split_probability=1.0, trace=True)
        ts, recs = await started(net, 2, row=4096)
        loop = asyncio.get_running_loop()
        steps: list[float] = []
        # a "protocol step" the receiver schedules on each arrival, as the driver does
        recs[1].on_arrival = lambda: loop.call_soon(lambda: steps.append(loop.time()))
        rnd = random.Random(9)
        pushes = []
        for _ in range(60):
            off = rnd.randrange(0, 2048)  # aligned or not
            data = rnd.randbytes(rnd.randrange(1, 200))
            ts[0].push(1, off, data, [1])
            pushes.append((off, data))
        await asyncio.sleep(5.0)
        events = recs[1].events
        pieces_per_push = []
        k = 0
        for off, data in pushes:
            got = b""
            pieces = 0
            last_time = -1.0
            while len(got) < len(data):
                tm, (kind, sender, o, d) = events[k]
                k += 1
                assert (kind, sender) == ("push", 0)
                assert o == off + len(got)  # the rest follows in order
                if got:
                    assert o % 8 == 0  # every cut is on a table word boundary
                    assert tm > last_time  # at a later instant,
                    assert any(last_time <= st < tm for st in steps)  # after a receiver step
                got += d  # type: ignore[operator]
                last_time = tm
                pieces += 1
            assert got == data
            pieces_per_push.append(pieces)
        assert k == len(events)
        assert max(pieces_per_push) >= 3
        assert sum(p > 1 for p in pieces_per_push) > 30
        assert net.counts["split"] == sum(p > 1 for p in pieces_per_push)
        assert net.counts["landed"] == len(events)
        assert [e.event for e in net.trace].count("push") == len(events)

    run(main)


def _crash_run(seed: int) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]], int]:
    """Member 0 sends 20 items to 1 and crashes with them in flight: (sent, landed, dropped)."""
    result: list[tuple[list[tuple[object, ...]], list[tuple[object, ...]], int]] = []

    async def main() -> None:
        net = SimNetwork(random.Random(seed), max_delay_s=0.05, trace=True)
        ts, recs = await started(net, 3)
        sent: list[tuple[object, ...]] = []
        for i in range(20):
            if i % 3 == 0:
                ts[0].send(1, b"msg %d" % i)
                sent.append(("msg", 0, b"msg %d" % i))
            else:
                data = b"".join(word(i * 100 + w) for w in range(6))
                ts[0].push(1, 0, data, [1])
                sent.append(("push", 0, 0, data))
        ts[2].send(0, b"to the dead")  # in flight to 0 when it crashes: dropped
        net.crash(0)
        ts[0].send(1, b"after the crash")  # dropped, no error
        ts[0].push(1, 0, word(7), [1])
        ts[1].send(0, b"to a dead member")
        await asyncio.sleep(1.0)
        assert recs[0].events == []
        assert all(r.failures == [] for r in recs)
        drops = sum(1 for e in net.trace if e.event.startswith("drop"))
        result.append((sent, recs[1].from_sender(0), drops))
        for t in ts:
            await t.close()

    run(main)
    return result[0]


def test_crash_keeps_a_random_prefix_of_what_was_in_flight() -> None:
    lengths = set()
    partial = 0
    for seed in range(30):
        sent, landed, drops = _crash_run(seed)
        assert drops >= 2  # at least the message to the dead member 0 and the one to 2's link
        whole = [e for e in landed if e in sent]
        assert landed[: len(whole)] == sent[: len(whole)]  # a prefix, in order
        extra = landed[len(whole):]
        assert len(extra) <= 1
        if extra:  # part of the next push: a word-aligned prefix of it
            kind, _, off, data = extra[0]
            want = sent[len(whole)]
            assert kind == "push" == want[0] and off == 0
            assert isinstance(data, bytes) and isinstance(want[3], bytes)
            assert want[3].startswith(data) and 0 < len(data) < len(want[3])
            assert len(data) % 8 == 0
            partial += 1
        lengths.add(len(whole))
    assert len(lengths) >= 5  # the prefix kept varies with the seed
    assert partial >= 3


def test_partition_holds_and_heal_releases_in_order() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(4), max_delay_s=0.01)
        ts, recs = await started(net, 3)
        loop = asyncio.get_running_loop()
        net.partition([0], [1, 2])
        for i in range(10):
            ts[0].send(1, b"0>1 %d" % i)
            ts[1].send(0, b"1>0 %d" % i)
            ts[1].send(2, b"1>2 %d" % i)
            ts[0].push(1, 0, word(i), [1, 2])
        await asyncio.sleep(2.0)
        assert recs[0].events == [] and recs[1].from_sender(0) == []
        assert len(recs[2].from_sender(1)) == 10  # same side: flows
        assert net.in_flight(src=0) == 30 and net.in_flight(src=1, dst=0) == 10
        healed_at = loop.time()
        net.heal()
        await asyncio.sleep(0.5)
        want_1 = []
        for i in range(10):
            want_1 += [("msg", 0, b"0>1 %d" % i), ("push", 0, 0, word(i))]
        assert recs[1].from_sender(0) == want_1
        assert recs[0].from_sender(1) == [("msg", 1, b"1>0 %d" % i) for i in range(10)]
        assert recs[2].from_sender(0) == [("push", 0, 0, word(i)) for i in range(10)]
        assert all(tm >= healed_at for tm, _ in recs[1].events)
        assert net.in_flight() == 0

    run(main)


def test_extra_link_delay_applies_to_that_link_only() -> None:
    async def main() -> None:
        net = SimNetwork(random.Random(5), max_delay_s=0.001)
        net.set_link(0, 1, extra_delay_s=2.0)
        ts, recs = await started(net, 3)
        ts[0].send(1, b"slow")
        ts[0].send(2, b"fast")
        await asyncio.sleep(3.0)
        (t1, _), = recs[1].events
        (t2, _), = recs[2].events
        assert 2.0 <= t1 <= 2.001 and t2 <= 0.001

    run(main)


def test_endpoints_are_unique_and_invalid_settings_refused() -> None:
    net = SimNetwork(random.Random(0))
    net.transport(1)
    with pytest.raises(UsageError):
        net.transport(1)
    with pytest.raises(UsageError):
        SimNetwork(random.Random(0), max_delay_s=0.1, min_delay_s=0.2)
    with pytest.raises(UsageError):
        SimNetwork(random.Random(0), split_probability=1.5)
    with pytest.raises(UsageError):
        net.partition([1, 2], [2])


def _chaos_trace(seed: int) -> list[TraceEvent]:
    """Random traffic among 4 members with splits, a partition, a heal and a crash."""
    trace: list[TraceEvent] = []

    async def main() -> None:
        rnd = random.Random(seed + 1000)  # the traffic pattern; the network has its own
        net = SimNetwork(random.Random(seed), max_delay_s=0.02, split_probability=0.5,
                         trace=True)
        ts, _recs = await started(net, 4)
        for step in range(200):
            s = rnd.randrange(4)
            if rnd.random() < 0.5:
                ts[s].push(1, s * ROW + 8 * rnd.randrange(16), rnd.randbytes(8 * rnd.randrange(1, 9)),
                           [t for t in range(4) if t != s])
            else:
                ts[s].send(rnd.randrange(4), rnd.randbytes(rnd.randrange(1, 40)))
            if step == 60:
                net.partition([0, 1], [2, 3])
            if step == 120:
                net.heal()
            if step == 150:
                net.crash(3)
            await asyncio.sleep(rnd.random() * 0.005)
        await asyncio.sleep(1.0)
        trace.extend(net.trace)

    run(main)
    return trace


def test_same_seed_same_landing_trace_other_seed_other_trace() -> None:
    first = _chaos_trace(21)
    assert len(first) > 500
    assert {"push", "msg", "drop-push", "partition", "heal", "crash"} <= {e.event for e in first}
    assert first == _chaos_trace(21)
    assert first != _chaos_trace(22)
