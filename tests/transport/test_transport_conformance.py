"""The conformance suite (derecho_async.testing.conformance) over every registered transport that
can run here, built as the runtime builds them (``registry.kind(name).build(config)``), on stock
asyncio and uvloop (this directory's loop factories)."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import pytest

import derecho_async as da
from derecho_async.certs import issue
from derecho_async.testing.conformance import CASES, TransportFactory, check_transport
from derecho_async.transport import Transport, registry

SECRET = "dasec1.qY100St0MInBnvRMJ00BpqDEDBOPWq8j2VzSXLIHVE4.NO8v55"

#: registered transports this machine cannot run: rdma needs an RDMA device (it runs the suite
#: inside rxe-vm, tests/transport/test_rdma.py)
ELSEWHERE = {"rdma"}
KINDS = [name for name in registry.names() if name not in ELSEWHERE]


class RegistryFactory(TransportFactory):
    """Members of transport ``name`` as a :class:`da.Config` describes them. Networked kinds
    listen on a free local port and learn each other's addresses once started."""

    def __init__(self, name: str) -> None:
        self.kind = registry.kind(name)

    def make(self, group: str, member: int, *, small_buffers: bool = False) -> Transport:
        config = da.Config(
            group=group,
            member_id=member,
            transport=self.kind.name,
            secret=SECRET if self.kind.networked else None,
        )
        return self.kind.build(config)

    def connect(self, transports: Sequence[Transport]) -> None:
        if not self.kind.networked:
            return
        for t in transports:
            for u in transports:
                if u is not t:
                    t.add_peer(u.member_id, getattr(u, "address"))  # noqa: B009


class ShmFactory(RegistryFactory):
    """shm: the smallest rings where asked, a peer given up on after 0.2 s without a ring, and
    every segment of the group gone after close."""

    def make(self, group: str, member: int, *, small_buffers: bool = False) -> Transport:
        from derecho_async.transport.shm import ShmTransport

        if small_buffers:
            return ShmTransport(group, member, ring_bytes=64 << 10)
        return super().make(group, member)

    def make_unreachable(self, transport: Transport, member: int) -> None:
        transport.unreachable_after = 0.2  # type: ignore[attr-defined]

    def check_open(self, group: str, transports: Sequence[Transport]) -> None:
        from derecho_async.transport.shm import ShmTransport

        n = len(transports)
        assert len(ShmTransport.segments(group)) == n * (n - 1)  # a ring per link

    def check_released(self, group: str) -> None:
        from derecho_async.transport.shm import ShmTransport

        assert ShmTransport.segments(group) == []


class TcpFactory(RegistryFactory):
    """tcp: an unreachable peer is a local port nobody listens on, dialled with short retries;
    after close nobody listens on the members' ports."""

    drops_offending_links = True

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._ports: dict[str, list[int]] = {}

    def make_unreachable(self, transport: Transport, member: int) -> None:
        transport.retry_delays = (0.0, 0.01, 0.02)  # type: ignore[attr-defined]
        with socket.socket() as sock:  # a port nobody listens on
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        transport.add_peer(member, ("127.0.0.1", port))

    def check_open(self, group: str, transports: Sequence[Transport]) -> None:
        self._ports[group] = [getattr(t, "address")[1] for t in transports]  # noqa: B009

    def check_released(self, group: str) -> None:
        for port in self._ports.pop(group, []):  # nobody listens on the ports any more
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen()


class TlsFactory(TcpFactory):
    """tcp in the TLS mode, without a secret: each member's certificate (made for the case's
    group by ``derecho_async.certs``, under ``directory``) names its id."""

    def __init__(self, directory: Path) -> None:
        super().__init__("tcp")
        self.directory = directory

    def make(self, group: str, member: int, *, small_buffers: bool = False) -> Transport:
        (files,) = issue(self.directory / group, group, [member])
        config = da.Config(
            group=group,
            member_id=member,
            transport="tcp",
            tls_cert=str(files.cert),
            tls_key=str(files.key),
            tls_ca=str(files.ca),
        )
        return self.kind.build(config)


#: what Config does not say about a transport, for the kinds that need it here
TUNED: dict[str, type[RegistryFactory]] = {"shm": ShmFactory, "tcp": TcpFactory}


def factory_for(name: str) -> RegistryFactory:
    return TUNED.get(name, RegistryFactory)(name)


def test_every_registered_transport_is_checked_here_or_elsewhere() -> None:
    assert set(KINDS) | ELSEWHERE == set(registry.names())
    assert {"shm", "tcp", "sim"} <= set(KINDS)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
async def test_conformance(kind: str, case: str) -> None:
    await check_transport(factory_for(kind), only=[case])


@pytest.mark.parametrize("case", CASES)
async def test_conformance_of_tcp_with_ids_bound_to_certificates(
    case: str, tmp_path: Path
) -> None:
    await check_transport(TlsFactory(tmp_path), only=[case])
