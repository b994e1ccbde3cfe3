"""Where a worker runs: the agent's Python, a cached virtualenv, a container, a bubblewrap sandbox.

The engine asks :meth:`Environments.kind` for a :class:`WorkerKind` (interpreter, extra import
path, variables, and the argv prefix that wraps it: ``bwrap ...`` or ``apptainer exec ...``) and
keeps warm workers per kind (mesh_agent/engine/local.py). Why each choice (docs/environments.md):

* **uv, not pip.** uv resolves and installs in one static binary, links files from its cache
  instead of copying them (hard links on one filesystem: a second venv with the same wheels costs
  directory entries, not megabytes of SD-card writes), and works offline with ``--no-index
  --find-links``. The operator picks the index (``environments.index_url``/``find_links`` in
  the agent config); a task's spec can only name requirements.
* **Cached by what was resolved.** A spec's requirements are resolved once (``uv pip compile``)
  and the venv is keyed by the pins + the Python ABI + the platform, so ``numpy`` and
  ``numpy>=1`` share one venv when they resolve alike, and a spec is not resolved again while
  its venv lives.
* **LRU within a disk budget.** After each build the least recently used venvs with no live
  worker are deleted until the total fits ``disk_budget_mb``.
* **Failures stick.** A spec that cannot be built (a requirement no index has, a missing image) is
  remembered by its id, with uv's or the runtime's message, and later tasks with the same spec
  fail at once: no rebuild loop on a metered link. A changed spec has a new id and is tried.
* **Sandbox = bubblewrap.** Read-only root, private /tmp (the scratch space, and the working
  directory), the agent's data directory and key directory replaced by empty tmpfs, new PID/IPC
  namespaces, and a new network namespace (loopback only, and down) unless the spec grants
  ``network``.
* **Containers.** Apptainer/Singularity or podman run the image's ``python3`` with the worker
  bootstrap and the agent's serializers bound read-only. A staged rootfs that is ``/`` or holds
  the agent's data or key directory is refused; another user's (sandboxed) container gets no
  network unless granted, and its own PID/IPC namespaces. Staged images count as held.

Stdlib only; the builds run uv as a subprocess from the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

# hashlib, shutil, sysconfig and mesh_agent.protocol.environment are imported where used: the agent loads
# this module at start, and those cost it about 1.3 MB of RSS on an endpoint that never builds one.

__all__ = ["EnvError", "WorkerKind", "DEFAULT_KIND", "Environments", "bwrap_argv", "lockdown_argv", "lockdown_env", "system_binds", "code_binds",
           "container_argv", "container_refusal", "image_form", "channel_prefix", "abi_tag"]

log = logging.getLogger(__name__)

_BUILD_TIMEOUT_S = 900.0  # a Pi on LTE building numpy from wheels; a hung index must still end
_MAX_REMEMBERED = 1000  # failed specs kept in index.json
_MAX_IMAGES = 32  # container specs remembered as staged (a heartbeat reports at most 32 held specs)


class EnvError(Exception):
    """An environment cannot be prepared on this endpoint; the message names the package or image."""

    __module__ = "mesh_agent.engine"


@dataclass(frozen=True, slots=True)
class WorkerKind:
    """How to start a worker: ``wrap + [python, "-c", boot, args]`` with ``path`` in front of the
    agent's import path and ``env`` added to its environment. ``key`` names the warm pool."""

    key: str = ""
    python: str = sys.executable
    path: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    wrap: tuple[str, ...] = ()
    cwd: str | None = None
    venv: str | None = None  # the venv key this kind keeps in use (not evicted while workers live)
    clean_env: bool = False  # start from SANDBOX_ENV, not the agent's environment (sandboxed workers)
    #: The fd the worker's channel must sit at inside the wrapper: podman passes only fds 3..3+N-1
    #: (``--preserve-fds N``), so the channel is moved to 3 first and nothing else of the agent's goes in.
    channel_fd: int | None = None


def channel_prefix(kind: WorkerKind, fd: int) -> tuple[list[str], int]:
    """The argv in front of ``kind.wrap`` and the fd number the worker is told, for a channel open
    at ``fd`` in the agent (pure). Without ``channel_fd`` the fd is inherited as it is."""
    want = kind.channel_fd
    if want is None or want == fd:
        return [], fd
    # A short-lived Python (not /bin/sh: dash refuses fd numbers above 9) dups the socket onto
    # `want`, closes the original and execs the wrapper (podman); about one interpreter start per spawn.
    return [sys.executable, "-c", _MOVE_FD, str(fd), str(want)], want


_MOVE_FD = ("import os,sys;a,b=int(sys.argv[1]),int(sys.argv[2]);os.dup2(a,b);os.close(a);"
            "os.execvp(sys.argv[3],sys.argv[3:])")


DEFAULT_KIND = WorkerKind()

#: The only variables of the agent's environment a sandboxed worker inherits (plus the spec's
#: env_vars, HOME=/tmp and TMPDIR=/tmp): the agent may have been started with secrets in its
#: environment (an enrollment token on first boot, staging settings), and the datasets' paths
#: point into the data directory the sandbox hides.
SANDBOX_ENV = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "MESH_ENDPOINT_ID", "MESH_ENDPOINT_NAME")


def sandbox_environ(environ: Mapping[str, str], extra: Iterable[tuple[str, str]] = ()) -> dict[str, str]:
    """A sandboxed worker's whole environment (pure)."""
    out = {k: environ[k] for k in SANDBOX_ENV if k in environ}
    out.update({"HOME": "/tmp", "TMPDIR": "/tmp"})
    out.update(dict(extra))
    return out


