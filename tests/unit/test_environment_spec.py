"""Environment specs (mesh_agent.protocol.environment): canonical form, ids, and clear errors for bad input;
the bubblewrap and container argv builders (pure)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mesh_agent.engine.environments import EnvError, bwrap_argv, container_argv, container_refusal, image_form
from mesh_agent.protocol.environment import EnvSpecError, decode, encode, env_id, normalize, requirement_name


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


def test_bwrap_argv_is_default_deny_and_cuts_network() -> None:
    binds = [("ro", "/usr", "/usr"), ("symlink", "usr/lib", "/lib"), ("ro", "/root/.pyenv/versions/3.11.7", "/root/.pyenv/versions/3.11.7"),
             ("ro", "/var/lib/mesh/envs/venvs/abc", "/opt/mesh-venv")]
    argv = bwrap_argv(binds, [Path("/var/lib/mesh"), Path("/etc/mesh")], network=False, bwrap="/usr/bin/bwrap")
    s = " ".join(argv)
    assert argv[0] == "/usr/bin/bwrap" and argv[-1] == "--"
    # nothing of the host but what is named: no "--ro-bind / /", and hidden paths not even as mount points
    assert "--ro-bind / /" not in s and "/var/lib/mesh " not in s + " " and "/etc/mesh" not in s
    assert "--unshare-net" in argv and "--die-with-parent" in argv and "--new-session" in argv
    assert "--unshare-user --disable-userns --cap-drop ALL" in s  # an unprivileged agent: a user namespace, no caps
    assert "--ro-bind /var/lib/mesh/envs/venvs/abc /opt/mesh-venv" in s and "--symlink usr/lib /lib" in s
    # the directories on the way to a bind are walkable by the sandbox uid
    assert s.index("--perms 0755 --dir /root") < s.index("--ro-bind /root/.pyenv/versions/3.11.7")
    assert "--perms 1777 --size" in s and "--tmpfs /tmp" in s
    assert "--unshare-net" not in bwrap_argv([], network=True)
    root = " ".join(bwrap_argv([], privileged=True))
    assert "--unshare-user" not in root and "--cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID --cap-add CAP_SETPCAP" in root


def test_bwrap_argv_hides_state_inside_a_bound_directory() -> None:
    # An agent checked out under /tmp (a CI clone): its code is bound over the private /tmp, and a
    # data directory inside it is hidden again on top.
    argv = bwrap_argv([("ro", "/tmp/clone", "/tmp/clone")], [Path("/tmp/clone/run/agent"), Path("/srv/other")])
    s = " ".join(argv)
    assert s.index("--tmpfs /tmp ") < s.index("--ro-bind /tmp/clone /tmp/clone") < s.index("--tmpfs /tmp/clone/run/agent")
    assert "/srv/other" not in s


def test_container_argv_binds_the_bootstrap_read_only() -> None:
    a = container_argv("/usr/bin/apptainer", "/img/fl.sif", ["/opt/mesh"])
    assert a[:2] == ["/usr/bin/apptainer", "exec"] and "/opt/mesh:/opt/mesh:ro" in a and a[-2:] == ["/img/fl.sif", "python3"]
    assert container_argv("apptainer", "/img/fl.oci.tar", [])[-2] == "oci-archive:/img/fl.oci.tar"  # an OCI archive
    assert container_argv("apptainer", "/img/rootfs", [])[-2] == "/img/rootfs"  # a staged rootfs directory
    assert container_argv("apptainer", "docker://python:3.11", [])[-2] == "docker://python:3.11"
    p = container_argv("podman", "docker://python:3.11", ["/opt/mesh"], network=False)
    assert p[:2] == ["podman", "run"] and "/opt/mesh:/opt/mesh:ro" in p and p[-2:] == ["docker://python:3.11", "python3"]
    assert p[p.index("--network") + 1] == "none" and p[p.index("--preserve-fds") + 1] == "1"


def test_podman_names_each_image_form_as_podman_needs_it() -> None:
    rootfs = container_argv("podman", "/img/rootfs", ["/opt/mesh"], is_dir=True)
    assert rootfs[-3:] == ["--rootfs", "/img/rootfs", "python3"]
    assert container_argv("podman", "/img/rootfs", [])[-3:] == ["--rootfs", "/img/rootfs", "python3"]  # no suffix: a directory
    assert container_argv("podman", "/img/fl.tar", [], is_dir=False)[-2:] == ["oci-archive:/img/fl.tar", "python3"]
    assert container_argv("podman", "oci-archive:/img/fl", [])[-2:] == ["oci-archive:/img/fl", "python3"]
    for image, is_dir in (("/img/fl.sif", None), ("/img/fl.img", False)):  # a staged file that is not an OCI archive: SIF
        with pytest.raises(EnvError, match=r"is a SIF file, which podman \(the runtime on this endpoint\) cannot run"):
            container_argv("/usr/bin/podman", image, [], is_dir=is_dir)
    with pytest.raises(EnvError, match="podman .* pulls only docker://"):
        container_argv("podman", "library://alpine", [])
    assert image_form("/img/x", is_dir=True) == "rootfs" and image_form("/img/x.sif") == "sif"
    assert image_form("docker://x.tar") == "registry" and image_form("/img/x.oci") == "oci-archive"


def test_container_network_sandbox_and_variables_in_the_argv() -> None:
    env = [("A", "1"), ("B", "x y")]
    ap = container_argv("apptainer", "/img/r", ["/opt/mesh"], network=False, sandbox=True, env=env)
    assert ap[ap.index("--network") + 1] == "none" and "--net" in ap and {"--ipc", "--pid", "--contain", "--cleanenv"} <= set(ap)
    assert ap[ap.index("--env") + 1] == "A=1" and "B=x y" in ap
    assert "--network" not in container_argv("apptainer", "/img/r", [], network=True)
    assert "--pid" not in container_argv("apptainer", "/img/r", [], sandbox=False)
    pd = container_argv("podman", "/img/r", [], network=False, sandbox=True, env=env, is_dir=True)
    assert pd[pd.index("--network") + 1] == "none" and "--read-only" in pd and pd[pd.index("--cap-drop") + 1] == "all"
    assert "no-new-privileges" in pd and pd[pd.index("-e") + 1] == "A=1"
    assert pd.index("-e") < pd.index("--rootfs")  # options before the image
    open_ = container_argv("podman", "/img/r", [], network=True, is_dir=True)
    assert open_[open_.index("--network") + 1] == "slirp4netns" and "--read-only" not in open_


def test_container_refusal_keeps_the_agents_keys_out() -> None:
    hidden = [Path("/var/lib/mesh"), Path("/etc/mesh")]
    binds = [Path("/opt/mesh")]
    for sandbox in (False, True):  # every task: the image is the host's root or holds the keys
        assert "host's root directory" in container_refusal(Path("/"), True, binds, hidden, sandbox)
        why = container_refusal(Path("/var/lib"), True, binds, hidden, sandbox)
        assert why and "contains the agent's data or credentials directory (/var/lib/mesh)" in why
        assert "(/etc/mesh)" in container_refusal(Path("/etc/mesh"), True, binds, hidden, sandbox)
    assert container_refusal(Path("/srv/images/rootfs"), True, binds, hidden, True) is None
    assert container_refusal(Path("/var/lib/mesh/images/rootfs"), True, binds, hidden, True) is None  # inside, not above
    assert container_refusal(Path("/"), False, binds, hidden, True) is None  # a file image (SIF): not a root to look into
    # the agent's code bound in, with its data directory inside it: only another user's (sandboxed) task is refused
    code = [Path("/srv/checkout")]
    inside = [Path("/srv/checkout/run/agent")]
    assert container_refusal(Path("/srv/images/r"), True, code, inside, False) is None
    why = container_refusal(Path("/srv/images/r"), True, code, inside, True)
    assert why and "'/srv/checkout'" in why and "move the agent's data_dir" in why


def test_pip_and_container_together_are_refused_naming_both() -> None:
    for spec, kw in (({"pip": ["numpy"], "container": "/img/a.sif"}, {}), ({"uv": ["numpy"]}, {"container": "/img/a.sif"})):
        with pytest.raises(EnvSpecError) as exc:
            normalize(spec, **kw)
        msg = str(exc.value)
        assert "and container cannot be combined" in msg and "install the packages in the image" in msg
        assert ("environment.pip" in msg) or ("environment.uv" in msg)
    assert normalize({"pip": [], "container": "/img/a.sif"}) == {"container": "/img/a.sif"}  # empty pip: nothing dropped


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


@pytest.mark.parametrize("name", ["LD_AUDIT", "LD_PRELOAD", "LD_DEBUG_OUTPUT", "GLIBC_TUNABLES", "GCONV_PATH", "MESH_KEY"])
def test_loader_and_mesh_variables_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} is reserved"):
        normalize({"env_vars": {name: "/tmp/x.so"}})


def test_the_specs_variables_reach_the_worker_only_after_the_lockdown() -> None:
    import json

    from mesh_agent.engine.environments import lockdown_argv, lockdown_env

    argv = lockdown_argv("/usr/bin/python3")
    assert argv[1:3] == ["-S", "-I"] and argv[3].endswith("_lockdown.py") and len(argv) == 4  # nothing for ps to show
    name, value = lockdown_env(network=False, env=[("OMP_NUM_THREADS", "1")])
    assert name == "MESH_LOCKDOWN" and json.loads(value)["env"] == {"OMP_NUM_THREADS": "1"}


def test_each_tenant_has_a_host_uid_of_its_own() -> None:
    from mesh_agent.engine.environments import SANDBOX_UID, TENANT_UID_BASE, tenant_uid

    a, b = tenant_uid("user-a"), tenant_uid("user-b")
    assert a != b and a == tenant_uid("user-a") and min(a, b) >= TENANT_UID_BASE and max(a, b) < 2**31
    assert tenant_uid(None) == SANDBOX_UID and tenant_uid("", 1234) == 1234
