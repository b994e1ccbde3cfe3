"""Environments through the whole mesh (docs/environments.md): the SDK's ``environment=``,
``sandbox=`` and ``register_function(environment=...)``, the hub's checks and its sandbox default
for users other than the endpoint's owner, the spec signed into the task frame, and a real agent
building a venv from a local wheel (``--no-index --find-links``: never PyPI) and running
sandboxed workers under bubblewrap. Real hub, Mosquitto, agent process and uv."""

from __future__ import annotations

import asyncio
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh
from cloud_hub.store import SqliteStore
from mesh_agent.protocol.environment import EnvSpecError, encode, env_id, normalize
from tests.fixtures.wheels import build_wheel

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def toy_version() -> str:
    import meshtoy

    return meshtoy.VERSION


def toy_version_here() -> str:
    import meshtoy

    return meshtoy.VERSION


def read_file(path: str) -> str:
    with open(path) as f:
        return f.read()


def env_var(name: str) -> str | None:
    return os.environ.get(name)


def pid() -> int:
    return os.getpid()


@pytest.fixture(scope="module")
def mesh() -> Iterator[tuple[LocalMesh, AgentProcess]]:
    if find_mosquitto() is None:
        pytest.fail("mosquitto is required for integration tests: run ./taskw setup (apt-get install mosquitto)")
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    # Not under /tmp: a sandbox's /tmp is its own tmpfs, which would hide the agent's files anyway.
    work = Path(tempfile.mkdtemp(prefix="mesh-envmesh-", dir="/var/tmp"))
    m = LocalMesh(work, heartbeat_s=0.5, lost_after_s=5.0)
    m.start()
    try:
        wheels = work / "wheels"
        build_wheel(wheels, "meshtoy", "1.0")
        agent = m.add_agent("envs", "mqtt", workers=2, environments={"no_index": True, "find_links": [str(wheels)]})
        m.wait_online(timeout=90)
        yield m, agent
    finally:
        m.stop()
        shutil.rmtree(work, ignore_errors=True)


def test_pip_environment_from_the_sdk_runs_in_a_venv_on_the_agent(mesh: Any) -> None:
    m, agent = mesh
    with Executor(m.client, endpoint=agent.endpoint_id, environment={"env_vars": {"STAGE": "exec"}}) as ex:
        assert ex.submit(toy_version, environment={"pip": ["meshtoy"]}).result(timeout=240) == "1.0"
        # executor-level env_vars and a submit's pip merge per key
        assert ex.submit(env_var, "STAGE", environment={"pip": ["meshtoy"]}).result(timeout=120) == "exec"
        fid = ex.register_function(toy_version, environment={"pip": ["meshtoy>=1"]})
        assert ex.submit_to_registered_function(fid).result(timeout=240) == "1.0"
        # registered with an environment: every call of it gets that environment
        assert ex.submit(toy_version).result(timeout=120) == "1.0"
        with pytest.raises(ModuleNotFoundError, match="meshtoy"):  # the agent's own Python has no meshtoy
            ex.submit(toy_version_here, environment={"env_vars": {"X": "1"}}).result(timeout=120)
    with sqlite3.connect(m.hub_cfg.db_path) as c:
        stored = {r[0] for r in c.execute("SELECT env FROM tasks WHERE env IS NOT NULL")}
    assert encode(normalize({"pip": ["meshtoy"], "env_vars": {"STAGE": "exec"}})) in stored


def test_bad_requirement_fails_naming_it_and_the_agent_keeps_serving(mesh: Any) -> None:
    m, agent = mesh
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        bad = [ex.submit(toy_version, environment={"pip": ["no-such-package-zz"]}) for _ in range(3)]
        for f in bad:
            with pytest.raises(Exception) as info:
                f.result(timeout=240)
            assert "no-such-package-zz" in str(info.value) and "cannot be installed" in str(info.value)
        assert ex.submit(pid).result(timeout=60) > 0
    index = Path(agent.cfg.data_dir) / "envs" / "index.json"
    assert env_id(normalize({"pip": ["no-such-package-zz"]})) in index.read_text()  # remembered: no rebuild loop


