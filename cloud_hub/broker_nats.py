"""A clustered broker: NATS servers with MQTT and JetStream (docs/operations.md, "Clustered broker").

Why NATS: one binary (Debian's ``nats-server``), a cluster of three that survives the loss of any
one node, MQTT 3.1.1 with QoS 1, persistent sessions, wills and retained messages kept in
replicated JetStream streams, per-user subject permissions in a config file that is reloaded on
SIGHUP, and a few MB of memory per idle node. The hub's logins and permissions are the same as for
Mosquitto (cloud_hub.broker_auth): the hub's own user may do anything, each endpoint may publish
only on ``{prefix}/ep/{id}/up`` and read only ``{prefix}/ep/{id}/down``.

NATS specifics found with real runs of nats-server 2.9.10 (tests/integration/test_broker_cluster.py):

- MQTT topic ``mesh/ep/X/up`` is subject ``mesh.ep.X.up``; permissions are written on subjects.
- A QoS 1 subscription is a JetStream consumer that delivers on ``$MQTT.sub.<random>``: a user
  without subscribe permission on ``$MQTT.sub.>`` gets a SUBACK failure ("Subscription Violation").
  Granting it leaks nothing: an MQTT client that subscribes to ``$MQTT/sub/#`` itself is refused,
  and a session restored under another user's client id is checked against the new user's rights.
- Passwords in the config must be plain or bcrypt (``$2b$``): the hub stores a bcrypt hash next to
  the Mosquitto one for every endpoint (broker_auth.broker_hash).
- MQTT needs JetStream, and a clustered JetStream needs ``server_name`` on every node.
- ``max_payload`` defaults to 1 MB, below the hub's 10 MB frames: the node config raises it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import bcrypt

from cloud_hub.broker import BrokerError, free_port, port_taken
from cloud_hub.broker_auth import BrokerAccount, _check_name, _write_atomic, default_group, group_id, hash_part
from mesh_agent.reload import reload_process

__all__ = ["NATS_AUTH_FILE", "NatsCluster", "NatsNode", "find_nats_server", "node_conf", "render_nats_auth", "topic_subject",
           "write_nats_auth"]

log = logging.getLogger(__name__)
#: Included by every node's config (``include ./nats_auth.conf``); the hub rewrites it after each enrollment.
NATS_AUTH_FILE = "nats_auth.conf"
_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def find_nats_server() -> str | None:
    return shutil.which("nats-server") or next((p for p in ("/usr/sbin/nats-server", "/usr/bin/nats-server") if Path(p).exists()), None)


def topic_subject(topic: str) -> str:
    """The NATS subject of an MQTT topic in our layout (``mesh/ep/X/up`` -> ``mesh.ep.X.up``).

    Each level must be a plain token: NATS rewrites ``.`` in a topic as ``//`` and reads ``*``,
    ``>`` as wildcards, so a permission written on such a level would not mean what it says."""
    levels = topic.split("/")
    bad = [lv for lv in levels if not _SUBJECT_TOKEN.match(lv)]
    if bad:
        raise ValueError(f"topic {topic!r}: level {bad[0]!r} is not a plain NATS subject token (letters, digits, _ and -)")
    return ".".join(levels)


def _q(text: str) -> str:
    """A double-quoted NATS config string (quoted, a bcrypt ``$2b$`` is not read as a variable)."""
    return json.dumps(text)


def _user(name: str, pw_hash: str, publish: list[str], subscribe: list[str]) -> str:
    return (f"    {{user: {_q(_check_name(name))}, password: {_q(pw_hash)}, allowed_connection_types: [\"MQTT\"],\n"
            f"     permissions: {{publish: {json.dumps(publish)}, subscribe: {json.dumps(subscribe)}}}}}\n")


def render_nats_auth(hub_user: str, hub_bcrypt: str, prefix: str, accounts: Iterable[BrokerAccount],
                     peer_hubs: Iterable[tuple[str, str]] = ()) -> tuple[str, list[str]]:
    """The ``authorization`` block every node includes, and the endpoints left out (no bcrypt hash:
    enrolled before the hub stored one; they need ``mesh-agent init`` again to use a NATS cluster).

    MQTT-only users (``allowed_connection_types``): a leaked endpoint password cannot open a plain
    NATS connection, where JetStream's API would be one more surface."""
    out = ["# Written by the Continuum Mesh hub (mesh-hub broker-config --kind nats); rewritten on every enrollment.",
           "# Each endpoint: publish its own up subject, read its own down subject ($MQTT.sub.> carries QoS 1 deliveries).",
           "authorization {", "  users = ["]
    out.append(_user(hub_user, hub_bcrypt, [">"], [">"]).rstrip("\n"))
    skipped: list[str] = []
    for name, stored in peer_hubs:
        h = hash_part(stored, "bcrypt")
        if h is None:
            skipped.append(f"hub replica {name}")
            continue
        out.append(_user(name, h, [">"], [">"]).rstrip("\n"))
    for a in accounts:
        h = hash_part(a.password_hash, "bcrypt")
        if h is None:
            skipped.append(a.endpoint_id)
            continue
        up = topic_subject(f"{prefix}/ep/{_check_name(a.endpoint_id)}/up")
        down = topic_subject(f"{prefix}/ep/{a.endpoint_id}/down")
        # a site gateway (docs/sites.md) also relays its devices' subjects
        ups = [up, *(topic_subject(f"{prefix}/ep/{_check_name(d)}/up") for d in a.relays)]
        downs = [down, *(topic_subject(f"{prefix}/ep/{d}/down") for d in a.relays)]
        out.append(_user(a.username, h, ups, [*downs, "$MQTT.sub.>"]).rstrip("\n"))
    out += ["  ]", "}", ""]
    return "\n".join(out), skipped


