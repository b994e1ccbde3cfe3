"""Task arguments that are Globus file references are staged in by the agent with Globus Transfer,
outputs pushed back; failures and timeouts come back as clear errors. Globus is a fake on
127.0.0.1 whose collections are local folders; the agent, its workers and globus-sdk are real."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from mesh_agent.config import Credentials, GlobusStaging
from mesh_agent.staging import GlobusFile, StagingError
from tests.fakes.globus_api import FakeGlobus

pytest.importorskip("globus_sdk")
pytestmark = pytest.mark.integration


def count_lines(path: Path) -> tuple[str, int]:
    return type(path).__name__, len(path.read_text().splitlines())


def summarize(inputs: list) -> object:
    from mesh_agent.staging import GlobusFile, output_path

    total = sum(len(p.read_text().splitlines()) for p in inputs)
    out = output_path("summary.txt")
    out.write_text(f"{total} lines\n")
    return GlobusFile.push(out, "remote", "/results/summary.txt")


@pytest.fixture
def globus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeGlobus]:
    fake = FakeGlobus(clients={"agent-client": "agent-secret"},
                      collections={"remote": tmp_path / "remote", "pi": tmp_path / "pi", "tape": tmp_path / "tape"},
                      slow={"tape"})
    for d in fake.collections.values():
        d.mkdir()
    (tmp_path / "remote" / "data").mkdir()
    (tmp_path / "remote" / "data" / "a.txt").write_text("1\n2\n3\n")
    (tmp_path / "remote" / "data" / "b.txt").write_text("4\n5\n")
    fake.start()
    for k, v in fake.env().items():
        monkeypatch.setenv(k, v)  # the agent process inherits them
    yield fake
    fake.stop()


def test_stage_in_push_out_and_clear_errors(mesh: LocalMesh, globus: FakeGlobus, tmp_path: Path) -> None:
    agent = mesh.add_agent("pi-lab", "mqtt", workers=1, start=False)
    agent.cfg = agent.cfg.model_copy(update={"globus": GlobusStaging(local_collection="pi", local_root=tmp_path / "pi", timeout_s=1.5, poll_s=0.2)})
    agent.cfg.save(agent.config_path)
    creds = Credentials.model_validate_json(agent.cfg.credentials_file.read_text())
    creds.model_copy(update={"globus_client_id": "agent-client", "globus_client_secret": "agent-secret"}).save(agent.cfg.credentials_file)
    agent.start()
    mesh.wait_online(agent)
    with Executor(mesh.client, agent.endpoint_id) as ex:
        assert ex.submit(count_lines, GlobusFile("remote", "/data/a.txt")).result(60) == ("PosixPath", 3)
        ref = ex.submit(summarize, [GlobusFile("remote", "/data/a.txt"), GlobusFile("remote", "/data/b.txt")]).result(60)
        assert ref == GlobusFile("remote", "/results/summary.txt"), "the caller gets the plain reference"
        assert (tmp_path / "remote" / "results" / "summary.txt").read_text() == "5 lines\n"

        with pytest.raises(StagingError) as missing:
            ex.submit(count_lines, GlobusFile("remote", "/data/nope.txt")).result(60)
        assert "FILE_NOT_FOUND" in str(missing.value) and "remote:/data/nope.txt" in str(missing.value)

        with pytest.raises(StagingError) as slow:
            ex.submit(count_lines, GlobusFile("tape", "/archive/x.txt")).result(60)
        assert "did not finish within 1.5 s" in str(slow.value) and "cancelled" in str(slow.value)
        assert any(t["nice_status"] == "CANCELED" for t in globus.tasks.values()), "the timed-out transfer was cancelled"

        assert ex.submit(len, "plain args are untouched").result(60) == 24, "tasks without references run as before"
    staged = tmp_path / "pi" / ".mesh-staging"
    assert not staged.exists() or not any(staged.iterdir()), "staged files are removed after each task"
