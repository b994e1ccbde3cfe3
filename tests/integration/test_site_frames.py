"""A tampering gateway against the hub's site frames (issue 29, docs/sites.md "Site frames").

The test plays a compromised gateway with its real credentials (its key and broker login, which
a stolen gateway has) against a real hub and Mosquitto. It never holds a device key except to make
the one genuine device frame a real device would have handed it. Everything it alters must be
refused and store nothing: a flipped byte in an inner frame, an inner frame of another site's
device (listed as that device, or listed as its own device), a site_up with a broken outer MAC,
a replayed site_up, and an inner frame replayed inside a new site_up. The genuine frame is stored
exactly once, and the hub's answer comes back in a site_down signed with the gateway's key.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from cloud_hub.localmesh import AgentProcess, LocalMesh
from mesh_agent.config import Credentials, load_config
from mesh_agent.protocol import Envelope, Kind, decode, encode, serialize
from mesh_agent.protocol.site import inner_frames, site_body
from mesh_agent.transport.mqtt import down_topic, up_topic
from tests.integration.peers import MqttPeer
from tests.waiting import wait_for

pytestmark = pytest.mark.integration


def creds_of(agent: AgentProcess) -> Credentials:
    return load_config(agent.config_path)[1]


def results_for(mesh: LocalMesh, task_id: str) -> int:
    db = sqlite3.connect(f"file:{mesh.workdir / 'hub.sqlite3'}?mode=ro", uri=True)
    try:
        return int(db.execute("SELECT COUNT(*) FROM results WHERE task_id=?", (task_id,)).fetchone()[0])
    finally:
        db.close()


def results_frame(endpoint: str, key: bytes, task_id: str, value: int) -> bytes:
    now = time.time()
    body = {"results": [{"id": task_id, "ok": True, "data": serialize(value), "started": now, "finished": now, "pid": 1}]}
    return encode(Envelope(Kind.RESULTS, endpoint, body, ts=now), key)


def noop(x: int) -> int:
    return x


def test_a_tampering_gateway_stores_nothing_and_loses_nothing(tmp_path: Path) -> None:
    with LocalMesh(tmp_path, heartbeat_s=1.0, lost_after_s=4.0, lease_s=5.0) as mesh:
        gw = mesh.add_gateway("gw", hold=0, start=False)
        dev = mesh.add_site_device("dev", gw, start=False)
        gw2 = mesh.add_gateway("gw2", hold=0, start=False)
        far = mesh.add_site_device("far", gw2, start=False)
        g, d, f = creds_of(gw), creds_of(dev), creds_of(far)
        prefix = gw.cfg.mqtt.topic_prefix
        c = mesh.client
        fid = c.register_function(noop)
        mine = c.submit(dev.endpoint_id, fid, 1)
        theirs = c.submit(far.endpoint_id, fid, 2)
        dispatcher: Any = mesh.hub.hub.dispatcher  # type: ignore[union-attr]

        peer = MqttPeer(mesh.broker.port, g.mqtt_username, g.mqtt_password, client_id=g.mqtt_username or "")
        try:
            assert peer.wait(), "the gateway's own broker login works"
            peer.subscribe(down_topic(prefix, g.endpoint_id))
            up = up_topic(prefix, g.endpoint_id)

            def site_up(frames: list[tuple[str, bytes]]) -> bytes:
                return encode(Envelope(Kind.SITE_UP, g.endpoint_id, site_body(frames), ts=time.time()), g.key_bytes, compress=True)

            nonce = os.urandom(8).hex()
            peer.publish(up, encode(Envelope(Kind.HELLO, g.endpoint_id, {"nonce": nonce, "capacity": 0, "z": 1,
                                                                           "site": {"hold": 0, "broker": "127.0.0.1:1", "frames": 1}}),
                                    g.key_bytes))

            def received(kind: Kind) -> list[dict[str, Any]]:
                """Bodies of the frames of ``kind`` that came down to the gateway's login, verified with its key."""
                out = []
                for _topic, frame in list(peer.frames):
                    try:
                        env = decode(frame, g.key_bytes, check_fresh=False)
                    except Exception:
                        continue
                    if env.kind is kind:
                        out.append(env.body)
                return out

            def welcome() -> dict[str, Any] | None:
                return next(iter(received(Kind.WELCOME)), None)

            wait_for(lambda: welcome() is not None, "the gateway's welcome", 20)
            assert welcome()["site"].get("frames") == 1, "the hub reads site frames"  # type: ignore[index]

            genuine = results_frame(dev.endpoint_id, d.key_bytes, mine, 1)
            rejected0 = dispatcher.stats["rejected_frames"]
            flipped = bytearray(genuine)
            flipped[-3] ^= 0x01  # inside the result's data: the device's MAC no longer matches
            foreign = results_frame(far.endpoint_id, f.key_bytes, theirs, 2)  # really signed by another site's device
            broken_outer = bytearray(site_up([(dev.endpoint_id, genuine)]))
            broken_outer[-1] ^= 0x01
            attacks = [
                site_up([(dev.endpoint_id, bytes(flipped))]),
                site_up([(far.endpoint_id, foreign)]),  # listed as the other site's device
                site_up([(dev.endpoint_id, foreign)]),  # listed as ours, header names the other device
                bytes(broken_outer),
            ]
            for frame in attacks:
                peer.publish(up, frame)
            wait_for(lambda: dispatcher.stats["rejected_frames"] >= rejected0 + 4, "four refusals", 20)
            assert dispatcher.rejected[(g.endpoint_id, "foreign_device")] >= 2
            assert results_for(mesh, mine) == 0 and results_for(mesh, theirs) == 0, "nothing altered or foreign was stored"

            good = site_up([(dev.endpoint_id, genuine)])
            peer.publish(up, good)
            wait_for(lambda: results_for(mesh, mine) == 1, "the genuine result stored", 20)
            rejected1 = dispatcher.stats["rejected_frames"]
            peer.publish(up, good)  # the same site_up again
            peer.publish(up, site_up([(dev.endpoint_id, genuine)]))  # the same inner frame in a new site_up
            wait_for(lambda: dispatcher.stats["rejected_frames"] >= rejected1 + 2, "both replays refused", 20)
            assert results_for(mesh, mine) == 1 and results_for(mesh, theirs) == 0

            def acked_in_site_down() -> bool:
                return any(mine in decode(inner, d.key_bytes, check_fresh=False).body.get("ids", [])
                           for body in received(Kind.SITE_DOWN) for ep, inner in inner_frames(body) if ep == dev.endpoint_id)

            wait_for(acked_in_site_down, "the result_ack for the device, inside a site_down", 20)
        finally:
            peer.close()


