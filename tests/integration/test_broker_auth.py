"""Broker logins and ACL files (cloud_hub.broker_auth) and ``mesh-hub broker-config``."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cloud_hub.broker_auth import (
    BrokerAccount,
    mosquitto_hash,
    render_acl_file,
    render_password_file,
    verify_mosquitto_hash,
    write_broker_files,
)
from cloud_hub.cli import app
from cloud_hub.store import SqliteStore
from mesh_agent.protocol import new_key


def test_hash_is_what_mosquitto_passwd_writes(tmp_path: Path) -> None:
    exe = shutil.which("mosquitto_passwd")
    if exe is None:
        pytest.fail("mosquitto_passwd (package mosquitto) is required: run ./taskw setup")
    pw_file = tmp_path / "pw"
    subprocess.run([exe, "-c", "-b", str(pw_file), "alice", "s3cret"], check=True, capture_output=True)
    theirs = pw_file.read_text().strip().split(":", 1)[1]
    assert theirs.startswith("$7$")
    assert verify_mosquitto_hash("s3cret", theirs) and not verify_mosquitto_hash("s3cre", theirs)
    # ours, with their salt and iteration count, is byte-identical
    _, _, iterations, salt, _ = theirs.split("$")
    import base64

    assert mosquitto_hash("s3cret", salt=base64.b64decode(salt), iterations=int(iterations)) == theirs


def test_hash_round_trip_and_garbage() -> None:
    h = mosquitto_hash("pw")
    assert h.startswith("$7$1000$") and verify_mosquitto_hash("pw", h)
    assert h != mosquitto_hash("pw"), "salted"
    for bad in ("", "$6$1$aa$bb", "$7$x$aa$bb", "$7$10$!!$bb", "plain"):
        assert not verify_mosquitto_hash("pw", bad)


def test_acl_gives_each_endpoint_only_its_own_topics() -> None:
    accounts = [BrokerAccount("ep-aaa", "$7$h1", "ep-aaa"), BrokerAccount("ep-bbb", "$7$h2", "ep-bbb")]
    acl = render_acl_file("mesh-hub", "mesh", accounts)
    blocks = {b.splitlines()[0]: b.splitlines()[1:] for b in ("\n".join(line for line in acl.splitlines() if not line.startswith("#"))).split("\n\n") if b.strip()}
    assert blocks["user mesh-hub"] == ["topic readwrite #"]
    assert blocks["user ep-aaa"] == ["topic read mesh/ep/ep-aaa/down", "topic write mesh/ep/ep-aaa/up"]
    assert blocks["user ep-bbb"] == ["topic read mesh/ep/ep-bbb/down", "topic write mesh/ep/ep-bbb/up"]
    assert "pattern" not in acl and "%u" not in acl
    assert render_password_file("mesh-hub", "$7$x", accounts).splitlines() == ["mesh-hub:$7$x", "ep-aaa:$7$h1", "ep-bbb:$7$h2"]


@pytest.mark.parametrize("name", ["", "a:b", "a b", "a/b", "a#", "a+", "é", "a\nuser evil"])
def test_names_that_would_change_the_files_meaning_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unusable broker username"):
        render_acl_file("mesh-hub", "mesh", [BrokerAccount(name, "$7$h", "ep-1")])
    with pytest.raises(ValueError):
        render_password_file(name, "$7$h", [])


def flat(text: str) -> str:
    """Rich wraps console output to the terminal width: compare without line breaks."""
    return " ".join(text.split())


def _hub_db_with_endpoints(path: Path) -> list[str]:
    async def go() -> list[str]:
        store = await SqliteStore(path).open()
        try:
            uid = await store.create_user("alice")
            ids = []
            for name, transport in (("pi-1", "mqtt"), ("hpc", "zmq"), ("pi-2", "mqtt")):
                tok = await store.create_enroll_token(uid, 60, 1)
                ep = await store.enroll_endpoint(tok, name, transport, new_key(), mqtt_hash=mosquitto_hash("x") if transport == "mqtt" else None)
                assert ep is not None
                ids.append(ep["id"])
            return ids
        finally:
            await store.close()

    return asyncio.run(go())


def test_broker_config_cli_writes_both_files(tmp_path: Path) -> None:
    db = tmp_path / "hub.sqlite3"
    mqtt_a, zmq_ep, mqtt_b = _hub_db_with_endpoints(db)
    out = tmp_path / "auth"
    r = CliRunner().invoke(app, ["broker-config", "--db", str(db), "--out", str(out), "--hub-password", "hubpw"])
    assert r.exit_code == 0, r.output
    assert "2 endpoint logins" in flat(r.output) and "use_username_as_clientid true" in flat(r.output)
    users = [line.split(":")[0] for line in (out / "password_file").read_text().splitlines()]
    assert users == ["mesh-hub", mqtt_a, mqtt_b], "only MQTT endpoints get a broker login"
    assert verify_mosquitto_hash("hubpw", (out / "password_file").read_text().splitlines()[0].split(":", 1)[1])
    acl = (out / "acl_file").read_text()
    assert f"topic read mesh/ep/{mqtt_a}/down" in acl and zmq_ep not in acl
    assert (out / "password_file").stat().st_mode & 0o007 == 0, "not world-readable"


def test_broker_config_cli_bad_input_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_HUB_MQTT_PASSWORD", raising=False)
    db = tmp_path / "hub.sqlite3"
    _hub_db_with_endpoints(db)
    out = tmp_path / "auth"
    r = CliRunner().invoke(app, ["broker-config", "--db", str(db), "--out", str(out)])
    assert r.exit_code == 2 and "broker password is needed" in flat(r.output)
    r = CliRunner().invoke(app, ["broker-config", "--db", str(tmp_path / "missing.sqlite3"), "--out", str(out), "--hub-password", "x"])
    assert r.exit_code == 2 and "no such hub database" in flat(r.output)
    (tmp_path / "junk.sqlite3").write_bytes(b"junk" * 500)
    r = CliRunner().invoke(app, ["broker-config", "--db", str(tmp_path / "junk.sqlite3"), "--out", str(out), "--hub-password", "x"])
    assert r.exit_code == 2 and "not a usable hub database" in flat(r.output)
    assert not out.exists(), "nothing written on bad input"
    monkeypatch.setenv("MESH_HUB_MQTT_PASSWORD", "from-env")
    r = CliRunner().invoke(app, ["broker-config", "--db", str(db), "--out", str(out)])
    assert r.exit_code == 0 and verify_mosquitto_hash("from-env", (out / "password_file").read_text().splitlines()[0].split(":", 1)[1])


def test_write_broker_files_is_atomic_and_private(tmp_path: Path) -> None:
    pw, acl = write_broker_files(tmp_path, "mesh-hub", "p", "mesh", [BrokerAccount("ep-1", "$7$h", "ep-1")])
    assert {p.name for p in tmp_path.iterdir()} == {"password_file", "acl_file"}, "no temporary files left behind"
    assert oct(pw.stat().st_mode & 0o777) == "0o640" and oct(acl.stat().st_mode & 0o777) == "0o640"
