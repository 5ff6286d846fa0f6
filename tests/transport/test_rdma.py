"""The rdma transport: its settings (no device needed) and, marked ``rdma``, tests on a device.
Its parts without a device: test_rdma_codec.py, test_rdma_rings.py, test_rdma_completions.py,
test_rdma_verbs.py and test_rdma_bulk.py.

The device tests run inside rxe-vm (Soft-RoCE; ``scripts/rdma-tests.sh``): the whole transport
conformance suite over rdma (reusing its test functions with an rdma cluster), busy polling,
per-peer inbox keys, injected queue-pair faults, the bulk path for large messages (order with
small messages and pushes, failure mid-transfer, hostile records, throughput), links closed at
a view change, separate processes, a 3-member group whose member is SIGKILLed, and a process
joining a running rdma group. Outside a machine with an RDMA device they skip, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import multiprocessing
import os
import queue as queue_mod
import random
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict, cast

import msgpack  # type: ignore[import-untyped]
import pytest
import test_transport_conformance as conformance
import transport_support as support
from member_process import ROW, expected_from
from rdma_support import (
    DEVICE_PROBLEM,
    bulk_blocks_sent,
    loop_name,
    make_rdma_transport,
    needs_device,
    rdma_cluster_factory,
    rdma_pair,
    word,
)
from transport_support import SECRET, Recorder

from derecho_async.errors import ConfigError
from derecho_async.launch import free_ports
from derecho_async.transport.rdma import RdmaTransport, verbs
from derecho_async.transport.rdma.codec import MIN_BULK_BLOCK
from derecho_async.transport.rdma.rings import R_BULK, REC, RF_FINAL
from derecho_async.transport.tcp import TcpTransport

HERE = Path(__file__).parent


def test_constructor_validates_its_settings() -> None:
    with pytest.raises(ConfigError):
        RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, port=0)
    with pytest.raises(ConfigError):
        RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, gid_index=-1)
    with pytest.raises(ConfigError):
        RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, device="")
    with pytest.raises(ConfigError):
        RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, inbox_bytes=1000)
    with pytest.raises(ConfigError):
        RdmaTransport(0, ("127.0.0.1", 0), secret=b"")
    for bad in (
        {"bulk_threshold": -1},
        {"bulk_threshold": True},
        {"bulk_block": MIN_BULK_BLOCK - 8},
        {"bulk_block": MIN_BULK_BLOCK + 4},
        {"bulk_slots": 0},
        {"bulk_slots": 1024, "bulk_block": 1 << 20},  # region too large
        {"bulk_max_message": 0},
    ):
        with pytest.raises(ConfigError):
            RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, **bad)
    t = RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, bulk_threshold=0)
    assert t.bulk_threshold == 0


@pytest.mark.skipif(DEVICE_PROBLEM is None, reason="this machine has an RDMA device")
async def test_start_without_a_device_raises_one_clear_error() -> None:
    t = RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET)
    with pytest.raises(verbs.RdmaUnavailable) as info:
        await t.start(Recorder())
    assert "install" in str(info.value) or "rdma link add" in str(info.value)
    assert t.closed


# ============================================================================================
# Device tests (rxe-vm)
# ============================================================================================


CONFORMANCE = sorted(n for n in dir(conformance) if n.startswith("test_"))


async def _run_case(
    case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, busy: bool
) -> None:
    monkeypatch.setattr(conformance, "cluster", rdma_cluster_factory(busy))
    monkeypatch.setattr(conformance, "make_transport", make_rdma_transport)
    fn = getattr(conformance, case)
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"kind": "rdma"}
    if "monkeypatch" in params:
        kwargs["monkeypatch"] = monkeypatch
    if "caplog" in params:
        kwargs["caplog"] = caplog
    await fn(**kwargs)


@pytest.mark.rdma
@needs_device
@pytest.mark.parametrize("case", CONFORMANCE)
async def test_conformance_over_rdma(
    case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await _run_case(case, monkeypatch, caplog, busy=False)


@pytest.mark.rdma
@needs_device
@pytest.mark.parametrize(
    "case",
    [
        "test_fifo_per_link_with_interleaved_messages",
        "test_big_messages_and_bursts_beyond_ring_capacity",
    ],
)
async def test_conformance_over_rdma_busy_poll(
    case: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    await _run_case(case, monkeypatch, caplog, busy=True)


def _fds(*needles: str) -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if any(n in target for n in needles):
                out.add(f"{fd}->{target}")
    return out


@pytest.mark.rdma
@needs_device
async def test_each_peer_gets_its_own_inbox_and_keys() -> None:
    before = _fds("infinibandevent", "uverbs")
    async with rdma_pair() as c:
        c.set_view(1, [0, 1, 2], ROW)
        for s in range(3):
            c[s].push(1, s * ROW, word(s), [0, 1, 2])
        for r in c.recs:

            def both_pushes(r: Recorder = r) -> bool:
                return len(r.pushes()) == 2

            await r.wait_for(both_pushes)
        regions = []
        for t in c.transports:
            assert isinstance(t, RdmaTransport)
            for peer, link in t._conns.links.items():
                ep = link.ep
                assert ep is not None and ep.paired and ep.peer_info is not None
                # the peer's endpoint was told exactly my inbox for it, nothing else
                other = c.transports[peer]
                assert isinstance(other, RdmaTransport)
                their = other._conns.links[t.member_id].ep
                assert their is not None and their.peer_info is not None
                assert their.peer_info.addr == ep.inbox_mr.buf
                assert their.peer_info.rkey == ep.inbox_mr.rkey
                assert their.peer_info.size == ep.inbox_mr.length == t.inbox_bytes
                regions.append((ep.inbox_mr.buf, ep.inbox_mr.rkey))
        assert len({rk for _, rk in regions}) == len(regions) == 6
        assert all(r.failures() == [] for r in c.recs)
    await asyncio.sleep(0)
    assert _fds("infinibandevent", "uverbs") <= before


async def _forge_write(t: RdmaTransport, peer: int, remote_offset: int) -> None:
    """Make ``t`` post a raw RDMA WRITE at ``remote_offset`` of its inbox at ``peer``."""
    ep = t._conns.links[peer].ep
    assert ep is not None and ep.peer_info is not None and ep.mirror_mr is not None
    pv = t._device.pv
    assert pv is not None
    e = pv.enums
    wr = pv.wr.SendWR(
        wr_id=ep.sq_seq + 1,
        opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
        num_sge=1,
        sg=[pv.wr.SGE(ep.mirror.address, 8, ep.mirror_mr.lkey)],  # type: ignore[union-attr]
        imm_data=0,
        send_flags=int(e.IBV_SEND_SIGNALED),
    )
    wr.set_wr_rdma(ep.peer_info.rkey, ep.peer_info.addr + remote_offset)
    t._send.post(ep, wr, True, ep.tx.posted if ep.tx else 0)


@pytest.mark.rdma
@needs_device
async def test_write_outside_the_inbox_is_rejected_by_the_nic_and_reported() -> None:
    async with rdma_pair() as c:
        c.set_view(1, [0, 1, 2], ROW)
        c[0].push(1, 0, word(1), [1, 2])
        await c.recs[1].wait_for(lambda: len(c.recs[1].pushes(0)) == 1)
        t0 = c[0]
        assert isinstance(t0, RdmaTransport)
        # member 0 aims past its inbox at member 1 (where member 2's inbox might be)
        await _forge_write(t0, 1, t0._conns.links[1].ep.peer_info.size)  # type: ignore[union-attr]
        await c.recs[1].wait_for(lambda: bool(c.recs[1].failures(0)))
        await c.recs[0].wait_for(lambda: bool(c.recs[0].failures(1)))
        assert "rdma" in c.recs[1].failures(0)[0]
        assert c.recs[1].pushes(2) == []
        # the other links are unaffected
        c[2].push(1, 2 * ROW, word(2), [1])
        await c.recs[1].wait_for(lambda: len(c.recs[1].pushes(2)) == 1)
        # after the back-off, member 0's pushes reach member 1 on a fresh queue pair
        await asyncio.sleep(t0.reconnect_backoff + 0.1)
        c[0].push(1, 8, word(3), [1])
        await c.recs[1].wait_for(lambda: (1, 0, 8, word(3)) in c.recs[1].pushes(0))


@pytest.mark.rdma
@needs_device
async def test_queue_pair_error_is_reported_not_hung_and_the_link_recovers() -> None:
    async with rdma_pair(2) as c:
        c.set_view(1, [0, 1], ROW)
        c[0].push(1, 0, word(1), [1])
        await c.recs[1].wait_for(lambda: len(c.recs[1].pushes(0)) == 1)
        t0 = c[0]
        assert isinstance(t0, RdmaTransport)
        ep = t0._conns.links[1].ep
        assert ep is not None and t0._device.pv is not None
        e = t0._device.pv.enums
        ep.qp.modify(t0._device.pv.qp.QPAttr(qp_state=e.IBV_QPS_ERR), int(e.IBV_QP_STATE))
        c[0].push(1, 8, word(2), [1])  # completes in error (flushed)
        await c.recs[0].wait_for(lambda: bool(c.recs[0].failures(1)))
        assert "error state" in c.recs[0].failures(1)[0]
        await c.recs[1].wait_for(lambda: bool(c.recs[1].failures(0)))  # told by RESET
        await asyncio.sleep(t0.reconnect_backoff + 0.1)
        c[0].push(1, 16, word(3), [1])
        c[0].send(1, b"after")
        await c.recs[1].wait_for(lambda: c.recs[1].messages(0) == [b"after"])
        assert (1, 0, 16, word(3)) in c.recs[1].pushes(0)


@pytest.mark.rdma
@needs_device
async def test_retry_exhaustion_is_reported() -> None:
    async with rdma_pair(2) as c:
        t0 = c[0]
        assert isinstance(t0, RdmaTransport)
        t0.qp_timeout, t0.qp_retry_cnt = 10, 2  # ~4 ms per try, 3 tries
        c.set_view(1, [0, 1], ROW)
        c[0].push(1, 0, word(1), [1])
        await c.recs[1].wait_for(lambda: len(c.recs[1].pushes(0)) == 1)
        # member 1's queue pair vanishes while its tcp channel stays up
        t1 = c[1]
        assert isinstance(t1, RdmaTransport)
        ep1 = t1._conns.links[0].ep
        assert ep1 is not None
        ep1.qp.close()
        c[0].push(1, 8, word(2), [1])
        await c.recs[0].wait_for(lambda: bool(c.recs[0].failures(1)))
        assert "retries exhausted" in c.recs[0].failures(1)[0], c.recs[0].failures(1)


@pytest.mark.rdma
@needs_device
async def test_a_restarted_member_gets_a_fresh_link() -> None:
    async with rdma_pair(2) as c:
        c.set_view(1, [0, 1], ROW)
        c[0].push(1, 0, word(1), [1])
        c[1].push(1, ROW, word(1), [0])
        await c.recs[1].wait_for(lambda: len(c.recs[1].pushes(0)) == 1)
        await c.recs[0].wait_for(lambda: len(c.recs[0].pushes(1)) == 1)
        await c[1].close()  # says goodbye: member 0 drops its endpoint quietly
        rec = Recorder(me=1)
        t1 = make_rdma_transport("rdma", 1, group=c.group)
        c.transports[1], c.recs[1] = t1, rec
        await t1.start(rec)
        t1.add_peer(0, cast(RdmaTransport, c[0]).address)
        c[0].add_peer(1, t1.address)
        t1.set_view(1, [0, 1], ROW)
        await asyncio.sleep(0.2)
        c[0].push(1, 8, word(2), [1])
        t1.push(1, ROW + 8, word(2), [0])
        c[0].send(1, b"welcome back")
        await rec.wait_for(lambda: rec.messages(0) == [b"welcome back"])
        assert rec.pushes(0) == [(1, 0, 8, word(2))]
        await c.recs[0].wait_for(lambda: (1, 1, ROW + 8, word(2)) in c.recs[0].pushes(1))
        assert rec.failures() == []


# -- the bulk path (large messages by RDMA into the peer's bulk region) -----------------------

class _BulkSettings(TypedDict):
    bulk_threshold: int
    bulk_block: int
    bulk_slots: int


SMALL_BULK: _BulkSettings = {"bulk_threshold": 32 << 10, "bulk_block": 16 << 10, "bulk_slots": 4}


@pytest.mark.rdma
@needs_device
async def test_bulk_messages_keep_link_order_with_small_messages_and_pushes() -> None:
    rnd = random.Random(11)
    async with rdma_pair(3, **SMALL_BULK) as c:
        c.set_view(1, [0, 1, 2], ROW)
        want: dict[int, list[tuple[object, ...]]] = {1: [], 2: []}
        # until a link is paired its large messages go over tcp (still in order): pair first
        c[0].push(1, 0, word(0), [1, 2])
        for t in (1, 2):
            want[t].append(("push", 1, 0, 0, word(0)))

            def first_push(t: int = t) -> bool:
                return len(c.recs[t].pushes(0)) == 1

            await c.recs[t].wait_for(first_push)
        for i in range(120):
            for t in (1, 2):
                r = rnd.random()
                if r < 0.5:
                    off = (i % 8) * 8
                    c[0].push(1, off, word(i), [t])
                    want[t].append(("push", 1, 0, off, word(i)))
                else:
                    size = rnd.choice((5, 1000, (32 << 10) - 1, 32 << 10, 100_000, 300_001))
                    msg = rnd.randbytes(size)
                    c[0].send(t, msg)
                    want[t].append(("msg", 0, msg))
            if i % 10 == 9:
                await asyncio.sleep(0)
        # a bytearray payload is copied at send: changing it afterwards changes nothing
        buf = bytearray(rnd.randbytes(200_000))
        c[0].send(1, buf)  # type: ignore[arg-type]  # typed bytes; a bytearray is accepted
        want[1].append(("msg", 0, bytes(buf)))
        buf[:10] = bytes(10)
        for t in (1, 2):
            rec = c.recs[t]

            def caught_up(rec: Recorder = rec, t: int = t) -> bool:
                return len(rec.from_sender(0)) >= len(want[t])

            await rec.wait_for(caught_up)
            assert rec.from_sender(0) == want[t]  # whole, and in link order
            assert bulk_blocks_sent(c[0], t) > 0, "the large messages did not use rdma"
        await c[0].drain()
        assert all(not r.failures() for r in c.recs)


@pytest.mark.rdma
@needs_device
async def test_bulk_message_broken_mid_transfer_is_reported_and_never_delivered() -> None:
    async with rdma_pair(2, bulk_threshold=64 << 10, bulk_block=64 << 10, bulk_slots=2) as c:
        c.set_view(1, [0, 1], ROW)
        c[0].push(1, 0, word(1), [1])
        await c.recs[1].wait_for(lambda: len(c.recs[1].pushes(0)) == 1)
        t0, t1 = c[0], c[1]
        assert isinstance(t0, RdmaTransport) and isinstance(t1, RdmaTransport)
        big = os.urandom(16 << 20)
        c[0].send(1, big)
        ep1 = t1._conns.links[0].ep
        assert ep1 is not None and ep1.brx is not None
        deadline = time.monotonic() + support.WAIT
        while not ep1.brx.partial or ep1.brx.got < (1 << 20):
            assert time.monotonic() < deadline, "the bulk transfer never started"
            await asyncio.sleep(0.001)
        # the receiver's queue pair breaks while the message is half way
        assert t1._device.pv is not None
        e = t1._device.pv.enums
        ep1.qp.modify(t1._device.pv.qp.QPAttr(qp_state=e.IBV_QPS_ERR), int(e.IBV_QP_STATE))
        await c.recs[0].wait_for(lambda: bool(c.recs[0].failures(1)))
        await c.recs[1].wait_for(lambda: bool(c.recs[1].failures(0)))
        await asyncio.sleep(0.2)
        assert c.recs[1].messages(0) == []  # the partial message was discarded
        assert ep1.dead and not ep1.brx.partial
        # after the back-off a fresh link carries bulk messages again
        await asyncio.sleep(t0.reconnect_backoff + 0.1)
        small = os.urandom(300_000)
        c[0].send(1, b"after")
        c[0].send(1, small)
        await c.recs[1].wait_for(lambda: len(c.recs[1].messages(0)) == 2)
        assert c.recs[1].messages(0) == [b"after", small]


@pytest.mark.rdma
@needs_device
@pytest.mark.parametrize(
    "fields,why",
    [
        ({"offset": 4096}, "starts at offset"),
        ({"length": 1 << 30}, "block size"),
        ({"total": 1 << 41}, "limit"),
        ({"final": False, "length": 8}, "short bulk block"),
    ],
)
async def test_hostile_bulk_record_is_a_protocol_violation(
    fields: dict[str, Any], why: str
) -> None:
    async with rdma_pair(2, **SMALL_BULK) as c:
        c.set_view(1, [0, 1], ROW)
        c[0].push(1, 0, word(1), [1])
        await c.recs[1].wait_for(lambda: len(c.recs[1].pushes(0)) == 1)
        t0 = c[0]
        assert isinstance(t0, RdmaTransport)
        ep = t0._conns.links[1].ep
        assert ep is not None and ep.tx is not None and ep.mirror is not None
        rec = {"total": 100_000, "offset": 0, "length": 16 << 10, "final": True} | fields
        place = ep.tx.place(0)
        assert place is not None and place.pad_at is None
        REC.pack_into(
            ep.mirror.mm,
            place.at,
            R_BULK,
            RF_FINAL if rec["final"] else 0,
            rec["length"],
            rec["total"],
            rec["offset"],
            0,
        )
        t0._send.post_ring(ep, None, True)
        await c.recs[1].wait_for(lambda: bool(c.recs[1].failures(0)))
        failure = c.recs[1].failures(0)[0]
        assert "protocol violation" in failure and why in failure, failure
        assert c.recs[1].messages(0) == []
        # member 1 is still fine with others' traffic
        await c.recs[0].wait_for(lambda: bool(c.recs[0].failures(1)))  # told by RESET


@pytest.mark.rdma
@needs_device
async def test_a_member_leaving_the_view_loses_its_keys_and_a_new_link_gets_fresh_ones() -> None:
    async with rdma_pair(3, **SMALL_BULK) as c:
        c.set_view(1, [0, 1, 2], ROW)
        for s in range(3):
            c[s].push(1, s * ROW, word(s), [t for t in range(3) if t != s])
        for t in range(3):

            def both_pushes(t: int = t) -> bool:
                return len(c.recs[t].pushes()) == 2

            await c.recs[t].wait_for(both_pushes)
        t0 = c[0]
        assert isinstance(t0, RdmaTransport)
        old = t0._conns.links[2].ep
        assert old is not None and old.paired
        old_keys = (old.inbox_mr.rkey, old.bulk_mr.rkey)
        for s in (0, 1):
            c[s].set_view(2, [0, 1], ROW)  # member 2 left
        assert old.dead and t0._conns.links[2].ep is None  # its queue pair and regions are gone
        await asyncio.sleep(0.3)
        assert all(not r.failures() for r in c.recs)  # a quiet close, not a failure
        # the link comes back on demand, with new connection data
        big = os.urandom(100_000)
        c[0].send(2, b"still there?")
        c[0].send(2, big)
        c[0].send(2, big)
        await c.recs[2].wait_for(lambda: len(c.recs[2].messages(0)) == 3)
        assert c.recs[2].messages(0) == [b"still there?", big, big]
        new = t0._conns.links[2].ep
        assert new is not None and new is not old
        assert (new.inbox_mr.rkey, new.bulk_mr.rkey) != old_keys
        deadline = time.monotonic() + support.WAIT
        while not new.paired:
            assert time.monotonic() < deadline, "the new link never paired"
            await asyncio.sleep(0.01)
        c[0].send(2, big)  # the new link is paired: this one goes by rdma
        await c.recs[2].wait_for(lambda: len(c.recs[2].messages(0)) == 4)
        assert c.recs[2].messages(0)[-1] == big and bulk_blocks_sent(t0, 2) > 0
        assert all(not r.failures() for r in c.recs)


@pytest.mark.rdma
@needs_device
async def test_a_peer_without_a_bulk_region_gets_large_messages_over_tcp() -> None:
    dev = os.environ.get("RXE_DEV")
    ts = [
        RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, device=dev, **SMALL_BULK),
        RdmaTransport(1, ("127.0.0.1", 0), secret=SECRET, device=dev, bulk_threshold=0),
    ]
    recs = [Recorder(me=0), Recorder(me=1)]
    try:
        for t, r in zip(ts, recs, strict=True):
            await t.start(r)
        ts[0].add_peer(1, ts[1].address)
        ts[1].add_peer(0, ts[0].address)
        for t in ts:
            t.set_view(1, [0, 1], ROW)
        ts[0].push(1, 0, word(1), [1])
        ts[1].push(1, ROW, word(1), [0])
        await recs[1].wait_for(lambda: len(recs[1].pushes(0)) == 1)
        await recs[0].wait_for(lambda: len(recs[0].pushes(1)) == 1)
        big = os.urandom(200_000)
        ts[0].send(1, big)
        ts[0].push(1, 8, word(2), [1])
        ts[1].send(0, big)
        await recs[1].wait_for(lambda: len(recs[1].from_sender(0)) == 3)
        assert recs[1].from_sender(0)[1:] == [("msg", 0, big), ("push", 1, 0, 8, word(2))]
        await recs[0].wait_for(lambda: recs[0].messages(1) == [big])
        assert bulk_blocks_sent(ts[0], 1) == 0 and bulk_blocks_sent(ts[1], 0) == 0
        assert recs[0].failures() == recs[1].failures() == []
    finally:
        for t in ts:
            await t.close()


class _Counter:
    """A handler that only counts pushes and wakes one waiter (cheap, for measuring)."""

    def __init__(self) -> None:
        self.pushes = 0
        self.failures: list[str] = []
        self._want = 0
        self._fut: asyncio.Future[None] | None = None

    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        self.pushes += 1
        if self._fut is not None and self.pushes >= self._want and not self._fut.done():
            self._fut.set_result(None)

    def on_message(self, sender: int, payload: bytes) -> None:
        pass

    def on_failure(self, member: int, reason: str) -> None:
        self.failures.append(reason)

    async def until(self, n: int) -> None:
        if self.pushes >= n:
            return
        self._want = n
        self._fut = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(self._fut, support.WAIT)


@pytest.mark.rdma
@needs_device
@pytest.mark.parametrize("mode", ["rdma", "rdma-busy-poll", "tcp"])
async def test_measure_push_latency_and_bandwidth(mode: str) -> None:
    """Not an assertion about speed (emulated CPU): prints what this machine measures, with
    tcp over the guest's loopback for comparison."""
    ts: list[Any] = []
    for i in range(2):
        if mode == "tcp":
            ts.append(TcpTransport(i, ("127.0.0.1", 0), secret=SECRET))
        else:
            ts.append(
                RdmaTransport(
                    i,
                    ("127.0.0.1", 0),
                    secret=SECRET,
                    device=os.environ.get("RXE_DEV"),
                    inbox_bytes=1 << 20,
                    busy_poll=mode == "rdma-busy-poll",
                )
            )
    hs = [_Counter(), _Counter()]
    try:
        for t, h in zip(ts, hs, strict=True):
            await t.start(h)
        ts[0].add_peer(1, ts[1].address)
        ts[1].add_peer(0, ts[0].address)
        row = 1 << 20
        for t in ts:
            t.set_view(1, [0, 1], row)
        # warm up (connection setup), then ping-pong 8-byte pushes: one-way = round trip / 2
        ts[0].push(1, 0, word(0), [1])
        await hs[1].until(1)
        ts[1].push(1, row, word(0), [0])
        await hs[0].until(1)
        rtts = []
        for i in range(1, 301):
            t0 = time.perf_counter()
            ts[0].push(1, 0, word(i), [1])
            await hs[1].until(i + 1)
            ts[1].push(1, row, word(i), [0])
            await hs[0].until(i + 1)
            rtts.append(time.perf_counter() - t0)
        rtts.sort()
        # one-way bandwidth with 64 KiB pushes
        blob = os.urandom(64 << 10)
        n, base = 160, hs[1].pushes
        t0 = time.perf_counter()
        for i in range(n):
            ts[0].push(1, 0, blob, [1])
            if i % 8 == 7:
                await asyncio.sleep(0)
        await hs[1].until(base + n)
        bw = n * len(blob) / (time.perf_counter() - t0)
        # 8-byte push rate, 20 pushes per loop iteration
        m, base = 4000, hs[1].pushes
        t0 = time.perf_counter()
        for i in range(m):
            ts[0].push(1, (i % 64) * 8, word(i), [1])
            if i % 20 == 19:
                await asyncio.sleep(0)
        await hs[1].until(base + m)
        rate = m / (time.perf_counter() - t0)
        loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
        print(
            f"\nmeasured [{mode}, {loop}]: push one-way p50 {rtts[150] / 2 * 1e6:.0f} us"
            f" p90 {rtts[270] / 2 * 1e6:.0f} us; 64 KiB pushes {bw / 1e6:.1f} MB/s;"
            f" 8-byte pushes {rate:.0f}/s"
        )
        assert hs[0].failures == hs[1].failures == []
    finally:
        for t in ts:
            await t.close()


