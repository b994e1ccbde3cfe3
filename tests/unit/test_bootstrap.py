"""First-boot settings from MESH_* environment variables: parsed strictly, errors name the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh_agent.bootstrap import ensure_enrolled, from_env
from mesh_agent.config import ConfigError


def test_no_hub_url_means_no_env_enrollment(tmp_path: Path) -> None:
    assert from_env({}) is None
    assert ensure_enrolled(tmp_path / "agent.yaml", {}) == "none"
    assert not (tmp_path / "agent.yaml").exists()


def test_settings_are_read_and_typed() -> None:
    s = from_env({"MESH_HUB_URL": "https://hub.example.org", "MESH_ENROLL_TOKEN": "ce_x", "MESH_WORKERS": "3",
                  "MESH_TRANSPORT": "zmq", "BALENA_DEVICE_NAME_AT_INIT": "field-pi-9", "MESH_WORKERS_EXTRA": "ignored"})
    assert s is not None
    assert (s.hub_url, s.enroll_token, s.workers, s.transport, s.name) == ("https://hub.example.org", "ce_x", 3, "zmq", "field-pi-9")
    assert from_env({"MESH_HUB_URL": "http://h", "MESH_ENROLL_TOKEN": "t", "MESH_AGENT_NAME": "n"}).name == "n"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MESH_HUB_URL": "https://hub"}, "MESH_ENROLL_TOKEN is not"),
        ({"MESH_HUB_URL": "hub.example.org", "MESH_ENROLL_TOKEN": "t"}, "MESH_HUB_URL"),
        ({"MESH_HUB_URL": "https://hub", "MESH_ENROLL_TOKEN": "t", "MESH_WORKERS": "many"}, "MESH_WORKERS"),
        ({"MESH_HUB_URL": "https://hub", "MESH_ENROLL_TOKEN": "t", "MESH_TRANSPORT": "lora"}, "MESH_TRANSPORT"),
        ({"MESH_HUB_URL": "https://hub", "MESH_ENROLL_TOKEN": "t", "MESH_ENROLL_WAIT_S": "-1"}, "MESH_ENROLL_WAIT_S"),
    ],
)
def test_bad_environment_is_refused_and_writes_nothing(tmp_path: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ensure_enrolled(tmp_path / "agent.yaml", env)
    assert list(tmp_path.iterdir()) == []


def test_existing_config_is_kept_and_token_not_used(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("endpoint_id: ep-1\n")
    # an unreachable hub would fail: returning at once shows the token is not used again
    env = {"MESH_HUB_URL": "http://127.0.0.1:9", "MESH_ENROLL_TOKEN": "t", "MESH_ENROLL_WAIT_S": "0"}
    assert ensure_enrolled(cfg, env) == "configured"
    assert cfg.read_text() == "endpoint_id: ep-1\n"
