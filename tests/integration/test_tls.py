"""TLS for real: Mosquitto with TLS and secure-WebSockets listeners, certificates from `mesh-hub tls init`,
an HTTPS hub, agent processes enrolled with a pinned CA hash, and each refusal named in one line."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.broker import BrokerTls, MosquittoBroker, find_mosquitto, free_port
from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import LocalMesh
from cloud_hub.tls import TlsFiles, cert_pem, init_dir, key_pem, make_ca, make_server_cert, write_pem
from mesh_agent.config import load_config
from mesh_agent.tls import TlsHandshakeError, client_context
from mesh_agent.transport import LinkError
from mesh_agent.transport.mqtt import MqttAgentLink

pytestmark = [pytest.mark.integration, pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]


def square_plus(x: int, y: int = 0) -> int:
    return x * x + y


def _run_tasks(mesh: LocalMesh, endpoint_id: str, n: int = 40) -> list[int]:
    with Executor(mesh.client, endpoint_id) as ex:
        futures = [ex.submit(square_plus, i, y=1) for i in range(n)]
        return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("transport", ["tcp", "websockets"])
@pytest.mark.timeout(180)
def test_agent_runs_tasks_over_tls(tmp_path: Path, transport: str) -> None:
    """mqtts and wss end to end: HTTPS hub, CA pinned by the token's hash, a real agent process, real tasks."""
    with LocalMesh(tmp_path / "mesh", heartbeat_s=0.5, lost_after_s=3.0, tls=True, mqtt_transport=transport) as mesh:
        assert mesh.url.startswith("https://")
        token = mesh.client.create_enrollment_token()
        assert mesh.tls_files is not None and token.ca_hash == mesh.tls_files.ca_hash
        want_url = (f"wss://127.0.0.1:{mesh.broker.ws_port}/mqtt" if transport == "websockets" else f"mqtts://127.0.0.1:{mesh.broker.tls_port}")
        assert token.broker_url == want_url
        agent = mesh.add_agent("pi-tls", workers=1)
        cfg, _ = load_config(agent.config_path)  # the plaintext check passes: TLS is configured
        assert cfg.mqtt.tls is not None and cfg.mqtt.transport == transport
        assert cfg.mqtt.port == (mesh.broker.ws_port if transport == "websockets" else mesh.broker.tls_port)
        assert cfg.mqtt.tls.ca_file is not None and cfg.mqtt.tls.ca_file.read_bytes() == mesh.tls_files.ca_cert.read_bytes()
        mesh.wait_online(agent, timeout=60)
        assert _run_tasks(mesh, agent.endpoint_id) == [i * i + 1 for i in range(40)]
        # The agent survives a broker restart on the same TLS port (reconnect re-does the handshake).
        mesh.broker.stop()
        mesh.broker.start()
        assert _run_tasks(mesh, agent.endpoint_id, 5) == [i * i + 1 for i in range(5)]


# ----------------------------------------------------------------- refusals on the MQTT link


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles | Path]:
    base = tmp_path_factory.mktemp("certs")
    good = init_dir(base / "good")
    other = init_dir(base / "other")  # a CA the broker's certificate is not signed by
    ca, ca_key = make_ca()
    now = dt.datetime.now(dt.timezone.utc)
    old, old_key = make_server_cert(ca, ca_key, [], not_before=now - dt.timedelta(days=30), not_after=now - dt.timedelta(days=1))
    expired = base / "expired"
    write_pem(expired / "ca.pem", cert_pem(ca))
    write_pem(expired / "server.pem", cert_pem(old) + cert_pem(ca))
    write_pem(expired / "server.key", key_pem(old_key), private=True)
    return {"good": good, "other": other, "expired": expired}


@pytest.fixture(scope="module")
def brokers(tmp_path_factory: pytest.TempPathFactory, certs: dict[str, TlsFiles | Path]) -> Iterator[dict[str, MosquittoBroker]]:
    good = certs["good"]
    assert isinstance(good, TlsFiles)
    exp = certs["expired"]
    assert isinstance(exp, Path)
    ok = MosquittoBroker(tmp_path_factory.mktemp("b1"), tls=BrokerTls(good.ca_cert, good.server_cert, good.server_key), ws_port=free_port())
    expired = MosquittoBroker(tmp_path_factory.mktemp("b2"), tls=BrokerTls(exp / "ca.pem", exp / "server.pem", exp / "server.key"))
    ok.start()
    expired.start()
    try:
        yield {"ok": ok, "expired": expired}
    finally:
        ok.stop()
        expired.stop()


