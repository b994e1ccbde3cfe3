"""Agent config and credentials: validated, written owner-only."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mesh_agent.config import AgentConfig, ConfigError, Credentials, load_config


def _cfg(tmp_path: Path) -> AgentConfig:
    return AgentConfig(endpoint_id="ep-1", name="pi", hub_url="http://127.0.0.1:8700", data_dir=tmp_path / "q", credentials_file=tmp_path / "creds.json")


def test_config_and_credentials_round_trip_with_mode_0600(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    cfg.save(tmp_path / "agent.yaml")
    Credentials(endpoint_id="ep-1", key="ab" * 32).save(cfg.credentials_file)
    for p in (tmp_path / "agent.yaml", cfg.credentials_file):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    loaded, creds = load_config(tmp_path / "agent.yaml")
    assert loaded == cfg and creds.key_bytes == bytes([0xAB]) * 32


def test_credentials_for_another_endpoint_are_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    cfg.save(tmp_path / "agent.yaml")
    Credentials(endpoint_id="ep-2", key="ab" * 32).save(cfg.credentials_file)
    with pytest.raises(ConfigError, match="credentials are for endpoint ep-2"):
        load_config(tmp_path / "agent.yaml")


def test_not_yaml_mapping(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("key: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "b.yaml")


def _write(tmp_path: Path, **override: object) -> Path:
    cfg = _cfg(tmp_path)
    cfg.save(tmp_path / "agent.yaml")
    Credentials(endpoint_id="ep-1", key="ab" * 32).save(cfg.credentials_file)
    import yaml

    raw = yaml.safe_load((tmp_path / "agent.yaml").read_text())
    raw.update(override)
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "agent.yaml"


@pytest.mark.parametrize(
    "override, names",
    [
        ({"workerz": 3}, "workerz: Extra inputs are not permitted"),
        ({"heartbeat_s": "soon"}, "heartbeat_s"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"mqtt": {"port": 70000}}, "mqtt.port"),
        ({"allowed_functions": ["not-a-function-id"]}, "allowed_functions.0"),
        ({"queue_max_mb": 0}, "queue_max_mb"),
    ],
)
def test_a_wrong_field_is_named_with_its_file(tmp_path: Path, override: dict, names: str) -> None:
    path = _write(tmp_path, **override)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(str(path)) and names in str(info.value)


def test_bad_credentials_are_named(tmp_path: Path) -> None:
    path = _write(tmp_path)
    creds = tmp_path / "creds.json"
    creds.write_text('{"endpoint_id": "ep-1", "key": "not hex"}')
    with pytest.raises(ConfigError, match=r"creds\.json: key"):
        load_config(path)
    creds.write_text("{broken")
    with pytest.raises(ConfigError, match=r"creds\.json"):
        load_config(path)
    Credentials(endpoint_id="ep-1", key="ab" * 32).save(creds)
    zmq_cfg = _write(tmp_path, transport="zmq")
    with pytest.raises(ConfigError, match="no ZeroMQ CURVE keys.*mesh-agent init"):
        load_config(zmq_cfg)


def test_start_with_a_bad_config_exits_2_and_touches_nothing(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mesh_agent.cli import app

    path = _write(tmp_path, workers="many")
    r = CliRunner().invoke(app, ["start", "--config", str(path)])
    assert r.exit_code == 2
    assert "workers" in r.output and str(path) in " ".join(r.output.split())
    assert not (tmp_path / "q").exists(), "no queue created for a config that does not load"
