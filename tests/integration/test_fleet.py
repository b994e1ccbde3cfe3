"""mesh-hub fleet against a fake balena API on 127.0.0.1 (balena-sdk and the hub are real)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import zmq
import pytest
from typer.testing import CliRunner

from cloud_hub.cli import app
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from tests.fakes.balena_api import FakeBalena

pytest.importorskip("balena")
pytestmark = pytest.mark.integration
runner = CliRunner()


@pytest.fixture
def balena() -> Iterator[FakeBalena]:
    fake = FakeBalena()
    fake.add_device("acme/field-pis", "pi-north", online=True)
    fake.add_device("acme/field-pis", "pi-south", online=False, last_seen="2026-11-20T08:00:00.000Z")
    fake.add_device("acme/field-pis", "pi-east", online=True)
    fake.add_device("acme/other", "elsewhere", online=True)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubThread]:
    cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*", bootstrap_user="ops")
    with HubThread(cfg) as h:
        yield h


def _run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return r.exit_code, r.output


def test_ls_shows_devices_with_online_state(balena: FakeBalena) -> None:
    code, out = _run("fleet", "ls", "acme/field-pis", "--balena-token", balena.token, "--balena-api-url", balena.url)
    assert code == 0, out
    lines = {line.split()[1]: line for line in out.splitlines() if "pi-" in line}
    assert set(lines) == {"pi-north", "pi-south", "pi-east"}, "only this fleet's devices"
    assert "online" in lines["pi-north"] and "offline" in lines["pi-south"] and "2026-11-20" in lines["pi-south"]
    assert "2/3 online" in out
    assert not balena.writes


def test_push_tokens_gives_each_device_a_working_single_use_token(balena: FakeBalena, hub: HubThread) -> None:
    args = ("fleet", "push-tokens", "acme/field-pis", "--hub", hub.url, "--token", hub.token,
            "--balena-token", balena.token, "--balena-api-url", balena.url)
    code, out = _run(*args)
    assert code == 0, out
    envs = {n: balena.env_of(n) for n in ("pi-north", "pi-south", "pi-east")}
    tokens = {env["MESH_ENROLL_TOKEN"] for env in envs.values()}
    assert len(tokens) == 3, "one distinct token per device"
    assert all(env["MESH_HUB_URL"] == hub.url and env["MESH_AGENT_NAME"] == n for n, env in envs.items())
    assert balena.env_of("elsewhere") == {}
    # each token enrolls exactly one device, once
    tok = envs["pi-north"]["MESH_ENROLL_TOKEN"]
    curve = zmq.curve_keypair()[0].decode()  # a ZeroMQ endpoint enrolls with its CURVE public key
    r = httpx.post(f"{hub.url}/v1/endpoints/enroll", json={"token": tok, "name": "pi-north", "transport": "zmq", "curve_public": curve})
    assert r.status_code == 201
    again = httpx.post(f"{hub.url}/v1/endpoints/enroll", json={"token": tok, "name": "pi-north-2", "transport": "zmq", "curve_public": curve})
    assert again.status_code == 401
    # a second run changes nothing; --force replaces tokens (the SDK's upsert: POST, 409, PATCH)
    writes = len(balena.writes)
    code, out = _run(*args)
    assert code == 0 and len(balena.writes) == writes and out.count("skipped") == 3, out
    code, out = _run(*args, "--force", "--device", "pi-south")
    assert code == 0, out
    assert balena.env_of("pi-south")["MESH_ENROLL_TOKEN"] != envs["pi-south"]["MESH_ENROLL_TOKEN"]
    assert any(m == "PATCH" for m, _, _ in balena.writes)


def test_bad_input_changes_nothing(balena: FakeBalena, hub: HubThread) -> None:
    base = ("--hub", hub.url, "--token", hub.token, "--balena-api-url", balena.url)
    cases = [
        (("fleet", "push-tokens", "acme/nope", *base, "--balena-token", balena.token), "no balena fleet 'acme/nope'"),
        (("fleet", "push-tokens", "acme/field-pis", *base, "--balena-token", "wrong"), "refused the API token"),
        (("fleet", "push-tokens", "acme/field-pis", *base, "--balena-token", balena.token, "--device", "pi-west"), "no device named 'pi-west'"),
        (("fleet", "push-tokens", "acme/field-pis", "--hub", hub.url, "--token", "bad", "--balena-api-url", balena.url,
          "--balena-token", balena.token), "invalid API token"),
        (("fleet", "ls", "acme/field-pis", "--balena-api-url", balena.url), "no balena API token"),
    ]
    for args, message in cases:
        code, out = _run(*args)
        assert code == 2 and message in " ".join(out.split()), (args, out)
    assert balena.writes == [] and balena.env == []


def test_push_tokens_reads_the_sdk_configuration(balena: FakeBalena, hub: HubThread, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """No --hub/--token: the `mesh-hub login` profile, MESH_HUB_URL / MESH_TOKEN over it, flags over both (issue 18)."""
    for k in ("MESH_HUB_URL", "MESH_TOKEN", "MESH_HUB_TOKEN", "MESH_PROFILE", "MESH_CA_FILE", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(k, raising=False)
    cfg = tmp_path / "cfg" / "config.yaml"
    monkeypatch.setenv("MESH_CONFIG", str(cfg))
    fleet = ("fleet", "push-tokens", "acme/field-pis", "--balena-token", balena.token, "--balena-api-url", balena.url)
    # nothing configured: one line saying how to log in, and nothing written to balena
    code, out = _run(*fleet)
    assert code == 2 and "no hub URL: run `mesh-hub login --url URL`" in " ".join(out.split()), out
    assert balena.writes == []
    # the profile `mesh-hub login` saves (checked against the hub) is enough
    code, out = _run("login", "--url", hub.url, "--token", hub.token)
    assert code == 0, out
    code, out = _run(*fleet, "--device", "pi-north")
    assert code == 0, out
    assert balena.env_of("pi-north")["MESH_HUB_URL"] == hub.url
    assert "MESH_ENROLL_TOKEN" in balena.env_of("pi-north") and "MESH_ENROLL_TOKEN" not in balena.env_of("pi-east")
    # MESH_TOKEN overrides the profile's token (a bad one: refused by the hub, nothing written) ...
    writes = len(balena.writes)
    monkeypatch.setenv("MESH_TOKEN", "cm_not-a-real-token")
    code, out = _run(*fleet, "--device", "pi-east")
    assert code == 2 and "refused the token (invalid API token)" in " ".join(out.split()), out
    assert len(balena.writes) == writes
    # ... and --token overrides MESH_TOKEN
    code, out = _run(*fleet, "--device", "pi-east", "--token", hub.token)
    assert code == 0, out
    assert "MESH_ENROLL_TOKEN" in balena.env_of("pi-east")
    # MESH_HUB_URL overrides the profile's URL (nothing listens there: one line, nothing written)
    monkeypatch.delenv("MESH_TOKEN")
    from cloud_hub.broker import free_port

    monkeypatch.setenv("MESH_HUB_URL", f"http://127.0.0.1:{free_port()}")
    writes = len(balena.writes)
    code, out = _run(*fleet, "--device", "pi-south")
    assert code == 2 and "cannot reach the hub at http://127.0.0.1:" in " ".join(out.split()), out
    assert len(balena.writes) == writes
