"""Attacks on the task path, tried the way an attacker would: real Mosquitto with per-endpoint logins
and ACLs, real ZeroMQ with CURVE, real agent processes, real hub. Each attack must be refused,
run nothing (the function would leave a marker file) and store nothing (hub and agent databases).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import msgpack
import pytest
import zmq

from cloud_hub.client import Client, Executor, HubError
from cloud_hub.client._results import RemoteTraceback, UntrustedResult
from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.config import Credentials, load_config
from mesh_agent.protocol import Envelope, Kind, encode, function_id, new_key, open_frame, serialize, serialize_function
from mesh_agent.transport.mqtt import down_topic, up_topic
from tests.integration.peers import MqttPeer, connect_intruder
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def mark(path: str) -> str:
    """Leaves evidence that it ran: one line per execution."""
    with open(path, "a") as f:
        f.write("ran\n")
    return path


def mark_too(path: str) -> str:
    """Another user's function (a different body, so a different function id). It makes the
    directory first: run sandboxed, the host's directories are not there, only its own /tmp."""
    import os

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write("ran\n")
    return str(path)


def creds_of(agent: AgentProcess) -> Credentials:
    return load_config(agent.config_path)[1]


def hub_counts(mesh: LocalMesh) -> dict[str, int]:
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        return {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("tasks", "results", "functions", "endpoints")}


def queue_ids(agent: AgentProcess) -> set[str]:
    with sqlite3.connect(agent.cfg.queue_path) as db:
        return {r[0] for r in db.execute("SELECT id FROM tasks")}


def log_count(agent: AgentProcess, text: str) -> int:
    return agent.log_path.read_text().count(text) if agent.log_path.exists() else 0


def forged_tasks(endpoint: str, key: bytes, marker: Path, task_id: str) -> bytes:
    body = serialize_function(mark)
    fid = function_id(body)
    task = {"id": task_id, "fn": fid, "args": serialize(((str(marker),), {})), "timeout": None, "exp": None}
    return encode(Envelope(Kind.TASKS, endpoint, {"tasks": [task], "functions": {fid: body}}), key)


def test_another_endpoints_broker_login_reaches_nothing(mesh: LocalMesh, tmp_path: Path) -> None:
    victim = mesh.add_agent("victim", "mqtt")
    thief = mesh.add_agent("thief", "mqtt", start=False)  # a device the attacker controls: its login and key
    mesh.wait_online(victim)
    t = creds_of(thief)
    v = creds_of(victim)
    assert t.mqtt_username == thief.endpoint_id and t.mqtt_password and v.mqtt_password != t.mqtt_password
    marker = tmp_path / "pwned"

    peer = MqttPeer(mesh.broker.port, t.mqtt_username, t.mqtt_password)
    assert peer.wait()
    try:
        peer.subscribe(down_topic("mesh", victim.endpoint_id))  # read the victim's task stream
        peer.subscribe("mesh/#")
        before = hub_counts(mesh)
        rejected_before = mesh.hub.hub.dispatcher.stats["rejected_frames"]  # type: ignore[union-attr]
        # publish a forged task (signed with the thief's own key) where the victim listens,
        # and forged results on the victim's up topic
        peer.publish(down_topic("mesh", victim.endpoint_id), forged_tasks(victim.endpoint_id, bytes.fromhex(t.key), marker, "forged-1"))
        fake = encode(Envelope(Kind.RESULTS, victim.endpoint_id, {"results": [{"id": "x" * 32, "ok": True, "data": b"json\n1"}]}), bytes.fromhex(t.key))
        peer.publish(up_topic("mesh", victim.endpoint_id), fake)
        # the victim keeps working; the thief saw none of its traffic
        with Executor(mesh.client, victim.endpoint_id) as ex:
            assert ex.submit(pow, 2, 7).result(30) == 128
        time.sleep(1.0)
        assert peer.frames == [], "the ACL must hide other endpoints' topics"
        assert mesh.hub.hub.dispatcher.stats["rejected_frames"] == rejected_before, "the broker must drop it before the hub"  # type: ignore[union-attr]
        assert log_count(victim, "rejected frame") == 0, "the broker must drop it before the agent"
    finally:
        peer.close()
    after = hub_counts(mesh)
    assert after["results"] == before["results"] + 1 and after["tasks"] == before["tasks"] + 1  # only the legitimate task
    assert not marker.exists() and "forged-1" not in queue_ids(victim)

    # claiming the victim's MQTT client id does not take over its session (use_username_as_clientid)
    squatter = MqttPeer(mesh.broker.port, t.mqtt_username, t.mqtt_password, client_id=f"agent-{victim.endpoint_id}")
    squatter2 = MqttPeer(mesh.broker.port, t.mqtt_username, t.mqtt_password, client_id=victim.endpoint_id)
    try:
        assert squatter.wait() and squatter2.wait()
        with Executor(mesh.client, victim.endpoint_id) as ex:
            assert ex.submit(pow, 3, 3).result(30) == 27
        assert log_count(victim, "link to hub lost") == 0
    finally:
        squatter.close()
        squatter2.close()
    # a wrong password and no login at all are refused at CONNECT
    for user, pw in ((victim.endpoint_id, t.mqtt_password), (victim.endpoint_id, "guess"), (None, None), ("mesh-hub", "guess")):
        p = MqttPeer(mesh.broker.port, user, pw)
        try:
            assert not p.wait(5) and p.refused is not None, (user, pw)
        finally:
            p.close()


