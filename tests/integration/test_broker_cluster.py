"""A clustered broker (docs/operations.md, "Clustered broker"): three real nats-server nodes with
MQTT and JetStream on loopback ports, a real hub writing their logins and permissions, real agent
processes with the nodes as their broker list.

- One node is SIGKILLed in the middle of a stream of tasks (the node the agents and the hub are
  connected to): every task still gets exactly one result, and everyone fails over to another node.
- The per-endpoint permissions the hub writes hold: an endpoint cannot read or write another's
  topics, nor take its session by its client id.
- Bad input (an unknown broker kind, a malformed broker list) is a one-line error that writes nothing.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from cloud_hub.broker_nats import NATS_AUTH_FILE, NatsCluster, find_nats_server
from cloud_hub.client import Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.config import AgentConfig, ConfigError, load_config
from mesh_agent.transport.mqtt import down_topic, up_topic
from tests.integration.peers import MqttPeer
from tests.waiting import wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_nats_server() is None, reason="nats-server not installed (Debian package nats-server; ./taskw setup installs it)"),
]


def record(path: str, i: int) -> int:
    """One line per execution, so a task run twice would show."""
    with open(path, "a") as f:
        f.write(f"{i}\n")
    return i * i


def use_cluster(agent: AgentProcess, cluster: NatsCluster) -> None:
    """The agent's broker list: every node, the first one first (what an operator adds to the config)."""
    data = agent.cfg.model_dump(mode="json")
    data["mqtt"]["hosts"] = cluster.mqtt_hosts
    agent.cfg = AgentConfig.model_validate(data)
    agent.cfg.save(agent.config_path)


def log_times(agent: AgentProcess, pattern: str) -> list[tuple[float, str]]:
    """(wall-clock time, line) of the agent's log lines matching ``pattern``."""
    out = []
    for line in agent.log_path.read_text(errors="replace").splitlines():
        if re.search(pattern, line):
            stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            out.append((stamp.timestamp(), line))
    return out


@pytest.fixture()
def cluster_mesh(tmp_path: Path) -> Iterator[LocalMesh]:
    m = LocalMesh(tmp_path, lease_s=10.0, broker_factory=lambda wd, login: NatsCluster(wd, login, nodes=3))
    m.start()
    try:
        yield m
    finally:
        m.stop()