def test_bad_spec_is_refused_by_the_sdk_and_by_the_hub_with_nothing_stored(mesh: Any) -> None:
    m, agent = mesh
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        with pytest.raises(EnvSpecError, match="unknown environment key 'conda'"):
            ex.submit(pid, environment={"conda": ["numpy"]})
    with sqlite3.connect(m.hub_cfg.db_path) as c:
        before = c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
    fid = m.client.register_function(pid)
    spec = Client.task_spec(agent.endpoint_id, fid)
    spec["environment"] = {"pip": ["--index-url=http://127.0.0.1:9/simple"]}
    r = httpx.post(f"{m.url}/v1/tasks", json=spec, headers={"Authorization": f"Bearer {m.token}"}, verify=False)
    assert r.status_code == 422 and "environment.pip[0]" in r.text
    with sqlite3.connect(m.hub_cfg.db_path) as c:
        assert c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == before


def test_pip_with_a_container_is_refused_by_the_sdk_and_by_the_hub_with_nothing_stored(mesh: Any) -> None:
    """The worker of a container runs the image's python3, so a venv built beside it would be
    silently unused: the pair is refused (422 at the hub), naming both keys, and nothing is stored."""
    m, agent = mesh
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        with pytest.raises(EnvSpecError, match="environment.pip and container cannot be combined"):
            ex.submit(pid, environment={"pip": ["meshtoy"]}, container="/images/fl.sif")
    with sqlite3.connect(m.hub_cfg.db_path) as c:
        before = c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
    fid = m.client.register_function(pid)
    spec = Client.task_spec(agent.endpoint_id, fid)
    spec["environment"] = {"pip": ["meshtoy"], "container": "/images/fl.sif"}
    r = httpx.post(f"{m.url}/v1/tasks", json=spec, headers={"Authorization": f"Bearer {m.token}"}, verify=False)
    assert r.status_code == 422, r.text
    assert "environment.pip and container cannot be combined" in r.text and "install the packages in the image" in r.text
    with sqlite3.connect(m.hub_cfg.db_path) as c:
        assert c.execute("SELECT COUNT(*) FROM tasks").fetchone()[0] == before


def _new_user_token(m: LocalMesh, name: str) -> str:
    """An API token of a new user ``name`` of the mesh's hub (written in its database)."""

    async def mint() -> str:
        store = await SqliteStore(m.hub_cfg.db_path).open()
        try:
            return await store.create_api_token(await store.create_user(name), "test")
        finally:
            await store.close()

    return asyncio.run(mint())


def test_another_users_function_is_sandboxed_by_default(mesh: Any) -> None:
    m, agent = mesh
    ep = agent.endpoint_id

    carol = Client(m.url, _new_user_token(m, "carol"), trusted_endpoints=[ep])
    m.client.share_endpoint(ep, "carol")
    key_file = str(agent.cfg.credentials_file)
    try:
        with Executor(m.client, endpoint=ep) as owner:
            assert "key" in owner.submit(read_file, key_file).result(timeout=60)  # the owner's own machine: not sandboxed
        with Executor(carol, endpoint=ep) as ex:
            with pytest.raises(FileNotFoundError):
                ex.submit(read_file, key_file).result(timeout=120)
            assert ex.submit(pid).result(timeout=60) > 0
            assert ex.submit(toy_version, environment={"pip": ["meshtoy"]}).result(timeout=240) == "1.0"  # venv, sandboxed
    finally:
        carol.close()
    with sqlite3.connect(m.hub_cfg.db_path) as c:
        carol_id = c.execute("SELECT id FROM users WHERE name='carol'").fetchone()[0]
        envs = [r[0] for r in c.execute("SELECT env FROM tasks WHERE user_id=?", (carol_id,))]
    assert envs and all(e is not None and '"sandbox":true' in e and f'"tenant":"{carol_id}"' in e for e in envs)
    # The agent is untouched: its key is intact and it serves its owner.
    assert "key" in Path(key_file).read_text()
    with Executor(m.client, endpoint=ep) as owner:
        assert owner.submit(pid).result(timeout=60) > 0


