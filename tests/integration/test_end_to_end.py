"""Functions submitted through the SDK run on real agents over MQTT and ZeroMQ."""

from __future__ import annotations

import time

import numpy as np
import pytest

from cloud_hub.client import Executor, RemoteExecutionError
from cloud_hub.localmesh import LocalMesh

pytestmark = pytest.mark.integration


def square(x: int) -> int:
    return x * x


def matmul_trace(n: int, seed: int) -> float:
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, n))
    return float(np.trace(a @ a.T))


def fails(msg: str) -> None:
    raise KeyError(msg)


def fails_unpicklable() -> None:
    class Unpicklable(Exception):
        def __reduce__(self):  # type: ignore[no-untyped-def]
            raise TypeError("no")

    raise Unpicklable("custom")


@pytest.mark.parametrize("transport", ["mqtt", "zmq"])
def test_submit_map_and_errors(mesh: LocalMesh, transport: str) -> None:
    agent = mesh.add_agent(f"a-{transport}", transport)
    mesh.wait_online(agent)
    with Executor(mesh.client, agent.endpoint_id) as ex:
        assert ex.submit(square, 12).result(30) == 144
        assert list(ex.map(square, range(300))) == [i * i for i in range(300)]
        # numpy arrays go by pickle, results come back exact
        want = matmul_trace(40, 3)
        assert ex.submit(matmul_trace, 40, 3).result(30) == pytest.approx(want)
        with pytest.raises(KeyError) as info:
            ex.submit(fails, "remote-boom").result(30)
        assert "fails" in str(info.value.__cause__), "remote traceback names the function"
        with pytest.raises(RemoteExecutionError) as info2:
            ex.submit(fails_unpicklable).result(30)
        assert "Unpicklable" in info2.value.remote_type and "fails_unpicklable" in info2.value.remote_traceback
        lam = ex.submit(lambda x, y=2: x ** y, 5, y=3)
        assert lam.result(30) == 125
    ep = mesh.client.get_endpoint(agent.endpoint_id)
    assert ep["online"] and ep["transport"] == transport
    assert ep["info"]["capacity"] == 2


def test_timeout_and_worker_crash_reported(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("crashy", "mqtt")
    mesh.wait_online(agent)
    with Executor(mesh.client, agent.endpoint_id, task_timeout_s=1.0) as ex:
        slow = ex.submit(time.sleep, 30)
        with pytest.raises(Exception) as info:
            slow.result(30)
        assert "timeout" in str(info.value).lower()
        import os

        with pytest.raises(Exception) as info2:
            ex.submit(os._exit, 7).result(30)
        assert "WorkerDied" in type(info2.value).__name__ or "died" in str(info2.value).lower()
        assert ex.submit(square, 3).result(30) == 9  # the pool recovered


def test_task_status_and_numpy_result(mesh: LocalMesh) -> None:
    agent = mesh.add_agent("np", "zmq")
    mesh.wait_online(agent)
    c = mesh.client
    fid = c.register_function(np.arange)
    tid = c.submit(agent.endpoint_id, fid, 5)
    assert list(c.get_result(tid, timeout_s=30)) == [0, 1, 2, 3, 4]
    st = c.task_status(tid)
    assert st["state"] == "done" and st["ok"] is True and st["attempts"] == 1
    assert st["created"] <= st["dispatched"] <= st["acked"] <= st["done"]


def test_agent_cli_status_queue_and_clean_sigterm(mesh: LocalMesh) -> None:
    import subprocess
    import sys

    agent = mesh.add_agent("cli", "mqtt")
    mesh.wait_online(agent)
    with Executor(mesh.client, agent.endpoint_id) as ex:
        assert sum(ex.map(square, range(50), progress=True)) == sum(i * i for i in range(50))
    assert agent.stop() == 0, "SIGTERM ends the agent cleanly"
    for cmd in (["status"], ["queue", "ls"]):
        out = subprocess.run([sys.executable, "-m", "mesh_agent.cli", *cmd, "-c", str(agent.config_path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "mesh_agent.cli", "status", "-c", str(agent.config_path)], capture_output=True, text=True, timeout=60)
    assert agent.endpoint_id in out.stdout and "tasks waiting" in out.stdout