def test_intruder_on_the_hub_topic_cannot_make_a_device_run_anything(mesh: LocalMesh, tmp_path: Path) -> None:
    victim = mesh.add_agent("victim", "mqtt")
    other = mesh.add_agent("other", "mqtt", start=False)
    mesh.wait_online(victim)
    v, o = creds_of(victim), creds_of(other)
    peer = connect_intruder(mesh)
    assert peer.connected.is_set()
    peer.subscribe("mesh/#")  # sniff everything
    legit, forged = tmp_path / "legit", tmp_path / "forged"
    try:
        with Executor(mesh.client, victim.endpoint_id) as ex:
            assert ex.submit(mark, str(legit)).result(30) == str(legit)
        wait_for(lambda: any(open_frame(f, bytes.fromhex(v.key)).kind is Kind.RESULTS for tp, f in peer.frames if tp.endswith("/up")), "sniffed results")
        down = [f for tp, f in peer.frames if tp == down_topic("mesh", victim.endpoint_id)]
        up = [f for tp, f in peer.frames if tp == up_topic("mesh", victim.endpoint_id)]
        tasks_frame = next(f for f in down if open_frame(f, bytes.fromhex(v.key)).kind is Kind.TASKS)
        results_frame = next(f for f in up if open_frame(f, bytes.fromhex(v.key)).kind is Kind.RESULTS)
        before = hub_counts(mesh)
        queue_before = queue_ids(victim)

        # a tampered copy of the real task: same header and MAC, the argument now points elsewhere
        sealed = open_frame(tasks_frame, bytes.fromhex(v.key))
        body = msgpack.unpackb(sealed.payload, raw=False)
        body["tasks"][0]["args"] = serialize(((str(forged),), {}))
        tampered = tasks_frame[: len(tasks_frame) - len(sealed.payload)] + msgpack.packb(body, use_bin_type=True)
        attacks = {
            "bad signature": [
                forged_tasks(victim.endpoint_id, new_key(), forged, "forged-random-key"),
                forged_tasks(victim.endpoint_id, bytes.fromhex(o.key), forged, "forged-other-key"),  # another device's real key
                tampered,
            ],
            "replayed": [tasks_frame],  # the real frame again, verbatim
            "cannot come from the hub": [results_frame],  # the agent's own frame reflected back at it
        }
        for frames in attacks.values():
            for f in frames:
                peer.publish(down_topic("mesh", victim.endpoint_id), f)
        for reason, frames in attacks.items():
            wait_for(lambda r=reason, n=len(frames): log_count(victim, r) >= n, f"agent refusing: {reason}")
        # at the hub: a replayed and a tampered result, and a hub frame reflected up
        hub = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
        rejected = hub.stats["rejected_frames"]
        bad_result = bytearray(results_frame)
        bad_result[-3] ^= 0x55
        for f in (results_frame, bytes(bad_result), tasks_frame):
            peer.publish(up_topic("mesh", victim.endpoint_id), f)
        wait_for(lambda: hub.stats["rejected_frames"] >= rejected + 3, "hub refusing replayed, tampered and reflected frames")

        # replayed to a freshly restarted agent (its replay memory is gone, the frame still fresh):
        # the task id is already in its queue, so it does not run again
        victim.stop()
        victim.start()
        mesh.wait_online(victim)
        peer.publish(down_topic("mesh", victim.endpoint_id), tasks_frame)
        with Executor(mesh.client, victim.endpoint_id) as ex:  # a later legitimate task still runs
            assert ex.submit(pow, 2, 3).result(30) == 8
        time.sleep(1.0)
    finally:
        peer.close()
    assert not forged.exists(), "a forged or tampered task ran"
    assert legit.read_text() == "ran\n", "the real task ran exactly once, replays notwithstanding"
    assert queue_ids(victim) - queue_before == {r[0] for r in sqlite3.connect(mesh.hub_cfg.db_path).execute(
        "SELECT id FROM tasks WHERE function_id=?", (function_id(serialize_function(pow)),))}, "only the legitimate later task was stored"
    after = hub_counts(mesh)
    assert after["results"] == before["results"] + 1 and after["tasks"] == before["tasks"] + 1


