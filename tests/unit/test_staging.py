"""Globus staging: references are validated, and an endpoint without staging says so clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from mesh_agent.config import AgentConfig, ConfigError, Credentials, GlobusStaging, load_config
from mesh_agent.engine._worker import run_task
from mesh_agent.protocol import deserialize, serialize, serialize_function
from mesh_agent.staging import GlobusFile


def test_references_need_a_collection_and_an_absolute_path() -> None:
    for bad in (("", "/x"), ("c", "relative/x")):
        with pytest.raises(ValueError, match="GlobusFile needs"):
            GlobusFile(*bad)
    assert GlobusFile.push("/tmp/o", "c", "/o").local == "/tmp/o"


def test_reference_on_an_endpoint_without_staging_fails_the_task_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_STAGING", raising=False)
    import mesh_agent.engine._worker as worker

    # run_task marks the process as running a task (a worker process's state); this one is pytest's
    monkeypatch.setattr(worker, "CURRENT_TASK_ID", None)
    body = serialize_function(len)
    task_id, ok, data, _, _ = run_task({}, ("t1", "f1", body, serialize(((GlobusFile("c", "/x"),), {}))))
    err = deserialize(data)
    assert not ok and err["type"] == "mesh_agent.staging.StagingError"
    assert "no Globus staging configured" in err["message"]


def test_staging_config_without_client_credentials_is_refused(tmp_path: Path) -> None:
    cfg = AgentConfig(endpoint_id="ep-1", name="pi", hub_url="http://127.0.0.1:8700", data_dir=tmp_path / "q", credentials_file=tmp_path / "c.json",
                      globus=GlobusStaging(local_collection="pi", local_root=tmp_path))
    cfg.save(tmp_path / "agent.yaml")
    Credentials(endpoint_id="ep-1", key="ab" * 32).save(cfg.credentials_file)
    with pytest.raises(ConfigError, match="globus_client_id / globus_client_secret are missing"):
        load_config(tmp_path / "agent.yaml")