class _Bytes:
    """A handler that counts message bytes and wakes one waiter (for measuring)."""

    def __init__(self) -> None:
        self.got = 0
        self.bad = 0
        self.failures: list[str] = []
        self._want = 0
        self._fut: asyncio.Future[None] | None = None
        self.expect: bytes = b""

    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        pass

    def on_message(self, sender: int, payload: bytes) -> None:
        self.got += len(payload)
        self.bad += payload != self.expect
        if self._fut is not None and self.got >= self._want and not self._fut.done():
            self._fut.set_result(None)

    def on_failure(self, member: int, reason: str) -> None:
        self.failures.append(reason)

    async def until(self, n: int) -> None:
        if self.got >= n:
            return
        self._want = n
        self._fut = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(self._fut, 600)


@pytest.mark.rdma
@needs_device
@pytest.mark.parametrize("mode", ["rdma", "tcp"])
@pytest.mark.parametrize("mib", [16, 64])
async def test_measure_large_payload_throughput(mode: str, mib: int) -> None:
    """Not an assertion about speed (emulated CPU): one member sends ``mib`` MiB messages to
    two others; prints MB/s delivered (whole, intact messages), rdma bulk path vs tcp."""
    ts: list[Any] = []
    for i in range(3):
        if mode == "tcp":
            ts.append(TcpTransport(i, ("127.0.0.1", 0), secret=SECRET, max_frame=1 << 30))
        else:
            ts.append(
                RdmaTransport(i, ("127.0.0.1", 0), secret=SECRET, device=os.environ.get("RXE_DEV"))
            )
    hs = [_Bytes() for _ in range(3)]
    try:
        for t, h in zip(ts, hs, strict=True):
            await t.start(h)
        for t in ts:
            for u in ts:
                if u is not t:
                    t.add_peer(u.member_id, u.address)
            t.set_view(1, [0, 1, 2], ROW)
        payload = os.urandom(mib << 20)
        for h in hs:
            h.expect = payload
        ts[0].push(1, 0, word(0), [1, 2])  # set the links up first
        await asyncio.sleep(0.5)
        count = 3
        t0 = time.perf_counter()
        for _ in range(count):
            ts[0].send(1, payload)
            ts[0].send(2, payload)
        await hs[1].until(count * len(payload))
        await hs[2].until(count * len(payload))
        elapsed = time.perf_counter() - t0
        rate = 2 * count * len(payload) / elapsed / 1e6
        used = "" if mode == "tcp" else f", {bulk_blocks_sent(ts[0], 1)} rdma blocks to member 1"
        print(
            f"\nmeasured [{mode}, {loop_name()}, 3 members, {mib} MiB x {count} to 2 receivers]: "
            f"{rate:.1f} MB/s delivered ({elapsed:.2f} s{used})"
        )
        assert hs[1].bad == hs[2].bad == 0
        assert all(not h.failures for h in hs)
        if mode == "rdma":
            assert bulk_blocks_sent(ts[0], 1) >= count * (mib << 20) // ts[0].bulk_block
    finally:
        for t in ts:
            await t.close()