def test_zeromq_needs_an_enrolled_curve_key_and_cannot_claim_another_endpoint(mesh: LocalMesh, tmp_path: Path) -> None:
    victim = mesh.add_agent("zvictim", "zmq")
    other = mesh.add_agent("zother", "zmq", start=False)
    mesh.wait_online(victim)
    v, o = creds_of(victim), creds_of(other)
    hub = mesh.hub.hub  # type: ignore[union-attr]
    address = hub.zmq_address
    rejected = hub.dispatcher.stats["rejected_frames"]
    hello = lambda key, ep: encode(Envelope(Kind.HELLO, ep, {"nonce": "0011", "capacity": 1, "have": []}), key)  # noqa: E731
    ctx = zmq.Context()
    socks = []

    def dealer(public: str | None, secret: str | None, routing_id: bytes | None = None) -> zmq.Socket:  # type: ignore[type-arg]
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        if public is not None:
            s.curve_serverkey = v.hub_curve_key.encode()  # type: ignore[union-attr]
            s.curve_publickey, s.curve_secretkey = public.encode(), secret.encode()  # type: ignore[union-attr]
        if routing_id is not None:
            s.routing_id = routing_id
        s.connect(address)
        socks.append(s)
        return s

    try:
        stranger_pub, stranger_sec = zmq.curve_keypair()
        dealer(stranger_pub.decode(), stranger_sec.decode()).send(hello(bytes.fromhex(v.key), victim.endpoint_id))  # even with the right HMAC key
        dealer(None, None).send(hello(bytes.fromhex(v.key), victim.endpoint_id))  # no encryption at all
        wait_for(lambda: hub.zmq_link.stats["refused_connections"] >= 1, "ZAP refusing an unknown CURVE key")
        # a real, enrolled device claiming to be the victim: its routing id and the frame header say so
        impostor = dealer(o.curve_public, o.curve_secret, routing_id=victim.endpoint_id.encode())
        impostor.send(hello(bytes.fromhex(o.key), victim.endpoint_id))
        wait_for(lambda: hub.dispatcher.stats["rejected_frames"] >= rejected + 1, "hub refusing a frame from the wrong channel")
        time.sleep(0.5)
        assert hub.dispatcher.stats["rejected_frames"] == rejected + 1, "frames without an enrolled CURVE key never reach the hub"
        # the victim's route was not taken over
        with Executor(mesh.client, victim.endpoint_id) as ex:
            assert ex.submit(pow, 5, 2).result(30) == 25
        assert impostor.poll(500) == 0, "the impostor received nothing"
    finally:
        for s in socks:
            s.close(0)
        ctx.term()
    # enrolling a ZeroMQ endpoint without a (valid) CURVE key is refused and spends no token
    token = mesh.client.create_enrollment_token()
    before = hub_counts(mesh)
    for bad in (None, "~" * 40, "#" * 40, "short"):
        r = httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": token, "name": "no-curve", "transport": "zmq", "curve_public": bad})
        assert r.status_code == 422, r.text
    assert "CURVE public key" in r.text or "curve_public" in r.text
    assert hub_counts(mesh) == before
    pub, _ = zmq.curve_keypair()
    r = httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": token, "name": "with-curve", "transport": "zmq", "curve_public": pub.decode()})
    assert r.status_code == 201 and r.json()["zmq_server_key"] == v.hub_curve_key
    # another device cannot enroll with a key already in use (it would share that endpoint's channel)
    token = mesh.client.create_enrollment_token()
    r = httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": token, "name": "copycat", "transport": "zmq", "curve_public": v.curve_public})
    assert r.status_code == 409 and "already enrolled" in r.text
    r = httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": token, "name": "fresh", "transport": "zmq", "curve_public": zmq.curve_keypair()[0].decode()})
    assert r.status_code == 201, "the refused attempt did not spend the token"


