"""Flower's current quickstart examples, unchanged, on a real mesh: Mosquitto, the hub, three
agent processes (one worker each) that declare their partition (``index``/``num_clients`` ->
``node_config`` ``partition-id``/``num-partitions``).

The apps come from tests/fixtures/flower_apps (see NOTICE: quickstart-numpy unchanged,
quickstart-sklearn with only its downloading loader swapped for scikit-learn's bundled iris).
One mesh for the module; tests run in file order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("sklearn")

from cloud_hub.broker import find_mosquitto  # noqa: E402
from cloud_hub.localmesh import AgentProcess, LocalMesh  # noqa: E402
from fl.flower.grid import RunFailed  # noqa: E402
from fl.flower.run import run_app  # noqa: E402
from fl.localmesh import add_digits_agents  # noqa: E402
from mesh_agent.config import AgentConfig  # noqa: E402
from tests.fixtures.wheels import build_wheel  # noqa: E402

pytestmark = pytest.mark.integration

APPS = Path(__file__).resolve().parents[1] / "fixtures" / "flower_apps"
REPO = Path(__file__).resolve().parents[2]


class _Mesh:
    def __init__(self, mesh: LocalMesh, agents: List[AgentProcess]) -> None:
        self.mesh, self.agents = mesh, agents

    @property
    def ids(self) -> List[str]:
        return [a.endpoint_id for a in self.agents]


@pytest.fixture(scope="module")
def fmesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Mesh]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    work = Path(tmp_path_factory.mktemp("flowermesh"))
    # the wheel depapp needs, served to the agents' execution environments offline (never PyPI)
    wheels = work / "wheels"
    build_wheel(wheels, "meshflwr-scale", "1.0", files={"meshflwr_scale/__init__.py": "VERSION = '1.0'\nFACTOR = 3.0\n"})
    m = LocalMesh(work, heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0)
    m.start()
    try:
        agents = add_digits_agents(m, 3, prefix="flwr", workers=1, start=False)
        for a in agents:
            a.cfg = AgentConfig.model_validate({**a.cfg.model_dump(),
                                                "environments": {"no_index": True, "find_links": [str(wheels)]}})
            a.cfg.save(a.config_path)
            a.start()
        m.wait_online(timeout=120)
        yield _Mesh(m, agents)
    finally:
        m.stop()


@pytest.fixture
def fresh_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Mesh]:
    """Three new agents on a new hub: a scheduler that has seen nothing of other tests' runs."""
    m = LocalMesh(Path(tmp_path_factory.mktemp("flowerauto")), heartbeat_s=0.5, lost_after_s=2.5, lease_s=4.0)
    m.start()
    try:
        agents = add_digits_agents(m, 3, prefix="auto", workers=1)
        m.wait_online(timeout=120)
        yield _Mesh(m, agents)
    finally:
        m.stop()


def _copy_app(name: str, dst: Path) -> Path:
    out = dst / name
    shutil.copytree(APPS / name, out)
    return out


