"""Measurements on a device (marked ``rdma``), printed, never asserted (the CPU is emulated):
push latency, bandwidth and rate, and large-message throughput, rdma against tcp."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import transport_support as support
from member_process import ROW
from rdma_support import bulk_blocks_sent, loop_name, needs_device, word
from transport_support import SECRET

from derecho_async.transport.rdma import RdmaTransport
from derecho_async.transport.tcp import TcpTransport


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
