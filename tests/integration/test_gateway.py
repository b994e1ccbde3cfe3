"""Site gateways (docs/sites.md), with real parts only: the hub's Mosquitto and hub, a gateway
process (``mesh-agent gateway``) running its own site Mosquitto, device agents that dial it, the
emulator's fault proxy on the uplink, SIGKILLs.

What is checked: devices behind a gateway run work and every result arrives exactly once; work
leased ahead to the site runs while the uplink is down and its results reach the hub afterwards,
through a gateway SIGKILL and a device SIGKILL; a tampering gateway (flipped byte, substituted
task, replayed frame) makes no device run anything it should not; bad enrollment input changes
nothing.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from cloud_hub.broker import find_mosquitto, free_port
from cloud_hub.localmesh import AgentProcess, GatewayProcess, LocalMesh
from mesh_agent.config import AgentConfig
from mesh_agent.protocol import deserialize
from tests.proxy import ProxyThread
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def count_runs(path: str, tag: str) -> str:
    """Appends one line per run to a file on the device's disk: how many times it really ran."""
    with open(path, "a") as f:
        f.write(tag + "\n")
    return tag


def add_gateway(mesh: LocalMesh, name: str, *, uplink_port: int | None = None, hold: int = 64) -> tuple[GatewayProcess, int]:
    gw = mesh.add_gateway(name, hold=hold, uplink_port=uplink_port, workers=1)
    return gw, gw.cfg.site.listen_port


def add_device(mesh: LocalMesh, name: str, gateway: GatewayProcess) -> AgentProcess:
    return mesh.add_site_device(name, gateway)


def results_of(mesh: LocalMesh, ids: list[str]) -> dict[str, Any]:
    r = mesh.client._http.post("/v1/results/wait", json={"task_ids": ids, "timeout_s": 0})
    r.raise_for_status()
    return {x["task_id"]: x for x in r.json()["results"]}


def held_at_site(mesh: LocalMesh) -> int:
    """Tasks whose lease ahead the gateway confirmed (stored in its queue): leased for site_hold_s,
    and (site frames) no longer waiting in a site_down link for the gateway's "stored up to"; a
    connected site-frames gateway's work is leased for site_hold_s from the start (docs/sites.md)."""
    import sqlite3

    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    waiting = {t for link in list(disp._site_links.values()) for t in link.unconfirmed_ids()}
    db = sqlite3.connect(f"file:{mesh.workdir / 'hub.sqlite3'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT id FROM tasks WHERE site IS NOT NULL AND state='leased' AND leased_until > ?",
                          (time.time() + 60,)).fetchall()
        return sum(1 for (tid,) in rows if tid not in waiting)
    finally:
        db.close()


