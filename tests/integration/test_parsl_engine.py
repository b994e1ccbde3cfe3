"""engine: parsl end to end: tasks from the hub run on a Parsl HighThroughputExecutor (LocalProvider)."""

from __future__ import annotations

import os
import time

import pytest

from cloud_hub.client import Executor
from cloud_hub.localmesh import LocalMesh
from mesh_agent.config import ParslSettings

pytestmark = pytest.mark.integration
pytest.importorskip("parsl")


def where(x: int) -> tuple[int, int]:
    import os

    return x * x, os.getpid()


def fails(msg: str) -> None:
    raise KeyError(msg)


def test_tasks_from_the_hub_run_through_parsl(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("hpc-login", "zmq", workers=2, start=False)
    # No block at start: the first tasks make Parsl's htex_auto_scale strategy submit one (elastic).
    settings = ParslSettings(provider="local", min_blocks=0, init_blocks=0, max_blocks=1, strategy_period=0.5, heartbeat_period=1)
    agent.cfg = agent.cfg.model_copy(update={"engine": "parsl", "parsl": settings})
    agent.cfg.save(agent.config_path)
    agent.start()
    mesh.wait_online(agent, timeout=60)
    ep = mesh.client.get_endpoint(agent.endpoint_id)
    assert ep["info"]["engine"] == "parsl" and ep["info"]["capacity"] == 2
    with Executor(mesh.client, agent.endpoint_id) as ex:
        out = list(ex.map(where, range(100)))
        assert [v for v, _ in out] == [i * i for i in range(100)]
        pids = {pid for _, pid in out}
        # run by Parsl's process_worker_pool workers, not by the agent or the local engine's pool
        assert agent.proc is not None and agent.proc.pid not in pids and len(pids) <= 2
        with pytest.raises(KeyError) as info:
            ex.submit(fails, "parsl-boom").result(60)
        assert "fails" in str(info.value.__cause__), "remote traceback comes back as with the local engine"
    with Executor(mesh.client, agent.endpoint_id, task_timeout_s=1.0) as ex:
        with pytest.raises(Exception) as timeout:
            ex.submit(time.sleep, 30).result(60)
        assert "TaskTimeout" in type(timeout.value).__name__ or "timeout" in str(timeout.value).lower()
        with pytest.raises(Exception) as died:
            ex.submit(os._exit, 7).result(60)
        assert "WorkerDied" in type(died.value).__name__ or "died" in str(died.value).lower()
        assert ex.submit(where, 3).result(60)[0] == 9, "Parsl replaced the dead worker"
    assert (agent.cfg.data_dir / "parsl").is_dir(), "Parsl's run dir is under the agent's data dir"
    parsl_log = next((agent.cfg.data_dir / "parsl").glob("*/parsl.log")).read_text()
    assert "Scaling out by 1 blocks" in parsl_log, "the block came from htex_auto_scale scaling out"
    assert agent.stop() == 0
