"""Helpers shared by the transport tests: a recording handler and small in-process clusters."""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from derecho_async.transport import Transport
from derecho_async.transport.loopback import LoopbackFabric
from derecho_async.transport.shm import ShmTransport
from derecho_async.transport.tcp import TcpTransport

KINDS = ["loopback", "shm", "tcp"]
SECRET = b"conformance-secret"
WAIT = 30.0  # only bounds a hang; tests never assert speed


@dataclass
class Recorder:
    """A TransportHandler that records everything, in order, and lets tests await conditions."""

    me: int = -1
    events: list[tuple[object, ...]] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        self.events.append(("push", view_id, sender, offset, data))
        self._changed.set()

    def on_message(self, sender: int, payload: bytes) -> None:
        self.events.append(("msg", sender, payload))
        self._changed.set()

    def on_failure(self, member: int, reason: str) -> None:
        self.events.append(("fail", member, reason))
        self._changed.set()

    def pushes(self, sender: int | None = None) -> list[tuple[int, int, int, bytes]]:
        return [
            (e[1], e[2], e[3], e[4])  # type: ignore[misc]
            for e in self.events
            if e[0] == "push" and (sender is None or e[2] == sender)
        ]

    def messages(self, sender: int | None = None) -> list[bytes]:
        return [
            e[2]  # type: ignore[misc]
            for e in self.events
            if e[0] == "msg" and (sender is None or e[1] == sender)
        ]

    def failures(self, member: int | None = None) -> list[str]:
        return [
            e[2]  # type: ignore[misc]
            for e in self.events
            if e[0] == "fail" and (member is None or e[1] == member)
        ]

    def from_sender(self, sender: int) -> list[tuple[object, ...]]:
        """Pushes and messages from ``sender``, in arrival order."""
        return [
            e
            for e in self.events
            if (e[0] == "push" and e[2] == sender) or (e[0] == "msg" and e[1] == sender)
        ]

    async def wait_for(self, pred: Callable[[], bool], timeout: float = WAIT) -> None:
        async with asyncio.timeout(timeout):
            while not pred():
                self._changed.clear()
                await self._changed.wait()


@dataclass
class Cluster:
    kind: str
    group: str
    transports: list[Transport]
    recs: list[Recorder]

    def __getitem__(self, i: int) -> Transport:
        return self.transports[i]

    def set_view(
        self, view_id: int, members: list[int], row_bytes: int, at: list[int] | None = None
    ) -> None:
        for i in at if at is not None else range(len(self.transports)):
            self.transports[i].set_view(view_id, members, row_bytes)

    async def close(self) -> None:
        for t in self.transports:
            await t.close()


def new_group() -> str:
    return "t" + uuid.uuid4().hex[:12]


def make_transport(
    kind: str,
    member: int,
    *,
    group: str,
    fabric: LoopbackFabric | None = None,
    ring_bytes: int = 64 << 10,
    secret: bytes = SECRET,
    max_frame: int = 64 << 20,
) -> Transport:
    if kind == "loopback":
        assert fabric is not None
        return fabric.transport(member)
    if kind == "shm":
        return ShmTransport(group, member, ring_bytes=ring_bytes)
    if kind == "tcp":
        return TcpTransport(member, ("127.0.0.1", 0), secret=secret, max_frame=max_frame)
    raise AssertionError(kind)


@contextlib.asynccontextmanager
async def cluster(kind: str, n: int = 3, **opts: object) -> AsyncIterator[Cluster]:
    """``n`` started transports (members 0..n-1) of one group, all knowing each other."""
    group = new_group()
    fabric = LoopbackFabric()
    ts = [make_transport(kind, i, group=group, fabric=fabric, **opts) for i in range(n)]  # type: ignore[arg-type]
    recs = [Recorder(me=i) for i in range(n)]
    for t, r in zip(ts, recs, strict=True):
        await t.start(r)
    if kind == "tcp":
        for t in ts:
            for u in ts:
                if u is not t:
                    assert isinstance(u, TcpTransport)
                    t.add_peer(u.member_id, u.address)
    c = Cluster(kind, group, ts, recs)
    try:
        yield c
    finally:
        await c.close()
        if kind == "shm":
            assert ShmTransport.segments(group) == []


def open_fds() -> set[str]:
    """This process's open sockets and shared-memory files (libuv opens /dev/null lazily once)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("socket:", "/dev/shm/")):
            out.add(f"{fd}->{target}")
    return out
