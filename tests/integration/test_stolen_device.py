"""A stolen device is not a way into the user's machine (issue 25 item 8; docs/security.md, "What a
stolen device key can and cannot do"). Real hub, real Mosquitto with per-endpoint logins, a real
agent process enrolled as a field device is: not trusted.

- Its results decode as data: numpy arrays and built-in exceptions come back; a custom object is
  refused with ``UntrustedResult`` naming the endpoint and both settings that would trust it.
- The owner marks it trusted (``Client.set_endpoint_trusted``): the same results unpickle, already
  stored ones included, on the REST path and on the stream (early results too); another user it is
  shared with still gets data only. Bad trust requests are one-line errors and change nothing.
- Frames forged with the device's broker login (wrong key, stale, replayed, another endpoint's)
  are refused, change nothing stored, and show in ``/metrics`` as
  ``mesh_frames_rejected_total{endpoint, reason}``; a channel of no enrolled endpoint is "unknown".
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from typing import Any, Callable

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cloud_hub.client import Client, Executor, HubError
from cloud_hub.client._results import (
    RemoteExecutionError,
    RemoteTraceback,
    UntrustedResult,
)
from cloud_hub.localmesh import LocalMesh
from mesh_agent.config import load_config
from mesh_agent.protocol import Envelope, Kind, encode, new_key
from mesh_agent.transport.mqtt import up_topic
from tests.integration.peers import MqttPeer, connect_intruder

pytestmark = pytest.mark.integration


class Loot:
    """A result only a pickle can carry: its class is named in the stream."""

    def __init__(self, v: int) -> None:
        self.v = v


class FieldError(Exception):
    pass


def returns_loot(v: int) -> Loot:
    return Loot(v)


def returns_array(n: int) -> dict:
    return {"w": [np.arange(n, dtype=np.float32).reshape(1, n), np.ones(2)], "n": np.int64(n), "s": np.array(["a", "b"])}


def divide(a: int, b: int) -> float:
    return a / b


def raises_custom() -> None:
    raise FieldError("a custom error")


def _token_for(mesh: LocalMesh, user: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "token", "create", "--user", user, "--db", str(mesh.hub_cfg.db_path)],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().splitlines()[-1]


def _stored(mesh: LocalMesh) -> dict[str, Any]:
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        out: dict[str, Any] = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("tasks", "results", "functions", "endpoints")}
        out["trusted"] = dict(db.execute("SELECT id, trusted FROM endpoints").fetchall())
        return out


def _wait(pred: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _rejected(mesh: LocalMesh) -> dict[tuple[str, str], float]:
    r = httpx.get(f"{mesh.url}/metrics", timeout=30)
    assert r.status_code == 200
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(r.text):
        if fam.name == "mesh_frames_rejected":
            for s in fam.samples:
                if s.name == "mesh_frames_rejected_total":
                    out[(s.labels["endpoint"], s.labels["reason"])] = s.value
    return out


def test_an_untrusted_endpoint_returns_data_only_until_its_owner_trusts_it(mesh: LocalMesh) -> None:
    alice = mesh.client
    pi = mesh.add_agent("field-pi", "mqtt", trusted=False)  # as `mesh-agent init` enrolls a field device
    mesh.wait_online(pi)
    ep = pi.endpoint_id
    assert alice.get_endpoint(ep)["trusted"] is False
    assert [e["trusted"] for e in alice.list_endpoints() if e["id"] == ep] == [False]

    with Executor(alice, ep, early_results=True) as ex:  # results as the agent sends them, then stored ones
        out = ex.submit(returns_array, 3).result(60)  # numpy arrays are data
        assert np.array_equal(out["w"][0], [[0, 1, 2]]) and out["w"][0].dtype == np.float32 and out["n"] == 3
        assert list(out["s"]) == ["a", "b"]
        with pytest.raises(ZeroDivisionError) as zde:  # a built-in exception, rebuilt by name
            ex.submit(divide, 1, 0).result(60)
        assert isinstance(zde.value.__cause__, RemoteTraceback) and "ZeroDivisionError" in zde.value.__cause__.tb
        with pytest.raises(RemoteExecutionError) as rex:  # anything else is never unpickled
            ex.submit(raises_custom).result(60)
        assert rex.value.remote_type.endswith("FieldError") and "a custom error" in str(rex.value)
        with pytest.raises(UntrustedResult) as info:
            ex.submit(returns_loot, 1).result(60)
    msg = str(info.value)
    assert "\n" not in msg and ep in msg and "not marked trusted" in msg, msg
    assert f"set_endpoint_trusted({ep!r}, True)" in msg and f"trusted_endpoints=[{ep!r}]" in msg, msg
    fid = alice.register_function(returns_loot)
    stored_task = alice.submit(ep, fid, 2)
    with pytest.raises(UntrustedResult):  # the REST path, the same rule
        alice.get_result(stored_task, timeout_s=60)

    # bad trust requests: one line each, nothing stored
    bob_token = _token_for(mesh, "bob")
    alice.share_endpoint(ep, "bob")
    bob = Client(mesh.url, bob_token)
    before = _stored(mesh)
    try:
        for who, body, status, text in ((bob, {"trusted": True}, 403, f"only the owner of endpoint {ep} can mark it trusted"),
                                        (alice, {"trusted": "yes"}, 422, "trusted"), (alice, {}, 422, "trusted"),
                                        (alice, {"trusted": True, "extra": 1}, 422, "extra")):
            with pytest.raises(HubError) as err:
                who.request("PUT", f"/v1/endpoints/{ep}/trusted", json=body)
            assert err.value.status == status and text in str(err.value.detail), err.value.detail
        with pytest.raises(HubError) as err:
            alice.set_endpoint_trusted("ep-000000000000", True)
        assert err.value.status == 404 and "unknown endpoint" in str(err.value.detail)
        assert _stored(mesh) == before

        # the owner marks it trusted: the stored result now unpickles, and so do new ones
        assert alice.set_endpoint_trusted(ep, True) is True
        assert alice.get_endpoint(ep)["trusted"] is True
        assert alice.get_result(stored_task, timeout_s=60).v == 2
        with Executor(alice, ep, early_results=True) as ex:
            assert ex.submit(returns_loot, 3).result(60).v == 3
        with Executor(alice, ep, stream=False) as ex:
            assert ex.submit(returns_loot, 4).result(60).v == 4

        # another user it is shared with: the owner's flag is the owner's alone
        with Executor(bob, ep) as ex:
            assert np.array_equal(ex.submit(returns_array, 2).result(60)["w"][1], np.ones(2))
            with pytest.raises(UntrustedResult) as info:
                ex.submit(returns_loot, 5).result(60)
        assert "not yours" in str(info.value) and f"trusted_endpoints=[{ep!r}]" in str(info.value)
        assert "set_endpoint_trusted" not in str(info.value)
        trusting = Client(mesh.url, bob_token, trusted_endpoints=[ep])
        try:
            with Executor(trusting, ep) as ex:
                assert ex.submit(returns_loot, 6).result(60).v == 6
        finally:
            trusting.close()

        # unmarked again: data only, for results already stored too
        assert alice.set_endpoint_trusted(ep, False) is False
        with pytest.raises(UntrustedResult):
            alice.get_result(stored_task, timeout_s=60)
    finally:
        bob.close()


def test_forged_frames_are_refused_counted_per_endpoint_and_store_nothing(mesh: LocalMesh) -> None:
    pi = mesh.add_agent("stolen-pi", "mqtt", trusted=False)
    mesh.wait_online(pi)
    ep = pi.endpoint_id
    creds = load_config(pi.config_path)[1]
    key = bytes.fromhex(creds.key)
    with Executor(mesh.client, ep) as ex:
        assert ex.submit(pow, 2, 5).result(60) == 32
    before = _stored(mesh)
    assert not any(e == ep for e, _ in _rejected(mesh))

    # the device is in a thief's hands: what its broker login can publish on its topic
    pi.stop()
    thief = MqttPeer(mesh.broker.port, creds.mqtt_username, creds.mqtt_password, client_id=f"thief-{ep}")
    intruder = connect_intruder(mesh)  # full broker access: a channel of no enrolled endpoint
    try:
        assert thief.wait()
        up = up_topic("mesh", ep)
        thief.publish(up, encode(Envelope(Kind.HEARTBEAT, ep, {}), new_key()))  # signed with a wrong key
        thief.publish(up, encode(Envelope(Kind.HEARTBEAT, ep, {}, ts=time.time() - 3600, exp=time.time() - 3000), key))  # stale
        replayed = encode(Envelope(Kind.HEARTBEAT, ep, {}), key)
        thief.publish(up, replayed)
        thief.publish(up, replayed)  # the same frame again
        thief.publish(up, encode(Envelope(Kind.HEARTBEAT, "ep-0123456789ab", {}), key))  # another endpoint's id on this channel
        thief.publish(up, b"\x00not a frame at all")
        intruder.publish(up_topic("mesh", "ep-notenrolled0"), encode(Envelope(Kind.HELLO, "ep-notenrolled0", {}), new_key()))
        want = {(ep, "bad_mac"), (ep, "stale"), (ep, "replay"), (ep, "wrong_channel"), (ep, "malformed"), ("unknown", "unknown_endpoint")}
        _wait(lambda: want <= set(_rejected(mesh)), "the forged frames in /metrics")
    finally:
        thief.close()
        intruder.close()
    got = _rejected(mesh)
    for k in want - {(ep, "malformed")}:
        assert got[k] == 1.0, (k, got)
    assert not any(e not in (ep, "unknown") for e, _ in got), got  # no other endpoint, no label a forger chose
    assert _stored(mesh) == before
    pi.start()  # the device back in its owner's hands still serves
    mesh.wait_online(pi)
    with Executor(mesh.client, ep) as ex:
        assert ex.submit(pow, 3, 3).result(60) == 27


def test_federated_learning_runs_on_untrusted_endpoints(mesh: LocalMesh) -> None:
    """FL moves weights as data (numpy arrays, fl.wire bytes, metrics dicts): a round on field
    devices nobody marked trusted works, for the torch app and for a Flower NumPyClient."""
    pytest.importorskip("torch")
    from fl import FedAvg, Federation
    from fl.localmesh import add_digits_agents
    from fl.models import MLP

    clients = add_digits_agents(mesh, 2, start=False)
    for a in clients:
        mesh.client.set_endpoint_trusted(a.endpoint_id, False)
        a.start()
    mesh.wait_online(*clients, timeout=120)
    ids = [a.endpoint_id for a in clients]
    assert not any(e["trusted"] for e in mesh.client.list_endpoints() if e["id"] in ids)
    hist = Federation(mesh.client, ids).fit(MLP(64, (16,), 10), "digits", rounds=2, strategy=FedAvg(), local_epochs=1,
                                            deadline_s=120, min_clients=2)
    assert [len(r.participants) for r in hist] == [2, 2], [r.__dict__ for r in hist]

    import flwr.serverapp.strategy as flower_strategies

    from fl.flower import FlowerClientApp, FlowerStrategy

    app = FlowerClientApp(_flower_client_fn, initial_weights=[np.zeros((64, 10)), np.zeros(10)])
    hist = Federation(mesh.client, ids).fit(app, "digits", rounds=1, strategy=FlowerStrategy(flower_strategies.FedAvg()),
                                            local_epochs=1, deadline_s=120, min_clients=2)
    assert len(hist[0].participants) == 2


def _flower_client_fn(context: Any) -> Any:
    from flwr.client import NumPyClient

    class Tiny(NumPyClient):
        def fit(self, parameters: Any, config: Any) -> Any:  # type: ignore[override]
            return [np.asarray(p) + 1.0 for p in parameters], 10, {"ok": 1}

        def evaluate(self, parameters: Any, config: Any) -> Any:  # type: ignore[override]
            return 0.0, 10, {}

    return Tiny().to_client()