# -- separate processes ------------------------------------------------------------------------

SCRIPT = HERE / "rdma_member.py"


async def _spawn(mode: str, member: int, arg: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        loop_name(),
        mode,
        str(member),
        arg,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


def _decoded(rec: Recorder, sender: int) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for e in rec.from_sender(sender):
        if e[0] == "push":
            out.append(("push", e[1], e[3], e[4]))
        else:
            out.append(("msg", msgpack.unpackb(e[2], raw=False, strict_map_key=False)))
    return out


async def _parent() -> tuple[RdmaTransport, Recorder, str]:
    t = RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, device=os.environ.get("RXE_DEV"))
    rec = Recorder()
    await t.start(rec)
    t.set_view(1, [0, 1, 2], ROW)
    return t, rec, f"{t.address[0]}:{t.address[1]}:{SECRET.hex()}"


@pytest.mark.rdma
@needs_device
async def test_three_processes_exchange_in_order_over_rdma() -> None:
    t, rec, arg = await _parent()
    procs = [await _spawn("run", m, arg) for m in (1, 2)]
    try:
        async with asyncio.timeout(240):
            await rec.wait_for(lambda: all(rec.messages(m) for m in (1, 2)), timeout=120)
            peers: dict[int, object] = {m: list(t._tcp._links[m].addr or ()) for m in (1, 2)}
            peers[0] = list(t.address)
            for m in (1, 2):
                t.send(m, msgpack.packb(["go", peers]))
            reports: dict[int, list[object]] = {}

            def reported() -> bool:
                for m in (1, 2):
                    for e in _decoded(rec, m):
                        msg = e[1]
                        if e[0] == "msg" and isinstance(msg, list) and msg[0] == "report":
                            reports[m] = msg
                return len(reports) == 2

            await rec.wait_for(reported, timeout=200)
            for m in (1, 2):
                assert reports[m][1] is True, reports[m]
                got = [
                    e
                    for e in _decoded(rec, m)
                    if not (e[0] == "msg" and e[1][0] == "report")  # type: ignore[index]
                ]
                assert got == expected_from(m, 0)
                t.send(m, msgpack.packb(["bye"]))
            for p in procs:
                assert await p.wait() == 0, (await p.stderr.read()).decode() if p.stderr else ""
        assert rec.failures() == []
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await t.close()