def _wait_listening(*ports: int) -> None:
    import socket
    import time

    deadline = time.monotonic() + 10
    for port in ports:
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _connect(port: int, **kw: object) -> str | None:
    """Connect one agent link; None on success, else the LinkError's one line."""

    async def go() -> str | None:
        link = MqttAgentLink("ep-tls-test", "127.0.0.1", port, **kw)  # type: ignore[arg-type]
        try:
            async with link:
                return None
        except LinkError as exc:
            return str(exc)

    return asyncio.run(asyncio.wait_for(go(), 30))


def test_link_connects_with_the_right_ca(brokers: dict[str, MosquittoBroker], certs: dict) -> None:  # type: ignore[type-arg]
    ok = brokers["ok"]
    ca = certs["good"].ca_cert
    assert _connect(ok.tls_port, tls_context=client_context(ca)) is None
    assert _connect(ok.ws_port, tls_context=client_context(ca), transport="websockets", websocket_path="/mqtt") is None
    # Pinning the server certificate itself works too.
    from mesh_agent.tls import ca_hash_of_pem

    pin = ca_hash_of_pem(certs["good"].server_cert.read_text())
    assert _connect(ok.tls_port, tls_context=client_context(ca, pin_sha256=pin)) is None


@pytest.mark.parametrize("case, expect", [
    ("wrong_ca", "not signed by the trusted CA"),
    ("expired", "certificate has expired"),
    ("hostname", "host name mismatch"),
    ("plaintext_to_tls", "is a TLS port but this agent speaks plaintext MQTT"),
    ("tls_to_plaintext", "does not speak TLS"),
    ("pin", "does not match the pinned fingerprint"),
    ("wss_wrong_ca", "not signed by the trusted CA"),
])
def test_link_refusals_are_one_clear_line(brokers: dict[str, MosquittoBroker], certs: dict, case: str, expect: str) -> None:  # type: ignore[type-arg]
    ok, expired = brokers["ok"], brokers["expired"]
    good, other = certs["good"], certs["other"]
    args: dict[str, object]
    port = ok.tls_port
    if case == "wrong_ca":
        args = {"tls_context": client_context(other.ca_cert)}
    elif case == "expired":
        port, args = expired.tls_port, {"tls_context": client_context(certs["expired"] / "ca.pem")}
    elif case == "hostname":
        args = {"tls_context": client_context(good.ca_cert, server_name="hub.example.org")}
    elif case == "plaintext_to_tls":
        args = {}
    elif case == "tls_to_plaintext":
        port, args = ok.port, {"tls_context": client_context(good.ca_cert)}
    elif case == "pin":
        args = {"tls_context": client_context(good.ca_cert, pin_sha256="sha256:" + "ab" * 32)}
    else:
        port, args = ok.ws_port, {"tls_context": client_context(other.ca_cert), "transport": "websockets", "websocket_path": "/mqtt"}
    err = _connect(port, **args)
    assert err is not None and expect in err, err
    assert "\n" not in err and f"127.0.0.1:{port}" in err


def test_agent_process_names_plaintext_on_tls_port(tmp_path: Path) -> None:
    """A real agent whose config says plaintext, pointed at the TLS port, logs why it cannot connect."""
    with LocalMesh(tmp_path / "mesh", tls=True) as mesh:
        agent = mesh.add_agent("pi-plain", workers=1, start=False)
        cfg = agent.cfg.model_copy(update={"mqtt": agent.cfg.mqtt.model_copy(update={"tls": None})})
        cfg.save(agent.config_path)
        agent.cfg = cfg
        agent.start()
        try:
            import time

            deadline = time.monotonic() + 30
            text = ""
            while time.monotonic() < deadline and "is a TLS port" not in text:
                time.sleep(0.2)
                text = agent.log_path.read_text() if agent.log_path.exists() else ""
            assert f"127.0.0.1:{mesh.broker.tls_port} is a TLS port but this agent speaks plaintext MQTT: configure mqtt.tls" in text, text[-2000:]
        finally:
            agent.stop()


# ----------------------------------------------------------------- enrollment: pinning and HTTPS


def _init(mesh: LocalMesh, token: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh_agent.cli", "init", "--hub", mesh.url, "--token", token, "--name", "pi-pin",
                           "--config", str(tmp_path / "agent.yaml"), "--data-dir", str(tmp_path / "q"), *extra],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "300"})


