"""Certificates (cloud_hub.tls), the agent's TLS helpers (mesh_agent.tls) and the plaintext refusal at config load."""

from __future__ import annotations

import datetime as dt
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from cloud_hub.broker import BrokerTls, tls_listener_conf
from cloud_hub.tls import (
    TlsSetupError,
    cert_pem,
    fingerprint,
    init_dir,
    key_pem,
    load_certs,
    load_server_pair,
    make_ca,
    make_server_cert,
    write_pem,
)
from mesh_agent.config import ConfigError, Credentials, load_config
from mesh_agent.enroll_tls import mqtt_from_url
from mesh_agent.tls import TlsError, ca_hash_of_pem, client_context, describe_tls_error, is_loopback, parse_hash


def test_init_dir_writes_a_ca_and_server_cert_with_private_keys(tmp_path: Path) -> None:
    files = init_dir(tmp_path / "tls", ["hub.example.org", "10.0.0.7"])
    for key in (files.ca_key, files.server_key):
        assert key.stat().st_mode & 0o777 == 0o600
    ca = load_certs(files.ca_cert)[0]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaf = load_server_pair(files.server_cert, files.server_key, hosts=["hub.example.org", "10.0.0.7", "localhost", "127.0.0.1"])
    leaf.verify_directly_issued_by(ca)
    assert files.ca_hash == fingerprint(ca) == ca_hash_of_pem(files.ca_cert.read_text())
    # Same value as `openssl x509 -fingerprint -sha256`, which operators can check by hand.
    out = subprocess.run(["openssl", "x509", "-in", str(files.ca_cert), "-noout", "-fingerprint", "-sha256"], capture_output=True, text=True)
    if out.returncode == 0:
        assert parse_hash(out.stdout.strip().split("=", 1)[1]) == files.ca_hash


def test_init_dir_refuses_to_replace_a_ca_and_bad_host_names(tmp_path: Path) -> None:
    init_dir(tmp_path / "tls")
    before = (tmp_path / "tls" / "ca.pem").read_bytes()
    with pytest.raises(TlsSetupError, match="exists: enrolled devices trust it"):
        init_dir(tmp_path / "tls")
    assert (tmp_path / "tls" / "ca.pem").read_bytes() == before
    with pytest.raises(TlsSetupError, match="not a host name or IP address: 'bad host'"):
        init_dir(tmp_path / "other", ["bad host"])
    assert not (tmp_path / "other").exists()


def test_load_server_pair_names_each_problem(tmp_path: Path) -> None:
    ca, ca_key = make_ca()
    now = dt.datetime.now(dt.timezone.utc)
    old, old_key = make_server_cert(ca, ca_key, ["hub.example.org"], not_before=now - dt.timedelta(days=9), not_after=now - dt.timedelta(days=1))
    write_pem(tmp_path / "old.pem", cert_pem(old))
    write_pem(tmp_path / "old.key", key_pem(old_key), private=True)
    with pytest.raises(TlsSetupError, match="certificate expired on"):
        load_server_pair(tmp_path / "old.pem", tmp_path / "old.key")
    good, _ = make_server_cert(ca, ca_key, ["hub.example.org"])
    write_pem(tmp_path / "good.pem", cert_pem(good))
    with pytest.raises(TlsSetupError, match="does not belong to the certificate"):
        load_server_pair(tmp_path / "good.pem", tmp_path / "old.key")
    with pytest.raises(TlsSetupError, match="no such certificate file"):
        load_server_pair(tmp_path / "missing.pem", tmp_path / "old.key")
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(TlsSetupError, match="not a PEM certificate file"):
        load_certs(tmp_path / "junk.pem")


def test_hostname_coverage_includes_wildcards(tmp_path: Path) -> None:
    ca, ca_key = make_ca()
    cert, key = make_server_cert(ca, ca_key, ["*.example.org"])
    write_pem(tmp_path / "c.pem", cert_pem(cert))
    write_pem(tmp_path / "c.key", key_pem(key), private=True)
    load_server_pair(tmp_path / "c.pem", tmp_path / "c.key", hosts=["hub.example.org"])
    with pytest.raises(TlsSetupError, match="does not name host 'hub.other.org'"):
        load_server_pair(tmp_path / "c.pem", tmp_path / "c.key", hosts=["hub.other.org"])


def test_parse_hash_accepts_openssl_form_and_refuses_junk() -> None:
    h = "sha256:" + "ab" * 32
    assert parse_hash(h) == h
    assert parse_hash(":".join(["AB"] * 32)) == h
    for bad in ("sha256:abc", "md5:" + "ab" * 16, "sha256:" + "zz" * 32, ""):
        with pytest.raises(TlsError, match="not a SHA-256 certificate hash"):
            parse_hash(bad)


def test_is_loopback() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("10.0.0.1", "hub.example.org", "0.0.0.0", ""))