def abi_tag() -> str:
    """Python ABI + platform, part of every venv key: a venv is only valid for the interpreter it was built for."""
    import sysconfig

    return f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"


#: What of the host's /etc a Python program needs (dynamic linker, time zone, name service, TLS
#: roots for a sandbox granted the network, MIME types); nothing else of /etc, no passwd or shadow.
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "nsswitch.conf", "host.conf", "hosts",
        "gai.conf", "mime.types", "alternatives", "ssl/certs", "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf",
        "os-release")
_NET_ETC = ("resolv.conf",)
#: System directories: bound read-only where they are directories, recreated as the same symlink
#: where they are symlinks (Debian's merged /usr).
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: Where a sandboxed worker finds its venv: a fixed path, so not even the name of the agent's data
#: directory shows inside.
SANDBOX_VENV = "/opt/mesh-venv"
#: The sandbox's /tmp (its scratch space) is a tmpfs of at most this size unless configured: it is
#: RAM, and a Pi Zero has 512 MB.
SANDBOX_TMP_MB = 64
#: Processes (and threads) a sandbox may hold at once: a fork bomb stops here.
SANDBOX_NPROC = 256
#: The host uid/gid a sandbox runs as when the agent runs as root (``nobody``), for the owner's own
#: sandboxed tasks; another user's run as a uid of their own (:func:`tenant_uid`).
SANDBOX_UID = 65534
#: Tenant uids: ``base + hash(tenant) % span``, far above any account or subordinate-uid range, so
#: the per-uid process limit is per tenant: one tenant's fork bomb cannot stop another's sandbox.
TENANT_UID_BASE = 0x70000000
TENANT_UID_SPAN = 1 << 24


def tenant_uid(tenant: str | None, default: int = SANDBOX_UID) -> int:
    """The host uid a root agent runs ``tenant``'s sandboxes as (pure; the same on every start)."""
    if not tenant:
        return default
    import hashlib

    return TENANT_UID_BASE + int.from_bytes(hashlib.sha256(tenant.encode()).digest()[:8], "big") % TENANT_UID_SPAN


def system_binds(root: Path = Path("/"), network: bool = False) -> list[tuple[str, str, str]]:
    """``(op, source, dest)`` for the host's system directories and the few /etc files a Python
    program reads: ``op`` is ``"ro"`` (bind read-only) or ``"symlink"`` (source is the link's text)."""
    out: list[tuple[str, str, str]] = []
    for d in _SYSTEM:
        p = root / d.lstrip("/")
        if p.is_symlink():
            out.append(("symlink", os.readlink(p), d))
        elif p.is_dir():
            out.append(("ro", str(p), d))
    for name in (*_ETC, *(_NET_ETC if network else ())):
        p = root / "etc" / name
        if p.exists():
            out.append(("ro", str(p), f"/etc/{name}"))
    cpu = root / "sys/devices/system/cpu"
    if cpu.is_dir():  # os.cpu_count() and numeric libraries read the CPU list; nothing else of /sys
        out.append(("ro", str(cpu), "/sys/devices/system/cpu"))
    return out


def bwrap_argv(binds: Iterable[tuple[str, str, str]], hidden: Iterable[Path] = (), network: bool = False, bwrap: str = "bwrap",
               *, privileged: bool = False, tmp_mb: int = SANDBOX_TMP_MB) -> list[str]:
    """The bubblewrap prefix for a sandboxed worker (pure): default-deny, so the sandbox's root is
    an empty tmpfs holding only ``binds`` (``(op, source, dest)``, see :func:`system_binds`), a
    private /tmp of ``tmp_mb``, a new /proc and a minimal /dev.

    ``privileged`` (the agent runs as root): bubblewrap keeps only CAP_SETUID, CAP_SETGID and
    CAP_SETPCAP for the lockdown, which drops them with the uid (``_lockdown.py``). Otherwise a
    user namespace with every capability dropped and no further user namespaces. ``hidden``:
    paths (the agent's data and key directories) covered by an empty tmpfs where they lie inside
    a bound directory; elsewhere they simply do not exist in the sandbox."""
    argv = [bwrap]
    if privileged:
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
    else:
        argv += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    # --as-pid-1: no bubblewrap init inside. That init is unfiltered and, under an unprivileged agent,
    # of the task's own uid: a task wrote code into it through /proc/1/mem and made its system calls
    # around the filter (issue 25). The lockdown, then the worker, is PID 1; it reaps no orphans.
    argv += ["--unshare-pid", "--as-pid-1", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
             "--new-session"]
    if not network:
        argv.append("--unshare-net")
    # /tmp first: the agent's own code may live under /tmp (a checkout in a temp dir) and is bound on top.
    argv += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(max(1, tmp_mb) << 20), "--tmpfs", "/tmp"]
    binds = list(binds)
    dests = [d for _op, _s, d in binds]
    made: set[str] = {"/tmp"}
    for op, src, dest in binds:
        # Directories bubblewrap would create for a bind copy the mode of nothing: make each one
        # 0755 first, so an unprivileged sandbox uid can walk to its binds (a Python under /root).
        for parent in reversed(Path(dest).parents):
            ps = str(parent)
            if ps == "/" or ps in made or any(ps == d or Path(ps).is_relative_to(d) for d in dests):
                continue
            made.add(ps)
            argv += ["--perms", "0755", "--dir", ps]
        argv += ["--symlink", src, dest] if op == "symlink" else ["--ro-bind", src, dest]
    for h in sorted({str(Path(h)) for h in hidden}):
        if any(Path(h).is_relative_to(d) for d in dests if d != "/"):
            argv += ["--tmpfs", h]
    # Everything bubblewrap made besides /tmp (its root, /etc, the directories on the way to binds,
    # /dev) is read-only, and /dev/shm (POSIX semaphores, multiprocessing) is a small tmpfs of its
    # own: no writable filesystem in the sandbox can grow past its size (issue 25).
    argv += ["--perms", "1777", "--size", str(max(1, min(tmp_mb, 16)) << 20), "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--"]
    return argv


