"""Helpers shared by the rdma tests: whether this machine has a usable RDMA device, rdma
clusters for the transport conformance suite, and small helpers of the device tests.

The rdma test files import it as a top-level module (pytest puts tests/transport on sys.path).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from transport_support import SECRET, Cluster, Recorder, new_group

from derecho_async.transport.rdma import RdmaTransport, verbs
from derecho_async.transport.rdma.codec import MIN_INBOX


# -- is there a device? ------------------------------------------------------------------------
def _device_problem() -> str | None:
    try:
        pv = verbs.load_pyverbs()
        ctx, _ = verbs.choose_port(pv, os.environ.get("RXE_DEV"))
        ctx.close()
    except verbs.RdmaUnavailable as exc:
        return str(exc)
    except Exception as exc:  # a broken installation: say so, do not crash collection
        return f"{type(exc).__name__}: {exc}"
    return None


DEVICE_PROBLEM = _device_problem()
# marks a test that needs an RDMA device: skipped elsewhere, saying why
needs_device = pytest.mark.skipif(
    DEVICE_PROBLEM is not None,
    reason=f"no usable RDMA device ({DEVICE_PROBLEM}); run scripts/rdma-tests.sh (rxe-vm)",
)


def make_rdma_transport(
    kind: str,
    member: int,
    *,
    group: str,
    ring_bytes: int = 64 << 10,
    secret: bytes = SECRET,
    max_frame: int = 64 << 20,
    busy_poll: bool = False,
    bulk_threshold: int = 256 << 10,
    bulk_block: int = 1 << 20,
    bulk_slots: int = 8,
) -> Any:
    """An rdma transport of ``group`` (``kind`` must be ``"rdma"``) on the device named by
    ``RXE_DEV``, or the first active one."""
    assert kind == "rdma", kind
    return RdmaTransport(
        member,
        ("127.0.0.1", 0),
        secret=secret,
        max_frame=max_frame,
        device=os.environ.get("RXE_DEV"),
        inbox_bytes=max(MIN_INBOX, ring_bytes),
        busy_poll=busy_poll,
        bulk_threshold=bulk_threshold,
        bulk_block=bulk_block,
        bulk_slots=bulk_slots,
    )


def rdma_cluster_factory(busy_poll: bool = False) -> Callable[..., Any]:
    """A ``transport_support.cluster`` for ``kind="rdma"``: each member linked to every other."""

    @contextlib.asynccontextmanager
    async def rdma_cluster(kind: str, n: int = 3, **opts: Any) -> AsyncIterator[Cluster]:
        group = new_group()
        ts = [
            make_rdma_transport(kind, i, group=group, busy_poll=busy_poll, **opts) for i in range(n)
        ]
        recs = [Recorder(me=i) for i in range(n)]
        started = []
        try:
            for t, r in zip(ts, recs, strict=True):
                await t.start(r)
                started.append(t)
            for t in ts:
                for u in ts:
                    if u is not t:
                        t.add_peer(u.member_id, u.address)
            yield Cluster(group, ts, recs)
        finally:
            for t in ts:
                await t.close()

    return rdma_cluster


@contextlib.asynccontextmanager
async def rdma_pair(n: int = 3, **kw: Any) -> AsyncIterator[Cluster]:
    """``n`` rdma transports linked to each other; ``kw`` as for :func:`make_rdma_transport`."""
    async with rdma_cluster_factory(kw.pop("busy_poll", False))("rdma", n, **kw) as c:
        yield c


def word(i: int) -> bytes:
    """``i`` as an 8-byte little-endian word (a push payload)."""
    return i.to_bytes(8, "little")


def bulk_blocks_sent(t: Any, peer: int) -> int:
    """How many bulk blocks transport ``t`` has sent to ``peer`` on its current link."""
    ep = t._conns.links[peer].ep
    return 0 if ep is None or ep.btx is None else int(ep.btx.seq)


def loop_name() -> str:
    """The running event loop's kind: ``uvloop`` or ``asyncio``."""
    return "uvloop" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "asyncio"
