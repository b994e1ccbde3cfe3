"""Pure parts of the site gateway (mesh_agent/gateway.py) and its queue tables (mesh_agent/store.py):
what it reads from frames it cannot verify, the site broker's files, the relay queue's rules."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mesh_agent.cli import app
from mesh_agent.gateway import frame_task_ids, site_broker_conf
from mesh_agent.protocol import Envelope, Kind, encode
from mesh_agent.protocol.envelope import _parse_header
from mesh_agent.store import AgentStore

KEY = bytes(range(32))
EP = "ep-0123456789ab"


def _ids(kind: Kind, body: dict, compress: bool = False) -> list[str]:
    frame = encode(Envelope(kind, EP, body), KEY, compress=compress)
    k, _ep, _mid, _ts, _exp, end, z = _parse_header(frame)
    return frame_task_ids(k, frame, end, z)


def test_task_ids_from_each_kind_compressed_or_not() -> None:
    tasks = {"tasks": [{"id": "a" * 32, "fn": "f" * 64, "args": b"x" * 2000}], "functions": {}}
    assert _ids(Kind.TASKS, tasks) == ["a" * 32]
    assert _ids(Kind.TASKS, tasks, compress=True) == ["a" * 32]
    assert _ids(Kind.ACK, {"ids": ["b", "c"]}) == ["b", "c"]
    assert _ids(Kind.RESULT_ACK, {"ids": ["d"]}) == ["d"]
    res = {"results": [{"id": "e", "ok": True, "data": b"", "started": 0.0, "finished": 0.0, "pid": 0}]}
    assert _ids(Kind.RESULTS, res) == ["e"]


def test_unparsable_body_yields_no_ids() -> None:
    frame = bytearray(encode(Envelope(Kind.ACK, EP, {"ids": ["b"]}), KEY))
    k, _ep, _mid, _ts, _exp, end, z = _parse_header(bytes(frame))
    frame[end + 32 :] = b"\xc1\xc1"  # msgpack's never-used byte
    assert frame_task_ids(k, bytes(frame), end, z) == []


def test_site_broker_files_per_device(tmp_path: Path) -> None:
    devices = [{"id": "ep-aaaaaaaaaaaa", "user": "ep-aaaaaaaaaaaa", "hash": "$7$101$c2FsdA==$ZGln"}]
    conf = site_broker_conf(tmp_path, "127.0.0.1", 1884, "mesh", "$7$101$eA==$eQ==", devices)
    assert "allow_anonymous false" in conf and "persistence false" in conf and "listener 1884 127.0.0.1" in conf
    acl = (tmp_path / "acl_file").read_text()
    assert "user ep-aaaaaaaaaaaa\ntopic read mesh/ep/ep-aaaaaaaaaaaa/down\ntopic write mesh/ep/ep-aaaaaaaaaaaa/up" in acl
    assert "ep-aaaaaaaaaaaa:$7$101$c2FsdA==$ZGln" in (tmp_path / "password_file").read_text()
    assert (tmp_path / "password_file").stat().st_mode & 0o077 == 0


def test_site_broker_refuses_a_name_that_would_widen_an_acl(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a usable broker name"):
        site_broker_conf(tmp_path, "127.0.0.1", 1884, "mesh", "$7$x", [{"id": "ep-#", "user": "u", "hash": "$7$y"}])
    assert not (tmp_path / "acl_file").exists()  # nothing written


def test_relay_queue_rules(tmp_path: Path) -> None:
    async def go() -> None:
        s = await AgentStore(tmp_path / "q.sqlite3").open()
        try:
            assert await s.relay_put("down", EP, "tasks", "m1", b"F1", 2e9, ["t1", "t2"])
            assert not await s.relay_put("down", EP, "tasks", "m1", b"F1", 2e9, ["t1", "t2"])  # same message: kept once
            assert await s.relay_put("up", EP, "results", "m2", b"R", 2e9, ["t1"])
            assert await s.relay_put("up", EP, "ack", "m3", b"A", 2e9)
            assert await s.relay_put("up", EP, "results", "old", b"R0", 1.0, ["t0"])
            # A device's ack of one of two tasks keeps the frame; of both, drops it.
            assert await s.relay_release("down", EP, ["t1"]) == 0
            assert await s.relay_release("down", EP, ["t2"]) == 1
            # The hub's result_ack drops the results frame, not the ack frame.
            assert await s.relay_release("up", EP, ["t1"]) == 1
            assert [k for _, _, k, _ in await s.relay_pending("up")] == ["ack", "results"]
            assert await s.relay_expire(100.0) == 1  # past its exp: the hub would refuse it as stale
            rows = await s.relay_pending("up")
            assert [k for _, _, k, _ in rows] == ["ack"]
            await s.relay_sent([rows[0][0]], 50.0)
            assert await s.relay_pending("up", sent_before=40.0) == []
            await s.relay_sent([rows[0][0]], 50.0, drop=True)
            assert await s.relay_counts() == {}
        finally:
            await s.close()

    asyncio.run(go())


def test_one_copy_per_result_at_the_gateway(tmp_path: Path) -> None:
    """A device re-signs unacked results under new message ids; the gateway keeps one frame per task
    (issue 29): a copy of tasks it holds is not kept, a frame with new tasks takes over the ones it
    shares, and another device's frame for the same ids is another device's."""
    async def go() -> None:
        s = await AgentStore(tmp_path / "q.sqlite3").open()
        try:
            assert await s.relay_put("up", EP, "results", "r1", b"R1", 2e9, ["a", "b"])
            assert not await s.relay_put("up", EP, "results", "r2", b"R2", 2e9, ["b", "a"]), "a re-signed copy is not kept"
            assert not await s.relay_put("up", EP, "results", "r3", b"R3", 2e9, ["a"])
            assert [f for *_, f in await s.relay_pending("up")] == [b"R1"]
            assert await s.relay_put("up", EP, "results", "r4", b"R4", 2e9, ["b", "c"])  # c is new: kept, and takes b
            assert [f for *_, f in await s.relay_pending("up")] == [b"R1", b"R4"]
            assert await s.relay_put("up", EP, "results", "r5", b"R5", 2e9, ["a", "b", "c", "d"])  # covers both: they go
            assert [f for *_, f in await s.relay_pending("up")] == [b"R5"]
            assert await s.relay_put("up", "ep-other", "results", "r1", b"O", 2e9, ["a"])
            assert await s.relay_release("up", EP, ["a", "b", "c", "d"]) == 1
            assert [f for *_, f in await s.relay_pending("up")] == [b"O"]
        finally:
            await s.close()

    asyncio.run(go())


def test_gateway_command_without_site_section_is_one_line(tmp_path: Path) -> None:
    from mesh_agent.config import AgentConfig, Credentials

    cfg = AgentConfig(endpoint_id=EP, name="g", hub_url="http://127.0.0.1:1", data_dir=tmp_path / "d",
                      credentials_file=tmp_path / "c.json")
    Credentials(endpoint_id=EP, key=KEY.hex(), mqtt_username=EP, mqtt_password="pw").save(cfg.credentials_file)
    cfg.save(tmp_path / "a.yaml")
    r = CliRunner().invoke(app, ["gateway", "--config", str(tmp_path / "a.yaml")])
    assert r.exit_code == 2
    assert "no site: section" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "d" / "site-broker").exists()  # nothing started, nothing written


def test_hub_broker_lets_a_gateway_relay_exactly_its_devices() -> None:
    from cloud_hub.broker_auth import BrokerAccount, render_acl_file
    from cloud_hub.broker_nats import render_nats_auth

    gw = BrokerAccount("ep-00000000000g", "$7$1$a$b", "ep-00000000000g", relays=("ep-0000000000d1",))
    dev = BrokerAccount("ep-0000000000d1", "$7$1$c$d", "ep-0000000000d1")
    other = BrokerAccount("ep-0000000000d2", "$7$1$e$f", "ep-0000000000d2")
    acl = render_acl_file("hub", "mesh", [gw, dev, other])
    block = acl.split("user ep-00000000000g\n", 1)[1].split("\n\n", 1)[0]
    assert block.splitlines() == ["topic read mesh/ep/ep-00000000000g/down", "topic write mesh/ep/ep-00000000000g/up",
                                  "topic read mesh/ep/ep-0000000000d1/down", "topic write mesh/ep/ep-0000000000d1/up"]
    with pytest.raises(ValueError):  # a relay name that would widen the ACL
        render_acl_file("hub", "mesh", [BrokerAccount("u", "$7$1$a$b", "ep-1", relays=("ep-#",))])
    import bcrypt

    h = bcrypt.hashpw(b"x", bcrypt.gensalt(4)).decode()
    text, _ = render_nats_auth("hub", h, "mesh", [BrokerAccount("ep-00000000000g", f"$7$1$a$b {h}", "ep-00000000000g",
                                                                relays=("ep-0000000000d1",))])
    assert "mesh.ep.ep-0000000000d1.up" in text and "mesh.ep.ep-0000000000d1.down" in text
    assert "ep-0000000000d2" not in text


def test_gateway_with_its_site_port_taken_is_one_line(tmp_path: Path) -> None:
    import socket

    from mesh_agent.config import AgentConfig, Credentials

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        cfg = AgentConfig(endpoint_id=EP, name="g", hub_url="http://127.0.0.1:1", data_dir=tmp_path / "d",
                          credentials_file=tmp_path / "c.json", site={"listen_port": port})
        Credentials(endpoint_id=EP, key=KEY.hex(), mqtt_username=EP, mqtt_password="pw").save(cfg.credentials_file)
        cfg.save(tmp_path / "a.yaml")
        r = CliRunner().invoke(app, ["gateway", "--config", str(tmp_path / "a.yaml")])
    assert r.exit_code == 2, r.output
    assert f"127.0.0.1:{port} is already in use" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "d" / "queue.sqlite3").exists()  # nothing started: no queue, no hub session