@pytest.mark.rdma
@needs_device
async def test_sigkilled_rdma_member_is_reported() -> None:
    t, rec, arg = await _parent()
    proc = await _spawn("crash", 1, arg)
    try:
        async with asyncio.timeout(120):
            await rec.wait_for(lambda: bool(rec.messages(1)), timeout=120)
            t.send(1, msgpack.packb(["go", {0: list(t.address)}]))
            await rec.wait_for(lambda: any(b"crash-ready" in m for m in rec.messages(1)))
        assert len(rec.pushes(1)) == 50
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        t.push(1, 0, word(1), [1])  # into the void: must end in a report, not a hang
        await rec.wait_for(lambda: bool(rec.failures(1)))
        assert any("connection lost" in f or "rdma" in f for f in rec.failures(1))
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await t.close()


# -- a group over transport="rdma", one member SIGKILLed --------------------------------------



@pytest.mark.rdma
@needs_device
def test_group_over_rdma_survives_a_sigkilled_member() -> None:
    import rdma_group

    members, count, victim = 3, 300, 2
    ctx = multiprocessing.get_context("spawn")
    # One queue per member. They must not share one: a member SIGKILLed while it holds a
    # shared queue's write lock blocks every other member's reports for good.
    queues = [ctx.Queue() for _ in range(members)]
    ports = free_ports(members)
    base: dict[str, Any] = {
        "group": f"rdma-{os.getpid()}-{secrets.token_hex(3)}",
        "initial_members": members,
        "transport": "rdma",
        "heartbeat_ms": 20,
        "suspect_after_ms": 1500,
        "peers": {i: f"127.0.0.1:{p}" for i, p in enumerate(ports)},
        "secret": secrets.token_hex(16),
        "rdma_device": os.environ.get("RXE_DEV"),
        "log_level": "INFO",  # view installs and transport reports, shown if the test fails
    }
    procs = {}
    for i in range(members):
        fields = dict(base, member_id=i, listen=base["peers"][i])
        p = ctx.Process(target=rdma_group.child, args=(fields, queues[i], count, 200, 8, True))
        p.start()
        procs[i] = p
    t0 = time.monotonic()
    progress: dict[int, tuple[int, float]] = {}  # member -> (delivered, when it last grew)
    views: dict[int, list[tuple[int, list[int]]]] = {}
    reports: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    killed: set[int] = set()

    def pump(until: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until():
            msg = None
            for m, q in enumerate(queues):
                if m in killed:  # its pipe may end in a torn message: a read could block
                    continue
                with contextlib.suppress(queue_mod.Empty):
                    msg = q.get_nowait()
                    break
            if msg is None:
                time.sleep(0.02)
                continue
            if msg[0] == "progress":
                if msg[2] != progress.get(msg[1], (None, 0.0))[0]:
                    progress[msg[1]] = (msg[2], round(time.monotonic() - t0, 1))
            elif msg[0] == "view":
                views.setdefault(msg[1], []).append((msg[2], msg[3]))
            elif msg[0] == "done":
                reports[msg[1]] = msg[2]
            elif msg[0] == "error":
                errors[msg[1]] = msg[2]
        if not until():
            # a hang: every live child writes its threads' stacks to stderr (see rdma_group)
            for p in procs.values():
                if p.is_alive() and p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGUSR1)
            time.sleep(2)
        assert until(), (
            f"timed out at {time.monotonic() - t0:.1f} s: progress (delivered, at s) {progress},"
            f" views {views}, reports {sorted(reports)}, errors {errors}"
        )

    survivors = set(range(members)) - {victim}
    try:
        pump(lambda: max((n for n, _ in progress.values()), default=0) >= 100 or bool(errors), 180)
        assert not errors, errors
        pid = procs[victim].pid
        assert pid is not None
        killed.add(victim)
        os.kill(pid, signal.SIGKILL)
        pump(lambda: survivors <= reports.keys() or bool(errors), 180)
        assert not errors, errors
    finally:
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    got = [reports[m] for m in sorted(survivors)]
    print(f"\nrdma group: survivors {sorted(survivors)}, delivered {[r['delivered'] for r in got]}")
    assert len({r["digest"] for r in got}) == 1, "survivors' logs differ"
    for r in got:
        assert r["members"] == sorted(survivors)
        assert len(r["views"]) >= 2
        for m in survivors:
            assert r["per_sender"][m] == count, f"member {m}'s appends lost or duplicated"
        assert r["per_sender"].get(victim, 0) <= count