def _token_for(mesh: LocalMesh, user: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "token", "create", "--user", user, "--db", str(mesh.hub_cfg.db_path)],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_another_users_token_sees_and_uses_nothing_until_shared(mesh: LocalMesh, tmp_path: Path) -> None:
    alice = mesh.client
    agent = mesh.add_agent("alices-pi", "mqtt")
    mesh.wait_online(agent)
    marker = tmp_path / "bob-ran"
    fid_alice = alice.register_function(mark)
    with Executor(alice, agent.endpoint_id) as ex:
        fut = ex.submit(mark, str(tmp_path / "alice-ran"))
        assert fut.result(30)
    alice_task = fut.task_id  # type: ignore[attr-defined]
    bob = Client(mesh.url, _token_for(mesh, "bob"))
    ep = agent.endpoint_id
    fid_bob = bob.register_function(mark_too)
    before = hub_counts(mesh)

    def refused(status: int, call: Callable[[], Any], text: str) -> None:
        with pytest.raises(HubError) as info:
            call()
        assert info.value.status == status and text in info.value.detail, (status, info.value)

    assert [e["id"] for e in bob.list_endpoints()] == []
    assert [f["function_id"] for f in bob.list_functions()] == [fid_bob]
    refused(404, lambda: bob.get_endpoint(ep), "unknown endpoint")
    refused(404, lambda: bob.submit(ep, fid_bob, str(marker)), "unknown endpoint")
    refused(404, lambda: bob.submit_batch([Client.task_spec(ep, fid_alice, (str(marker),))]), "unknown")
    refused(404, lambda: bob.task_status(alice_task), "unknown task")
    assert bob.wait_results([alice_task], timeout_s=0.5) == []
    assert bob.result_stream(0, timeout_s=0.5)[0] == []
    assert bob.result_cursor() == 0, "bob's cursor reveals nothing about alice's results"
    assert mesh.client.result_cursor() > 0
    for method, path, body in (("GET", f"/v1/endpoints/{ep}/shares", None), ("PUT", f"/v1/endpoints/{ep}/shares/bob", None),
                               ("PUT", f"/v1/endpoints/{ep}/allowed-functions", {"function_ids": [fid_bob]}),
                               ("GET", f"/v1/endpoints/{ep}/allowed-functions", None), ("DELETE", f"/v1/endpoints/{ep}", None)):
        refused(404, lambda: bob.request(method, path, json=body), "unknown endpoint")
    assert hub_counts(mesh) == before and not marker.exists()

    # alice shares: bob sees it and may run his own functions on it, but not manage it
    alice.request("PUT", f"/v1/endpoints/{ep}/shares/bob")
    assert [s["user"] for s in alice.request("GET", f"/v1/endpoints/{ep}/shares")] == ["bob"]
    assert [e["id"] for e in bob.list_endpoints()] == [ep]
    refused(404, lambda: bob.submit(ep, fid_alice, str(marker)), "unknown function")  # alice's function stays hers
    refused(403, lambda: bob.request("PUT", f"/v1/endpoints/{ep}/shares/mallory"), "only the owner")
    refused(403, lambda: bob.request("PUT", f"/v1/endpoints/{ep}/allowed-functions", json={"function_ids": None}), "only the owner")
    refused(403, lambda: bob.request("DELETE", f"/v1/endpoints/{ep}"), "only the owner")
    refused(404, lambda: alice.request("PUT", f"/v1/endpoints/{ep}/shares/nobody-here"), "unknown user")
    assert bob.get_result(bob.submit(ep, fid_bob, str(marker)), timeout_s=30) == str(marker)
    # It ran sandboxed (another user's function on alice's endpoint, docs/environments.md): its
    # write went to the sandbox's private /tmp, not to alice's disk.
    assert not marker.exists()
    # the scheduler counts a shared endpoint among bob's: "auto" may place his work there
    placed = bob.request("POST", "/v1/tasks", json=Client.task_spec("auto", fid_bob, (str(marker),)))
    assert placed["endpoint_id"] == ep and bob.get_result(placed["task_id"], timeout_s=30) == str(marker)
    refused(404, lambda: alice.task_status(bob.submit(ep, fid_bob, str(tmp_path / "x"))), "unknown task")  # bob's tasks are bob's
    # alice withdraws the share: bob can no longer submit or see it
    alice.request("DELETE", f"/v1/endpoints/{ep}/shares/bob")
    refused(404, lambda: bob.submit(ep, fid_bob, str(marker)), "unknown endpoint")
    refused(409, lambda: bob.submit("auto", fid_bob, str(marker)), "none of your endpoints")
    assert bob.list_endpoints() == []
    bob.close()


