"""Cross-tenant (issue 25, item 7) and the endpoint itself: C cannot read B's /tmp or memory, see or
signal B's processes; symlink and hard-link tricks on scratch paths reach nothing outside; the
sandbox's /tmp is not the host's; no tenant can kill the agent (or its process group) or stop it
serving the owner; the sandbox inherits none of the agent's secrets from its environment."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.security.conftest import AGENT_ENV_SECRETS, SharedEndpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def leave_secrets(secret: str) -> dict[str, Any]:
    """B: a file in its /tmp, a value in its worker's memory, and a sleeper process that carries the
    secret in its argv and environment (kept for a while, to be found by C)."""
    import builtins
    import os
    import subprocess
    import sys

    with open(f"/tmp/{secret}", "w") as f:
        f.write(secret)
    builtins.__dict__["_mesh_sec_secret"] = secret
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", secret], env={"SECRET": secret},
                         start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return {"pid_inside": os.getpid(), "sleeper_inside": p.pid}


def hunt_secrets(secret: str, host_pids: list[int]) -> dict[str, Any]:
    """C: look for B's file, B's value, B's processes; try to read and signal them by the host pids."""
    import builtins
    import glob
    import os
    import signal

    out: dict[str, Any] = {"tmp_files": [p for p in glob.glob("/tmp/*") if secret in p],
                           "in_memory": builtins.__dict__.get("_mesh_sec_secret")}
    seen = {}
    for n in os.listdir("/proc"):
        if n.isdigit() and int(n) != os.getpid():
            for what in ("cmdline", "environ"):
                try:
                    with open(f"/proc/{n}/{what}", "rb") as f:
                        if secret.encode() in f.read():
                            seen[n] = what
                except OSError:
                    pass
    out["procs_with_secret"] = seen
    for pid in host_pids:
        for sig in (0, signal.SIGKILL):
            try:
                os.kill(pid, sig)
                out[f"kill {pid} {sig}"] = "sent"
            except OSError as exc:
                out[f"kill {pid} {sig}"] = f"{type(exc).__name__}: {exc.strerror}"
        try:
            with open(f"/proc/{pid}/mem", "rb") as f:
                f.read(1)
            out[f"mem {pid}"] = "read"
        except OSError as exc:
            out[f"mem {pid}"] = f"{type(exc).__name__}: {exc.strerror}"
    return out


def link_tricks(key_file: str, data_dir: str, hub_db: str) -> dict[str, Any]:
    import os

    out: dict[str, Any] = {}
    targets = {"key": key_file, "data": data_dir, "hub": hub_db, "root": "/proc/1/root" + key_file,
               "parent_root": f"/proc/{os.getppid()}/root{key_file}", "cwd_escape": "/proc/self/cwd/../../" + key_file.lstrip("/")}
    for name, target in targets.items():
        link = f"/tmp/sym-{name}"
        try:
            os.symlink(target, link)
        except OSError as exc:
            out[f"symlink {name}"] = f"{type(exc).__name__}: {exc.strerror}"
            continue
        try:
            with open(link, "rb") as f:
                out[f"symlink {name}"] = f.read(300).decode(errors="replace")
        except IsADirectoryError:
            out[f"symlink {name}"] = f"directory: {os.listdir(link)[:10]}"
        except OSError as exc:
            out[f"symlink {name}"] = f"{type(exc).__name__}: {exc.strerror}"
        finally:
            os.unlink(link)
    for name, target in (("key", key_file), ("hub", hub_db)):
        try:
            os.link(target, f"/tmp/hard-{name}")
            with open(f"/tmp/hard-{name}", "rb") as f:
                out[f"hardlink {name}"] = f.read(300).decode(errors="replace")
            os.unlink(f"/tmp/hard-{name}")
        except OSError as exc:
            out[f"hardlink {name}"] = f"{type(exc).__name__}: {exc.strerror}"
    return out


def write_scratch(name: str) -> str:
    import os

    with open(f"/tmp/{name}", "w") as f:
        f.write("from a sandbox")
    os.symlink("/etc/passwd", f"/tmp/{name}.lnk")  # a trap for whoever trusts /tmp later
    return os.getcwd()


