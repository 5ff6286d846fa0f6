"""The rdma bulk path on a device (marked ``rdma``): large messages by RDMA into the peer's
bulk region keep link order with small messages and pushes, a transfer broken mid-way is
reported and never delivered, hostile BULK records, keys dropped when a member leaves the
view, and a peer without a bulk region. Its bookkeeping without a device: test_rdma_bulk.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Any, TypedDict

import pytest
import transport_support as support
from member_process import ROW
from rdma_support import bulk_blocks_sent, needs_device, rdma_pair, word
from transport_support import SECRET, Recorder

from derecho_async.transport.rdma import RdmaTransport
from derecho_async.transport.rdma.rings import R_BULK, REC, RF_FINAL


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
