"""Mutual TLS with member ids bound to certificates (issue 26, finding 2), over real sockets.

Certificates come from ``derecho_async.certs`` (what ``derecho-async certs`` runs). A holder of
a valid certificate for one member can speak as that member only; a peer without a
certificate, with one of another CA or of another group is refused; a dialler refuses an address
whose certificate names another member than the one it dialled.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

import pytest
from transport_support import SECRET, Recorder

import derecho_async as da
from derecho_async.certs import MemberFiles, issue
from derecho_async.errors import ConfigError
from derecho_async.transport import registry
from derecho_async.transport.tcp import TcpTransport
from derecho_async.transport.tcp.handshake import client_handshake
from derecho_async.transport.tcp.identity import (
    certified_by_file,
    contexts,
    member_uri,
    parse_member_uri,
)

GROUP = "tls-g"
ROW = 64


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TcpTransport, "retry_delays", (0.0, 0.01, 0.02))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, MemberFiles]:
    return {f.member_id: f for f in issue(tmp_path_factory.mktemp("ca"), GROUP, range(4))}


def member(files: MemberFiles, claims: int | None = None, **kw: object) -> TcpTransport:
    """A transport claiming ``claims`` (default: the certificate's member) that presents
    ``files``' certificate, in the TLS mode without a secret."""
    server, client = contexts(str(files.cert), str(files.key), str(files.ca))
    return TcpTransport(
        files.member_id if claims is None else claims,
        ("127.0.0.1", 0),
        secret=None,
        group=GROUP,
        ssl_server=server,
        ssl_client=client,
        cert_ids=True,
        **kw,  # type: ignore[arg-type]
    )


async def tls_dial(
    target: TcpTransport, ctx: ssl.SSLContext, claimed: int, secret: bytes = b""
) -> tuple[str, str]:
    """Dial ``target`` over TLS with ``ctx`` and run the handshake claiming ``claimed``;
    (verdict, why) of the acceptor."""
    host, port = target.address
    reader, writer = await asyncio.open_connection(host, port, ssl=ctx, server_hostname=host)
    try:
        _sid, _addr, verdict, why = await asyncio.wait_for(
            client_handshake(
                reader, writer, secret=secret, my_id=claimed, my_addr=("127.0.0.1", 1),
                expect=target.member_id, group=GROUP,
            ),
            10,
        )
        return verdict, why
    finally:
        writer.close()


def client_ctx(files: MemberFiles) -> ssl.SSLContext:
    return contexts(str(files.cert), str(files.key), str(files.ca))[1]


def test_member_uris_round_trip_and_reject_lookalikes() -> None:
    assert parse_member_uri(member_uri("kv", 7)) == ("kv", 7)
    for bad in ("derecho-async://kv/member/07", "derecho-async://kv/member/-1",
                "derecho-async://kv/member/1/x", "derecho-async://k v/member/1",
                "https://kv/member/1", f"derecho-async://kv/member/{1 << 63}"):
        assert parse_member_uri(bad) is None, bad


def test_issued_certificates_name_their_member(certs: dict[int, MemberFiles]) -> None:
    for m, files in certs.items():
        assert certified_by_file(str(files.cert)) == [(GROUP, m)]
        assert files.key.stat().st_mode & 0o077 == 0  # private keys: owner only


async def test_members_with_certificates_talk_without_a_secret(
    certs: dict[int, MemberFiles],
) -> None:
    recs = [Recorder(me=0), Recorder(me=1)]
    ts = [member(certs[0]), member(certs[1])]
    for t, r in zip(ts, recs, strict=True):
        await t.start(r)
    try:
        ts[0].add_peer(1, ts[1].address)
        for t in ts:
            t.set_view(1, [0, 1], ROW)
        ts[0].send(1, b"from zero")
        ts[1].send(0, b"from one")
        await recs[1].wait_for(lambda: recs[1].messages(0) == [b"from zero"])
        await recs[0].wait_for(lambda: recs[0].messages(1) == [b"from one"])
        conn = ts[0]._links[1].conn
        assert conn is not None
        assert conn.writer.get_extra_info("peercert")["subjectAltName"] == (
            ("URI", member_uri(GROUP, 1)),
        )
        assert not recs[0].failures() and not recs[1].failures()
    finally:
        for t in ts:
            await t.close()


async def test_a_certificate_holder_cannot_claim_another_members_id(
    certs: dict[int, MemberFiles], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="derecho_async.transport")
    rec = Recorder(me=0)
    target = member(certs[0])
    await target.start(rec)
    try:
        # member 3's certificate, claiming to be member 1 (and, worse, the target itself)
        for claimed in (1, 0):
            verdict, why = await tls_dial(target, client_ctx(certs[3]), claimed)
            assert verdict == "reject"
            assert "certificate names member 3" in why
        assert target.refusals.counts["forged id"] == 2
        assert target._links.get(1) is None or target._links[1].conn is None
        assert any("claiming member 1" in r.getMessage() for r in caplog.records)
        # the same certificate speaking as itself is accepted
        verdict, _why = await tls_dial(target, client_ctx(certs[3]), 3)
        assert verdict == "accept"
        assert rec.failures(1) == []
    finally:
        await target.close()


async def test_the_secret_does_not_let_a_holder_forge_an_id_in_the_tls_mode(
    certs: dict[int, MemberFiles],
) -> None:
    server, client = contexts(str(certs[0].cert), str(certs[0].key), str(certs[0].ca))
    target = TcpTransport(
        0, ("127.0.0.1", 0), secret=SECRET, group=GROUP, ssl_server=server, ssl_client=client,
        cert_ids=True,
    )
    await target.start(Recorder(me=0))
    try:
        verdict, why = await tls_dial(target, client_ctx(certs[2]), 1, secret=SECRET)
        assert (verdict, "certificate names member 2" in why) == ("reject", True)
    finally:
        await target.close()


async def test_peers_without_a_certificate_of_this_group_and_ca_are_refused(
    certs: dict[int, MemberFiles], tmp_path: Path
) -> None:
    rec = Recorder(me=0)
    target = member(certs[0])
    await target.start(rec)
    try:
        # no certificate at all: the TLS handshake itself fails (the client learns at its read)
        bare = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs[0].ca))
        bare.check_hostname = False
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await tls_dial(target, bare, 1)
        # a certificate for member 1 from another CA
        (stranger,) = issue(tmp_path / "other-ca", GROUP, [1])
        other = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(certs[0].ca))
        other.check_hostname = False
        other.load_cert_chain(str(stranger.cert), str(stranger.key))
        with pytest.raises((ssl.SSLError, ConnectionError, asyncio.IncompleteReadError)):
            await tls_dial(target, other, 1)
        # a certificate for member 1 of another group, from the group's own CA
        same_ca = tmp_path / "same-ca"
        same_ca.mkdir()
        for name in ("ca.pem", "ca.key"):
            (same_ca / name).write_bytes((certs[0].ca.parent / name).read_bytes())
        (elsewhere,) = issue(same_ca, "another-group", [1])
        verdict, why = await tls_dial(target, client_ctx(elsewhere), 1)
        assert verdict == "reject" and "it is for group 'another-group'" in why
        counts = target.refusals.counts
        assert counts["TLS handshake failed"] + counts["ended during handshake"] >= 1
        assert counts["authentication failed"] >= 1
        assert target._links.get(1) is None or target._links[1].conn is None
    finally:
        await target.close()


