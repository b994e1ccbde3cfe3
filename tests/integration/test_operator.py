"""What an operator meets (issue 19, item 0): real `mesh-hub` / `mesh-agent` processes, a real
Mosquitto on free loopback ports, real files read as another local user.

- an embedded broker that cannot start stops the hub with one line naming the port and its holder;
- ``--mqtt-host ''`` means no MQTT; a hub set up for broker auth never connects without its login;
- ``broker-config`` writes files Mosquitto's group can read (0640), and the hub's rewrites keep that;
- ``mesh-agent init`` does not overwrite an enrollment; ``start`` says when it is online;
- secrets at rest (hub database + WAL/SHM, agent queue, credentials) are 0600 and unreadable to others;
- REST is up while the broker is unreachable, and /readyz says why it is not ready;
- the hub and agent log what an operator needs, and repeated warnings are rate-limited.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import pytest

from cloud_hub.broker import MosquittoBroker, free_port
from cloud_hub.broker_auth import ACL_FILE, PASSWORD_FILE, write_broker_files
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from mesh_agent._logs import RateLimitFilter
from tests.conftest import needs_mosquitto
from tests.integration.operator_helpers import BIN, Proc, other_user_cmd, read_as_other_user, wait_http
from tests.pg import pg_url  # noqa: F401  (fixture)

HUB = str(BIN / "mesh-hub")
AGENT = str(BIN / "mesh-agent")


def run(args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **(env or {})})


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A folder every local user may enter (tmp_path is 0700): file modes alone decide who reads."""
    d = Path(tempfile.mkdtemp(prefix="mesh-op-", dir="/tmp"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """An anonymous Mosquitto on a free port: "some broker that answers" (as Debian's on 1883)."""
    b = MosquittoBroker(tmp_path / "other-broker").start()
    try:
        yield b
    finally:
        b.stop()


# ------------------------------------------------------------------ 1. embedded broker on a taken port
@needs_mosquitto
def test_embedded_broker_on_a_taken_port_stops_the_hub_with_one_line(tmp_path: Path, broker: MosquittoBroker) -> None:
    r = run([HUB, "serve", "--db", str(tmp_path / "hub.sqlite3"), "--broker", "embedded", "--mqtt-port", str(broker.port),
             "--port", str(free_port()), "--zmq-bind", ""])
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert f"127.0.0.1:{broker.port} is already in use by pid {broker.proc.pid} (mosquitto)" in out, out
    assert "per-endpoint logins and ACLs" not in out and "hub listening" not in out, out
    assert [line for line in out.splitlines() if line.strip()] == [next(ln for ln in out.splitlines() if "error:" in ln)], out


@needs_mosquitto
def test_embedded_broker_failure_leaves_no_child(tmp_path: Path, broker: MosquittoBroker) -> None:
    from cloud_hub.broker import BrokerError

    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}  # other tests' children in this process are not ours to judge
    embedded = MosquittoBroker(tmp_path / "embedded", port=broker.port, hub_login=("mesh-hub", "pw"))
    with pytest.raises(BrokerError, match=rf"127\.0\.0\.1:{broker.port} is already in use by pid {broker.proc.pid} \(mosquitto\)"):
        embedded.start()
    assert embedded.proc is None
    children = [c for c in me.children(recursive=True) if c.pid != broker.proc.pid and c.pid not in before]
    assert not [c for c in children if c.status() == psutil.STATUS_ZOMBIE or "mosquitto" in c.name()], children


@needs_mosquitto
def test_embedded_broker_runs_locked_down_when_the_port_is_free(tmp_path: Path) -> None:
    """The announcement is printed only once our own broker holds the port, and it does refuse anonymous clients."""
    from tests.integration.peers import MqttPeer

    port, rest = free_port(), free_port()
    hub = Proc([HUB, "serve", "--db", str(tmp_path / "hub.sqlite3"), "--broker", "embedded", "--mqtt-port", str(port),
                "--port", str(rest), "--zmq-bind", ""], tmp_path / "hub.log")
    try:
        hub.wait_for(rf"embedded mosquitto on 127\.0\.0\.1:{port} \(per-endpoint logins and ACLs")
        wait_http(f"http://127.0.0.1:{rest}/readyz")
        anonymous = MqttPeer(port, None, None)
        try:
            assert not anonymous.wait(10) and anonymous.refused is not None
        finally:
            anonymous.close()
    finally:
        assert hub.stop() is not None
    hub.wait_for(r"hub stopped")


# ------------------------------------------------------------------ 2. --mqtt-host '' and broker logins
@needs_mosquitto
def test_mqtt_host_empty_means_no_mqtt_even_with_a_broker_and_env(tmp_path: Path, broker: MosquittoBroker) -> None:
    rest = free_port()
    hub = Proc([HUB, "serve", "--db", str(tmp_path / "hub.sqlite3"), "--mqtt-host", "", "--mqtt-port", str(broker.port),
                "--port", str(rest), "--zmq-bind", f"tcp://127.0.0.1:{free_port()}"], tmp_path / "hub.log",
               env={"MESH_HUB_MQTT_HOST": "127.0.0.1", "MESH_HUB_MQTT_PORT": str(broker.port)})
    try:
        ready = wait_http(f"http://127.0.0.1:{rest}/readyz").json()
        assert ready["broker"] == "none configured", ready
        hub.wait_for(r"hub listening: REST http://127\.0\.0\.1:\d+, no MQTT, ZeroMQ tcp://")
        conns = psutil.Process(hub.proc.pid).net_connections(kind="inet")
        assert not [c for c in conns if c.raddr and c.raddr.port == broker.port], conns
        r = httpx.post(f"http://127.0.0.1:{rest}/v1/endpoints/enroll", json={"token": "ce_xxxxxxxxxxxx", "name": "a", "transport": "mqtt"})
        assert r.status_code == 422 and "no MQTT broker" in r.text
    finally:
        hub.stop()


def test_broker_auth_without_password_refuses_to_start(tmp_path: Path) -> None:
    r = run([HUB, "serve", "--db", str(tmp_path / "hub.sqlite3"), "--port", str(free_port()), "--zmq-bind", ""],
            env={"MESH_HUB_MQTT_AUTH_DIR": str(tmp_path / "auth"), "MESH_HUB_MQTT_PASSWORD": ""})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "MESH_HUB_MQTT_PASSWORD" in lines[0] and "MESH_HUB_MQTT_USERNAME" in lines[0], lines
    assert not (tmp_path / "hub.sqlite3").exists() and not (tmp_path / "auth").exists()  # nothing stored


@needs_mosquitto
def test_hub_with_broker_auth_logs_in_as_mesh_hub_by_default(tmp_path: Path) -> None:
    """The documented default: MESH_HUB_MQTT_USERNAME is mesh-hub; the password is required."""
    locked = MosquittoBroker(tmp_path / "broker", hub_login=("mesh-hub", "s3cret")).start()
    try:
        cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_port=locked.port, zmq_bind=None, mqtt_password="s3cret",
                        mqtt_auth_dir=locked.workdir, mqtt_broker_pid_file=locked.pid_path)
        assert cfg.mqtt_username == "mesh-hub"
        with HubThread(cfg) as hub:
            ready = wait_http(f"{hub.url}/readyz").json()
            assert ready["broker"] == "connected"
    finally:
        locked.stop()


