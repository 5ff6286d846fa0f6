"""Making a group's CA and member certificates for the TLS mode (``derecho-async certs``).

Theory of operation (docs/DESIGN.md §5.3): a group CA (an EC P-256 key and a self-signed CA
certificate) signs one certificate per member whose subject alternative name is the member's
URI (:func:`derecho_async.transport.tcp.identity.member_uri`); the transport binds the id a
peer claims to that URI. A directory holds ``ca.pem``/``ca.key`` and
``member-<id>.pem``/``member-<id>.key``; issuing into a directory that already holds a CA
reuses it, so certificates for joiners can be made later. Private keys are written with mode
0600 and never overwritten unless asked. Needs the ``cryptography`` package (the ``tls`` extra);
running a group in the TLS mode needs only the standard library's ``ssl``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from derecho_async.errors import UsageError
from derecho_async.transport.tcp.identity import member_uri, parse_member_uri

__all__ = ["MemberFiles", "issue", "parse_members"]

CA_CERT = "ca.pem"
CA_KEY = "ca.key"


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
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, rsa
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise UsageError(
            "making certificates needs the cryptography package: "
            "pip install 'derecho_async[tls]'"
        ) from None

    if parse_member_uri(member_uri(group, 0)) is None:
        raise UsageError(f"not a group name: {group!r} (1-64 of A-Za-z0-9_.-)")
    if not 1 <= days <= 36500:
        raise UsageError(f"days must be from 1 to 36500, not {days}")
    ids = sorted(set(members))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    targets = [MemberFiles(m, out / f"member-{m}.pem", out / f"member-{m}.key", out / CA_CERT)
               for m in ids]
    if not overwrite:
        taken = [str(p) for t in targets for p in (t.cert, t.key) if p.exists()]
        if taken:
            raise UsageError(f"{', '.join(taken)} exist already (--force replaces them)")
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    pem = serialization.Encoding.PEM
    no_password = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8

    ca_cert_path, ca_key_path = out / CA_CERT, out / CA_KEY
    if ca_cert_path.exists() != ca_key_path.exists():
        raise UsageError(f"{out} holds only one of {CA_CERT} and {CA_KEY}")
    if ca_cert_path.exists():
        ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
        loaded = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise UsageError(f"{ca_key_path} is not an EC or RSA private key")
        ca_key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey = loaded
    else:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"derecho-async CA {group}")])
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
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
                x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_private(ca_key_path, ca_key.private_bytes(pem, pkcs8, no_password), False)
        _write_public(ca_cert_path, ca_cert.public_bytes(pem), False)

    for t in targets:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name(
            [x509.NameAttribute(NameOID.COMMON_NAME, f"{group} member {t.member_id}")]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(member_uri(group, t.member_id))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        _write_private(t.key, key.private_bytes(pem, pkcs8, no_password), overwrite)
        _write_public(t.cert, cert.public_bytes(pem), overwrite)
    return targets