def test_auto_placement_prefers_the_endpoint_that_holds_the_environment(mesh: Any) -> None:
    """Two equal endpoints of one user; only the first has built the environment. Its heartbeat
    says so (``envs``), and the hub's scheduler sends the environment's tasks there rather than
    pay a build on the other (scheduler/environments.py)."""
    m, agent = mesh
    other = m.add_agent("envs-other", "mqtt", workers=2, environments={"no_index": True, "find_links": [str(m.workdir / "wheels")]})
    m.wait_online(other, timeout=90)
    spec = {"pip": ["meshtoy==1.0"]}
    sid = env_id(normalize(spec))
    with Executor(m.client, endpoint=agent.endpoint_id) as ex:
        assert ex.submit(toy_version, environment=spec).result(timeout=240) == "1.0"
    deadline = time.monotonic() + 60
    while sid not in (m.client.get_endpoint(agent.endpoint_id)["info"].get("envs") or []):
        assert time.monotonic() < deadline, "the agent's heartbeat never reported the environment"
        time.sleep(0.5)
    placed = []
    with Executor(m.client, endpoint=[agent.endpoint_id, other.endpoint_id]) as ex:
        for _ in range(4):  # one at a time: both endpoints idle at each decision, only the environment differs
            f = ex.submit(toy_version, environment=spec)
            assert f.result(timeout=240) == "1.0"
            placed.append(f.endpoint_id)  # type: ignore[attr-defined]
    assert set(placed) == {agent.endpoint_id}
    assert not (Path(other.cfg.data_dir) / "envs" / "index.json").exists()  # the other never built it


def probe_key(path: str) -> str:
    """Slow enough that work queues at the hub; says whether the agent's key file is visible."""
    import time

    time.sleep(0.3)
    try:
        with open(path) as f:
            f.read(1)
        return "read"
    except FileNotFoundError:
        return "hidden"


def test_work_moved_off_a_lost_endpoint_onto_a_shared_one_is_sandboxed_there(mesh: Any) -> None:
    """Carol's tasks wait at the hub for her own endpoint (unsandboxed there: it is hers); it is
    lost, and the scheduler moves them to alice's endpoint that alice shares with her. On alice's
    machine they must run sandboxed, exactly as if carol had submitted them there: the re-placement
    path applies the submit path's rule (cloud_hub/service/environments.py ``env_for``)."""
    from mesh_agent.cli import enroll

    m, agent = mesh
    ep = agent.endpoint_id

    dora = Client(m.url, _new_user_token(m, "dora"), trusted_endpoints=[ep])
    m.client.share_endpoint(ep, "dora")
    cfg_path = m.workdir / "agents" / "dora-own.yaml"
    cfg = enroll(m.url, dora.create_enrollment_token(), "dora-own", cfg_path, transport="mqtt", workers=1, prefetch=0)
    own = AgentProcess(cfg, cfg_path, m.workdir / "agents" / "dora-own.log")
    m.agents.append(own)
    own.start()
    key_file = str(agent.cfg.credentials_file)
    try:
        deadline = time.monotonic() + 90  # dora's endpoint: only dora sees it
        while not any(e["id"] == own.endpoint_id and e["online"] for e in dora.list_endpoints()):
            assert time.monotonic() < deadline, own.log_path.read_text()[-3000:]
            time.sleep(0.2)
        with Executor(dora, endpoint=[own.endpoint_id, ep]) as ex:
            futs = [ex.submit(probe_key, key_file) for _ in range(24)]
            deadline = time.monotonic() + 60
            while not all(hasattr(f, "endpoint_id") for f in futs):
                assert time.monotonic() < deadline, "batch not submitted"
                time.sleep(0.02)
            on_own = [f for f in futs if f.endpoint_id == own.endpoint_id]
            assert len(on_own) >= 3, "the scheduler put (almost) nothing on dora's own endpoint"
            own.kill()
            placement = m.hub.hub.placement  # type: ignore[union-attr]
            deadline = time.monotonic() + 60
            while placement.stats["moved"] == 0:
                assert time.monotonic() < deadline, "nothing re-placed after dora's endpoint was lost"
                time.sleep(0.1)
            with sqlite3.connect(m.hub_cfg.db_path) as c:
                dora_id = c.execute("SELECT id FROM users WHERE name='dora'").fetchone()[0]
                moved = [r for r in c.execute(
                    "SELECT t.id, t.env FROM tasks t WHERE t.endpoint_id=? AND t.user_id=? AND t.id IN "
                    "(SELECT task_id FROM scheduler_decisions WHERE state='moved')", (ep, dora_id))]
            assert moved, "no task of dora's was moved to the shared endpoint"
            for _, env in moved:
                assert env is not None and '"sandbox":true' in env and f'"tenant":"{dora_id}"' in env, env
            moved_ids = {tid for tid, _ in moved}
            own.start()  # what its queue already held finishes there
            outcome = {f.task_id: f.result(timeout=180) for f in futs}  # type: ignore[attr-defined]
    finally:
        dora.close()
        if own.proc is not None and own.proc.poll() is None:
            own.kill()
    assert {outcome[t] for t in moved_ids} == {"hidden"}, "a moved task read the agent's key on a machine dora does not own"
    assert "key" in Path(key_file).read_text()