def _cli(mesh: LocalMesh, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MESH_HUB_URL=mesh.url, MESH_TOKEN=mesh.token,
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "fl.flower.cli", "run", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_quickstart_numpy_unchanged_then_cached(fmesh: _Mesh, tmp_path: Path) -> None:
    client = fmesh.mesh.client
    res = run_app(APPS / "quickstart-numpy", client, endpoints=fmesh.ids, dataset="digits", workdir=tmp_path)
    assert res.status == "finished", res.error
    assert sorted(res.delivery["installed"]) == sorted(fmesh.ids) and res.delivery["fab_bytes_sent"] == 3 * res.app["fab_bytes"]
    assert sorted(res.ready) == sorted(fmesh.ids)
    assert [r["round"] for r in res.rounds] == [1, 2, 3]  # num-server-rounds from its pyproject.toml
    assert all(sorted(r["participants"]) == sorted(fmesh.ids) for r in res.rounds)
    # federated evaluation ran on the devices (FedAvg's default fraction_evaluate=1.0)
    assert all(sorted(r["extra"]["federated_eval"]["clients"]) == sorted(fmesh.ids) for r in res.rounds)
    assert res.bytes_out > 0 and res.bytes_in > 0
    final = np.load(tmp_path / "final_model.npz")  # what its ServerApp saves, in its working directory
    assert final["arr_0"].shape == (1, 1) and final["arr_0"][0, 0] > 1.0  # ones + 3 rounds of noise averaged
    run = client.fl_run(res.run_id)
    assert run["status"] == "finished" and run["rounds_done"] == 3
    # second run: the devices hold the app (same hash): nothing is sent again
    res2 = run_app(APPS / "quickstart-numpy", client, endpoints=fmesh.ids, dataset="digits", workdir=tmp_path,
                   run_config={"num-server-rounds": 1})
    assert res2.status == "finished" and sorted(res2.delivery["already"]) == sorted(fmesh.ids)
    assert res2.delivery["fab_bytes_sent"] == 0 and len(res2.rounds) == 1


def test_quickstart_sklearn_through_a_device_outage(fmesh: _Mesh, tmp_path: Path) -> None:
    """SIGKILL one agent after round 1 is recorded (round 2 under way), restart it two rounds
    later: the round it misses answers NODE_UNAVAILABLE (Flower's semantics), the others carry
    on, and it trains again after its restart (app and state still on its disk)."""
    client = fmesh.mesh.client
    victim = fmesh.agents[1]
    killed, restarted = threading.Event(), threading.Event()

    def on_round(rec: Dict[str, Any]) -> None:
        if rec["round"] == 1 and not killed.is_set():
            victim.kill()
            killed.set()
        elif rec["round"] == 3 and killed.is_set() and not restarted.is_set():
            victim.start()  # from run_app's working directory, not the repository's: venv workers still import mesh_agent
            fmesh.mesh.wait_online(victim, timeout=60)
            restarted.set()

    res = run_app(APPS / "quickstart-sklearn", client, endpoints=fmesh.ids, dataset="digits", workdir=tmp_path,
                  run_config={"num-server-rounds": 8}, on_round=on_round, poll_s=1.0)
    assert killed.is_set() and restarted.is_set()
    assert res.status == "finished", res.error
    assert [r["round"] for r in res.rounds] == list(range(1, 9))
    vid = victim.endpoint_id
    missed = [r for r in res.rounds if vid not in r["participants"]]
    assert missed, [(r["round"], r["participants"]) for r in res.rounds]
    assert all(len(r["participants"]) >= 2 for r in res.rounds)  # the others kept training
    reasons = [r["dropped"].get(vid, "") for r in missed] + [
        (r["extra"]["federated_eval"] or {}).get("failed", {}).get(vid, "") for r in res.rounds]
    assert any("Node Unavailable" in x for x in reasons) or any(vid not in r["extra"]["asked"] for r in missed)
    assert vid in res.rounds[-1]["participants"]  # back after the restart
    assert (tmp_path / "logreg_model.pkl").is_file()
    fe = res.rounds[-1]["extra"]["federated_eval"]["metrics"]
    assert fe["num-examples"] == 30 and fe["accuracy"] > 0.5, fe


def test_state_node_config_and_run_config_reach_the_clientapp(fmesh: _Mesh, tmp_path: Path) -> None:
    """Flower's own ClientApp API, no example: context.state counts rounds on each device
    (kept in the device's data dir between messages), node_config and run_config are reported."""
    app = tmp_path / "stateapp"
    (app / "stateapp").mkdir(parents=True)
    (app / "stateapp" / "__init__.py").write_text("")
    (app / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["hatchling"]\nbuild-backend = "hatchling.build"\n\n'
        '[project]\nname = "stateapp"\nversion = "1.0.0"\nlicense = "Apache-2.0"\ndependencies = ["flwr>=1.20"]\n\n'
        '[tool.hatch.build.targets.wheel]\npackages = ["."]\n\n[tool.flwr.app]\npublisher = "tests"\n\n'
        '[tool.flwr.app.components]\nserverapp = "stateapp.server:app"\nclientapp = "stateapp.client:app"\n\n'
        '[tool.flwr.app.config]\nnum-server-rounds = 3\nscale = 1.0\n')
    (app / "stateapp" / "client.py").write_text(
        "from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict\n"
        "from flwr.clientapp import ClientApp\n\napp = ClientApp()\n\n\n@app.train()\n"
        "def train(msg: Message, context: Context):\n"
        "    seen = context.state.get('seen', ConfigRecord({'n': 0}))\n"
        "    seen['n'] = int(seen['n']) + 1\n    context.state['seen'] = seen\n"
        "    arrays = [a * float(context.run_config['scale']) for a in msg.content['arrays'].to_numpy_ndarrays()]\n"
        "    m = {'num-examples': 1, 'seen': seen['n'], 'pid': context.node_config['partition-id'],\n"
        "         'parts': context.node_config['num-partitions']}\n"
        "    return Message(RecordDict({'arrays': ArrayRecord(arrays), 'metrics': MetricRecord(m)}), reply_to=msg)\n")
    (app / "stateapp" / "server.py").write_text(
        "import numpy as np\nfrom flwr.app import ArrayRecord, Context\nfrom flwr.serverapp import Grid, ServerApp\n"
        "from flwr.serverapp.strategy import FedAvg\n\napp = ServerApp()\n\n\n@app.main()\n"
        "def main(grid: Grid, context: Context) -> None:\n"
        "    FedAvg(fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3).start(\n"
        "        grid=grid, initial_arrays=ArrayRecord([np.ones(2)]), num_rounds=context.run_config['num-server-rounds'])\n")
    res = run_app(app, fmesh.mesh.client, endpoints=fmesh.ids, dataset="digits", workdir=tmp_path,
                  run_config={"scale": 2.0})
    assert res.status == "finished", res.error
    for r in res.rounds:
        cm = r["extra"]["client_metrics"]
        assert sorted(cm) == sorted(fmesh.ids)
        assert all(m["seen"] == r["round"] for m in cm.values()), cm  # state kept across rounds
        assert sorted(m["pid"] for m in cm.values()) == [0, 1, 2] and all(m["parts"] == 3 for m in cm.values())
    assert res.rounds[-1]["extra"]["federated_eval"] is None  # fraction_evaluate=0


def _failed_cli_run(fmesh: _Mesh, app: Path, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``mesh-fl run`` on the mesh's endpoints that must exit 1, and the one run it recorded."""
    before = {r["id"] for r in fmesh.mesh.client.fl_runs()}
    p = _cli(fmesh.mesh, str(app), "--endpoints", ",".join(fmesh.ids), "--dataset", "digits", *args,
             "--out-dir", str(tmp_path / "out"), cwd=tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    new = [r["id"] for r in fmesh.mesh.client.fl_runs() if r["id"] not in before]
    assert len(new) == 1, new
    return p, fmesh.mesh.client.fl_run(new[0])


def test_missing_run_config_key_fails_loudly_with_nonzero_exit(fmesh: _Mesh, tmp_path: Path) -> None:
    """The ClientApp reads a run_config key the app does not define (the KeyError a user meets):
    every client fails every round the same way, so the run stops after 2 such rounds (not 10),
    is recorded failed with the reason, and the CLI exits 1."""
    app = _copy_app("quickstart-sklearn", tmp_path)
    client_py = app / "sklearnexample" / "client_app.py"
    client_py.write_text(client_py.read_text().replace('context.run_config["penalty"]', 'context.run_config["client-penalty"]'))
    p, run = _failed_cli_run(fmesh, app, tmp_path, "--run-config", "num-server-rounds=10")
    assert "every client failed 2 training round(s) in a row" in p.stderr and "client-penalty" in p.stderr, p.stderr[-2000:]
    assert run["status"] == "failed" and "client-penalty" in (run.get("error") or ""), run
    assert run["rounds_done"] <= 2


def test_missing_dependency_is_named_and_nothing_runs(fmesh: _Mesh, tmp_path: Path) -> None:
    app = _copy_app("quickstart-numpy", tmp_path)
    toml = app / "pyproject.toml"
    toml.write_text(toml.read_text().replace('"numpy>=2.0.2",', '"numpy>=2.0.2",\n    "torchvision==0.23.0",'))
    with pytest.raises(RunFailed, match=r"no endpoint can run the app .*torchvision==0.23.0 \(not installed; comes from "
                                        r"the agent's Python only, never downloaded\)"):
        run_app(app, fmesh.mesh.client, endpoints=fmesh.ids, dataset="digits", workdir=tmp_path)


def test_app_dependency_is_built_in_an_environment_on_each_endpoint(fmesh: _Mesh, tmp_path: Path) -> None:
    """depapp needs meshflwr-scale, which the agents' Python lacks: each endpoint runs its
    ClientApp in an execution environment built from the local wheel (no index), with only that
    package in it (flwr and numpy come from the agent). The replies prove the package was
    imported there (its FACTOR scaled the model)."""
    res = run_app(APPS / "depapp", fmesh.mesh.client, endpoints=fmesh.ids, dataset="digits", workdir=tmp_path,
                  warmup_s=300)
    assert res.status == "finished", res.error
    assert res.delivery["environments"] == {e: {"pip": ["meshflwr-scale>=1.0"]} for e in fmesh.ids}, res.delivery
    assert sorted(res.ready) == sorted(fmesh.ids) and not res.failed
    for r in res.rounds:
        cm = r["extra"]["client_metrics"]
        assert sorted(cm) == sorted(fmesh.ids)
        assert all(m["dep-factor"] == 3.0 and m["dep-version"] == 1.0 for m in cm.values()), cm
    final = np.load(tmp_path / "final_model.npz")["arr_0"]
    assert final.tolist() == [9.0, 9.0]  # ones, times 3 in each of 2 rounds
    run = fmesh.mesh.client.fl_run(res.run_id)
    assert run["config"]["delivery"]["environments"] == res.delivery["environments"]


def test_app_dependency_that_cannot_be_built_fails_naming_it(fmesh: _Mesh, tmp_path: Path) -> None:
    """The same app needing a package no index holds: every endpoint's environment build fails,
    each warm-up error names the package, and the run fails with it (nothing trains)."""
    app = _copy_app("depapp", tmp_path)
    toml = app / "pyproject.toml"
    toml.write_text(toml.read_text().replace('"meshflwr-scale>=1.0"', '"meshflwr-nosuch>=2.1"'))
    p, run = _failed_cli_run(fmesh, app, tmp_path, "--warmup-s", "300")
    assert "run failed: no endpoint can run the app (3 failed)" in p.stderr and "meshflwr-nosuch>=2.1" in p.stderr, p.stderr[-3000:]
    assert run["status"] == "failed" and "meshflwr-nosuch>=2.1" in (run.get("error") or ""), run
    dropped = run["rounds"][0]["dropped"]
    assert sorted(dropped) == sorted(fmesh.ids) and all("meshflwr-nosuch>=2.1" in why for why in dropped.values()), dropped


def test_warmup_failure_is_not_ready(fmesh: _Mesh, tmp_path: Path) -> None:
    client = fmesh.mesh.client
    before = {r["id"] for r in client.fl_runs()}
    with pytest.raises(RunFailed, match="no endpoint can run the app .*DatasetNotFound.*'nope'"):
        run_app(APPS / "quickstart-numpy", client, endpoints=fmesh.ids, dataset="nope", workdir=tmp_path)
    # the hub's run record says which endpoint failed and how, as a native run's does
    new = [r["id"] for r in client.fl_runs() if r["id"] not in before]
    assert len(new) == 1
    run = client.fl_run(new[0])
    assert run["status"] == "failed" and "DatasetNotFound" in (run["error"] or "")
    assert [r["round"] for r in run["rounds"]] == [1]
    r1 = run["rounds"][0]
    assert sorted(r1["dropped"]) == sorted(fmesh.ids) and not r1["participants"]
    assert all("DatasetNotFound" in why and "'nope'" in why for why in r1["dropped"].values()), r1["dropped"]
    assert r1["extra"]["skipped"] is True and r1["extra"]["reason"] == "every client failed its warm-up"
    assert r1["extra"]["warmup_failed"] == r1["dropped"]


def test_one_endpoint_failing_its_warmup_is_in_the_hubs_record(fmesh: _Mesh, tmp_path: Path) -> None:
    """The ClientApp cannot be imported on one device: that endpoint is left out with its first
    error, written into round 1 of the hub's run record; the others train."""
    vid = fmesh.agents[0].endpoint_id
    app = _copy_app("quickstart-numpy", tmp_path)
    client_py = app / "quickstart_numpy" / "client_app.py"
    client_py.write_text("from fl.datasets import endpoint_id as _endpoint_id\n\n"
                         f"if _endpoint_id() == {vid!r}:\n    raise ImportError('libfoo.so is missing on this device')\n\n"
                         + client_py.read_text())
    client = fmesh.mesh.client
    res = run_app(app, client, endpoints=fmesh.ids, dataset="digits", workdir=tmp_path, run_config={"num-server-rounds": 2})
    assert res.status == "finished", res.error
    assert list(res.failed) == [vid] and "libfoo.so is missing on this device" in res.failed[vid], res.failed
    assert sorted(res.ready) == sorted(set(fmesh.ids) - {vid})
    run = client.fl_run(res.run_id)
    assert run["status"] == "finished" and [r["round"] for r in run["rounds"]] == [1, 2]
    r1, r2 = run["rounds"]
    assert r1["extra"]["warmup_failed"] == {vid: res.failed[vid]}
    assert r1["dropped"] == {vid: res.failed[vid]}
    assert sorted(r1["participants"]) == sorted(r2["participants"]) == sorted(res.ready)
    assert vid not in r2["dropped"] and "warmup_failed" not in r2["extra"]


def test_bad_input_is_refused_before_anything_is_stored(fmesh: _Mesh, tmp_path: Path) -> None:
    before = len(fmesh.mesh.client.fl_runs())
    p = _cli(fmesh.mesh, str(APPS / "quickstart-numpy"), "--endpoints", ",".join(fmesh.ids), "--run-config", "no-such-key=1",
             cwd=tmp_path)
    assert p.returncode == 2 and "no-such-key" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = _cli(fmesh.mesh, str(tmp_path / "nowhere"), "--auto", cwd=tmp_path)
    assert p.returncode == 2 and "no Flower App" in p.stderr, p.stderr
    p = _cli(fmesh.mesh, str(APPS / "quickstart-numpy"), "--endpoints", "ep-nope", cwd=tmp_path)
    assert p.returncode == 2 and "unknown endpoint(s): ep-nope" in p.stderr, p.stderr
    assert len(fmesh.mesh.client.fl_runs()) == before


def test_auto_takes_the_n_best_endpoints_the_scheduler_predicts(fresh_mesh: _Mesh, tmp_path: Path) -> None:
    """``--auto --clients 2`` of 3 online endpoints: the scheduler has seen the ClientApp runner
    take ~1.5 s per message on one endpoint (an app that sleeps there) and milliseconds on the
    others, so it predicts that endpoint slowest; the run takes the other two and records which,
    and why (each endpoint's prediction and rank), in its summary and in the hub's run record."""
    slow = fresh_mesh.agents[0].endpoint_id  # first by name: a ranking by name would take it
    app = _copy_app("quickstart-numpy", tmp_path)
    client_py = app / "quickstart_numpy" / "client_app.py"
    src = client_py.read_text()
    src = src.replace('    """Train the model on local data."""\n', '    """Train the model on local data."""\n    _slow_here()\n')
    src = src.replace('    """Evaluate the model on local data."""\n', '    """Evaluate the model on local data."""\n    _slow_here()\n')
    client_py.write_text("import time as _time\n\nfrom fl.datasets import endpoint_id as _endpoint_id\n\n\n"
                         f"def _slow_here():\n    if _endpoint_id() == {slow!r}:\n        _time.sleep(1.5)\n\n\n" + src)
    res = run_app(app, fresh_mesh.mesh.client, endpoints=fresh_mesh.ids, dataset="digits", workdir=tmp_path,
                  run_config={"num-server-rounds": 3})
    assert res.status == "finished" and sorted(res.ready) == sorted(fresh_mesh.ids), res.error
    p = _cli(fresh_mesh.mesh, str(APPS / "quickstart-numpy"), "--auto", "--clients", "2", "--dataset", "digits",
             "--run-config", "num-server-rounds=1", "--out-dir", str(tmp_path / "out"), "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    sel = out["selection"]
    ranking = {x["endpoint"]: x for x in sel["ranking"]}
    assert sel["policy"] == "scheduler" and sel["online"] == 3 and sel["asked_for"] == 2, sel
    assert sel["left_out"] == [slow] and sorted(sel["chosen"]) == sorted(set(fresh_mesh.ids) - {slow}), sel
    assert ranking[slow]["rank"] == 3 and all(ranking[e]["predicted_s"] < ranking[slow]["predicted_s"] for e in sel["chosen"])
    assert sorted(out["ready"]) == sorted(sel["chosen"])  # the run used exactly those
    assert all(sorted(r["participants"]) == sorted(sel["chosen"]) for r in out["rounds"])
    assert "--auto: took 2 of 3 online endpoint(s)" in p.stderr and f"--auto: left out: auto-0 [{slow}]" in p.stderr, p.stderr[-2000:]
    run = fresh_mesh.mesh.client.fl_run(out["run_id"])
    assert run["config"]["selection"]["chosen"] == sel["chosen"] and sorted(run["clients"]) == sorted(sel["chosen"])
    # --clients without --auto is bad input: exit 2, nothing stored
    before = len(fresh_mesh.mesh.client.fl_runs())
    p = _cli(fresh_mesh.mesh, str(APPS / "quickstart-numpy"), "--endpoints", ",".join(fresh_mesh.ids), "--clients", "2", cwd=tmp_path)
    assert p.returncode == 2 and "--clients N takes N >= 1, with --auto" in p.stderr, p.stderr
    assert len(fresh_mesh.mesh.client.fl_runs()) == before
