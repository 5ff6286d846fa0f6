"""Making a group's CA and member certificates for the TLS mode (``derecho-async certs``).

Theory of operation (docs/DESIGN.md §5.3): a group CA (an EC P-256 key and a self-signed CA
certificate) signs one certificate per member whose subject alternative name is the member's
URI (:func:`derecho_async.transport.tcp.identity.member_uri`); the transport binds the id a
peer claims to that URI. A directory holds ``ca.pem``/``ca.key`` and
``member-<id>.pem``/``member-<id>.key``; issuing into a directory that already holds a CA
reuses it, so certificates for joiners can be made later. Private keys are written with mode
0600 and never overwritten unless asked. The same CA signs external clients' certificates
(``client-<name>.pem``/``.key``, naming ``derecho-async://<group>/client/<name>``), which a
member's client port requires in the TLS mode and a member port refuses. Needs the ``cryptography`` package (the ``tls`` extra);
running a group in the TLS mode needs only the standard library's ``ssl``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from derecho_async.errors import UsageError
from derecho_async.transport.tcp.identity import (
    client_uri,
    member_uri,
    parse_client_uri,
    parse_member_uri,
)

__all__ = ["ClientFiles", "MemberFiles", "issue", "issue_clients", "parse_members"]

CA_CERT = "ca.pem"
CA_KEY = "ca.key"


@dataclass(frozen=True, slots=True)
class ClientFiles:
    """The files of one external client: its certificate, its key, and the group's CA (which
    the client's TLS context trusts to check the members)."""

    name: str
    cert: Path
    key: Path
    ca: Path


@dataclass(frozen=True, slots=True)
class MemberFiles:
    """The files of one member: its certificate, its key, and the CA to check peers against."""

    member_id: int
    cert: Path
    key: Path
    ca: Path


def parse_members(text: str) -> list[int]:
    """Member ids from ``"0-2"``, ``"0,1,5"`` or ``"3"`` (ranges inclusive, at most 4096 ids)."""
    ids: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo_text, dash, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise UsageError(f"not a member id or range: {part!r}") from None
        if lo < 0 or hi < lo or hi >= 1 << 63:
            raise UsageError(f"not a member id or range: {part!r}")
        if hi - lo + len(ids) >= 4096:
            raise UsageError("at most 4096 members at a time")
        ids.update(range(lo, hi + 1))
    return sorted(ids)


def _write_private(path: Path, data: bytes, overwrite: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_public(path: Path, data: bytes, overwrite: bool) -> None:
    with open(path, "wb" if overwrite else "xb") as f:
        f.write(data)


def _crypto() -> None:
    """UsageError, saying what to install, where ``cryptography`` is missing."""
    try:
        import cryptography.x509
    except ImportError:
        raise UsageError(
            "making certificates needs the cryptography package: "
            "pip install 'derecho_async[tls]'"
        ) from None
    del cryptography


class _Signer:
    """The group CA of a directory (made there if absent) and the validity of what it signs."""

    def __init__(self, out: Path, group: str, days: int) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.UTC)
        self.start, self.end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(
            days=days)
        ca_cert_path, ca_key_path = out / CA_CERT, out / CA_KEY
        self.ca_path = ca_cert_path
        if ca_cert_path.exists() != ca_key_path.exists():
            raise UsageError(f"{out} holds only one of {CA_CERT} and {CA_KEY}")
        if ca_cert_path.exists():
            self.cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
            loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
            if not isinstance(loaded, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
                raise UsageError(f"{ca_key_path} is not an EC or RSA private key")
            self.key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey = loaded
            return
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"derecho-async CA {group}")])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.start)
            .not_valid_after(now + datetime.timedelta(days=max(days, 3650)))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False, content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, key_cert_sign=True,
                    crl_sign=True, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        _write_private(ca_key_path, self.key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), False)
        _write_public(ca_cert_path, self.cert.public_bytes(pem), False)

    def leaf(self, cert_path: Path, key_path: Path, common_name: str, uri: str,
             server: bool, overwrite: bool) -> None:
        """Write a certificate (and its new key) naming ``uri``, for TLS clients, and servers
        too when ``server``."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.start)
            .not_valid_after(self.end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        pem = serialization.Encoding.PEM
        _write_private(key_path, key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()), overwrite)
        _write_public(cert_path, cert.public_bytes(pem), overwrite)


def _prepare(directory: Path | str, group: str, days: int, files: list[Path],
             overwrite: bool) -> Path:
    """Check the arguments and that ``files`` may be written; the directory, made."""
    _crypto()
    if parse_member_uri(member_uri(group, 0)) is None:
        raise UsageError(f"not a group name: {group!r} (1-64 of A-Za-z0-9_.-)")
    if not 1 <= days <= 36500:
        raise UsageError(f"days must be from 1 to 36500, not {days}")
    out = Path(directory)
    if not overwrite:
        taken = [str(p) for p in files if p.exists()]
        if taken:
            raise UsageError(f"{', '.join(taken)} exist already (--force replaces them)")
    out.mkdir(parents=True, exist_ok=True)
    return out


def issue(
    directory: Path | str,
    group: str,
    members: Iterable[int],
    *,
    days: int = 365,
    overwrite: bool = False,
) -> list[MemberFiles]:
    """Write a certificate and key for each of ``members`` of ``group`` into ``directory``,
    signed by the CA there (made first if the directory has none). :class:`UsageError` for a
    member whose files exist (unless ``overwrite``), a bad group name or ``days``."""
    out = Path(directory)
    targets = [MemberFiles(m, out / f"member-{m}.pem", out / f"member-{m}.key", out / CA_CERT)
               for m in sorted(set(members))]
    _prepare(out, group, days, [p for t in targets for p in (t.cert, t.key)], overwrite)
    signer = _Signer(out, group, days)
    for t in targets:
        signer.leaf(t.cert, t.key, f"{group} member {t.member_id}",
                    member_uri(group, t.member_id), True, overwrite)
    return targets


def issue_clients(
    directory: Path | str,
    group: str,
    names: Iterable[str],
    *,
    days: int = 365,
    overwrite: bool = False,
) -> list[ClientFiles]:
    """Write an external client's certificate and key for each of ``names`` (1-64 of
    ``A-Za-z0-9_.-``) into ``directory``, signed by the group's CA there (made if absent): a
    member's client port takes them, a member port refuses them (they name no member)."""
    out = Path(directory)
    chosen = sorted(set(names))
    for name in chosen:
        if parse_client_uri(client_uri(group, name)) is None:
            raise UsageError(f"not a client name: {name!r} (1-64 of A-Za-z0-9_.-)")
    targets = [ClientFiles(n, out / f"client-{n}.pem", out / f"client-{n}.key", out / CA_CERT)
               for n in chosen]
    _prepare(out, group, days, [p for t in targets for p in (t.cert, t.key)], overwrite)
    signer = _Signer(out, group, days)
    for t in targets:
        signer.leaf(t.cert, t.key, f"{group} client {t.name}", client_uri(group, t.name),
                    False, overwrite)
    return targets
