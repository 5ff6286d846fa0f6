"""The transport registry: names, errors, and a transport added by one entry."""

from __future__ import annotations

import asyncio

import pytest

import derecho_async as da
from derecho_async.transport import registry
from derecho_async.transport.registry import TransportKind


class _Log(da.Actor):
    def __init__(self) -> None:
        self.items: list[bytes] = []

    @da.ordered
    def put(self, item: bytes) -> int:
        self.items.append(item)
        return len(self.items)


def test_the_built_in_transports_and_what_they_provide() -> None:
    assert registry.names() == ("shm", "tcp", "rdma", "sim")
    assert registry.kind("shm").one_host and registry.kind("shm").bulk_plane is not None
    assert registry.kind("tcp").networked and registry.kind("rdma").networked
    assert registry.kind("sim").in_process and registry.kind("sim").bulk_plane is None
    with pytest.raises(da.UsageError, match="no transport 'udp'; known: shm, tcp, rdma, sim"):
        registry.kind("udp")
    with pytest.raises(da.ConfigError, match="transport"):
        da.Config(group="g", member_id=0, transport="udp")
    with pytest.raises(da.UsageError, match="registered already"):
        registry.register(TransportKind("shm", "again", make="x:y"))
    with pytest.raises(da.UsageError, match="built in"):
        registry.unregister("tcp")


async def test_a_transport_added_by_one_registry_entry_carries_a_group() -> None:
    """What adding a transport takes: its module (here the loopback fabric's factory) and one
    TransportKind; Config accepts the name and a Group runs over it."""
    registry.register(TransportKind(
        "loop-demo", "members of one process on a loopback fabric (a test's)",
        make="derecho_async.transport.loopback:from_config", in_process=True))
    try:
        assert "loop-demo" in registry.names()
        gs = await asyncio.gather(*(
            da.Group.join(da.Config(group="reg-demo", member_id=i, initial_members=3,
                                    transport="loop-demo", heartbeat_ms=5,
                                    suspect_after_ms=500), actors=[_Log], timeout=10)
            for i in range(3)))
        try:
            replies = await gs[0].subgroup(_Log).put(b"x")
            assert sorted(replies) == [0, 1, 2]
            assert all(g.local(_Log).items == [b"x"] for g in gs)
        finally:
            for g in gs:
                await g.leave()
    finally:
        registry.unregister("loop-demo")
    with pytest.raises(da.ConfigError):
        da.Config(group="g", member_id=0, transport="loop-demo")