def lockdown_argv(python: str) -> list[str]:
    """What bubblewrap runs first (pure): ``_lockdown.py`` under ``python -S -I``, which drops every
    privilege, installs the seccomp filter and then execs the argv that follows. Its settings come in
    the variable :func:`lockdown_env` names, not on the command line, which any local user can read."""
    return [python, "-S", "-I", str(Path(__file__).with_name("_lockdown.py"))]


LOCKDOWN_VAR = "MESH_LOCKDOWN"


def lockdown_env(*, network: bool, uid: int = SANDBOX_UID, nproc: int = SANDBOX_NPROC,
                 env: Iterable[tuple[str, str]] = ()) -> tuple[str, str]:
    """The lockdown's settings as one variable of bubblewrap's environment (pure). ``env``, the
    spec's variables, are data inside it: the lockdown adds them to the worker's environment only
    as it execs the worker, so they never reach bubblewrap or the lockdown itself (a loader variable
    such as LD_AUDIT there would load a tenant's library before the sandbox exists)."""
    opts = {"network": network, "uid": uid, "gid": uid, "nproc": nproc, "nofile": 1024, "env": dict(env)}
    return LOCKDOWN_VAR, json.dumps(opts, separators=(",", ":"))


#: Schemes of registry references the runtime pulls (anything else names a file or directory staged here).
REGISTRY_SCHEMES = ("docker://", "oras://", "library://")
_OCI_SUFFIXES = (".tar", ".oci", ".oci.tar")


def image_form(image: str, is_dir: bool | None = None) -> str:
    """What an image names (pure): ``"registry"``, ``"oci-archive"``, ``"sif"`` or ``"rootfs"``.
    ``is_dir``: whether the staged path is a directory, where the caller has looked; without it a
    path with no image-file suffix is taken for a rootfs directory."""
    if image.startswith(REGISTRY_SCHEMES):
        return "registry"
    if image.startswith("oci-archive:") or image.endswith(_OCI_SUFFIXES):
        return "oci-archive"
    if is_dir is True:
        return "rootfs"
    if is_dir is False or image.endswith(".sif"):
        return "sif"  # a staged file that is not an OCI archive: Apptainer's own format
    return "rootfs"


def container_argv(runtime: str, image: str, bootstrap: Sequence[str], network: bool = False, *,
                   is_dir: bool | None = None, sandbox: bool = False, env: Iterable[tuple[str, str]] = ()) -> list[str]:
    """The prefix that runs ``python3`` inside an image with ``bootstrap`` (the worker bootstrap
    and the agent's own packages) bind-mounted read-only (pure). Apptainer/Singularity exec in
    place, so the worker's socket fd passes through; podman gets it at fd 3 (:func:`channel_prefix`).

    ``network=False`` gives the container no network (``--network none``); ``sandbox`` adds what
    a task of another user gets besides: its own PID and IPC namespaces, and under podman a
    read-only root, no capabilities and no privilege gain. ``env``: the spec's variables (both
    runtimes start from a clean environment). Raises :class:`EnvError` for an image the runtime
    cannot run (podman: SIF, ``oras://``, ``library://``)."""
    name = Path(runtime).name
    form = image_form(image, is_dir)
    env = list(env)
    if name in ("apptainer", "singularity"):
        argv = [runtime, "exec", "--cleanenv", "--no-home", "--contain"]
        if sandbox:
            argv += ["--ipc", "--pid"]
        if not network:
            argv += ["--net", "--network", "none"]
        for b in bootstrap:
            argv += ["--bind", f"{b}:{b}:ro"]
        for k, v in env:
            argv += ["--env", f"{k}={v}"]
        return argv + [apptainer_image(image), "python3"]
    if name == "podman":
        if form == "sif":
            raise EnvError(f"container image {image!r} is a SIF file, which podman (the runtime on this endpoint) cannot run: "
                           "stage an OCI archive (.tar) or a rootfs directory instead, or install apptainer")
        if form == "registry" and not image.startswith("docker://"):
            raise EnvError(f"container image {image!r}: podman (the runtime on this endpoint) pulls only docker:// references")
        # --preserve-fds 1: the worker's channel, moved to fd 3 by channel_prefix(), and nothing else.
        argv = [runtime, "run", "--rm", "-i", "--preserve-fds", "1", "--network", "slirp4netns" if network else "none"]
        if sandbox:
            argv += ["--read-only", "--cap-drop", "all", "--security-opt", "no-new-privileges"]
        for b in bootstrap:
            argv += ["-v", f"{b}:{b}:ro"]
        for k, v in env:
            argv += ["-e", f"{k}={v}"]
        if form == "rootfs":
            return argv + ["--rootfs", image, "python3"]
        if form == "oci-archive":
            return argv + [image if image.startswith("oci-archive:") else f"oci-archive:{image}", "python3"]
        return argv + [image, "python3"]
    raise EnvError(f"unknown container runtime {runtime!r}")