def test_client_context_names_bad_files(tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="no such CA file"):
        client_context(tmp_path / "nope.pem")
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(TlsError, match="not a PEM CA certificate"):
        client_context(tmp_path / "junk.pem")
    files = init_dir(tmp_path / "tls")
    with pytest.raises(TlsError, match="needs both cert_file and key_file"):
        client_context(files.ca_cert, cert_file=files.server_cert)
    ctx = client_context(files.ca_cert, cert_file=files.server_cert, key_file=files.server_key, server_name="hub")
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_describe_tls_error_maps_verification_codes() -> None:
    def verr(code: int, msg: str) -> ssl.SSLCertVerificationError:
        e = ssl.SSLCertVerificationError(1, msg)
        e.verify_code, e.verify_message = code, msg
        return e

    assert "has expired" in (describe_tls_error(verr(10, "certificate has expired"), "h:1") or "")
    assert "host name mismatch" in (describe_tls_error(verr(62, "Hostname mismatch"), "h:1") or "")
    assert "not signed by the trusted CA" in (describe_tls_error(verr(20, "unable to get local issuer certificate")) or "")
    wrapped = RuntimeError("outer")
    wrapped.__context__ = verr(10, "certificate has expired")
    assert "has expired" in (describe_tls_error(wrapped) or "")
    assert describe_tls_error(ValueError("unrelated")) is None


def test_tls_listener_conf_binds_wss_to_ipv4_only() -> None:
    tls = BrokerTls(Path("/c/ca.pem"), Path("/c/s.pem"), Path("/c/s.key"), require_certificate=True)
    plain = tls_listener_conf(8883, "127.0.0.1", tls)
    assert plain.splitlines()[0] == "listener 8883 127.0.0.1" and "protocol websockets" not in plain and "require_certificate true" in plain
    ws = tls_listener_conf(443, "127.0.0.1", tls, websockets=True)
    # Debian's mosquitto 2.0.11 binds a websockets listener to every interface without socket_domain.
    assert ws.splitlines()[:3] == ["listener 443 127.0.0.1", "socket_domain ipv4", "protocol websockets"]
    assert tls_listener_conf(443, None, tls, websockets=True).splitlines()[0] == "listener 443"


def test_mqtt_from_url() -> None:
    assert mqtt_from_url("mqtts://hub.example.org") == ("hub.example.org", 8883, True, "tcp", None)
    assert mqtt_from_url("wss://hub.example.org:443/mqtt") == ("hub.example.org", 443, True, "websockets", "/mqtt")
    assert mqtt_from_url("mqtt://127.0.0.1:1883") == ("127.0.0.1", 1883, False, "tcp", None)
    with pytest.raises(ConfigError, match="unusable broker URL"):
        mqtt_from_url("http://hub")


# ------------------------------------------------------------------ plaintext refused at config load


def _write(tmp_path: Path, **over: object) -> Path:
    creds = tmp_path / "c.json"
    Credentials(endpoint_id="ep-1", key="ab" * 32).save(creds)
    raw = {"endpoint_id": "ep-1", "name": "pi", "hub_url": "http://127.0.0.1:8700", "data_dir": str(tmp_path / "q"), "credentials_file": str(creds)}
    raw.update(over)  # type: ignore[arg-type]
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_plaintext_to_loopback_is_fine(tmp_path: Path) -> None:
    cfg, _ = load_config(_write(tmp_path))
    assert cfg.mqtt.tls is None and not cfg.insecure_plaintext


@pytest.mark.parametrize("over, expect", [
    ({"mqtt": {"host": "broker.example.org", "port": 1883}}, "plaintext MQTT to broker.example.org:1883 refused"),
    ({"hub_url": "http://hub.example.org:8700"}, "plaintext hub_url http://hub.example.org:8700 refused"),
])
def test_plaintext_off_the_machine_is_refused_in_one_line(tmp_path: Path, over: dict, expect: str) -> None:  # type: ignore[type-arg]
    path = _write(tmp_path, **over)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert expect in str(err.value) and "insecure_plaintext: true" in str(err.value) and "\n" not in str(err.value)
    cfg, _ = load_config(_write(tmp_path, insecure_plaintext=True, **over))  # the explicit opt-out
    assert cfg.insecure_plaintext


def test_tls_config_loads_and_bad_ca_file_is_named(tmp_path: Path) -> None:
    files = init_dir(tmp_path / "tls")
    cfg, _ = load_config(_write(tmp_path, hub_url="https://hub.example.org",
                                mqtt={"host": "hub.example.org", "port": 443, "transport": "websockets", "tls": {"ca_file": str(files.ca_cert)}}))
    assert cfg.mqtt.transport == "websockets" and cfg.mqtt.websocket_path == "/mqtt"
    with pytest.raises(ConfigError, match=r"mqtt.tls: .*missing.pem: no such CA file"):
        load_config(_write(tmp_path, mqtt={"host": "hub.example.org", "tls": {"ca_file": str(tmp_path / "missing.pem")}}))
    with pytest.raises(ConfigError, match="mutual TLS needs both cert_file and key_file"):
        load_config(_write(tmp_path, mqtt={"host": "hub.example.org", "tls": {"cert_file": str(files.server_cert)}}))


def test_mesh_hub_tls_init_cli(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "tls", "init", "--out", str(tmp_path / "t"), "--host", "hub.example.org"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    h = [line for line in out.stdout.splitlines() if line.startswith("CA hash: ")][0].split(": ")[1]
    assert h == ca_hash_of_pem((tmp_path / "t" / "ca.pem").read_text())
    again = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "tls", "init", "--out", str(tmp_path / "t")], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists: enrolled devices trust it" in again.stdout
    printed = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "tls", "hash", str(tmp_path / "t" / "ca.pem")], capture_output=True, text=True, timeout=60)
    assert printed.stdout.strip() == h