@pytest.mark.rdma
@needs_device
def test_a_process_joins_a_running_rdma_group_and_gets_state_and_ordered_traffic() -> None:
    """Connection data for a joiner is exchanged like for the founders (CONNECT over the
    authenticated channel when a link is first used in the new view)."""
    import rdma_group

    from derecho_async.cli import _Run

    # The founders stay until released: a slow machine (CI runs this in a VM) must not see them
    # leave before the joiner has made its calls (they lingered 40 s once, and that was too short).
    run = _Run(3, "rdma", 60, 64, 8, 3, heartbeat_ms=25, suspect_after_ms=3000, linger=600.0)
    got: list[tuple[object, ...]] = []
    try:
        deadline = time.monotonic() + 180
        while len(run.reports) < 3 and not run.errors and time.monotonic() < deadline:
            run.poll(0.2)
        assert len(run.reports) == 3, f"founders: {run.progress} {run.errors}"
        fields = dict(run.base, member_id=7, listen=f"127.0.0.1:{free_ports(1)[0]}")
        p = run.ctx.Process(target=rdma_group.joiner, args=(fields, run.q, 2 << 20))
        started = time.monotonic()
        p.start()
        deadline = time.monotonic() + 120
        while not got and time.monotonic() < deadline and 7 not in run.errors:
            got = [m for m in run.poll(0.2) if m[0] == "joined"]
        took = time.monotonic() - started
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    finally:
        run.release()
        run.finish(15)
    assert got, f"the joiner never reported; errors {run.errors}"
    joined = got[0][2]
    assert isinstance(joined, dict)
    print(f"\njoiner: reported {took:.1f} s after it was started")
    assert joined["view"] == [0, 1, 2, 7], f"after {took:.1f} s; errors {run.errors}"
    assert joined["replies"] == [[0, 1, 2, 7], [0, 1, 2, 7]]
    assert joined["at_join"] == run.reports[0]["delivered"]  # state transfer: the whole log
    assert joined["items"] == joined["at_join"] + 2 and joined["big_ok"]
    # every member holds the same log in the same order, the joiner's large item included
    assert set(joined["digests"]) == {joined["digest"]}
    # the joiner's large item reached the founders by the rdma bulk path
    print(f"\njoiner: bulk blocks sent per founder {joined['rdma_blocks']}")
    assert all(joined["rdma_blocks"].get(m, 0) >= 2 for m in (0, 1, 2)), joined["rdma_blocks"]