def container_refusal(image: Path, is_dir: bool, binds: Iterable[Path], hidden: Iterable[Path], sandbox: bool) -> str | None:
    """Why a container must not start, or None (pure; give it resolved paths).

    For every task: a rootfs directory that is ``/`` or holds a hidden path (the agent's data
    directory, the directory of its credentials file) would hand the agent's keys and queue to
    the function, writable under podman. For a sandboxed task (another user's) also: a bind
    (the worker bootstrap, the agent's packages) that holds a hidden path."""
    hidden = [Path(h) for h in hidden]
    if is_dir:
        if image == Path("/"):
            return (f"container image {str(image)!r} is the host's root directory, not a staged rootfs: it would give the "
                    "function the agent's keys and files; stage a rootfs directory of its own")
        for h in hidden:
            if h == image or h.is_relative_to(image):
                return (f"container image {str(image)!r} contains the agent's data or credentials directory ({h}): the "
                        "function would see the agent's keys; stage the rootfs outside it")
    if sandbox:
        for b in binds:
            for h in hidden:
                if h == b or h.is_relative_to(b):
                    return (f"the agent's code directory {str(b)!r}, bound into the container, contains its data or "
                            f"credentials directory ({h}): another user's sandboxed function would see the agent's keys; "
                            "move the agent's data_dir and credentials_file outside it")
    return None


def apptainer_image(image: str) -> str:
    """How Apptainer names a staged image: an OCI archive file needs its ``oci-archive:`` scheme; a
    SIF file or a rootfs directory (a "sandbox" in Apptainer's words) is given as its path."""
    if image_form(image) == "oci-archive" and not image.startswith("oci-archive:"):
        return f"oci-archive:{image}"
    return image


def staged_path(image: str) -> Path | None:
    """The local file or directory an image names (None: a registry reference the runtime pulls)."""
    if image.startswith(REGISTRY_SCHEMES):
        return None
    return Path(image.removeprefix("oci-archive:"))


