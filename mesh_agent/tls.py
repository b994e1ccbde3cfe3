"""TLS on the agent's side (stdlib ``ssl`` only: the agent installs on a Pi Zero, no ``cryptography``).

One place builds the client context for MQTT (mqtts, wss) and HTTPS, checks an optional
certificate pin, recognises loopback hosts (where plaintext stays allowed), and turns every
``ssl`` failure into one line that names the problem (wrong CA, expired certificate, host name
mismatch, plaintext on a TLS port or TLS on a plaintext port, pin mismatch). The hub's SDK and
``mesh-agent init`` use the same messages.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import socket
import ssl
from pathlib import Path
from typing import Any

__all__ = [
    "TlsError",
    "TlsHandshakeError",
    "ca_hash_of_pem",
    "parse_hash",
    "client_context",
    "describe_tls_error",
    "is_loopback",
    "probe_tls",
]


class TlsError(ValueError):
    """A TLS setting or certificate is unusable; the message is one line naming the problem."""


class TlsHandshakeError(ConnectionError):
    """A TLS connection failed (wrong CA, expired, host name, pin, plaintext port); one line from describe_tls_error."""


_HASH = re.compile(r"^(?:sha256:)?([0-9a-fA-F:]{64,95})$")


def parse_hash(value: str) -> str:
    """``sha256:<64 hex>`` (colons and upper case, as ``openssl -fingerprint`` prints, accepted)."""
    m = _HASH.match(value.strip())
    digest = m.group(1).replace(":", "").lower() if m else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise TlsError(f"not a SHA-256 certificate hash: {value!r} (expected sha256:<64 hex digits>)")
    return "sha256:" + digest


def _first_der(pem: str | bytes) -> bytes:
    text = pem.decode("ascii", "replace") if isinstance(pem, bytes) else pem
    m = re.search(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)
    if not m:
        raise TlsError("no PEM certificate found")
    try:
        return ssl.PEM_cert_to_DER_cert(m.group(0))
    except ValueError:
        raise TlsError("PEM certificate is damaged") from None


def ca_hash_of_pem(pem: str | bytes) -> str:
    """``sha256:<hex>`` of the first certificate in ``pem`` (DER bytes, as kubeadm's CA cert hash is of the CA)."""
    return "sha256:" + hashlib.sha256(_first_der(pem)).hexdigest()


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``: traffic that never leaves the machine."""
    host = host.strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Socket(ssl.SSLSocket):
    """Checks the context's pin right after the handshake, before a byte of MQTT or HTTP is sent."""

    def do_handshake(self, block: bool = False) -> None:  # type: ignore[override]
        super().do_handshake(block)
        ctx = self.context
        pin = getattr(ctx, "pin", None)
        if not pin:
            return
        chain = [self.getpeercert(binary_form=True) or b""]
        verified = getattr(self, "get_verified_chain", None)  # Python >= 3.13: the whole chain
        if verified is not None:
            chain += [bytes(c) for c in verified()]  # DER bytes
        if pin not in {"sha256:" + hashlib.sha256(der).hexdigest() for der in chain}:
            raise ssl.SSLCertVerificationError(f"certificate pin mismatch: the server's certificate is not {pin}")


class _Context(ssl.SSLContext):
    """An ``SSLContext`` that verifies as ``server_name`` (connect to an IP, check the DNS name)."""

    server_name: str | None = None
    pin: str | None = None
    sslsocket_class = _Socket

    def wrap_socket(self, sock: socket.socket, server_side: bool = False, do_handshake_on_connect: bool = True,  # type: ignore[override]
                    suppress_ragged_eofs: bool = True, server_hostname: str | None = None, session: Any = None) -> ssl.SSLSocket:
        return super().wrap_socket(sock, server_side, do_handshake_on_connect, suppress_ragged_eofs,
                                   self.server_name or server_hostname, session)


def client_context(ca_file: Path | str | None = None, *, cert_file: Path | str | None = None, key_file: Path | str | None = None,
                   server_name: str | None = None, pin_sha256: str | None = None, ca_data: str | None = None) -> ssl.SSLContext:
    """Verify the server against ``ca_file`` (else the system's trust store), hostname checked.

    ``cert_file``/``key_file``: a client certificate for mutual TLS. Raises TlsError naming a file
    that is missing or unusable, so a bad config fails at start, not at the first connect."""
    ctx = _Context(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = True
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        if ca_data:
            ctx.load_verify_locations(cadata=ca_data)
        elif ca_file:
            ctx.load_verify_locations(cafile=str(ca_file))
        else:
            ctx.load_default_certs()
    except FileNotFoundError:
        raise TlsError(f"{ca_file}: no such CA file") from None
    except ssl.SSLError:
        raise TlsError(f"{ca_file}: not a PEM CA certificate") from None
    if cert_file or key_file:
        if not (cert_file and key_file):
            raise TlsError("mutual TLS needs both cert_file and key_file")
        try:
            ctx.load_cert_chain(str(cert_file), str(key_file))
        except FileNotFoundError as exc:
            raise TlsError(f"{exc.filename or cert_file}: no such client certificate or key file") from None
        except ssl.SSLError:
            raise TlsError(f"{cert_file} / {key_file}: client certificate and key do not load or do not match") from None
    ctx.server_name = server_name or None
    ctx.pin = parse_hash(pin_sha256) if pin_sha256 else None
    return ctx


def describe_tls_error(exc: BaseException, where: str = "") -> str | None:
    """One line for a TLS failure (``where``: ``host:port``), or None if ``exc`` is not one.

    Every component maps ssl errors here, so the same problem reads the same everywhere."""
    at = f" ({where})" if where else ""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:  # httpx and aiomqtt wrap the ssl error
        seen.add(id(e))
        msg = _describe_one(e, at)
        if msg:
            return msg
        e = e.__cause__ or e.__context__ or (e.args[0] if e.args and isinstance(e.args[0], BaseException) else None)
    text = str(exc)
    for marker, line in _TEXT_MARKERS:
        if marker in text:
            return line.format(at=at)
    return None


_TEXT_MARKERS = [
    ("certificate pin mismatch", "TLS: the server's certificate does not match the pinned fingerprint{at}"),
    ("CERTIFICATE_VERIFY_FAILED", "TLS: the server's certificate could not be verified{at}"),
    ("WRONG_VERSION_NUMBER", "TLS: the server does not speak TLS: is this a plaintext port?{at}"),
]


def _describe_one(e: BaseException, at: str) -> str | None:
    if isinstance(e, ssl.SSLCertVerificationError):
        code = getattr(e, "verify_code", None)
        why = getattr(e, "verify_message", None) or str(e)
        if "pin mismatch" in str(e):
            return f"TLS: the server's certificate does not match the pinned fingerprint{at}"
        if code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
            return f"TLS: the server's certificate has expired{at}"
        if code == 9:  # X509_V_ERR_CERT_NOT_YET_VALID
            return f"TLS: the server's certificate is not valid yet (check this device's clock){at}"
        if code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
            return f"TLS: host name mismatch: the server's certificate does not name the host connected to{at}"
        if code in (18, 19, 20, 21, 2):  # self-signed / unknown issuer / cannot verify
            return f"TLS: the server's certificate is not signed by the trusted CA (wrong CA file?){at}"
        return f"TLS: the server's certificate was refused: {why}{at}"
    if isinstance(e, ssl.SSLError):
        reason = getattr(e, "reason", None) or ""
        if reason in ("WRONG_VERSION_NUMBER", "HTTP_REQUEST", "UNKNOWN_PROTOCOL", "RECORD_LAYER_FAILURE"):
            return f"TLS: the server does not speak TLS: is this a plaintext port?{at}"
        if reason in ("TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_BAD_CERTIFICATE", "TLSV1_ALERT_UNKNOWN_CA"):
            return f"TLS: the server refused this device's client certificate ({reason}){at}"
        return f"TLS handshake failed: {reason or e}{at}"
    return None


def probe_tls(host: str, port: int, timeout: float = 3.0) -> bool:
    """Does ``host:port`` complete a TLS handshake (certificate not checked)?

    Only for diagnosis: after a plaintext MQTT connect was dropped before the broker's answer, this
    tells "plaintext client on a TLS port" apart from any other failure."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, ctx.wrap_socket(raw, server_hostname=host):
            return True
    except (OSError, ssl.SSLError):
        return False