def kill_the_agent(agent_pid: int, deadline: float) -> dict[str, Any]:
    """Signal the agent by its host pid, then (from a child, once this task's result is out) the
    whole process group and every process it may signal."""
    import os
    import signal
    import time

    out: dict[str, Any] = {}
    if time.time() > deadline:  # a re-delivery after a restart: do no harm twice
        return {"expired": True}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(agent_pid, sig)
            out[f"kill agent {sig.name}"] = "sent"
        except OSError as exc:
            out[f"kill agent {sig.name}"] = f"{type(exc).__name__}: {exc.strerror}"
    for what, call in (("killpg", lambda: os.killpg(agent_pid, signal.SIGKILL)), ("getpgid", lambda: os.getpgid(agent_pid))):
        try:
            out[what] = call()
        except OSError as exc:
            out[what] = f"{type(exc).__name__}: {exc.strerror}"
    out["my_pgid"] = os.getpgid(0)
    out["my_sid"] = os.getsid(0)
    if os.fork() == 0:  # after the result is sent: its own process group, then everyone it can reach
        try:
            time.sleep(1.5)
            os.kill(0, signal.SIGKILL)
        finally:
            os._exit(0)
    if os.fork() == 0:
        try:
            time.sleep(2.0)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    return out


def environment() -> dict[str, str]:
    import os

    return dict(os.environ)


# ---------------------------------------------------------------------------------------------- tests


def _host_pids_with(secret: str) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if secret.encode() in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                pass
    return found


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_tenants_never_share_a_worker_or_its_tmp(shared: SharedEndpoint) -> None:
    secret = f"mesh-sec-b-{uuid.uuid4().hex[:10]}"
    shared.run("b", leave_secrets, secret).expect()
    seen = shared.run("c", hunt_secrets, secret, []).expect()
    assert not seen["tmp_files"], f"C sees B's /tmp files: {seen['tmp_files']}"
    assert seen["in_memory"] is None, "C's function ran in B's worker (it found B's in-memory value)"