class Loot:
    """A result type only a pickle can carry (its class is named in the stream)."""

    def __init__(self, v: int) -> None:
        self.v = v


def returns_loot(v: int) -> Loot:
    return Loot(v)


def returns_plain(v: int) -> dict:
    return {"v": v, "raw": b"\x00\x01", "t": (1, 2.5)}


def raises_value_error() -> None:
    raise ValueError("boom on the shared endpoint")


def test_results_from_another_users_endpoint_are_not_unpickled_unless_trusted(mesh: LocalMesh) -> None:
    """Issue 13 item 5: a result from an endpoint the user does not own could be a crafted pickle
    that runs code on the user's machine. Plain data decodes without pickle; anything else is
    refused with a clear error, unless the user marks that endpoint trusted."""
    alice = mesh.client
    agent = mesh.add_agent("alices-shared-pi", "mqtt")
    mesh.wait_online(agent)
    ep = agent.endpoint_id
    bob_token = _token_for(mesh, "bob")
    alice.request("PUT", f"/v1/endpoints/{ep}/shares/bob")
    bob = Client(mesh.url, bob_token)
    try:
        with Executor(bob, ep) as ex:
            assert ex.submit(returns_plain, 3).result(30) == {"v": 3, "raw": b"\x00\x01", "t": (1, 2.5)}
            with pytest.raises(UntrustedResult) as info:
                ex.submit(returns_loot, 4).result(30)
            msg = str(info.value)
            assert ep in msg and "not yours" in msg and "trusted_endpoints" in msg and "runs code" in msg
            with pytest.raises(ValueError) as err:  # a built-in type: rebuilt by name from its message, not unpickled
                ex.submit(raises_value_error).result(30)
            assert str(err.value) == "boom on the shared endpoint" and isinstance(err.value.__cause__, RemoteTraceback)
        with pytest.raises(UntrustedResult):
            bob.get_result(bob.submit(ep, bob.register_function(returns_loot), 5), timeout_s=30)
        trusting = Client(mesh.url, bob_token, trusted_endpoints=[ep])
        with Executor(trusting, ep) as ex:
            assert ex.submit(returns_loot, 6).result(30).v == 6
            with pytest.raises(ValueError, match="boom on the shared endpoint"):
                ex.submit(raises_value_error).result(30)
        trusting.close()
        with Executor(alice, ep) as ex:  # the owner's own results are unpickled as always
            assert ex.submit(returns_loot, 7).result(30).v == 7
    finally:
        bob.close()


