"""Raw MQTT peers for attacker and bad-input tests: what someone with some broker login (or none) can do."""

from __future__ import annotations

import threading
import time
from typing import Any

import paho.mqtt.client as paho

from cloud_hub.broker_auth import mosquitto_hash
from cloud_hub.localmesh import LocalMesh

__all__ = ["MqttPeer", "add_intruder", "connect_intruder"]


class MqttPeer:
    """A raw paho client: what an attacker with some broker login (or none) can do."""

    def __init__(self, port: int, username: str | None, password: str | None, client_id: str = "", clean_session: bool | None = None) -> None:
        """``clean_session=False``: resume the broker's stored session for ``client_id`` (a session-takeover attempt)."""
        self.frames: list[tuple[str, bytes]] = []
        self.connected = threading.Event()
        self.refused: int | None = None
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean_session)
        if username is not None:
            self.client.username_pw_set(username, password)
        self.client.on_connect = self._on_connect
        self.client.on_message = lambda c, u, m: self.frames.append((m.topic, bytes(m.payload)))
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any = None) -> None:
        if rc.is_failure:
            self.refused = rc.value
        else:
            self.connected.set()

    def wait(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.refused is None and not self.connected.is_set():
            time.sleep(0.02)
        return self.connected.is_set()

    def subscribe(self, topic: str) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *a: done.set()
        self.client.subscribe(topic, qos=1)
        assert done.wait(5)

    def publish(self, topic: str, frame: bytes) -> None:
        self.client.publish(topic, frame, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def add_intruder(mesh: LocalMesh) -> tuple[str, str]:
    """Simulate an attacker who controls the broker (or the hub's broker login): full read/write."""
    user, pw = "intruder", "intruder-password"
    broker_dir = mesh.broker.workdir
    with open(broker_dir / "password_file", "a") as f:
        f.write(f"{user}:{mosquitto_hash(pw)}\n")
    with open(broker_dir / "acl_file", "a") as f:
        f.write(f"\nuser {user}\ntopic readwrite #\n")
    mesh.broker.reload()
    return user, pw


def connect_intruder(mesh: LocalMesh) -> MqttPeer:
    """An MQTT client with full broker access, connected (retrying while the broker reloads its files).

    The hub rewrites the broker's password and ACL files from its database whenever broker
    logins change; a rewrite that lands after ``add_intruder`` appended its login drops it (seen
    once in an idle CI run: 10 s without a connection). So each retry adds the login again when
    the file no longer has it."""
    login = add_intruder(mesh)
    deadline = time.monotonic() + 20
    while True:
        peer = MqttPeer(mesh.broker.port, *login)
        if peer.wait(1) or time.monotonic() > deadline:
            return peer
        peer.close()
        if f"{login[0]}:" not in (mesh.broker.workdir / "password_file").read_text():
            add_intruder(mesh)
