"""The rdma transport as a whole: its settings, a clear error without a device, and, marked
``rdma``, on a real device: the whole transport conformance suite over rdma (``check_transport`` with an rdma
factory, busy polling too), per-peer inbox keys, injected queue-pair
faults and a restarted member's fresh link.

The device tests run inside rxe-vm (Soft-RoCE; ``scripts/rdma-tests.sh``); outside a machine
with an RDMA device they skip, saying why. The other device tests: test_rdma_bulk_device.py,
test_rdma_measure.py, test_rdma_processes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import cast

import pytest
from member_process import ROW
from rdma_support import (
    DEVICE_PROBLEM,
    make_rdma_transport,
    needs_device,
    rdma_pair,
    word,
)
from transport_support import SECRET, Recorder, dial_as

import derecho_async as da
from derecho_async.errors import ConfigError
from derecho_async.testing.conformance import CASES, TransportFactory, check_transport
from derecho_async.transport import registry
from derecho_async.transport.base import Transport
from derecho_async.transport.rdma import RdmaTransport, verbs
from derecho_async.transport.rdma.codec import MIN_BULK_BLOCK
from derecho_async.transport.tcp import TcpTransport
from derecho_async.transport.tcp.framing import F_MSG, FRAME


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


def _from_config(**kw: object) -> RdmaTransport:
    config = da.Config(
        group="rdma-adm", member_id=0, transport="rdma", secret=SECRET.decode(), **kw  # type: ignore[arg-type]
    )
    t = registry.kind("rdma").build(config)
    assert isinstance(t, RdmaTransport)
    return t


def test_the_channel_admits_the_members_of_the_views_it_is_given() -> None:
    """Issue 26: the runtime's rdma channel bounds strangers as tcp does; the views the rdma
    transport is given admit their members on the channel too."""
    t = _from_config()
    channel = t._tcp
    assert channel.admission
    assert not channel._is_admitted(5)
    t.set_view(1, [0, 5], ROW)
    assert channel._is_admitted(5) and not channel._is_admitted(6)


@pytest.mark.rdma
@needs_device
async def test_a_stranger_on_the_rdma_channel_may_send_only_handshake_sized_frames() -> None:
    rec = Recorder()
    t = _from_config(listen="127.0.0.1:0")
    await t.start(rec)
    try:
        t.set_view(1, [0, 1], ROW)
        reader, writer = await dial_as(t, 42, group="rdma-adm")
        writer.write(FRAME.pack(F_MSG, 0, 0, 0, 1 << 30))  # announces 1 GiB
        async with asyncio.timeout(10):
            rest = await reader.read()
            while rest:
                rest = await reader.read()
        writer.close()
        assert t._tcp.refusals.counts["bad frame before admission"] == 1
        assert rec.messages() == []
    finally:
        await t.close()


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


class RdmaFactory(TransportFactory):
    """rdma members for the conformance suite, as the device tests make them."""

    def __init__(self, busy_poll: bool) -> None:
        self.busy_poll = busy_poll

    def make(self, group: str, member: int, *, small_buffers: bool = False) -> Transport:
        t: Transport = make_rdma_transport("rdma", member, group=group, busy_poll=self.busy_poll)
        return t

    def connect(self, transports: Sequence[Transport]) -> None:
        for t in transports:
            for u in transports:
                if u is not t:
                    assert isinstance(u, RdmaTransport)
                    t.add_peer(u.member_id, u.address)


CONFORMANCE = list(CASES)


async def _run_case(case: str, monkeypatch: pytest.MonkeyPatch, busy: bool) -> None:
    if case == "send_to_absent_member_reports_failure":  # the channel gives up dialling soon
        monkeypatch.setattr(TcpTransport, "retry_delays", (0.0, 0.01, 0.02))
    await check_transport(RdmaFactory(busy), only=[case])


@pytest.mark.rdma
@needs_device
@pytest.mark.parametrize("case", CONFORMANCE)
async def test_conformance_over_rdma(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    await _run_case(case, monkeypatch, busy=False)


@pytest.mark.rdma
@needs_device
@pytest.mark.parametrize(
    "case",
    [
        "fifo_per_link_with_interleaved_messages",
        "big_messages_and_bursts_beyond_ring_capacity",
    ],
)
async def test_conformance_over_rdma_busy_poll(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _run_case(case, monkeypatch, busy=True)


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