def test_tenant_cannot_see_signal_or_read_another_tenants_processes(shared: SharedEndpoint) -> None:
    secret = f"mesh-sec-b-{uuid.uuid4().hex[:10]}"
    shared.run("b", leave_secrets, secret).expect()
    deadline = time.monotonic() + 20
    while not (sleepers := _host_pids_with(secret)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sleepers, "B's sleeper process never showed up on the host, so this proved nothing"
    b_worker = _ppid(sleepers[0])
    seen = shared.run("c", hunt_secrets, secret, [sleepers[0], b_worker]).expect()
    assert not seen["procs_with_secret"], f"C sees B's processes in its /proc: {seen['procs_with_secret']}"
    sent = {k: v for k, v in seen.items() if k.startswith("kill") and v == "sent"}
    assert not sent, f"C could signal B's processes by their host pids: {sent}"
    read = {k: v for k, v in seen.items() if k.startswith("mem") and v == "read"}
    assert not read, f"C read the memory of B's processes: {read}"
    assert all(Path(f"/proc/{p}").exists() for p in (sleepers[0], b_worker)), "B's processes died while C attacked them"


def test_scratch_symlinks_and_hardlinks_do_not_reach_outside(shared: SharedEndpoint) -> None:
    seen = shared.run("b", link_tricks, str(shared.key_file), str(shared.data_dir), str(shared.mesh.hub_cfg.db_path)).expect()
    leaked = {k: v for k, v in seen.items() if shared.key_hex in v or v.startswith(("SQLite format", "directory"))}
    assert not leaked, f"a link in the sandbox's scratch reached the agent's or hub's files: {leaked}"


def test_sandbox_scratch_is_not_the_hosts_tmp(shared: SharedEndpoint) -> None:
    name = f"mesh-sec-scratch-{uuid.uuid4().hex[:10]}"
    seen = shared.run("b", write_scratch, name).expect()
    assert seen == "/tmp", f"the sandbox's working directory is {seen}, not its scratch /tmp"
    assert not Path("/tmp", name).exists() and not Path("/tmp", name + ".lnk").is_symlink(), \
        "a file a sandbox wrote to its /tmp appeared in the host's /tmp"
    for p in (shared.data_dir, shared.workdir):
        assert not list(p.rglob(name + "*")), f"a file a sandbox wrote to its /tmp appeared under {p}"


def test_tenant_cannot_kill_the_agent_or_its_process_group(shared: SharedEndpoint) -> None:
    pid = shared.agent_pid
    out = shared.run("b", kill_the_agent, pid, time.time() + 20, timeout=90, task_timeout_s=30, ttl_s=25)
    time.sleep(4.0)  # the delayed kill(0) and kill(-1) from inside the sandbox
    assert shared.agent.alive() and shared.agent_pid == pid, \
        f"a sandboxed task killed the agent ({out.describe()}); log tail:\n{shared.log_text()[-1500:]}"
    if out.ok:
        sent = {k: v for k, v in out.value.items() if k.startswith("kill") and v == "sent"}
        assert not sent, f"the sandbox could signal the agent by its host pid: {out.value}"


def test_sandbox_environment_holds_none_of_the_agents_secrets(shared: SharedEndpoint) -> None:
    env = shared.run("b", environment).expect()
    leaked = {k: v for k, v in env.items() if v in AGENT_ENV_SECRETS.values() or k in AGENT_ENV_SECRETS}
    assert not leaked, f"the sandbox inherited secrets from the agent's environment: {leaked}"
    paths = {k: v for k, v in env.items() if str(shared.data_dir) in v or str(shared.key_file.parent) in v}
    assert not paths, f"the sandbox's environment names the agent's data or key directory: {paths}"
    assert "PYTHONPATH" not in env and "LD_PRELOAD" not in env, f"loader variables reached the sandbox: {env}"


def test_agent_survives_a_worker_killed_mid_task_and_keeps_serving(shared: SharedEndpoint) -> None:
    """The bluntest attack on the engine: the function kills its own worker with SIGKILL."""
    out = shared.run("b", kill_own_worker, timeout=90, task_timeout_s=30)
    assert not out.ok, f"a task whose worker was SIGKILLed reported success: {out.describe()}"
    assert shared.agent.alive()


def kill_own_worker() -> None:
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
    # The worker is PID 1 of its sandbox (bwrap --as-pid-1), which its own SIGKILL does not end;
    # it ends itself the hard way instead, as a segfault or the OOM killer would
    os._exit(137)



def reach_loopback(ports: list[int]) -> dict[str, str]:
    import socket

    out: dict[str, str] = {}
    for port in ports:
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=3)
        except OSError as exc:
            out[str(port)] = f"{type(exc).__name__}: {exc.strerror or exc}"
            continue
        with c:
            try:
                c.settimeout(2)
                out[str(port)] = "connected: " + c.recv(200).decode(errors="replace")
            except OSError:
                out[str(port)] = "connected"
    return out


def test_a_tenant_asking_for_network_does_not_reach_the_owners_loopback_services(shared: SharedEndpoint) -> None:
    """Any submitter may put ``network: true`` in its spec. Whatever network a tenant gets, it must
    not be the host's own loopback: there the owner's private services listen (a database, redis,
    the broker and the hub of this very test). A stand-in service answers with a secret."""
    import socket
    import threading

    secret = f"owner-private-{uuid.uuid4().hex[:10]}"
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(secret.encode())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        out = shared.run("b", reach_loopback, [port, shared.mesh.broker.port, shared.mesh.hub_cfg.port],
                         environment={"sandbox": True, "network": True})
    finally:
        stop.set()
        t.join(5)
        srv.close()
    if not out.ok and "tenant_network" in str(out.error):  # refused: the owner has not granted other users the network
        assert "loopback" in str(out.error), out.describe()
        return
    seen = out.expect()
    assert secret not in seen.get(str(port), ""), (
        f"a tenant that asked for network read the owner's loopback-only service (port {port}): {seen}")
    reached = {p: r for p, r in seen.items() if r.startswith("connected")}
    assert not reached, f"a tenant that asked for network reached loopback services of the host: {reached}"