@pytest.mark.timeout(180)
def test_init_refuses_a_ca_hash_mismatch_and_spends_nothing(tmp_path: Path) -> None:
    with LocalMesh(tmp_path / "mesh", tls=True) as mesh:
        token = mesh.client.create_enrollment_token(uses=1)
        bad = _init(mesh, token, tmp_path, "--ca-hash", "sha256:" + "00" * 32)
        assert bad.returncode == 2
        line = bad.stdout.strip()
        assert line.startswith("error: CA fingerprint mismatch") and "\n" not in line, bad.stdout + bad.stderr
        assert not (tmp_path / "agent.yaml").exists() and not (tmp_path / "q").exists()
        # No pin at all: the hub's private CA is not in the system trust store, so HTTPS is refused.
        nopin = _init(mesh, token, tmp_path)
        assert nopin.returncode == 2 and "not signed by the trusted CA" in nopin.stdout, nopin.stdout + nopin.stderr
        assert mesh.client.list_endpoints() == []  # the token was never sent: still unused
        good = _init(mesh, token, tmp_path, "--ca-hash", token.ca_hash.upper().replace("SHA256:", "sha256:"))
        assert good.returncode == 0, good.stdout + good.stderr
        cfg, _ = load_config(tmp_path / "agent.yaml")
        assert cfg.mqtt.tls is not None and cfg.mqtt.tls.ca_file == (tmp_path / "q" / "hub-ca.pem").resolve()
        assert oct(cfg.mqtt.tls.ca_file.stat().st_mode & 0o777) == "0o600"


def test_sdk_verifies_the_https_hub(tmp_path: Path, certs: dict) -> None:  # type: ignore[type-arg]
    with LocalMesh(tmp_path / "mesh", tls=True) as mesh:
        assert mesh.tls_files is not None
        with Client(mesh.url, mesh.token, verify=mesh.tls_files.ca_cert) as c:
            assert c.list_endpoints() == []
        with Client(mesh.url, mesh.token, verify=certs["other"].ca_cert) as c, pytest.raises(TlsHandshakeError) as err:
            c.list_endpoints()
        assert "not signed by the trusted CA" in str(err.value)
        with Client(mesh.url.replace("https://", "http://"), mesh.token) as c, pytest.raises(Exception) as plain:
            c.list_endpoints()  # plaintext HTTP to the HTTPS port: the server drops it
        assert not isinstance(plain.value, AssertionError)


def test_broker_config_writes_tls_and_wss_listeners_mosquitto_accepts(tmp_path: Path, certs: dict) -> None:  # type: ignore[type-arg]
    """`mesh-hub broker-config --tls-cert/--tls-key --ws-port` writes listeners a real mosquitto runs."""
    from cloud_hub.store import SqliteStore

    async def mkdb() -> None:
        store = await SqliteStore(tmp_path / "hub.sqlite3").open()
        await store.close()

    asyncio.run(mkdb())
    good = certs["good"]
    tls_port, ws_port = free_port(), free_port()
    base = [sys.executable, "-m", "cloud_hub.cli", "broker-config", "--out", str(tmp_path / "auth"), "--db", str(tmp_path / "hub.sqlite3"),
            "--hub-password", "pw-for-test"]
    r = subprocess.run([*base, "--tls-cert", str(good.server_cert), "--tls-key", str(good.server_key), "--tls-port", str(tls_port),
                        "--ws-port", str(ws_port), "--listen", "127.0.0.1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    listeners = (tmp_path / "auth" / "listeners.conf").read_text()
    assert f"listener {tls_port} 127.0.0.1" in listeners and "protocol websockets" in listeners
    broker = MosquittoBroker(tmp_path / "b", extra_conf=listeners)
    broker.start()
    try:
        _wait_listening(tls_port, ws_port)
        assert _connect(tls_port, tls_context=client_context(good.ca_cert)) is None
        assert _connect(ws_port, tls_context=client_context(good.ca_cert), transport="websockets", websocket_path="/mqtt") is None
    finally:
        broker.stop()
    # A key that does not belong to the certificate: refused, nothing written.
    bad = subprocess.run([*base[:5], str(tmp_path / "auth2"), *base[6:], "--tls-cert", str(good.server_cert), "--tls-key", str(good.ca_key)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "does not belong to the certificate" in bad.stdout, bad.stdout + bad.stderr
    assert not (tmp_path / "auth2").exists()