# ------------------------------------------------------------------ 3. broker-config: group and mode
def _mosquitto_group() -> int:
    try:
        return grp.getgrnam("mosquitto").gr_gid
    except KeyError:
        pytest.skip("no group 'mosquitto' (install the Debian mosquitto package)")


def test_broker_config_writes_files_mosquitto_can_read_and_the_hub_keeps_them_so(tmp_path: Path, public_dir: Path) -> None:
    gid = _mosquitto_group()
    if os.geteuid() != 0:
        pytest.skip("needs root to hand files to the mosquitto group")
    db = tmp_path / "hub.sqlite3"
    assert run([HUB, "token", "create", "--user", "alice", "--db", str(db)]).returncode == 0
    out = public_dir / "mesh"
    out.mkdir()
    os.chown(out, 0, gid)
    out.chmod(0o2750)  # the documented setgid group folder
    r = run([HUB, "broker-config", "--db", str(db), "--out", str(out), "--hub-password", "pw"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mode 640, group mosquitto" in r.stdout
    for name in (PASSWORD_FILE, ACL_FILE):
        st = (out / name).stat()
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, 0o640), name
        assert read_as_other_user(out / name, "mosquitto").returncode == 0
        assert read_as_other_user(out / name, "nobody").returncode != 0
    # The hub's own rewrite (after an enrollment) keeps group and mode even outside a setgid folder.
    out.chmod(0o750)
    write_broker_files(out, "mesh-hub", "pw", "mesh", [])
    for name in (PASSWORD_FILE, ACL_FILE):
        st = (out / name).stat()
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (gid, 0o640), name
        assert read_as_other_user(out / name, "mosquitto").returncode == 0


def test_broker_config_group_option_and_bad_group(tmp_path: Path) -> None:
    gid = _mosquitto_group()
    if os.geteuid() != 0:
        pytest.skip("needs root to hand files to the mosquitto group")
    db = tmp_path / "hub.sqlite3"
    assert run([HUB, "token", "create", "--user", "alice", "--db", str(db)]).returncode == 0
    bad = run([HUB, "broker-config", "--db", str(db), "--out", str(tmp_path / "x"), "--hub-password", "pw", "--group", "no-such-group-zz"])
    assert bad.returncode == 2 and "no such group 'no-such-group-zz'" in bad.stdout and not (tmp_path / "x").exists()
    good = run([HUB, "broker-config", "--db", str(db), "--out", str(tmp_path / "y"), "--hub-password", "pw", "--group", "mosquitto"])
    assert good.returncode == 0, good.stdout + good.stderr
    assert (tmp_path / "y" / PASSWORD_FILE).stat().st_gid == gid


def test_broker_config_reads_a_postgresql_hub(tmp_path: Path, pg_url: str) -> None:  # noqa: F811
    made = run([HUB, "token", "create", "--user", "alice", "--database-url", pg_url])
    assert made.returncode == 0, made.stdout + made.stderr
    r = run([HUB, "broker-config", "--database-url", pg_url, "--out", str(tmp_path / "pg"), "--hub-password", "pw"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "pg" / PASSWORD_FILE).read_text().startswith("mesh-hub:$7$")
    assert not (tmp_path / "hub.sqlite3").exists()  # it did not fall back to a SQLite file


# ------------------------------------------------------------------ 4 + 7. agent init/start, hub and agent logs
@needs_mosquitto
def test_operator_session_logs_init_refusal_and_online_line(tmp_path: Path) -> None:
    locked = MosquittoBroker(tmp_path / "broker", hub_login=("mesh-hub", "pw")).start()
    rest, db = free_port(), tmp_path / "hub.sqlite3"
    env = {"MESH_HUB_MQTT_AUTH_DIR": str(locked.workdir), "MESH_HUB_MQTT_PASSWORD": "pw",
           "MESH_HUB_MQTT_BROKER_PID_FILE": str(locked.pid_path), "MESH_HUB_HEARTBEAT_S": "0.5"}
    token = run([HUB, "token", "create", "--user", "alice", "--db", str(db)]).stdout.strip()
    assert token.startswith("cm_")
    hub = Proc([HUB, "serve", "--db", str(db), "--port", str(rest), "--mqtt-port", str(locked.port), "--zmq-bind", ""], tmp_path / "hub.log", env=env)
    agent: Proc | None = None
    try:
        hub.wait_for(rf"hub listening: REST http://127\.0\.0\.1:{rest}, MQTT broker mqtt://127\.0\.0\.1:{locked.port} as mesh-hub")
        hub.wait_for(r"hub MQTT link up")
        url = f"http://127.0.0.1:{rest}"
        from cloud_hub.client import Client

        client = Client(url, token)
        enroll = str(client.create_enrollment_token(uses=1))
        cfg = tmp_path / "agent" / "agent.yaml"
        first = run([AGENT, "init", "--hub", url, "--token", enroll, "--name", "dev-1", "--workers", "1", "-c", str(cfg)])
        assert first.returncode == 0, first.stdout + first.stderr
        ep = client.list_endpoints()[0]["id"]
        hub.wait_for(rf"enrolled endpoint {ep} \(name 'dev-1', transport mqtt\)")
        before = cfg.read_bytes()
        # A second init at the same path is refused before the hub is asked: the single-use token stays unused.
        again = run([AGENT, "init", "--hub", url, "--token", str(client.create_enrollment_token(uses=1)), "--name", "dev-2", "-c", str(cfg)])
        assert again.returncode == 2 and f"of endpoint {ep} (dev-1) already exists: {cfg}" in again.stdout.replace("\n", ""), again.stdout
        assert "--force" in again.stdout and cfg.read_bytes() == before and len(client.list_endpoints()) == 1

        agent = Proc([AGENT, "start", "-c", str(cfg)], tmp_path / "agent.log")
        agent.wait_for(rf"connected to mqtt://127\.0\.0\.1:{locked.port}")
        agent.wait_for(rf"online: {ep} via mqtt to mqtt://127\.0\.0\.1:{locked.port} \(hub {url}\)")
        # The broker goes away and comes back: the agent says so, with the reason, and reconnects.
        mark = len(agent.text())
        locked.stop()
        agent.wait_for(rf"disconnected from mqtt://127\.0\.0\.1:{locked.port}: .+; reconnecting in", after=mark)
        locked.start()
        agent.wait_for(rf"reconnected to mqtt://127\.0\.0\.1:{locked.port} after \d+s offline", after=mark)
        agent.wait_for(rf"online: {ep} via mqtt", after=mark)
        client.revoke_endpoint(ep)
        hub.wait_for(rf"revoked endpoint {ep} \(by user")
        client.close()
    finally:
        if agent is not None:
            agent.stop()
        hub.stop()
        locked.stop()
    hub.wait_for(r"hub shutting down")
    hub.wait_for(r"hub stopped")


# ------------------------------------------------------------------ 5. secrets at rest
def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_secrets_at_rest_are_private_to_their_owner(public_dir: Path) -> None:
    if other_user_cmd() is None:
        pytest.skip("cannot run a command as another user here (not root, or no runuser/setpriv)")
    from cloud_hub.client import Client
    from mesh_agent.config import Credentials
    from mesh_agent.store import AgentStore

    hubdir = public_dir / "hub"
    hubdir.mkdir(mode=0o755)
    hubdir.chmod(0o755)
    with HubThread(HubConfig(db_path=hubdir / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*",
                             bootstrap_user="alice")) as hub:
        Client(hub.url, hub.token).create_enrollment_token()
        files = [hubdir / n for n in ("hub.sqlite3", "hub.sqlite3-wal", "hub.sqlite3-shm")]
        assert all(f.exists() for f in files), list(hubdir.iterdir())
        for f in files:
            assert _mode(f) == 0o600, f
            assert read_as_other_user(f).returncode != 0, f

    agentdir = public_dir / "agent"
    agentdir.mkdir()
    agentdir.chmod(0o755)

    async def queue() -> None:
        store = await AgentStore(agentdir / "queue.sqlite3").open()
        try:
            await store.set_meta("x", "y")
            for f in (agentdir / n for n in ("queue.sqlite3", "queue.sqlite3-wal", "queue.sqlite3-shm")):
                assert _mode(f) == 0o600, f
                assert read_as_other_user(f).returncode != 0, f
        finally:
            await store.close()

    asyncio.run(queue())
    Credentials(endpoint_id="ep-1", key="00" * 32).save(agentdir / "agent.credentials.json")
    assert _mode(agentdir / "agent.credentials.json") == 0o600
    assert read_as_other_user(agentdir / "agent.credentials.json").returncode != 0
    # The control: a world-readable file in the same folder IS readable by that user, so the
    # refusals above come from the modes, not from the folder or the command.
    (agentdir / "public.txt").write_text("hello")
    (agentdir / "public.txt").chmod(0o644)
    assert read_as_other_user(agentdir / "public.txt").stdout == b"hello"


def test_an_old_world_readable_database_is_tightened_on_open(public_dir: Path) -> None:
    import sqlite3

    from mesh_agent.store import AgentStore

    path = public_dir / "queue.sqlite3"
    sqlite3.connect(path).execute("PRAGMA journal_mode=WAL").fetchall()
    path.chmod(0o644)

    async def reopen() -> None:
        store = await AgentStore(path).open()
        await store.close()

    asyncio.run(reopen())
    assert _mode(path) == 0o600


# ------------------------------------------------------------------ 6. REST without the broker; /readyz
@needs_mosquitto
def test_rest_is_up_while_the_broker_is_unreachable_and_readyz_says_why(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there yet
    cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_port=port, zmq_bind=None, bootstrap_user="alice")
    with HubThread(cfg) as hub:
        assert httpx.get(f"{hub.url}/healthz").json()["ok"] is True
        r = httpx.get(f"{hub.url}/readyz")  # no token needed
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["ready"] is False and body["database"] == "ok" and body["migrations"] == "done"
        assert f"mqtt://127.0.0.1:{port}" in body["broker"], body
        # REST works meanwhile (an authenticated call), and readiness follows the broker.
        assert httpx.get(f"{hub.url}/v1/endpoints", headers={"Authorization": f"Bearer {hub.token}"}).status_code == 200
        late = MosquittoBroker(tmp_path / "late", port=port).start()
        try:
            ok = wait_http(f"{hub.url}/readyz", timeout=60).json()
            assert ok == {"ready": True, "migrations": "done", "database": "ok", "broker": "connected"}
        finally:
            late.stop()


# ------------------------------------------------------------------ 7. rate-limited warnings
def test_repeated_warnings_are_rate_limited_and_counted() -> None:
    now = [0.0]
    limiter = RateLimitFilter(60.0, clock=lambda: now[0])
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    handler.addFilter(limiter)
    log = logging.getLogger("test.ratelimit")
    log.propagate = False
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    try:
        for i in range(13):  # every 5 s for a minute, as an unreachable broker did
            log.warning("hub MQTT link down (%s); retrying in %.1fs", "refused", 5.0)
            log.info("info lines always pass %d", i)
            now[0] += 5.0
        log.warning("hub MQTT link down (%s); retrying in %.1fs", "refused", 5.0)
        log.warning("another kind of warning")
    finally:
        log.removeHandler(handler)
    warnings = [s for s in seen if s.startswith("hub MQTT")]
    assert warnings[0] == "hub MQTT link down (refused); retrying in 5.0s"
    assert warnings[1] == "hub MQTT link down (refused); retrying in 5.0s [11 similar messages suppressed in the last 60s]"
    assert len(warnings) == 2 and "another kind of warning" in seen
    assert len([s for s in seen if s.startswith("info lines")]) == 13


def test_a_burst_of_distinct_events_passes_whole_then_is_limited() -> None:
    """Five forged frames in a row are five lines (the attack tests count them); the sixth and
    later within the window are counted, and the count appears on the next line after it."""
    now = [0.0]
    limiter = RateLimitFilter(60.0, burst=5, clock=lambda: now[0])
    passed = []
    for i in range(8):
        rec = logging.LogRecord("mesh_agent", logging.WARNING, __file__, 1, "rejected frame from hub: %s", (f"reason {i}",), None)
        if limiter.filter(rec):
            passed.append(rec.getMessage())
    assert passed == [f"rejected frame from hub: reason {i}" for i in range(5)]
    now[0] += 60.0
    rec = logging.LogRecord("mesh_agent", logging.WARNING, __file__, 1, "rejected frame from hub: %s", ("later",), None)
    assert limiter.filter(rec) and rec.getMessage() == "rejected frame from hub: later [3 similar messages suppressed in the last 60s]"


def test_cli_logging_setup_rate_limits_every_logger() -> None:
    import io

    from mesh_agent._logs import setup_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buf = io.StringIO()
    try:
        setup_logging("INFO", stream=buf)
        for _ in range(12):  # a minute of retries every 5 s
            logging.getLogger("mesh_agent.transport.mqtt").warning("cannot reach %s", "mqtt://x")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert buf.getvalue().count("cannot reach mqtt://x") == 5, "a burst of 5 of a kind, then quiet for the rest of the minute"
