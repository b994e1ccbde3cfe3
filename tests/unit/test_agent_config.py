"""Agent config and credentials: validated, written owner-only."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from mesh_agent.config import AgentConfig, ConfigError, Credentials, load_config


def _cfg(tmp_path: Path) -> AgentConfig:
    return AgentConfig(endpoint_id="ep-1", name="pi", hub_url="http://hub", data_dir=tmp_path / "q", credentials_file=tmp_path / "creds.json")


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
