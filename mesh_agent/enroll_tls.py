"""Trusting the hub at enrollment: ``mesh-agent init --ca-hash sha256:...`` (kubeadm-join style).

Why: a device must not send its enrollment token, nor later its broker password, to whoever
answers at the hub's address, and nobody should copy CA files onto devices by hand. The
enrollment token's output carries the hash of the hub's CA. Before anything secret is sent, the
agent fetches the CA (``GET /v1/tls/ca``, the one request made without verification), checks its
hash, and from then on talks HTTPS only with a context that trusts that CA alone, host name
checked: the HTTPS server's certificate chain is verified against the pinned CA. The CA the
enrollment answer carries must be the same one. It is written to the agent's data directory and
becomes ``mqtt.tls.ca_file``.

Without ``--ca-hash``, an https:// hub is verified with the system's CAs (a Let's Encrypt hub).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from mesh_agent.config import ConfigError, MqttSettings, MqttTls, write_private
from mesh_agent.redact import mask_url
from mesh_agent.tls import TlsError, ca_hash_of_pem, client_context, describe_tls_error, is_loopback, parse_hash

__all__ = ["HubTrust", "CA_FILE_NAME", "mqtt_from_url"]

CA_FILE_NAME = "hub-ca.pem"


def mqtt_from_url(url: str) -> tuple[str, int, bool, str, str | None]:
    """``mqtts://h:8883`` -> (host, port, tls, transport, websocket path)."""
    u = urlsplit(url)
    scheme = u.scheme.lower()
    if scheme not in ("mqtt", "mqtts", "ws", "wss") or not u.hostname:
        raise ConfigError(f"the hub advertises an unusable broker URL {url!r} (expected mqtt://, mqtts://, ws:// or wss://host:port)")
    tls = scheme in ("mqtts", "wss")
    ws = scheme in ("ws", "wss")
    default_port = {"mqtt": 1883, "mqtts": 8883, "ws": 80, "wss": 443}[scheme]
    return u.hostname, u.port or default_port, tls, "websockets" if ws else "tcp", (u.path or "/mqtt") if ws else None


@dataclass
class HubTrust:
    """How this enrollment verifies the hub: an SSL context (or system CAs) and the pinned CA, if any."""

    hub_url: str
    verify: Any  # ssl.SSLContext | bool, for httpx
    pinned_pem: str | None
    ca_hash: str | None

    @classmethod
    def establish(cls, hub_url: str, ca_hash: str | None, *, insecure_plaintext: bool = False) -> "HubTrust":
        u = urlsplit(hub_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ConfigError(f"hub URL {mask_url(hub_url)!r} must be http(s)://host[:port]")
        if u.scheme == "http" and not is_loopback(u.hostname) and not insecure_plaintext:
            raise ConfigError(f"plaintext hub URL {mask_url(hub_url)} refused: the enrollment token and keys would cross the network in clear; "
                              "use https:// or pass --insecure-plaintext")
        pin = None
        if ca_hash:
            try:
                pin = parse_hash(ca_hash)
            except TlsError as exc:
                raise ConfigError(str(exc)) from None
        if u.scheme == "http" or pin is None:
            return cls(hub_url, True, None, pin)
        pem = cls._fetch_ca(hub_url)
        got = ca_hash_of_pem(pem)
        if got != pin:
            raise ConfigError(f"CA fingerprint mismatch: the hub at {mask_url(hub_url)} sent a CA with {got}, but --ca-hash is {pin}; "
                              "not enrolling (a wrong hash, or someone between this device and the hub)")
        return cls(hub_url, client_context(ca_data=pem), pem, pin)

    @staticmethod
    def _fetch_ca(hub_url: str) -> str:
        # The one unverified request: what it returns is trusted only if its hash matches the pin.
        try:
            r = httpx.get(f"{hub_url.rstrip('/')}/v1/tls/ca", timeout=30, verify=False)
        except httpx.HTTPError as exc:
            raise ConfigError(describe_tls_error(exc, mask_url(hub_url)) or f"cannot fetch the hub's CA from {mask_url(hub_url)}: {mask_url(str(exc))}") from None
        if r.status_code != 200:
            raise ConfigError(f"the hub at {mask_url(hub_url)} has no CA to pin ({r.status_code}); enroll without --ca-hash if it has a public certificate")
        try:
            return str(r.json()["ca_pem"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"the hub at {mask_url(hub_url)} answered /v1/tls/ca with something that is not a CA") from None

    def post(self, url: str, **kw: Any) -> httpx.Response:
        """A request verified against the pinned CA (or the system's); TLS failures become one line."""
        try:
            return httpx.post(url, timeout=30, verify=self.verify, **kw)
        except httpx.ConnectError as exc:
            line = describe_tls_error(exc, mask_url(self.hub_url))
            if line:
                raise ConfigError(line) from None
            raise

    def save_ca(self, ca_pem: str | None, data_dir: Path) -> Path | None:
        """Check the CA from the enrollment answer against the pin and write it for the MQTT link."""
        if not ca_pem:
            return None
        try:
            got = ca_hash_of_pem(ca_pem)
        except TlsError as exc:
            raise ConfigError(f"the hub's CA in the enrollment answer: {exc}") from None
        if self.ca_hash and got != self.ca_hash:
            raise ConfigError(f"CA fingerprint mismatch: the enrollment answer carries a CA with {got}, but --ca-hash is {self.ca_hash}; "
                              "not trusting it")
        if not self.ca_hash and urlsplit(self.hub_url).scheme == "http" and not is_loopback(urlsplit(self.hub_url).hostname or ""):
            raise ConfigError("the hub sent a CA over plaintext http: pass --ca-hash (printed with the enrollment token) to check it")
        path = Path(data_dir) / CA_FILE_NAME
        write_private(path, ca_pem)
        return path

    def mqtt_settings(self, mqtt: dict[str, Any], ca_file: Path | None, *, host: str | None = None, port: int | None = None) -> MqttSettings:
        """From the enrollment answer: the advertised broker URL decides TLS and WebSockets."""
        url = mqtt.get("url")
        if url:
            h, p, tls, transport, path = mqtt_from_url(url)
        else:
            h, p, tls, transport, path = mqtt.get("host", "127.0.0.1"), mqtt.get("port", 1883), False, "tcp", None
        return MqttSettings(
            host=host or h, port=port or p, topic_prefix=mqtt.get("topic_prefix", "mesh"),
            tls=MqttTls(ca_file=ca_file) if tls else None, transport=transport,  # type: ignore[arg-type]
            **({"websocket_path": path} if path else {}),
        )