def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _sha16(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            total += st.st_blocks * 512  # hard links into uv's cache counted whole: what eviction + prune frees
    return total


@dataclass(slots=True)
class _Venv:
    key: str
    pins: list[str]
    bytes: int
    last_used: float
    build_s: float


@dataclass(slots=True)
class BuildStats:
    builds: int = 0
    build_s: float = 0.0
    resolves: int = 0
    hits: int = 0
    evicted: int = 0
    failures: int = 0
    refused: int = 0  # tasks failed at once because their spec had failed before
    last_build_s: float = 0.0


class Environments:
    """Builds and caches venvs, wraps workers in sandboxes or containers, remembers failures.

    ``root``: a directory of the agent's own (``<data_dir>/envs``); ``hidden``: paths a sandboxed
    worker must not see (the data directory, the key's directory)."""

    def __init__(
        self,
        root: Path,
        *,
        hidden: Iterable[Path] = (),
        disk_budget_mb: int = 2048,
        index_url: str | None = None,
        find_links: Sequence[str] = (),
        no_index: bool = False,
        uv: str | None = None,
        bwrap: str | None = None,
        container_runtime: str | None = None,
        sandbox_tmp_mb: int = SANDBOX_TMP_MB,
        sandbox_uid: int = SANDBOX_UID,
        sandbox_nproc: int = SANDBOX_NPROC,
        tenant_network: bool = False,
    ) -> None:
        self.root = Path(root)
        self.sandbox_tmp_mb = sandbox_tmp_mb
        self.sandbox_uid = sandbox_uid
        self.sandbox_nproc = sandbox_nproc
        self.tenant_network = tenant_network
        self.hidden = [Path(h) for h in hidden]
        self.budget = max(1, disk_budget_mb) * 2**20
        self.index_url = index_url
        self.find_links = list(find_links)
        self.no_index = no_index
        self._uv = uv
        self._bwrap = bwrap
        self._runtime = container_runtime
        self._index_path = self.root / "index.json"
        self._requests: dict[str, str] = {}  # request key -> venv key
        self._venvs: dict[str, _Venv] = {}
        self.failed: dict[str, str] = {}  # spec id -> why it could not be built
        #: spec ids whose failure is the deployment's, not the spec's (a sandbox that cannot start under
        #: this unit or kernel): remembered for this process only, so a fixed deployment is tried again
        #: at the next start without ``mesh-agent envs forget``
        self._not_saved: set[str] = set()
        self.specs: dict[str, str | None] = {}  # spec id -> its venv key, for held_specs()
        #: spec id -> (seconds, bytes added to uv's cache) of its last build here, newest last (at most 8):
        #: what the hub's scheduler learns an environment's cold start from (heartbeat ``eb``)
        self.builds: dict[str, tuple[float, int]] = {}
        self._last_build: tuple[float, int] | None = None
        self._locks: dict[str, asyncio.Lock] = {}
        self._probed: dict[tuple[str, ...], str] = {}  # wrapped command lines that started fine -> what they printed
        #: spec id -> (staged image path, when prepared): containers that start here without a pull
        self.images: dict[str, tuple[str, float]] = {}
        self.stats = BuildStats()
        self._loaded = False
        self._load()  # one small file: what is held and what failed is known before the first task

    # ------------------------------------------------------------------ public

    def held(self) -> list[str]:
        """Venv keys on disk, most recently used first (what heartbeats report)."""
        self._load()
        return [v.key for v in sorted(self._venvs.values(), key=lambda v: -v.last_used)]

    def touch(self, venv_key: str) -> None:
        """A task is running in this venv: it is the most recently used (in memory; written to
        disk with the next build, eviction or failure, never per task)."""
        v = self._venvs.get(venv_key)
        if v is not None:
            v.last_used = time.time()

    def held_specs(self) -> list[str]:
        """Spec ids this endpoint could start a worker for without a build or pull, most recently
        used first: specs with a venv, and container specs whose image is staged here. What the
        hub's scheduler compares with a task's spec id."""
        self._load()
        order = {k: -v.last_used for k, v in self._venvs.items()}
        # only specs with a venv: variables and the sandbox cost nothing to start, so saying so costs bytes for nothing
        live = [(-order.get(vk, 0.0), sid) for sid, vk in self.specs.items() if vk is not None and vk in self._venvs]
        # containers whose image is staged here (a file or rootfs directory that still exists): no pull;
        # one stat per image per heartbeat, at most 32
        live += [(t, sid) for sid, (image, t) in self.images.items() if sid not in self.failed and Path(image).exists()]
        return [sid for _t, sid in sorted(live, key=lambda x: -x[0])]

    def held_bytes(self) -> int:
        self._load()
        return sum(v.bytes for v in self._venvs.values())

    async def kind(self, spec: Mapping[str, Any], in_use: Iterable[str] = ()) -> WorkerKind:
        """The worker kind for a normalized spec, building its venv first if needed.

        Raises :class:`EnvError` (and remembers it for this spec id) when it cannot be built."""
        from mesh_agent.protocol.environment import env_id

        self._load()
        sid = env_id(spec)
        if sid in self.failed:
            self.stats.refused += 1
            raise EnvError(self.failed[sid])
        lock = self._locks.setdefault(sid, asyncio.Lock())
        async with lock:
            if sid in self.failed:
                raise EnvError(self.failed[sid])
            try:
                builds = self.stats.builds
                kind = await self._kind(sid, spec, set(in_use))
                if self.stats.builds > builds and self._last_build is not None:  # built here: report what it cost
                    self.builds.pop(sid, None)
                    self.builds[sid] = self._last_build
                    while len(self.builds) > 8:
                        self.builds.pop(next(iter(self.builds)))
                if kind.venv is not None and self.specs.get(sid) != kind.venv:  # only venvs: bounded by the disk budget
                    self.specs[sid] = kind.venv
                    self._save()
                return kind
            except EnvError as exc:
                self.failed[sid] = str(exc)
                if getattr(exc, "deployment", False):
                    self._not_saved.add(sid)
                while len(self.failed) > _MAX_REMEMBERED:  # bounded: the oldest failure is tried again some day
                    self.failed.pop(next(iter(self.failed)))
                self.stats.failures += 1
                self._save()
                raise

    def fail(self, sid: str, message: str) -> None:
        """Remember that a spec cannot run here (its workers would not start): no retry loop."""
        self.failed[sid] = message
        self.stats.failures += 1
        self._save()

    def forget_failure(self, sid: str) -> None:
        """Let a spec that failed be tried again (an operator fixed the index or staged the image)."""
        if self.failed.pop(sid, None) is not None:
            self._save()

    # ------------------------------------------------------------------ building

    async def _kind(self, sid: str, spec: Mapping[str, Any], in_use: set[str]) -> WorkerKind:
        env = tuple(sorted((spec.get("env_vars") or {}).items()))
        if spec.get("container") is not None:
            if spec.get("pip"):  # normalize() refuses the pair; a spec that skipped it is refused here too
                raise EnvError("pip and container cannot be combined: a container worker runs the image's python3")
            return await self._container_kind(sid, spec, str(spec["container"]), env)
        path: tuple[str, ...] = ()
        python = sys.executable
        venv_key: str | None = None
        venv_dir: Path | None = None
        sandboxed = bool(spec.get("sandbox"))
        if spec.get("pip"):
            # Another user's requirements are installed from wheels only: building a source
            # distribution runs its build backend, as the agent, outside any sandbox (issue 25).
            venv_key = await self._venv(list(spec["pip"]), in_use, wheels_only=sandboxed)
            venv_dir = self._venv_dir(venv_key)
            python = str(venv_dir / "bin" / "python")
            path = (str(self._site_packages(venv_dir)),)
        if sandboxed:
            bwrap = self._bwrap_path()
            network = bool(spec.get("network"))
            tenant = spec.get("tenant")
            if network and tenant and not self.tenant_network:
                err = EnvError("this endpoint does not give other users' tasks the network: with it they would reach its "
                               "loopback services (broker, databases, the hub); its owner can allow it with "
                               "environments.tenant_network: true")
                err.deployment = True  # type: ignore[attr-defined]  # the owner's setting: tried again after a restart
                raise err
            self._check_socket_filter()
            binds = [*system_binds(network=network), *code_binds()]
            if venv_dir is not None:
                # At a fixed path, and only what the interpreter reads: not even the data directory's name
                # shows inside (the venv's bin/activate scripts would name it).
                binds += [("ro", str(venv_dir / "lib"), f"{SANDBOX_VENV}/lib"),
                          ("ro", str(venv_dir / "pyvenv.cfg"), f"{SANDBOX_VENV}/pyvenv.cfg"),
                          ("symlink", os.path.realpath(venv_dir / "bin" / "python"), f"{SANDBOX_VENV}/bin/python")]
                python = f"{SANDBOX_VENV}/bin/python"
                path = (str(self._site_packages(Path(SANDBOX_VENV))),)
            uid = tenant_uid(str(tenant) if tenant else None, self.sandbox_uid)
            wrap = (*bwrap_argv(binds, self.hidden, network, bwrap, privileged=os.geteuid() == 0, tmp_mb=self.sandbox_tmp_mb),
                    *lockdown_argv(sys.executable))
            # The spec's variables go to the worker through the lockdown, after it: never to bubblewrap.
            env = (lockdown_env(network=network, uid=uid, nproc=self.sandbox_nproc, env=env),)
            # Start the sandbox once, lockdown and filter included: a kernel that refuses namespaces or
            # seccomp, or a unit that forbids them, fails the spec here in bubblewrap's own words, not in
            # a respawn loop, and the task never runs unsandboxed.
            await self._probe([*wrap, python, "-c", "print('ok')"], "sandbox (bubblewrap)", env=sandbox_environ(os.environ, env))
            return WorkerKind(sid, python, path, env, wrap, "/tmp", venv_key, clean_env=True)
        return WorkerKind(sid, python, path, env, (), None, venv_key)

    async def _container_kind(self, sid: str, spec: Mapping[str, Any], image: str, env: tuple[tuple[str, str], ...]) -> WorkerKind:
        """A worker in ``image``: checked (staged, and not the host's root or the agent's keys),
        noted as held when staged here, then started once to learn the image's own import path."""
        sandboxed = bool(spec.get("sandbox"))
        staged = staged_path(image)
        is_dir: bool | None = None
        real = Path("/nonexistent")
        if staged is not None:
            if not staged.exists():
                raise EnvError(f"container image {image!r} not found on this endpoint (stage the SIF/OCI archive or rootfs "
                               "there, or name a registry image with docker://)")
            real = staged.resolve()  # a symlink to / is /
            is_dir = real.is_dir()
        binds, pkgs = _container_binds()
        reason = container_refusal(real, bool(is_dir), [Path(b).resolve() for b in binds],
                                   [h.resolve() for h in self.hidden], sandboxed)
        if reason is not None:
            raise EnvError(reason)
        if staged is not None:
            self._note_image(sid, staged)  # staged here: no pull (heartbeat ``envs``), unless it fails below
        runtime = self._container_runtime()
        # Unsandboxed (the owner's) workers have the network, as every other unsandboxed worker does;
        # a sandboxed one only where its spec grants it.
        network = not sandboxed or bool(spec.get("network"))
        wrap = tuple(container_argv(runtime, image, binds, network, is_dir=is_dir, sandbox=sandboxed, env=env))
        podman = Path(runtime).name == "podman"
        # The probe has no channel to pass: without --preserve-fds podman is not asked for an fd 3 that is not open.
        probe = [a for i, a in enumerate(wrap) if not (podman and (a == "--preserve-fds" or (i and wrap[i - 1] == "--preserve-fds")))]
        out = await self._probe([*probe, "-c", _PATH_PROBE], f"container image {image!r}")
        image_path = _probed_path(out)
        boot = _bootstrap_dirs()
        # mesh_agent first, then the image's own packages, then the agent's (cloudpickle, dill) for what the image lacks
        path = tuple(dict.fromkeys([*boot, *image_path, *pkgs]))
        return WorkerKind(sid, "", path, (), wrap, None, None, channel_fd=3 if podman else None)

    def _note_image(self, sid: str, staged: Path) -> None:
        """Remember that this spec's image is staged here (written once per spec, not per task)."""
        new = sid not in self.images
        self.images[sid] = (str(staged), time.time())
        while len(self.images) > _MAX_IMAGES:
            self.images.pop(min(self.images, key=lambda k: self.images[k][1]))
        if new:
            self._save()

    @staticmethod
    def _check_socket_filter() -> None:
        """Every sandbox runs under the seccomp filter: only where one exists for this CPU."""
        import platform

        from mesh_agent.engine._seccomp import SUPPORTED

        if platform.machine() not in SUPPORTED:
            raise EnvError(f"sandbox requested but this endpoint's CPU ({platform.machine()}) has no seccomp filter "
                           f"(supported: {', '.join(SUPPORTED)}); a sandbox never runs without one")

    def _bwrap_path(self) -> str:
        found = self._bwrap or _which("bwrap")
        if not found:
            err = EnvError("sandbox requested but bubblewrap (bwrap) is not installed on this endpoint (apt install bubblewrap, "
                           "0.8 or newer)")
            err.deployment = True  # type: ignore[attr-defined]
            raise err
        return found

    def _container_runtime(self) -> str:
        if self._runtime:
            return self._runtime
        for name in ("apptainer", "singularity"):
            found = _which(name)
            if found:
                return found
        found = _which("podman")
        if found:
            return found
        raise EnvError("container requested but no container runtime (apptainer, singularity or podman) is installed on this endpoint")

    async def _probe(self, argv: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> str:
        """Start a wrapped python once: a runtime that cannot start here fails the spec with its own words
        (``<what> cannot start on this endpoint: ...``). Once per distinct command line per agent process:
        a kind rebuilt after eviction is not probed again. Returns what it printed."""
        done = self._probed.get(tuple(argv))
        if done is not None:
            return done
        code, out = await self._run(list(argv), timeout=300, env=env)
        if code != 0 or "ok" not in out:
            err = EnvError(f"{what} cannot start on this endpoint: {_tail(out)}")
            err.deployment = True  # type: ignore[attr-defined]  # the runtime's or the unit's doing: not saved across restarts
            raise err
        self._probed[tuple(argv)] = out
        return out

    def _uv_path(self) -> str:
        if self._uv:
            return self._uv
        here = Path(sys.executable).parent / "uv"
        found = str(here) if here.exists() else _which("uv")
        if not found:
            raise EnvError("pip environment requested but uv is not installed on this endpoint (pip install uv)")
        return found

    def _index_args(self) -> list[str]:
        args: list[str] = []
        if self.no_index:
            args.append("--no-index")
        elif self.index_url:
            args += ["--index-url", self.index_url]
        for link in self.find_links:
            args += ["--find-links", link]
        return args

    async def _venv(self, reqs: list[str], in_use: set[str], wheels_only: bool = False) -> str:
        build_args = ["--only-binary", ":all:"] if wheels_only else []
        rkey = _sha16(json.dumps([reqs, self._index_args() + build_args, abi_tag()]))
        vkey = self._requests.get(rkey)
        if vkey is not None and vkey in self._venvs and (self._venv_dir(vkey) / ".ok").exists():
            self._venvs[vkey].last_used = time.time()
            self.stats.hits += 1
            return vkey
        uv = self._uv_path()
        started = time.monotonic()
        cache0 = _tree_bytes(self.root / "uv-cache")  # a miss: what the resolve and build add is what was fetched
        pins = await self._resolve(uv, reqs, build_args)
        vkey = _sha16(json.dumps([pins, abi_tag()]))
        self._requests[rkey] = vkey
        async with self._locks.setdefault(f"venv:{vkey}", asyncio.Lock()):  # two specs, one venv: one build
            if vkey in self._venvs and (self._venv_dir(vkey) / ".ok").exists():
                self._venvs[vkey].last_used = time.time()
                self.stats.hits += 1
                self._save()
                return vkey
            await self._build(uv, vkey, pins, reqs, build_args)
            self._last_build = (time.monotonic() - started, max(0, _tree_bytes(self.root / "uv-cache") - cache0))
        if self._evict(in_use | {vkey}):
            await self._run([uv, "cache", "prune", "--quiet"], timeout=120)  # drop wheels no venv links to any more
        self._save()
        return vkey

    async def _resolve(self, uv: str, reqs: list[str], build_args: Sequence[str] = ()) -> list[str]:
        self.stats.resolves += 1
        req_file = self.root / f".req-{os.getpid()}-{time.monotonic_ns()}.in"
        self.root.mkdir(parents=True, exist_ok=True)
        req_file.write_text("\n".join(reqs) + "\n")
        try:
            code, out = await self._run([uv, "pip", "compile", str(req_file), "--python", sys.executable, "--no-header",
                                         "--quiet", "--no-annotate", *self._index_args(), *build_args])
        finally:
            req_file.unlink(missing_ok=True)
        if code != 0:
            raise EnvError(self._explain(reqs, out, "resolved", wheels_only=bool(build_args)))
        return sorted(line.strip() for line in out.splitlines() if line.strip() and not line.lstrip().startswith("#"))

    async def _build(self, uv: str, vkey: str, pins: list[str], reqs: list[str], build_args: Sequence[str] = ()) -> None:
        target = self._venv_dir(vkey)
        if target.exists():
            _rmtree(target)  # a build cut short (crash, power loss)
        target.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        code, out = await self._run([uv, "venv", "--quiet", "--python", sys.executable, str(target)])
        if code == 0:
            pin_file = target / "requirements.txt"
            pin_file.write_text("\n".join(pins) + "\n")
            code, out = await self._run([uv, "pip", "install", "--quiet", "--python", str(target / "bin" / "python"),
                                         "-r", str(pin_file), *self._index_args(), *build_args])
        if code != 0:
            _rmtree(target)
            raise EnvError(self._explain(reqs, out, "installed", wheels_only=bool(build_args)))
        (target / ".ok").write_text(json.dumps({"pins": pins, "abi": abi_tag()}, sort_keys=True))
        took = time.monotonic() - started
        self._venvs[vkey] = _Venv(vkey, pins, _tree_bytes(target), time.time(), took)
        self.stats.builds += 1
        self.stats.build_s += took
        self.stats.last_build_s = took
        log.info("environment venv %s built in %.1fs (%d packages, %.1f MB)", vkey, took, len(pins),
                 self._venvs[vkey].bytes / 2**20)

    def _evict(self, keep: set[str]) -> int:
        """Delete least recently used venvs with no live worker until the total fits the budget."""
        total = sum(v.bytes for v in self._venvs.values())
        evicted = 0
        for v in sorted(self._venvs.values(), key=lambda v: v.last_used):
            if total <= self.budget:
                break
            if v.key in keep:
                continue
            _rmtree(self._venv_dir(v.key))
            del self._venvs[v.key]
            for r, k in list(self._requests.items()):
                if k == v.key:
                    del self._requests[r]
            for sid, vk in list(self.specs.items()):
                if vk == v.key:
                    del self.specs[sid]
            total -= v.bytes
            evicted += 1
            self.stats.evicted += 1
            log.info("environment venv %s evicted (LRU, disk budget %d MB)", v.key, self.budget // 2**20)
        return evicted

    def _explain(self, reqs: list[str], out: str, step: str, wheels_only: bool = False) -> str:
        """uv's error, led by the requirement(s) it names: what a user needs to fix their spec."""
        from mesh_agent.protocol.environment import requirement_name

        low = out.lower()
        named = [r for r in reqs if requirement_name(r) in low.replace("_", "-")]
        lead = (f"pip requirement {', '.join(repr(r) for r in named)} cannot be installed on this endpoint"
                if named else f"pip requirements {reqs!r} cannot be {step} on this endpoint")
        if wheels_only and ("wheel" in low or "source distribution" in low or "only-binary" in low or "no-build" in low):
            lead += (" (a shared endpoint installs another user's packages from wheels only, and this one has no wheel "
                     "for this platform: ask the endpoint's owner to add a wheel to its index or find_links)")
        return f"{lead}: {_tail(out)}"

    async def _run(self, argv: list[str], timeout: float = _BUILD_TIMEOUT_S, env: Mapping[str, str] | None = None) -> tuple[int, str]:
        env = dict(env) if env is not None else {
            **os.environ, "UV_CACHE_DIR": str(self.root / "uv-cache"), "UV_NO_PROGRESS": "1", "NO_COLOR": "1",
            "UV_PYTHON_DOWNLOADS": "never"}
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT, env=env)
        except OSError as exc:
            return 127, f"{argv[0]}: {exc.strerror or exc}"
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return 124, f"{Path(argv[0]).name} did not finish within {timeout:.0f}s"
        return proc.returncode or 0, out.decode(errors="replace")

    # ------------------------------------------------------------------ persistence

    def _venv_dir(self, vkey: str) -> Path:
        return self.root / "venvs" / vkey

    @staticmethod
    def _site_packages(venv: Path) -> Path:
        return venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            data = json.loads(self._index_path.read_text())
        except (OSError, ValueError):
            return
        self._requests = {str(k): str(v) for k, v in (data.get("requests") or {}).items()}
        for k, v in (data.get("venvs") or {}).items():
            if (self._venv_dir(k) / ".ok").exists():
                self._venvs[k] = _Venv(k, list(v.get("pins", [])), int(v.get("bytes", 0)), float(v.get("last_used", 0)),
                                       float(v.get("build_s", 0)))
        self.failed = {str(k): str(v) for k, v in (data.get("failed") or {}).items()}
        self.specs = {str(k): (str(v) if v else None) for k, v in (data.get("specs") or {}).items()}
        self.images = {str(k): (str(v[0]), float(v[1])) for k, v in (data.get("images") or {}).items()
                       if isinstance(v, list) and len(v) == 2}

    def _save(self) -> None:
        """One small file, written on builds, evictions and failures only (not per task: SD cards)."""
        self.root.mkdir(parents=True, exist_ok=True)
        failed = {k: v for k, v in self.failed.items() if k not in self._not_saved}
        data = {"requests": self._requests, "failed": failed, "specs": self.specs,
                "images": {k: [p, t] for k, (p, t) in self.images.items()},
                "venvs": {k: {"pins": v.pins, "bytes": v.bytes, "last_used": v.last_used, "build_s": v.build_s}
                          for k, v in self._venvs.items()}}
        tmp = self._index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self._index_path)


def _bootstrap_dirs() -> list[str]:
    """Directories a worker needs to import ``mesh_agent.engine._worker`` (the package's parent)."""
    return [str(Path(__file__).resolve().parents[2])]


def _container_binds() -> tuple[list[str], list[str]]:
    """What a container worker gets bound read-only, and the import path it adds behind the image's
    own: the worker bootstrap, and the directories the agent's serializers (cloudpickle, dill) live
    in, which an image may lack; a function payload needs them to load. A directory inside another
    bind is not bound again."""
    import importlib.util

    pkgs: list[str] = []
    for name in ("cloudpickle", "dill"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            d = str(Path(spec.origin).resolve().parents[1])  # site-packages/<name>/__init__.py
            if d not in pkgs:
                pkgs.append(d)
    binds: list[str] = []
    for p in sorted({*_bootstrap_dirs(), *pkgs}, key=lambda p: (len(Path(p).parts), p)):
        if not any(Path(p).is_relative_to(q) for q in binds):
            binds.append(p)
    return binds, pkgs


#: Run once in a new container: it starts, and its python3's own import path (stdlib, the image's
#: packages) is what the worker keeps behind the bootstrap (the worker replaces sys.path whole).
_PATH_PROBE = "import sys,json;print('ok'+json.dumps([p for p in sys.path if p]))"


def _probed_path(out: str) -> list[str]:
    """The image's import path from :data:`_PATH_PROBE`'s output (runtimes may print around it)."""
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("ok["):
            try:
                got = json.loads(line[2:])
            except ValueError:
                break
            if isinstance(got, list) and all(isinstance(p, str) for p in got):
                return got
    raise EnvError(f"the container's python3 did not report its import path: {_tail(out)}")


#: This project's packages: a sandboxed worker imports the bootstrap, and functions may be pickled
#: by reference to the SDK's or the FL library's helpers.
_OUR_PACKAGES = ("mesh_agent", "cloud_hub", "scheduler", "fl", "sim")


def code_binds() -> list[tuple[str, str, str]]:
    """What a sandboxed worker needs of the agent's install, read-only: the base interpreter, the
    agent's venv (its site-packages) and this project's package directories. For a source
    checkout that is the package folders, not the checkout: a demo's hub database or an agent's
    data directory beside them stays out of sight."""
    import importlib.util

    roots: list[str] = []
    for raw in (sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
                os.path.dirname(os.path.realpath(sys.executable))):
        p = os.path.abspath(raw)
        if p != "/" and os.path.isdir(p):
            roots.append(p)
    # package directories on the agent's import path (PYTHONPATH, a --target install): where the
    # serializers (cloudpickle, dill) and the user's installed packages live; never a bare directory
    # such as the working directory
    roots += [os.path.abspath(p) for p in sys.path
              if p and os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    for name in _OUR_PACKAGES:
        spec = importlib.util.find_spec(name) if name not in sys.modules else sys.modules[name].__spec__
        locs = list(spec.submodule_search_locations or []) if spec is not None else []
        roots += [os.path.abspath(d) for d in locs if os.path.isdir(d)]
    system = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
    keep: list[str] = []
    for p in sorted(set(roots), key=lambda p: (len(Path(p).parts), p)):
        if any(Path(p).is_relative_to(q) for q in (*keep, *system)):
            continue  # inside a directory bound already
        keep.append(p)
    return [("ro", p, p) for p in keep]


def _tail(out: str, lines: int = 6) -> str:
    text = [ln.strip() for ln in out.strip().splitlines() if ln.strip()]
    return " ".join(text[-lines:])[:800] or "(no output)"