def test_allow_lists_at_submit_and_on_the_device(mesh: LocalMesh, tmp_path: Path) -> None:
    c = mesh.client
    fid_mark, fid_pow = c.register_function(mark), c.register_function(pow)
    strict = mesh.add_agent("strict", "mqtt", allowed_functions=[fid_pow])  # the device's own local policy
    mesh.wait_online(strict)
    marker = tmp_path / "ran"
    # hub has no list: accepted, but the device refuses to run it, before loading any code
    with Executor(c, strict.endpoint_id) as ex:
        with pytest.raises(Exception) as info:
            ex.submit(mark, str(marker)).result(30)
        assert "not on this device's allow-list" in str(info.value)
        assert ex.submit(pow, 2, 4).result(30) == 16
    assert not marker.exists()
    # the owner sets the hub's list: submit refuses others with 403 and stores nothing
    out = c.request("PUT", f"/v1/endpoints/{strict.endpoint_id}/allowed-functions", json={"function_ids": [fid_pow]})
    assert out["function_ids"] == [fid_pow]
    before = hub_counts(mesh)
    with pytest.raises(HubError) as err:
        c.submit(strict.endpoint_id, fid_mark, str(marker))
    assert err.value.status == 403 and "not on endpoint" in err.value.detail and fid_mark in err.value.detail
    with pytest.raises(HubError) as err:
        c.submit_batch([Client.task_spec(strict.endpoint_id, fid_pow, (2, 2)), Client.task_spec(strict.endpoint_id, fid_mark, (str(marker),))])
    assert err.value.status == 403 and "task 1" in err.value.detail
    assert hub_counts(mesh) == before
    with pytest.raises(HubError) as err:
        c.request("PUT", f"/v1/endpoints/{strict.endpoint_id}/allowed-functions", json={"function_ids": ["not-a-function-id"]})
    assert err.value.status == 422
    assert c.request("GET", f"/v1/endpoints/{strict.endpoint_id}/allowed-functions")["function_ids"] == [fid_pow]
    # the agent gets the hub's list with its next tasks frame and keeps it
    assert c.get_result(c.submit(strict.endpoint_id, fid_pow, 3, 2), timeout_s=30) == 9
    wait_for(lambda: log_count(strict, "hub allow-list: 1 functions") >= 1, "agent learning the hub's allow-list")
    # tasks queued at the hub for a function the owner then removes fail with a clear error
    strict.stop()
    mesh.wait_online(strict, online=False)
    c.request("PUT", f"/v1/endpoints/{strict.endpoint_id}/allowed-functions", json={"function_ids": None})
    queued = c.submit(strict.endpoint_id, fid_mark, str(marker))
    out = c.request("PUT", f"/v1/endpoints/{strict.endpoint_id}/allowed-functions", json={"function_ids": [fid_pow]})
    assert out["failed_tasks"] == 1
    with pytest.raises(Exception) as info:
        c.get_result(queued, timeout_s=10)
    assert "no longer on endpoint" in str(info.value)
    assert not marker.exists()


def test_revoked_endpoint_is_locked_out_everywhere(mesh: LocalMesh, tmp_path: Path) -> None:
    c = mesh.client
    agent = mesh.add_agent("stolen", "mqtt")
    mesh.wait_online(agent)
    creds = creds_of(agent)
    agent.stop()
    mesh.wait_online(agent, online=False)
    waiting = c.submit(agent.endpoint_id, c.register_function(pow), 2, 2)
    out = c.request("DELETE", f"/v1/endpoints/{agent.endpoint_id}")
    assert out == {"endpoint_id": agent.endpoint_id, "revoked": True, "failed_tasks": 1}
    with pytest.raises(Exception) as info:
        c.get_result(waiting, timeout_s=10)
    assert "revoked" in str(info.value)
    assert agent.endpoint_id not in {e["id"] for e in c.list_endpoints()}
    with pytest.raises(HubError) as err:
        c.submit(agent.endpoint_id, c.register_function(pow), 1, 1)
    assert err.value.status == 404
    # its broker login is gone from the password file, and the broker refuses it
    assert agent.endpoint_id not in (mesh.broker.workdir / "password_file").read_text()
    p = MqttPeer(mesh.broker.port, creds.mqtt_username, creds.mqtt_password)
    try:
        assert not p.wait(5) and p.refused is not None
    finally:
        p.close()
    with sqlite3.connect(mesh.hub_cfg.db_path) as db:
        key, mqtt_hash = db.execute("SELECT key, mqtt_hash FROM endpoints WHERE id=?", (agent.endpoint_id,)).fetchone()
    assert key == b"" and mqtt_hash is None, "secrets of a revoked endpoint are wiped"
