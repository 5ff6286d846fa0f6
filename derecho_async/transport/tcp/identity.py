"""Member identity from certificates: mutual TLS where each certificate names one member.

Theory of operation (docs/DESIGN.md §5.3). In the TLS mode every member holds a certificate
signed by the group's CA whose subject alternative name carries the URI
``derecho-async://<group>/member/<id>`` (:func:`member_uri`; ``derecho-async certs`` makes
them). Both sides of every stream present and verify a certificate against the CA
(:func:`contexts`), and the member id a peer claims in the handshake must be the one its
certificate names (:func:`certified_member`): holding the group's CA-signed certificate for
member 3 lets a process speak as member 3 and as nobody else. An external client's certificate
carries ``derecho-async://<group>/client/<name>`` instead (:func:`client_uri`): a member's client
port requires one (:func:`certified_client`), and a member port refuses it, since it names no
member. Only the standard library's ``ssl`` is needed here; making certificates needs
``cryptography`` (:mod:`derecho_async.certs`).
"""

from __future__ import annotations

import re
import ssl
from typing import Any, Final

from derecho_async.transport.tcp.handshake import AuthError

__all__ = [
    "URI_SCHEME",
    "certified_by_file",
    "certified_client",
    "certified_member",
    "client_context",
    "client_uri",
    "contexts",
    "member_uri",
    "parse_client_uri",
    "parse_member_uri",
    "requires_peer_certificates",
]

URI_SCHEME: Final = "derecho-async"
_URI = re.compile(r"derecho-async://([A-Za-z0-9_.-]{1,64})/member/(0|[1-9][0-9]{0,18})")
_CLIENT_URI = re.compile(r"derecho-async://([A-Za-z0-9_.-]{1,64})/client/([A-Za-z0-9_.-]{1,64})")
_MAX_ID = (1 << 63) - 1


def member_uri(group: str, member_id: int) -> str:
    """The URI a member's certificate carries as its subject alternative name."""
    return f"{URI_SCHEME}://{group}/member/{member_id}"


def parse_member_uri(uri: str) -> tuple[str, int] | None:
    """(group, member id) of a member URI, or None if ``uri`` is not one."""
    m = _URI.fullmatch(uri)
    if m is None:
        return None
    member = int(m.group(2))
    return (m.group(1), member) if member <= _MAX_ID else None


def client_uri(group: str, name: str) -> str:
    """The URI an external client's certificate carries as its subject alternative name."""
    return f"{URI_SCHEME}://{group}/client/{name}"


def parse_client_uri(uri: str) -> tuple[str, str] | None:
    """(group, client name) of a client URI, or None if ``uri`` is not one."""
    m = _CLIENT_URI.fullmatch(uri)
    return None if m is None else (m.group(1), m.group(2))


def certified_client(peercert: Any, group: str) -> str:
    """The client name that a verified peer certificate names for ``group``;
    :class:`AuthError` if it names none (a member's certificate included) or several."""
    if not isinstance(peercert, dict) or not peercert:
        raise AuthError("authentication failed: the client presented no verified certificate")
    named: set[str] = set()
    for kind, value in peercert.get("subjectAltName", ()):
        if kind == "URI" and isinstance(value, str):
            parsed = parse_client_uri(value)
            if parsed is not None and parsed[0] == group:
                named.add(parsed[1])
    if len(named) == 1:
        return named.pop()
    if named:
        raise AuthError("authentication failed: the certificate names several clients")
    raise AuthError(f"authentication failed: the certificate names no client of group "
                    f"{group!r} (make one with `derecho-async certs --clients`)")


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The TLS context of a member's client port: TLS 1.3, the member's certificate, and a
    client certificate asked for and verified against ``ca``. It is required by the port (with
    :func:`certified_client`) after TLS, in the handshake, so that a client without one is told
    why instead of seeing its stream cut (TLS 1.3 checks the client's certificate only after
    the client considers the handshake done)."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    server.verify_mode = ssl.CERT_OPTIONAL
    server.load_cert_chain(cert, key)
    return server


def certified_member(peercert: Any, group: str) -> int:
    """The member id that a verified peer certificate (``getpeercert()``'s dict) names for
    ``group``; :class:`AuthError` if it names none, several, or only members of other groups."""
    if not isinstance(peercert, dict) or not peercert:
        raise AuthError("authentication failed: the peer presented no verified certificate")
    named: set[int] = set()
    others: set[str] = set()
    for kind, value in peercert.get("subjectAltName", ()):
        if kind != "URI" or not isinstance(value, str):
            continue
        parsed = parse_member_uri(value)
        if parsed is None:
            continue
        if parsed[0] == group:
            named.add(parsed[1])
        else:
            others.add(parsed[0])
    if len(named) == 1:
        return named.pop()
    if named:
        raise AuthError(
            f"authentication failed: the peer's certificate names several members {sorted(named)}"
        )
    where = f" (it is for group {sorted(others)[0]!r})" if others else ""
    raise AuthError(
        f"authentication failed: the peer's certificate names no member of group {group!r}{where}"
    )


def contexts(cert: str, key: str, ca: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The (server, client) TLS contexts of a member: TLS 1.3, this member's certificate on
    both sides, and the peer's certificate required and verified against ``ca`` on both sides
    (no host-name check: the member id in the certificate is what is checked)."""
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    client.check_hostname = False
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(cert, key)
    return server, client


def requires_peer_certificates(server: ssl.SSLContext | None, client: ssl.SSLContext | None) -> bool:
    """Whether both contexts exist and require a verified certificate of the peer."""
    return (
        server is not None
        and client is not None
        and server.verify_mode == ssl.CERT_REQUIRED
        and client.verify_mode == ssl.CERT_REQUIRED
    )


def certified_by_file(path: str) -> list[tuple[str, int]] | None:
    """The (group, member id) pairs the PEM certificate in ``path`` names, or None where that
    cannot be told here (no ``cryptography`` package, or the file does not parse: loading it
    into a TLS context then reports why)."""
    try:
        from cryptography import x509
    except ImportError:
        return None
    try:
        with open(path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    except (OSError, ValueError):
        return None
    uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
    return [p for p in (parse_member_uri(u) for u in uris) if p is not None]
