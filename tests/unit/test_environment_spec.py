"""Environment specs (mesh_agent.environment): canonical form, ids, and clear errors for bad input;
the bubblewrap and container argv builders (pure)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mesh_agent.engine.environments import bwrap_argv, container_argv
from mesh_agent.environment import EnvSpecError, decode, encode, env_id, normalize, requirement_name


def test_canonical_form_and_id_ignore_spelling_order_and_empty_parts() -> None:
    a = normalize({"pip": ["scipy", "numpy>=1.26", "numpy>=1.26"], "env_vars": {"B": "2", "A": "1"}, "sandbox": False})
    b = normalize({"uv": ["numpy>=1.26", " scipy "], "env_vars": {"A": "1", "B": "2"}})
    assert a == b == {"pip": ["numpy>=1.26", "scipy"], "env_vars": {"A": "1", "B": "2"}}
    assert env_id(a) == env_id(b) and len(env_id(a)) == 16
    assert encode(a) == '{"env_vars":{"A":"1","B":"2"},"pip":["numpy>=1.26","scipy"]}'
    assert normalize(None) is None and normalize({}) is None and normalize({"pip": [], "sandbox": False}) is None
    assert decode(encode(a)) == a and decode(None) is None


def test_keywords_override_and_network_needs_sandbox() -> None:
    assert normalize({"container": "a.sif"}, container="b.sif") == {"container": "b.sif"}
    assert normalize(None, sandbox=True) == {"sandbox": True}
    assert normalize({"network": True}) is None  # unsandboxed workers have the network anyway
    assert normalize({"network": True, "sandbox": True}) == {"network": True, "sandbox": True}
    assert env_id(normalize(None, sandbox=True)) != env_id(normalize({"sandbox": True, "network": True}))


@pytest.mark.parametrize("spec, words", [
    ("numpy", "environment must be a map"),
    ({"conda": ["numpy"]}, "unknown environment key 'conda'"),
    ({"pip": "numpy"}, "environment.pip must be a list"),
    ({"pip": [3]}, "environment.pip[0] must be a string"),
    ({"pip": ["--index-url=http://evil/simple"]}, "environment.pip[0]: '--index-url"),
    ({"pip": ["pkg @ https://example.org/pkg.whl"]}, "no URLs, paths or pip options"),
    ({"pip": ["./local/dir"]}, "environment.pip[0]"),
    ({"pip": ["numpy; python_version>'3' --find-links ."]}, "environment.pip[0]"),
    ({"pip": ["x"] * 101}, "at most 100"),
    ({"env_vars": {"1BAD": "x"}}, "is not a variable name"),
    ({"env_vars": {"PYTHONPATH": "/x"}}, "PYTHONPATH is reserved"),
    ({"env_vars": {"MESH_DATASETS": "x"}}, "MESH_DATASETS is reserved"),
    ({"env_vars": {"A": 1}}, "environment.env_vars['A'] must be a string"),
    ({"container": ""}, "environment.container must be"),
    ({"container": "--privileged"}, "environment.container must be"),
    ({"sandbox": "yes"}, "environment.sandbox must be true or false"),
])
def test_bad_specs_are_refused_with_the_key_named(spec: object, words: str) -> None:
    with pytest.raises(EnvSpecError) as exc:
        normalize(spec)  # type: ignore[arg-type]
    assert words in str(exc.value)


def test_tenant_only_means_something_in_a_sandbox() -> None:
    a = normalize({"sandbox": True, "tenant": "u-1"})
    assert a == {"sandbox": True, "tenant": "u-1"} and env_id(a) != env_id(normalize({"sandbox": True, "tenant": "u-2"}))
    assert normalize({"tenant": "u-1"}) is None
    with pytest.raises(EnvSpecError, match="environment.tenant"):
        normalize({"sandbox": True, "tenant": "a b"})


def test_decode_refuses_bad_json() -> None:
    with pytest.raises(EnvSpecError, match="not JSON"):
        decode("{pip")


def test_requirement_names_are_canonical() -> None:
    assert requirement_name("Foo_Bar[x]>=1,<2") == "foo-bar"
    assert requirement_name("numpy; python_version>'3.8'") == "numpy"


def test_bwrap_argv_hides_state_binds_venv_back_and_cuts_network() -> None:
    argv = bwrap_argv([Path("/var/lib/mesh"), Path("/etc/mesh")], [Path("/var/lib/mesh/envs/venvs/abc")], network=False, bwrap="/usr/bin/bwrap")
    assert argv[:5] == ["/usr/bin/bwrap", "--ro-bind", "/", "/", "--dev"] and argv[-1] == "--"
    assert "--unshare-net" in argv and "--die-with-parent" in argv
    s = " ".join(argv)
    assert "--tmpfs /tmp" in s and "--tmpfs /var/lib/mesh" in s and "--tmpfs /etc/mesh" in s
    # the venv is bound back after (on top of) the tmpfs that hides the data directory
    assert s.index("--ro-bind /var/lib/mesh/envs/venvs/abc") > s.index("--tmpfs /var/lib/mesh")
    assert "--unshare-net" not in bwrap_argv([], network=True)


def test_bwrap_argv_binds_code_under_tmp_before_hiding_state() -> None:
    # An agent checked out under /tmp (a CI clone): its code is bound back over the private /tmp,
    # and a data directory inside it is hidden again on top.
    argv = bwrap_argv([Path("/tmp/clone/run/agent")], [], code=[Path("/tmp/clone")])
    s = " ".join(argv)
    assert s.index("--tmpfs /tmp ") < s.index("--ro-bind /tmp/clone /tmp/clone") < s.index("--tmpfs /tmp/clone/run/agent")


def test_container_argv_binds_the_bootstrap_read_only() -> None:
    a = container_argv("/usr/bin/apptainer", "/img/fl.sif", ["/opt/mesh"])
    assert a[:2] == ["/usr/bin/apptainer", "exec"] and "/opt/mesh:/opt/mesh:ro" in a and a[-2:] == ["/img/fl.sif", "python3"]
    assert container_argv("apptainer", "/img/fl.oci.tar", [])[-2] == "oci-archive:/img/fl.oci.tar"  # an OCI archive
    assert container_argv("apptainer", "/img/rootfs", [])[-2] == "/img/rootfs"  # a staged rootfs directory
    assert container_argv("apptainer", "docker://python:3.11", [])[-2] == "docker://python:3.11"
    p = container_argv("podman", "img", ["/opt/mesh"], network=False)
    assert p[:2] == ["podman", "run"] and "none" in p and "/opt/mesh:/opt/mesh:ro" in p


# ---------------------------------------------------------------- the frame and the agent


def test_frames_carry_only_well_formed_environment_fields() -> None:
    from mesh_agent.protocol import BadFrame, Kind, validate_body

    task = {"id": "t1", "fn": "f" * 64, "args": b""}
    validate_body(Kind.TASKS, {"tasks": [{**task, "env": '{"sandbox":true}'}]})
    for bad in (5, b"{}", "x" * 40_000):
        with pytest.raises(BadFrame, match=r"tasks\[0\].env"):
            validate_body(Kind.TASKS, {"tasks": [{**task, "env": bad}]})
    validate_body(Kind.HEARTBEAT, {"envs": ["0123456789abcdef"], "eb": {"0123456789abcdef": [1.5, 2048]}})
    for body, words in (({"envs": "abc"}, "envs"), ({"envs": [3]}, "envs must hold string ids"),
                        ({"eb": []}, "eb"), ({"eb": {"a": [1]}}, "eb['a']"), ({"eb": {"a": [-1, 2]}}, "eb['a']"),
                        ({"eb": {"a": ["x", 2]}}, "eb['a']")):
        with pytest.raises(BadFrame, match=re.escape(words)):
            validate_body(Kind.HEARTBEAT, body)


def test_agent_refuses_a_bad_spec_from_a_frame_with_a_clear_error(tmp_path: Path) -> None:
    """A spec is checked again on the agent (a hub is not trusted): a bad one fails its task with a
    clear error and reaches no engine and no build."""
    from mesh_agent.agent import Agent
    from mesh_agent.config import AgentConfig, Credentials
    from mesh_agent.protocol.serialize import deserialize

    creds = Credentials(endpoint_id="ep-1234", key="ab" * 32)
    cfg = AgentConfig(endpoint_id="ep-1234", name="t", hub_url="http://127.0.0.1:9", data_dir=tmp_path / "data",
                      credentials_file=tmp_path / "c.json")
    agent = Agent(cfg, creds)
    fid = "f" * 64
    agent._submit([("t1", fid, b"", None, None, '{"pip": ["--index-url=http://127.0.0.1:9"]}'),
                   ("t2", fid, b"", None, None, "{not json")], {fid: b"body"})
    errors = {r.task_id: deserialize(r.data) for r in agent._pending}
    assert errors["t1"]["type"] == "mesh_agent.engine.EnvError" and "bad environment spec: environment.pip[0]" in errors["t1"]["message"]
    assert "not JSON" in errors["t2"]["message"]
    assert agent.engine.queued == 0 and not (tmp_path / "data" / "envs").exists()  # nothing queued, nothing built


def test_agent_queue_keeps_a_tasks_environment_across_restarts_and_upgrades_an_old_queue(tmp_path: Path) -> None:
    """The spec is in the durable queue: a restarted agent runs the task in it again. A queue
    written before environments existed gains the column and keeps its tasks."""
    import asyncio
    import sqlite3

    from mesh_agent.store import AgentStore

    old = tmp_path / "old.sqlite3"
    with sqlite3.connect(old) as c:  # the schema as it was before issue 16
        c.executescript("""
            CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
            INSERT INTO meta VALUES ('schema_version', '1');
            CREATE TABLE functions (id TEXT PRIMARY KEY, body BLOB NOT NULL, stored_at REAL NOT NULL);
            CREATE TABLE tasks (id TEXT PRIMARY KEY, function_id TEXT NOT NULL, args BLOB, timeout REAL, expires REAL,
                state TEXT NOT NULL CHECK (state IN ('queued', 'done', 'acked')), received REAL NOT NULL, ok INTEGER,
                result BLOB, started REAL, finished REAL, worker_pid INTEGER);
            INSERT INTO tasks (id, function_id, args, state, received) VALUES ('old1', 'f', x'00', 'queued', 1.0);
        """)
    spec = encode(normalize({"pip": ["numpy"]}))

    async def go() -> None:
        store = await AgentStore(old).open()
        try:
            await store.add_tasks({"f": b"body"}, [{"id": "new1", "fn": "f", "args": b"a", "env": spec}])
        finally:
            await store.close()
        store = await AgentStore(old).open()  # the restart
        try:
            got = {t.id: t.env for t in await store.queued_tasks()}
        finally:
            await store.close()
        assert got == {"old1": None, "new1": spec}

    asyncio.run(go())