def runs(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.fixture
def mesh(tmp_path: Path):
    with LocalMesh(tmp_path, heartbeat_s=1.0, lost_after_s=4.0, lease_s=5.0, hub_overrides={"site_hold_s": 600.0}) as m:
        yield m


def test_devices_behind_gateway_run_work_exactly_once(mesh: LocalMesh, tmp_path: Path) -> None:
    gw, site_port = add_gateway(mesh, "gw")
    mesh.wait_online(gw)
    devs = [add_device(mesh, f"dev{i}", gw) for i in range(2)]
    mesh.wait_online(*devs, gw, timeout=40)
    c = mesh.client
    fid = c.register_function(count_runs)
    out = tmp_path / "runs.txt"
    ids = [c.submit(d.endpoint_id, fid, str(out), f"{d.cfg.name}-{i}") for d in devs for i in range(5)]
    wait_for(lambda: len(results_of(mesh, ids)) == len(ids), "results through the gateway", 60, logs=[gw, *devs])
    got = results_of(mesh, ids)
    assert all(r["ok"] for r in got.values())
    assert sorted(runs(out)) == sorted(f"{d.cfg.name}-{i}" for d in devs for i in range(5))
    # The devices' frames crossed on the gateway's login: the hub saw them, under their own ids.
    eps = {e["id"]: e for e in c.list_endpoints()}
    assert all(eps[d.endpoint_id]["online"] for d in devs)
    # The console shows the site on the gateway's page: its devices, the uplink, its bytes per day.
    with httpx.Client(base_url=mesh.url, headers={"Origin": mesh.url}) as web:
        r = web.post("/console/login", data={"token": mesh.token, "next": "/console"})
        assert r.status_code in (303, 200)
        page = web.get(f"/console/endpoints/{gw.endpoint_id}").text
        assert "<h2>Site</h2>" in page and "Devices (2)" in page and all(d.cfg.name in page for d in devs)
        assert "is-on\">up</span>" in page
        assert f"Behind site gateway <a href=\"/console/endpoints/{gw.endpoint_id}\">" in web.get(f"/console/endpoints/{devs[0].endpoint_id}").text


def test_work_continues_through_uplink_outage_and_kills(mesh: LocalMesh, tmp_path: Path) -> None:
    proxy = ProxyThread(("127.0.0.1", mesh.broker.port))
    try:
        gw, site_port = add_gateway(mesh, "gw", uplink_port=proxy.proxy.port, hold=64)
        mesh.wait_online(gw)
        dev = add_device(mesh, "dev0", gw)
        dev2 = add_device(mesh, "dev1", gw)
        mesh.wait_online(dev, dev2, gw, timeout=40)
        c = mesh.client
        fid = c.register_function(count_runs)
        out = tmp_path / "runs.txt"
        # Devices stop; work queued for them is leased ahead to the gateway, which holds it.
        dev.kill()
        dev2.kill()
        ids = [c.submit(d.endpoint_id, fid, str(out), f"{d.cfg.name}-{i}") for d in (dev, dev2) for i in range(6)]
        wait_for(lambda: held_at_site(mesh) >= len(ids), "the gateway confirmed it holds the site's work", 30, logs=[gw])
        # The uplink goes down; then the gateway loses power, comes back, still without an uplink.
        proxy.cut()
        gw.kill()
        gw.start()
        dev.start()
        dev2.start()
        # Both devices run all their work with the uplink down.
        wait_for(lambda: len(set(runs(out))) == len(ids), "all tasks ran during the outage", 60, logs=[gw, dev, dev2])
        assert not results_of(mesh, ids), "no result can reach the hub while the uplink is down"
        # A device dies after running its work, with its results only at the gateway (and on its disk).
        time.sleep(2.0)  # its results frames reached the gateway's queue
        dev.kill()
        proxy.restore()
        wait_for(lambda: len(results_of(mesh, ids)) == len(ids), "results after the uplink came back", 90, logs=[gw, dev, dev2])
        got = results_of(mesh, ids)
        assert all(r["ok"] for r in got.values())
        assert sorted(runs(out)) == sorted(f"{d.cfg.name}-{i}" for d in (dev, dev2) for i in range(6)), "each task ran exactly once"
        # The dead device's results came from the gateway's queue, not from the device.
        assert not dev.alive()
    finally:
        proxy.stop()


def test_tampering_gateway_runs_nothing(mesh: LocalMesh, tmp_path: Path) -> None:
    """A compromised gateway holds its own broker logins, never a device key. Here the test plays
    it: it reads a device's tasks frame as the gateway relays it into the site broker and feeds the
    device altered copies there; nothing the hub did not sign for that device runs.

    The site broker is where the gateway's power lies (it writes that broker's logins). The test
    does not borrow the gateway's login on the hub's broker: that broker takes the login as the
    client id, so a second client with it takes the gateway's session over and the gateway, on
    reconnecting, takes it back; a spy there was cut off before the frame came in 1 of 7 runs."""
    import aiomqtt

    from mesh_agent.gateway import _mosquitto_hash
    from mesh_agent.protocol import Envelope, Kind, encode
    from mesh_agent.reload import reload_process

    gw, site_port = add_gateway(mesh, "gw", hold=0)  # hold 0: the hub sends only what the device fetches
    mesh.wait_online(gw)
    dev = add_device(mesh, "dev0", gw)
    mesh.wait_online(dev, timeout=40)
    c = mesh.client
    fid = c.register_function(count_runs)
    out = tmp_path / "runs.txt"
    down = f"{gw.cfg.mqtt.topic_prefix}/ep/{dev.endpoint_id}/down"

    # The compromised gateway process is modelled by a client with the site broker's admin
    # rights: write that broker's files as the gateway would, adding an attacker login with every
    # right (the gateway's own site login is in its memory only).
    acl = gw.cfg.data_dir / "site-broker" / "acl_file"
    pwf = gw.cfg.data_dir / "site-broker" / "password_file"
    acl.write_text(acl.read_text() + "\nuser evil\ntopic readwrite #\n")
    pwf.write_text(pwf.read_text() + f"evil:{_mosquitto_hash('evil-pw')}\n")
    assert reload_process(int((gw.cfg.data_dir / "site-broker" / "mosquitto.pid").read_text()))

    async def evil_login() -> aiomqtt.Client:
        deadline = time.monotonic() + 10  # the broker reads its files again after the SIGHUP
        while True:
            site = aiomqtt.Client("127.0.0.1", site_port, username="evil", password="evil-pw", identifier="evil-gw")
            try:
                await site.__aenter__()
                return site
            except aiomqtt.MqttError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def capture_and_tamper() -> str:
        site = await evil_login()
        try:
            await site.subscribe(down, qos=1)
            genuine = c.submit(dev.endpoint_id, fid, str(out), "genuine")
            frame = None
            async with asyncio.timeout(30):
                async for msg in site.messages:
                    if isinstance(msg.payload, bytes) and b"genuine" in msg.payload:
                        frame = msg.payload
                        break
            assert frame is not None
            flipped = bytearray(frame)
            flipped[frame.index(b"genuine")] ^= 0x01  # "genuine" -> "fenuine": args changed, MAC unchanged
            # A substituted task: the same header and MAC, another body (a task of the attacker's choosing).
            forged = encode(Envelope(Kind.TASKS, dev.endpoint_id, {"tasks": [{"id": "f" * 32, "fn": fid, "args": b"x", "timeout": None,
                                                                              "exp": None}], "functions": {}}), os.urandom(32))
            await asyncio.to_thread(wait_for, lambda: runs(out).count("genuine") == 1, "the genuine task ran", 60, logs=[gw, dev])
            for f in (bytes(flipped), forged, frame, frame):  # flipped byte, forged task, replays of the genuine frame
                await site.publish(down, f, qos=1)
            return genuine
        finally:
            await site.__aexit__(None, None, None)

    genuine = asyncio.run(capture_and_tamper())
    # The genuine task is stored, so the device sees the replays as known; a second genuine task
    # sent after the tampered frames proves the device processed them all (frames are in order).
    second = c.submit(dev.endpoint_id, fid, str(out), "second")
    wait_for(lambda: runs(out).count("second") == 1, "a later genuine task ran", 60, logs=[gw, dev])
    time.sleep(1.0)
    assert sorted(runs(out)) == ["genuine", "second"], "nothing tampered ran, nothing ran twice"
    got = results_of(mesh, [genuine, second])
    assert len(got) == 2 and all(r["ok"] for r in got.values())
    log = dev.log_path.read_text()
    assert log.count("MAC does not match") >= 2  # the flipped and the forged frames were refused by the device
    assert "seen before" in log  # the replay too (and its task was known: stored once, run once)


def test_bad_gateway_at_enrollment_changes_nothing(mesh: LocalMesh) -> None:
    token = mesh.client.create_enrollment_token()
    before = {e["id"] for e in mesh.client.list_endpoints()}
    r = httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": token, "name": "d", "gateway_id": "ep-0123456789ab"})
    assert r.status_code == 422 and "gateway ep-0123456789ab is not an MQTT endpoint" in r.json()["detail"]
    # The token was not spent: it still enrolls a device.
    r = httpx.post(f"{mesh.url}/v1/endpoints/enroll", json={"token": token, "name": "d"})
    assert r.status_code == 201
    assert {e["id"] for e in mesh.client.list_endpoints()} - before == {r.json()["endpoint_id"]}


def test_device_moves_to_hub_when_its_gateway_dies(tmp_path: Path) -> None:
    """Work leased ahead to a gateway that then dies for good is not stranded: after site_hold_s
    the hub re-queues it, and the device, now dialling the hub's broker directly with the same
    login, runs each task once."""
    with LocalMesh(tmp_path, heartbeat_s=1.0, lost_after_s=4.0, lease_s=5.0, hub_overrides={"site_hold_s": 6.0}) as mesh:
        gw, site_port = add_gateway(mesh, "gw", hold=64)
        mesh.wait_online(gw)
        dev = add_device(mesh, "dev0", gw)
        mesh.wait_online(dev, gw, timeout=40)
        dev.kill()
        c = mesh.client
        fid = c.register_function(count_runs)
        out = tmp_path / "runs.txt"
        ids = [c.submit(dev.endpoint_id, fid, str(out), f"t{i}") for i in range(4)]
        disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
        wait_for(lambda: disp.stats.get("site_leased", 0) >= len(ids), "work leased ahead to the site", 30, logs=[gw])
        gw.kill()  # for good: its held tasks must not be lost with it
        cfg = AgentConfig.model_validate({**dev.cfg.model_dump(), "mqtt": {**dev.cfg.mqtt.model_dump(), "port": mesh.broker.port}})
        cfg.save(dev.config_path)
        dev.cfg = cfg
        dev.start()
        wait_for(lambda: len(results_of(mesh, ids)) == len(ids), "results straight through the hub", 60, logs=[dev])
        assert all(r["ok"] for r in results_of(mesh, ids).values())
        assert sorted(runs(out)) == [f"t{i}" for i in range(4)]


_BIG = bytes(range(256)) * 1024  # 256 KiB that travels inside the function body


def big_body_task(tag: str) -> int:
    return len(_BIG) + len(tag)


@pytest.mark.parametrize("cache", [True, False])
def test_function_body_crosses_uplink_once_per_site(tmp_path: Path, cache: bool) -> None:
    """Content-addressed bodies: with ``site.cache_bodies`` the hub sends a body to the gateway once
    and the devices take it from the gateway, checked by hash; without, once per device. Bytes from
    the hub to the site (its dispatcher's counters) say which happened."""
    with LocalMesh(tmp_path, heartbeat_s=1.0, lost_after_s=4.0, lease_s=5.0) as mesh:
        gw = mesh.add_gateway("gw", hold=64, workers=1, site={"listen_host": "127.0.0.1", "listen_port": free_port(), "hold": 64,
                                                             "cache_bodies": cache})
        mesh.wait_online(gw)
        devs = [mesh.add_site_device(f"dev{i}", gw) for i in range(3)]
        mesh.wait_online(gw, *devs, timeout=40)
        for d in devs:  # all work goes the site's way: leased ahead to the gateway
            d.kill()
        c = mesh.client
        fid = c.register_function(big_body_task)
        disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
        before = sum(disp.traffic.get(e, [0, 0])[1] for e in [gw.endpoint_id, *(d.endpoint_id for d in devs)])
        ids = [c.submit(d.endpoint_id, fid, f"t{i}") for d in devs for i in range(2)]
        wait_for(lambda: disp.stats.get("site_leased", 0) >= len(ids), "leased ahead", 30, logs=[gw])
        for d in devs:
            d.start()
        wait_for(lambda: len(results_of(mesh, ids)) == len(ids), "results", 60, logs=[gw, *devs])
        bad = [deserialize(base64.b64decode(r["data"])) for r in results_of(mesh, ids).values() if not r["ok"]]
        assert not bad
        sent = sum(disp.traffic.get(e, [0, 0])[1] for e in [gw.endpoint_id, *(d.endpoint_id for d in devs)]) - before
        print(f"cache_bodies={cache}: hub -> site {sent} bytes for 6 tasks on 3 devices, body {len(_BIG)} B of data")
        if cache:
            assert disp.stats.get("site_bodies") == 1
            assert sent < 2 * len(_BIG), "the body crossed the uplink once"
        else:
            assert sent > 3 * len(_BIG), "without the cache, once per device"


def test_device_moves_to_another_gateway(mesh: LocalMesh, tmp_path: Path) -> None:
    """Work leased ahead to gateway A for a device goes back to the queue when the device is moved
    to gateway B (A is dead meanwhile); the device, dialling B, runs each task once. Bad moves
    change nothing."""
    gwa, _ = add_gateway(mesh, "gwa", hold=64)
    gwb, portb = add_gateway(mesh, "gwb", hold=64)
    mesh.wait_online(gwa, gwb)
    dev = add_device(mesh, "dev0", gwa)
    mesh.wait_online(dev, timeout=40)
    dev.kill()
    c = mesh.client
    fid = c.register_function(count_runs)
    out = tmp_path / "runs.txt"
    ids = [c.submit(dev.endpoint_id, fid, str(out), f"t{i}") for i in range(4)]
    disp = mesh.hub.hub.dispatcher  # type: ignore[union-attr]
    wait_for(lambda: disp.stats.get("site_leased", 0) >= len(ids), "leased ahead to gateway A", 30, logs=[gwa])
    gwa.kill()
    http = c._http
    # Bad input: a gateway that does not exist, a device as its own gateway: 422/404, nothing moved.
    assert http.put(f"/v1/endpoints/{dev.endpoint_id}/gateway", json={"gateway_id": "ep-0123456789ab"}).status_code == 404
    r = http.put(f"/v1/endpoints/{dev.endpoint_id}/gateway", json={"gateway_id": dev.endpoint_id})
    assert r.status_code == 422 and "its own gateway" in r.json()["detail"]
    assert disp.gateway_of(dev.endpoint_id) == gwa.endpoint_id
    r = http.put(f"/v1/endpoints/{dev.endpoint_id}/gateway", json={"gateway_id": gwb.endpoint_id})
    assert r.status_code == 200, r.text
    assert r.json() == {"endpoint_id": dev.endpoint_id, "gateway_id": gwb.endpoint_id, "previous": gwa.endpoint_id, "requeued_tasks": 4}
    cfg = AgentConfig.model_validate({**dev.cfg.model_dump(), "gateway_id": gwb.endpoint_id,
                                      "mqtt": {**dev.cfg.mqtt.model_dump(), "port": portb}})
    cfg.save(dev.config_path)
    dev.cfg = cfg
    dev.start()
    wait_for(lambda: len(results_of(mesh, ids)) == len(ids), "results through gateway B", 60, logs=[gwb, dev])
    assert all(r["ok"] for r in results_of(mesh, ids).values())
    assert sorted(runs(out)) == [f"t{i}" for i in range(4)]


def test_gateway_uplink_is_tls_and_its_devices_run_work(tmp_path: Path) -> None:
    """The uplink is TLS (docs/sites.md, "Security"): on a hub whose broker speaks mqtts, the gateway
    enrolls with the CA pinned by its token and dials the TLS port, never the plaintext one; its
    devices dial the gateway's own Mosquitto on the LAN; their work runs once each."""
    with LocalMesh(tmp_path / "mesh", heartbeat_s=1.0, lost_after_s=4.0, lease_s=5.0, tls=True,
                   hub_overrides={"site_hold_s": 600.0}) as mesh:
        gw, site_port = add_gateway(mesh, "gw-tls")
        assert mesh.tls_files is not None and gw.cfg.mqtt.tls is not None
        assert gw.cfg.mqtt.port == mesh.broker.tls_port != mesh.broker.port
        assert gw.cfg.mqtt.tls.ca_file is not None and gw.cfg.mqtt.tls.ca_file.read_bytes() == mesh.tls_files.ca_cert.read_bytes()
        mesh.wait_online(gw, timeout=60)
        devs = [add_device(mesh, f"tdev{i}", gw) for i in range(2)]
        assert all(d.cfg.mqtt.port == site_port and d.cfg.mqtt.host == "127.0.0.1" for d in devs), "devices dial the LAN broker"
        mesh.wait_online(*devs, gw, timeout=60)
        fid = mesh.client.register_function(count_runs)
        out = tmp_path / "runs.txt"
        ids = [mesh.client.submit(d.endpoint_id, fid, str(out), f"{d.cfg.name}-{i}") for d in devs for i in range(4)]
        wait_for(lambda: len(results_of(mesh, ids)) == len(ids), "results through the TLS uplink", 90, logs=[gw, *devs])
        assert all(r["ok"] for r in results_of(mesh, ids).values())
        assert sorted(runs(out)) == sorted(f"{d.cfg.name}-{i}" for d in devs for i in range(4))


def digest_of(value: bytes) -> str:
    import hashlib

    return hashlib.sha256(value).hexdigest()


def test_a_shared_ref_crosses_the_uplink_once_per_site(mesh: LocalMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """Data refs are fetched once per site (docs/sites.md): a shared ref carries the SHA-256 of its
    bytes, inside the hub-signed task. The hub's welcome names each device's site store; the first
    device to read the ref fetches it from the hub's store and leaves a copy on the LAN, the next
    reads it there. Proof: with the hub's copy deleted, the second device still reads it. A ref the
    site never held fails as before."""
    from cloud_hub.client import Client, Executor, refs
    from cloud_hub.client import multiprocessing as mp
    from cloud_hub.client.multiprocessing import _state
    from cloud_hub.client.multiprocessing._resource import loads
    from mesh_agent.site_store import SITE_STORE_FILE, SiteStoreError, get_blob

    monkeypatch.setattr(_state, "_settings", {**_state._settings, "redis_url": None})  # refs.Store(): the hub's store
    mp.config(client=Client(mesh.url, mesh.token))
    gw, _ = add_gateway(mesh, "gw")
    mesh.wait_online(gw)
    devs = [add_device(mesh, f"rdev{i}", gw) for i in range(2)]
    mesh.wait_online(*devs, gw, timeout=40)
    store_addr = f"127.0.0.1:{gw.cfg.site.store_port}"
    wait_for(lambda: all((d.cfg.data_dir / SITE_STORE_FILE).exists() for d in devs), "the welcome naming the site store", 30, logs=devs)
    assert all((d.cfg.data_dir / SITE_STORE_FILE).read_text() == store_addr for d in devs)
    value = os.urandom(300_000)
    store = refs.Store()
    ref = store.put(value, tier="shared")
    assert len(ref.meta["sha256"]) == 64  # of the stored (serialized) bytes

    def run_on(dev: AgentProcess, r: refs.MeshRef) -> Any:
        with Executor(client=Client(mesh.url, mesh.token), endpoint=dev.endpoint_id) as ex:
            f = ex.submit(digest_of, r)
            exc = f.exception(90)
            return exc if exc is not None else f.result()

    assert run_on(devs[0], ref) == digest_of(value)
    assert loads(get_blob(store_addr, ref.meta["sha256"])) == value, "the first reader left a copy on the site's LAN"
    store.delete(ref)  # gone from the hub's store: only the site's copy is left
    assert run_on(devs[1], ref) == digest_of(value), "the second device read it on the LAN"
    other = store.put(b"never at the site" * 100, tier="shared")
    store.delete(other)
    exc = run_on(devs[1], other)
    assert isinstance(exc, refs.RefError) and "was deleted or lost" in str(exc), exc
    swapped = store.put(b"the bytes put" * 100, tier="shared")
    store._r().set(swapped.key, store._r().get(store.put(b"other bytes" * 100, tier="shared").key))  # the shared store's copy changed
    exc = run_on(devs[1], swapped)
    assert isinstance(exc, refs.RefError) and "SHA-256 differs" in str(exc), exc
    with pytest.raises(SiteStoreError, match="not found|no blob|unknown"):
        get_blob(store_addr, swapped.meta["sha256"])  # and nothing was left at the site
