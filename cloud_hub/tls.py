"""Certificates for a self-hosted hub: a private CA and a server certificate (``mesh-hub tls init``).

Why a private CA: a hub on a campus server or a cloud VM often has no public DNS name that Let's
Encrypt could validate, and devices must still verify who they talk to. The CA's key signs one
server certificate (SANs: every hostname and IP the hub is reached by, plus localhost/127.0.0.1),
and devices trust only that CA, pinned at enrollment by its SHA-256 fingerprint (the spirit of
``kubeadm join --discovery-token-ca-cert-hash``), so nobody copies CA files by hand.

Nothing here assumes our CA: :func:`load_server_pair` validates any PEM certificate chain and key
(Let's Encrypt's ``fullchain.pem``/``privkey.pem`` included), and :func:`fingerprint` hashes any
certificate. Pure helpers: files are only written by :func:`write_pem` (keys 0600).
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mesh_agent.tls import ca_hash_of_pem

__all__ = [
    "TlsFiles",
    "TlsSetupError",
    "make_ca",
    "make_server_cert",
    "fingerprint",
    "ca_hash_of_pem",
    "write_pem",
    "init_dir",
    "load_server_pair",
    "DEFAULT_HOSTS",
]

#: Always in the server certificate: the hub is reachable on the machine itself.
DEFAULT_HOSTS = ("localhost", "127.0.0.1")


class TlsSetupError(ValueError):
    """A certificate, key or host name is unusable; the message names the file and the problem."""


@dataclass(frozen=True)
class TlsFiles:
    """What ``mesh-hub tls init`` wrote."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    ca_hash: str  # "sha256:<hex>" of the CA certificate (DER), what `mesh-agent init --ca-hash` pins


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _key() -> ec.EllipticCurvePrivateKey:
    # P-256: small certificates and handshakes (bytes matter on a metered SIM), fast on a Pi.
    return ec.generate_private_key(ec.SECP256R1())


def make_ca(common_name: str = "Continuum Mesh hub CA", *, days: int = 3650) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA that may sign server certificates only (path length 0)."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not host or any(c.isspace() or c in "/:@" for c in host):
        raise TlsSetupError(f"not a host name or IP address: {host!r}")
    return x509.DNSName(host)


def make_server_cert(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, hosts: list[str] | tuple[str, ...], *,
                     days: int = 825, not_before: _dt.datetime | None = None,
                     not_after: _dt.datetime | None = None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A server certificate for ``hosts`` (DNS names and IPs, deduplicated, localhost included).

    ``not_before``/``not_after`` exist so tests can make an already expired certificate."""
    names = list(dict.fromkeys([*hosts, *DEFAULT_HOSTS]))
    key = _key()
    start = not_before or _now() - _dt.timedelta(minutes=5)
    end = not_after or start + _dt.timedelta(days=days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def make_client_cert(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str, *,
                     days: int = 825) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A client certificate (mutual TLS: ``require_certificate true`` on the broker)."""
    key = _key()
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def fingerprint(cert: x509.Certificate) -> str:
    """``sha256:<hex>`` of the certificate's DER bytes (what ``openssl x509 -fingerprint -sha256`` shows, lower case, no colons)."""
    return "sha256:" + cert.fingerprint(hashes.SHA256()).hex()


def write_pem(path: Path, data: bytes, *, private: bool = False) -> Path:
    """Write atomically; a key is never readable by anyone but its owner, not even for a moment."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600 if private else 0o644)
    os.replace(tmp, path)
    return path


def init_dir(out: Path, hosts: list[str] | tuple[str, ...] = (), *, force: bool = False) -> TlsFiles:
    """Make ``ca.pem``, ``ca.key``, ``server.pem``, ``server.key`` in ``out``.

    Refuses to overwrite an existing CA unless ``force``: replacing it would strand every device
    already enrolled with the old one."""
    out = Path(out)
    files = TlsFiles(out / "ca.pem", out / "ca.key", out / "server.pem", out / "server.key", "")
    if not force and files.ca_cert.exists():
        raise TlsSetupError(f"{files.ca_cert} exists: enrolled devices trust it; pass --force to replace it")
    for h in hosts:
        _san(h)  # a bad host name fails before anything is written
    ca, ca_key = make_ca()
    srv, srv_key = make_server_cert(ca, ca_key, list(hosts))
    write_pem(files.ca_key, key_pem(ca_key), private=True)
    write_pem(files.ca_cert, cert_pem(ca))
    write_pem(files.server_key, key_pem(srv_key), private=True)
    write_pem(files.server_cert, cert_pem(srv) + cert_pem(ca))  # full chain, as Let's Encrypt's fullchain.pem
    return TlsFiles(files.ca_cert, files.ca_key, files.server_cert, files.server_key, fingerprint(ca))


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise TlsSetupError(f"{path}: no such {what} file") from None
    except OSError as exc:
        raise TlsSetupError(f"{path}: cannot read {what}: {exc.strerror}") from None


def load_certs(path: Path) -> list[x509.Certificate]:
    """Every certificate in a PEM file (a chain or a CA bundle)."""
    data = _read(path, "certificate")
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise TlsSetupError(f"{path}: not a PEM certificate file") from None
    return certs


def load_server_pair(cert_file: Path, key_file: Path, *, hosts: list[str] | tuple[str, ...] = ()) -> x509.Certificate:
    """Check a server certificate chain and key before a server is started with them.

    Any issuer works (our CA, Let's Encrypt, a campus CA). Checked: the file parses, the key
    matches the first certificate, it is not expired (or not yet valid), and it names every host in
    ``hosts``. Returns the leaf certificate."""
    leaf = load_certs(cert_file)[0]
    key_data = _read(key_file, "private key")
    try:
        key = serialization.load_pem_private_key(key_data, password=None)
    except (ValueError, TypeError):
        raise TlsSetupError(f"{key_file}: not an unencrypted PEM private key") from None
    if key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo) != leaf.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        raise TlsSetupError(f"{key_file}: this key does not belong to the certificate in {cert_file}")
    now = _now()
    if leaf.not_valid_after_utc < now:
        raise TlsSetupError(f"{cert_file}: certificate expired on {leaf.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    if leaf.not_valid_before_utc > now:
        raise TlsSetupError(f"{cert_file}: certificate not valid before {leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
    names = _names(leaf)
    for h in hosts:
        if not _covers(names, h):
            raise TlsSetupError(f"{cert_file}: certificate does not name host {h!r} (it names {', '.join(sorted(names)) or 'nothing'})")
    return leaf


def _names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))}


def _covers(names: set[str], host: str) -> bool:
    if host in names:
        return True
    first, _, rest = host.partition(".")
    return bool(rest) and f"*.{rest}" in names
