"""`mesh-agent envs ls` and `mesh-agent envs forget` on a real environments directory (a venv built
offline from a local wheel, and a remembered failure)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mesh_agent.cli import app
from mesh_agent.config import AgentConfig, Credentials
from mesh_agent.engine.environments import EnvError, Environments
from mesh_agent.protocol.environment import env_id, normalize
from tests.fixtures.wheels import build_wheel


@pytest.fixture
def agent_config(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    creds = tmp_path / "credentials.json"
    Credentials(endpoint_id="ep-1234", key="ab" * 32).save(creds)
    cfg = AgentConfig(endpoint_id="ep-1234", name="cli", hub_url="http://127.0.0.1:9", data_dir=data, credentials_file=creds)
    path = tmp_path / "agent.yaml"
    cfg.save(path)
    wheels = tmp_path / "wheels"
    build_wheel(wheels, "meshtoy", "1.0")

    async def build() -> None:
        envs = Environments(data / "envs", no_index=True, find_links=[str(wheels)])
        await envs.kind(normalize({"pip": ["meshtoy"]}))
        with pytest.raises(EnvError):
            await envs.kind(normalize({"pip": ["nosuchpkg-zz"]}))

    asyncio.run(build())
    return path


def test_ls_shows_venvs_and_failures_and_forget_clears_one(agent_config: Path) -> None:
    runner = CliRunner()
    bad = env_id(normalize({"pip": ["nosuchpkg-zz"]}))
    out = runner.invoke(app, ["envs", "ls", "--config", str(agent_config)], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "meshtoy==1.0" in out.output and bad in out.output and "nosuchpkg-zz" in out.output
    index = agent_config.parent / "data" / "envs" / "index.json"
    before = index.read_text()
    unknown = runner.invoke(app, ["envs", "forget", "0000000000000000", "--config", str(agent_config)])
    assert unknown.exit_code == 2 and "no failure recorded" in unknown.output
    assert index.read_text() == before  # a bad id changes nothing
    ok = runner.invoke(app, ["envs", "forget", bad, "--config", str(agent_config)])
    assert ok.exit_code == 0, ok.output
    assert bad not in json.loads(index.read_text())["failed"]
    assert json.loads(index.read_text())["venvs"]  # the venv is still there