@pytest.mark.timeout(300)
def test_killing_the_node_everyone_uses_loses_no_task(cluster_mesh: LocalMesh, tmp_path: Path) -> None:
    mesh = cluster_mesh
    cluster: NatsCluster = mesh.broker
    first = cluster.nodes[0]
    agents = [mesh.add_agent(f"a{i}", "mqtt", start=False, workers=2) for i in range(2)]
    for a in agents:
        use_cluster(a, cluster)
        a.start()
    mesh.wait_online(*agents, timeout=60)
    hub_link = next(link for link in mesh.hub.hub.dispatcher.links if link.name == "mqtt")  # type: ignore[union-attr]
    assert hub_link.address == f"mqtt://127.0.0.1:{first.mqtt_port}"
    for a in agents:
        assert log_times(a, rf"connected to mqtt://127\.0\.0\.1:{first.mqtt_port}\b"), a.log_path.read_text()[-2000:]
    # the hub wrote one login per endpoint into the file every node includes
    auth = (cluster.workdir / NATS_AUTH_FILE).read_text()
    assert all(f'"{a.endpoint_id}"' in auth and f"mesh.ep.{a.endpoint_id}.up" in auth for a in agents)

    marker = tmp_path / "runs"
    total, waves = 240, 12
    futures: list[Any] = []
    kill_at: float | None = None
    executors = [Executor(mesh.client, a.endpoint_id) for a in agents]
    try:
        for w in range(waves):
            for k in range(total // waves):
                i = w * (total // waves) + k
                futures.append(executors[i % 2].submit(record, str(marker), i))
            if w == waves // 3:
                # a third of the stream is done: kill the node the agents (and the hub) are on
                wait_for(lambda: sum(f.done() for f in futures) >= len(futures) // 2, "a first share of results", timeout=60)
                kill_at = time.time()
                cluster.kill(first)
            time.sleep(0.1)
        results = [f.result(timeout=180) for f in futures]
    finally:
        for ex in executors:
            ex.shutdown(wait=False)
    assert kill_at is not None
    assert results == [i * i for i in range(total)]

    # every task has exactly one result at the hub, and none is left unfinished
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        per_task = db.execute("SELECT t.id, COUNT(r.task_id) FROM tasks t LEFT JOIN results r ON r.task_id = t.id GROUP BY t.id").fetchall()
        undone = db.execute("SELECT COUNT(*) FROM tasks WHERE state != 'done'").fetchone()[0]
    assert len(per_task) == total and all(n == 1 for _, n in per_task) and undone == 0
    runs = [int(x) for x in marker.read_text().split()]
    assert set(runs) == set(range(total))  # every task ran (a re-run after a lost ack would show as a repeat)

    # everyone moved to a surviving node
    survivors = {n.mqtt_port for n in cluster.nodes if n is not first}
    wait_for(lambda: hub_link.connected, "the hub's link back on a surviving node", 30)
    assert int(hub_link.address.rsplit(":", 1)[1]) in survivors
    failover = {}
    for a in agents:
        back = [(t, line) for t, line in log_times(a, r"reconnected to mqtt://127\.0\.0\.1:\d+") if t >= kill_at - 0.01]
        assert back, a.log_path.read_text()[-3000:]
        assert int(re.search(r":(\d+) after", back[0][1])[1]) in survivors  # type: ignore[index]
        failover[a.cfg.name] = round(back[0][0] - kill_at, 3)
    import psutil

    costs = {}  # what the docs quote: memory, bytes through each node, JetStream's stored bytes
    for n in cluster.nodes:
        if n.alive and n.proc is not None:
            varz, jsz = cluster.monitor(n, "varz"), cluster.monitor(n, "jsz")
            costs[n.name] = {"rss": psutil.Process(n.proc.pid).memory_info().rss, "in_bytes": varz["in_bytes"], "out_bytes": varz["out_bytes"],
                             "js_store_bytes": jsz.get("storage"), "js_mem_bytes": jsz.get("memory")}
    print(json.dumps({"tasks": total, "re_runs": len(runs) - total, "agent_reconnect_s_after_kill": failover,
                      "hub_link_now": hub_link.address, "nodes": costs, "date": dt.date.today().isoformat()}))


@pytest.mark.timeout(180)
def test_an_endpoint_reads_and_writes_only_its_own_topics(cluster_mesh: LocalMesh) -> None:
    mesh = cluster_mesh
    cluster: NatsCluster = mesh.broker
    victim = mesh.add_agent("victim", "mqtt", start=False)
    thief = mesh.add_agent("thief", "mqtt", start=False)  # a device the attacker controls: its login
    v, t = load_config(victim.config_path)[1], load_config(thief.config_path)[1]
    node = cluster.nodes[1].mqtt_port  # any node: the permissions are the cluster's
    hub_user, hub_pw = mesh.hub_cfg.mqtt_username, mesh.hub_cfg.mqtt_password

    thief_peer = MqttPeer(node, t.mqtt_username, t.mqtt_password, client_id="thief-a")
    victim_peer = MqttPeer(node, v.mqtt_username, v.mqtt_password, client_id=f"agent-{victim.endpoint_id}", clean_session=False)
    hub_peer = MqttPeer(cluster.nodes[2].mqtt_port, hub_user, hub_pw, client_id="hub-observer")
    peers = [thief_peer, victim_peer, hub_peer]
    try:
        # A NATS node sets up JetStream state for each new MQTT session: seconds under load (the
        # whole suite beside it), so the connects get 30 s, not the helper's default 10 s.
        up = [p.wait(30.0) for p in peers]
        assert all(up), [(name, ok, p.refused) for name, p, ok in zip(("thief", "victim", "hub"), peers, up)]
        hub_peer.subscribe("mesh/ep/+/up")
        victim_peer.subscribe(down_topic("mesh", victim.endpoint_id))
        thief_peer.subscribe(down_topic("mesh", thief.endpoint_id))  # its own: allowed (the positive control)
        for topic in (down_topic("mesh", victim.endpoint_id), "mesh/ep/+/down", "mesh/#", "#", "$MQTT/sub/#", "$MQTT/#"):
            thief_peer.subscribe(topic)  # the broker answers with a failure code; nothing may arrive
        hub_peer.publish(down_topic("mesh", victim.endpoint_id), b"for-the-victim")
        hub_peer.publish(down_topic("mesh", thief.endpoint_id), b"for-the-thief")
        thief_peer.publish(up_topic("mesh", victim.endpoint_id), b"forged-as-victim")
        thief_peer.publish(up_topic("mesh", thief.endpoint_id), b"thief-own-up")
        wait_for(lambda: (down_topic("mesh", victim.endpoint_id), b"for-the-victim") in victim_peer.frames, "the victim's own frame", 20)
        wait_for(lambda: (up_topic("mesh", thief.endpoint_id), b"thief-own-up") in hub_peer.frames, "the thief's own up frame", 20)
        wait_for(lambda: (down_topic("mesh", thief.endpoint_id), b"for-the-thief") in thief_peer.frames, "the thief's own down frame", 20)
        assert thief_peer.frames == [(down_topic("mesh", thief.endpoint_id), b"for-the-thief")]
        assert (up_topic("mesh", victim.endpoint_id), b"forged-as-victim") not in hub_peer.frames
    finally:
        for p in peers:
            p.close()

    # the victim's session, queued while it is away, is not the thief's for claiming its client id
    hub_peer = MqttPeer(cluster.nodes[2].mqtt_port, hub_user, hub_pw, client_id="hub-observer-2")
    try:
        assert hub_peer.wait()
        hub_peer.publish(down_topic("mesh", victim.endpoint_id), b"queued-for-the-victim")
    finally:
        hub_peer.close()
    squatter = MqttPeer(node, t.mqtt_username, t.mqtt_password, client_id=f"agent-{victim.endpoint_id}", clean_session=False)
    try:
        squatter.wait()
        time.sleep(1.0)  # long enough for a restored subscription to deliver; what matters is what arrived
        assert squatter.frames == []
    finally:
        squatter.close()
    back = MqttPeer(node, v.mqtt_username, v.mqtt_password, client_id=f"agent-{victim.endpoint_id}", clean_session=False)
    try:
        assert back.wait()
        wait_for(lambda: (down_topic("mesh", victim.endpoint_id), b"queued-for-the-victim") in back.frames, "the victim's queued frame", 20)
    finally:
        back.close()
    # wrong passwords are refused at CONNECT
    for user, pw in ((victim.endpoint_id, t.mqtt_password), (hub_user, "guess"), (None, None)):
        p = MqttPeer(node, user, pw)
        try:
            assert not p.wait(5), (user, pw)
        finally:
            p.close()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "cloud_hub.cli", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def test_broker_config_kind_nats_and_bad_input(cluster_mesh: LocalMesh, tmp_path: Path) -> None:
    mesh = cluster_mesh
    agent = mesh.add_agent("one", "mqtt", start=False)
    db = str(mesh.hub_cfg.db_path)
    out = tmp_path / "cfg"

    bad = _cli("broker-config", "--kind", "rabbitmq", "--out", str(out), "--db", db, "--hub-password", "x")
    assert bad.returncode == 2 and "--kind" in bad.stdout + bad.stderr and not out.exists()
    assert len((bad.stdout + bad.stderr).strip().splitlines()) == 1, bad.stdout + bad.stderr

    ok = _cli("broker-config", "--kind", "nats", "--out", str(out), "--db", db, "--hub-password", "hub-secret")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    text = (out / NATS_AUTH_FILE).read_text()
    assert f'"{agent.endpoint_id}"' in text and f'"mesh.ep.{agent.endpoint_id}.up"' in text and "$MQTT.sub.>" in text
    assert not (out / "password_file").exists() and not (out / "acl_file").exists()
    assert "include" in ok.stdout and "mqtt" in ok.stdout

    # a malformed broker list in an agent's config: one line naming the entry, the file untouched
    before = agent.config_path.read_text()
    data = agent.cfg.model_dump(mode="json")
    data["mqtt"]["hosts"] = ["127.0.0.1:1883", "node-2:notaport"]
    broken = tmp_path / "broken.yaml"
    import yaml

    broken.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"node-2:notaport") as exc:
        load_config(broken)
    assert "\n" not in str(exc.value).strip()
    run = subprocess.run([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(broken)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "node-2:notaport" in run.stdout + run.stderr and "Traceback" not in run.stdout + run.stderr
    assert agent.config_path.read_text() == before

    # and in the hub's settings
    bad_hub = _cli("broker-config", "--out", str(tmp_path / "x"), "--db", db, "--hub-password", "x", env={"MESH_HUB_MQTT_HOSTS": "a:1,b:c"})
    assert bad_hub.returncode == 2 and "b:c" in bad_hub.stdout + bad_hub.stderr and not (tmp_path / "x").exists()