def test_one_liveness_summary_keeps_idle_devices_online_and_reports_a_lost_one(tmp_path: Path) -> None:
    """Idle devices behind a site-frames gateway beat every second on the LAN (lan profile); their
    beats do not cross the uplink (the gateway's liveness rows stand in for them), yet they stay
    online far past their own 4 s bound, for as long as their gateway's session lives. A device that
    dies is reported off the LAN by the gateway (its will on the site broker); the hub keeps its
    session for its offline bound from that row (4 s: a LAN flap resumes within it, docs/sites.md
    "LAN reconnects without a hello") and then marks it offline; restarted, it is online again."""
    with LocalMesh(tmp_path, heartbeat_s=1.0, lost_after_s=4.0, lease_s=5.0) as mesh:
        gw = mesh.add_gateway("gw", hold=8, workers=1)
        mesh.wait_online(gw)
        devs = [mesh.add_site_device(f"d{i}", gw) for i in range(3)]
        mesh.wait_online(*devs, timeout=40)
        dispatcher: Any = mesh.hub.hub.dispatcher  # type: ignore[union-attr]

        def frames_in(ep: str) -> float:
            return dispatcher.traffic.get(ep, [0, 0, 0])[2]

        wait_for(lambda: all(dispatcher._on_lan.get(d.endpoint_id) for d in devs), "liveness rows for every device", 20)
        before = {d.endpoint_id: frames_in(d.endpoint_id) for d in devs}
        time.sleep(10.0)  # 10 beats of each device on the LAN, 2.5 of their bounds
        assert all(dispatcher.online(d.endpoint_id) for d in devs), "kept online by the gateway's rows"
        grown = {ep: frames_in(ep) - n for ep, n in before.items()}
        assert all(g <= 2 for g in grown.values()), f"device frames reached the hub while idle: {grown}"

        victim = devs[0]
        victim.kill()
        wait_for(lambda: not dispatcher.online(victim.endpoint_id), "the dead device offline", 30, logs=[gw])
        assert all(dispatcher.online(d.endpoint_id) for d in devs[1:])
        victim.start()
        mesh.wait_online(victim, timeout=40)
        c = mesh.client
        fid = c.register_function(noop)
        ids = [c.submit(d.endpoint_id, fid, i) for i, d in enumerate(devs)]
        assert [c.get_result(i, timeout_s=60) for i in ids] == [0, 1, 2]