def write_nats_auth(directory: Path, hub_user: str, hub_password: str, prefix: str, accounts: Iterable[BrokerAccount],
                    peer_hubs: Iterable[tuple[str, str]] = (), *, group: str | int | None = None) -> tuple[Path, list[str]]:
    """Write ``nats_auth.conf`` (0640, atomically, keeping an existing file's owner, group and mode)
    into ``directory``; returns its path and the endpoints left out (see :func:`render_nats_auth`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    gid = group_id(group) if group is not None else None
    hub_hash = bcrypt.hashpw(hub_password.encode(), bcrypt.gensalt(4)).decode()
    text, skipped = render_nats_auth(hub_user, hub_hash, prefix, list(accounts), list(peer_hubs))
    path = directory / NATS_AUTH_FILE
    _write_atomic(path, text, gid if gid is not None or path.exists() else default_group(directory))
    if skipped:
        log.warning("NATS logins left out (no bcrypt hash, enrolled before it was stored; enroll them again): %s", ", ".join(skipped))
    return path, skipped


def node_conf(name: str, *, host: str, client_port: int, cluster_port: int, mqtt_port: int, routes: Iterable[str], store_dir: Path,
              auth_include: str, http_port: int | None = None, cluster_name: str = "mesh", replicas: int = 3) -> str:
    """One node's nats-server config: MQTT on ``mqtt_port``, JetStream in ``store_dir``, a route to
    each other node, and the hub's ``nats_auth.conf`` included (``auth_include``: a path relative to
    the config file's folder; nats-server 2.9 resolves include paths that way, even absolute ones).

    ``stream_replicas``: MQTT's sessions, retained messages and QoS 1 messages are kept on
    ``replicas`` nodes, so any one node may die. ``ack_wait`` 30 s: an unacked QoS 1 delivery is
    sent again after that (the hub's lease re-queues a task the agent never acked anyway)."""
    route_urls = ", ".join(_q(f"nats-route://{r}") for r in routes)
    cluster = f"cluster {{ name: {_q(cluster_name)}, listen: {_q(f'{host}:{cluster_port}')}, routes: [{route_urls}] }}"
    lines = [
        f"server_name: {_q(name)}",
        f"listen: {_q(f'{host}:{client_port}')}",
        "max_payload: 16MB  # the hub's frames go up to max_payload_bytes (10 MB) plus framing",
        f"jetstream {{ store_dir: {_q(str(store_dir))}, max_memory_store: 256MB, max_file_store: 8GB }}",
        cluster if route_urls else "# one node: no cluster block (a clustered JetStream wants routes)",
        f"mqtt {{ listen: {_q(f'{host}:{mqtt_port}')}, ack_wait: \"30s\", max_ack_pending: 1000, stream_replicas: {replicas} }}",
        f"include {_q(auth_include)}",
    ]
    if http_port is not None:
        lines.insert(2, f"http: {_q(f'{host}:{http_port}')}  # monitoring: /healthz, /varz, /connz")
    return "\n".join(lines) + "\n"


@dataclass
class NatsNode:
    name: str
    client_port: int
    cluster_port: int
    mqtt_port: int
    http_port: int
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class NatsCluster:
    """A NATS cluster on this machine (tests, a one-box deployment): ``nodes`` servers on free
    ports, each with its own config and JetStream store under ``workdir``.

    Looks like :class:`cloud_hub.broker.MosquittoBroker` where the hub and LocalMesh need it
    (``workdir`` holds the auth file, ``pid_path`` the nodes' pids, ``port`` the first node's MQTT
    port), and :meth:`hub_settings` gives the rest of the hub's broker settings."""

    def __init__(self, workdir: Path, hub_login: tuple[str, str], *, nodes: int = 3, host: str = "127.0.0.1", prefix: str = "mesh") -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.workdir = Path(workdir)
        self.host = host
        self.prefix = prefix
        self.hub_login = hub_login
        self.nodes = [NatsNode(f"n{i}", free_port(), free_port(), free_port(), free_port()) for i in range(nodes)]

    @property
    def port(self) -> int:
        return self.nodes[0].mqtt_port

    @property
    def pid_path(self) -> Path:
        return self.workdir / "broker.pid"

    @property
    def mqtt_hosts(self) -> list[str]:
        return [f"{self.host}:{n.mqtt_port}" for n in self.nodes]

    def hub_settings(self) -> dict[str, Any]:
        """HubConfig fields for a hub on this cluster: kind, every node, where to write and whom to SIGHUP."""
        return {"mqtt_broker_kind": "nats", "mqtt_host": self.host, "mqtt_port": self.port, "mqtt_hosts": self.mqtt_hosts,
                "mqtt_auth_dir": self.workdir, "mqtt_broker_pid_file": self.pid_path}

    def conf_path(self, node: NatsNode) -> Path:
        return self.workdir / f"{node.name}.conf"

    def write_configs(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        auth = self.workdir / NATS_AUTH_FILE
        if not auth.exists():  # the hub adds the endpoints when it starts
            write_nats_auth(self.workdir, *self.hub_login, prefix=self.prefix, accounts=[])
        for node in self.nodes:
            routes = [f"{self.host}:{o.cluster_port}" for o in self.nodes if o is not node]
            self.conf_path(node).write_text(node_conf(
                node.name, host=self.host, client_port=node.client_port, cluster_port=node.cluster_port, mqtt_port=node.mqtt_port,
                routes=routes, store_dir=self.workdir / f"js-{node.name}", auth_include=auth.name, http_port=node.http_port,
                replicas=min(3, len(self.nodes))))

    def _write_pids(self) -> None:
        self.pid_path.write_text("".join(f"{n.proc.pid}\n" for n in self.nodes if n.alive and n.proc is not None))

    def start(self, timeout: float = 30.0) -> "NatsCluster":
        exe = find_nats_server()
        if exe is None:
            raise BrokerError("nats-server is not installed (Debian: apt-get install nats-server); ./taskw setup installs it")
        for node in self.nodes:
            for port in (node.client_port, node.cluster_port, node.mqtt_port, node.http_port):
                if port_taken(self.host, port):
                    raise BrokerError(f"cannot start NATS node {node.name}: {self.host}:{port} is already in use")
        self.write_configs()
        for node in self.nodes:
            self._spawn(exe, node)
        self._write_pids()
        self.wait_ready(timeout)
        return self

    def _spawn(self, exe: str, node: NatsNode) -> None:
        logf = open(self.workdir / f"{node.name}.log", "ab")
        node.proc = subprocess.Popen([exe, "-c", str(self.conf_path(node))], stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        logf.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Every live node answers /healthz with JetStream current (MQTT sessions need it) and accepts MQTT connections."""
        deadline = time.monotonic() + timeout
        pending = [n for n in self.nodes if n.alive]
        while pending and time.monotonic() < deadline:
            node = pending[0]
            if node.proc is not None and node.proc.poll() is not None:
                raise BrokerError(f"NATS node {node.name} exited with {node.proc.returncode}: {self.log_tail(node)}")
            if self._healthy(node):
                pending.pop(0)
            else:
                time.sleep(0.1)
        if pending:
            raise BrokerError(f"NATS node {pending[0].name} not ready within {timeout}s: {self.log_tail(pending[0])}")

    def _healthy(self, node: NatsNode) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{node.http_port}/healthz", timeout=1) as r:
                if json.loads(r.read()).get("status") != "ok":
                    return False
            with socket.create_connection((self.host, node.mqtt_port), timeout=0.5):
                return True
        except (OSError, ValueError):
            return False

    def monitor(self, node: NatsNode, path: str) -> dict[str, Any]:
        """A monitoring endpoint of one node (``varz``: memory; ``connz?mqtt_client=...``: who is connected)."""
        with urllib.request.urlopen(f"http://{self.host}:{node.http_port}/{path}", timeout=2) as r:
            return json.loads(r.read())  # type: ignore[no-any-return]

    def log_tail(self, node: NatsNode) -> str:
        try:
            lines = (self.workdir / f"{node.name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        return lines[-1] if lines else "empty log"

    def reload(self) -> None:
        for node in self.nodes:
            if node.alive and node.proc is not None:
                reload_process(node.proc.pid)

    def kill(self, node: NatsNode) -> None:
        """SIGKILL one node (a crashed machine, as far as the others can tell)."""
        if node.alive and node.proc is not None:
            node.proc.kill()
            node.proc.wait(10)
        self._write_pids()

    def restart(self, node: NatsNode, timeout: float = 30.0) -> None:
        exe = find_nats_server()
        assert exe is not None
        self._spawn(exe, node)
        self._write_pids()
        self.wait_ready(timeout)

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive and node.proc is not None:
                node.proc.terminate()
        for node in self.nodes:
            if node.proc is not None:
                try:
                    node.proc.wait(10)
                except subprocess.TimeoutExpired:
                    node.proc.kill()
                    node.proc.wait(5)
            node.proc = None
        if self.pid_path.exists():
            self.pid_path.write_text("")

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