async def test_a_dialler_refuses_an_address_holding_another_members_certificate(
    certs: dict[int, MemberFiles],
) -> None:
    ra, rb = Recorder(me=0), Recorder(me=1)
    a = member(certs[0])
    impostor = member(certs[2], claims=1)  # listens where a expects member 1
    await a.start(ra)
    await impostor.start(rb)
    try:
        a.add_peer(1, impostor.address)
        a.send(1, b"for member 1 only")
        await ra.wait_for(lambda: bool(ra.failures(1)))
        assert "certificate at" in ra.failures(1)[0]
        assert "names member 2, not member 1" in ra.failures(1)[0]
        assert rb.messages() == []
    finally:
        await a.close()
        await impostor.close()


def test_cert_ids_need_contexts_that_require_peer_certificates(
    certs: dict[int, MemberFiles],
) -> None:
    plain_server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    plain_server.load_cert_chain(str(certs[0].cert), str(certs[0].key))
    _server, client = contexts(str(certs[0].cert), str(certs[0].key), str(certs[0].ca))
    for kw in ({}, {"ssl_server": plain_server, "ssl_client": client}):
        with pytest.raises(ConfigError) as info:
            TcpTransport(0, ("127.0.0.1", 0), secret=None, cert_ids=True, **kw)  # type: ignore[arg-type]
        assert info.value.key == "cert_ids"
    with pytest.raises(ConfigError):  # without certificates, a secret is needed
        TcpTransport(0, ("127.0.0.1", 0), secret=None)


@pytest.mark.parametrize("transport", ["tcp", "rdma"])
def test_a_member_whose_certificate_names_another_member_is_a_config_error(
    certs: dict[int, MemberFiles], transport: str
) -> None:
    files = certs[2]
    config = da.Config(
        group=GROUP, member_id=1, transport=transport,
        tls_cert=str(files.cert), tls_key=str(files.key), tls_ca=str(files.ca),
    )
    with pytest.raises(ConfigError) as info:
        registry.kind(transport).build(config)
    assert info.value.key == "tls_cert"
    assert "names member 1 of group 'tls-g'" in info.value.expected
    wrong_group = da.Config(
        group="other", member_id=2, transport="tcp",
        tls_cert=str(files.cert), tls_key=str(files.key), tls_ca=str(files.ca),
    )
    with pytest.raises(ConfigError, match="it names"):
        registry.kind("tcp").build(wrong_group)
