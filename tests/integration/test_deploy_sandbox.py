"""The sandbox where the agent is deployed (issue 25, item 6; docs/operations.md, "Sandbox under
systemd, balena and Apptainer"): do the shipped systemd unit, the balena service and an
Apptainer-like user namespace let the agent start its bubblewrap sandbox, and where they do not,
does a task see a clear error?

This machine has systemd installed but not as PID 1 (no ``systemd-run``), and no Docker daemon or
Apptainer. So the settings are applied by hand, as systemd (src/core/namespace.c,
src/shared/seccomp-util.c) and Docker (moby's masked paths and capabilities) apply them, to a
real agent: a root helper (:data:`HARNESS`) enters a new mount namespace and

* mounts what the unit asks for: ``ProtectSystem=strict`` (every mount read-only but /proc, /sys,
  /dev), ``ProtectHome=``, ``PrivateTmp=``, ``PrivateDevices=`` (a tmpfs /dev with the basic
  nodes), ``ProtectProc=``/``ProcSubset=`` (a new procfs with ``hidepid=``/``subset=``),
  ``ProtectKernelTunables=`` (read-only and inaccessible mounts over /proc/sys, /proc/kcore, ...,
  /sys read-only), ``ProtectKernelLogs=`` (/proc/kmsg inaccessible), ``ProtectControlGroups=``,
  ``ReadOnlyPaths=``; or Docker's masked and read-only /proc paths;
* drops the capability bounding set and switches to uid/gid 65534 (``User=``), or stays root with
  only the container's capabilities (balena);
* sets no_new_privs and installs a seccomp filter that does what systemd's does for
  ``RestrictNamespaces=`` (unshare/clone with a namespace flag that is not allowed, setns with such
  a type or 0: EPERM; clone3: ENOSYS), ``RestrictAddressFamilies=`` (socket() of another family:
  EAFNOSUPPORT), ``SystemCallFilter=~syslog`` and ``ProtectHostname=`` (EPERM);
* and execs the agent's own code: ``Environments.kind({"sandbox": True})``, which builds the real
  bwrap command line of mesh_agent/engine/environments.py and starts it once (the probe), exactly
  as a shared user's first task would. It prints ``SANDBOX-OK`` or the :class:`EnvError` a task
  would get.

Settings that do not take part in starting a sandbox (``RestrictSUIDSGID=``, ``LockPersonality=``,
...) are listed in :data:`NOT_INVOLVED`; a setting the harness neither models nor lists fails
:func:`test_the_emulation_models_every_setting_of_the_unit`, so a later edit of the unit cannot
go untested by accident. Each run takes well under a second.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_deploy_sandbox_config import effective, unit_settings

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "device_images" / "systemd" / "continuum-mesh-agent.service"
COMPOSE = REPO / "device_images" / "balena" / "docker-compose.yml"
SYSTEM_PYTHON = "/usr/bin/python3"  # the agent's interpreter under the unit (the venv's own lives under /root here)
BWRAP = shutil.which("bwrap")
NOBODY = 65534

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "applying a unit's mounts and credentials by hand needs a root test process"
    if BWRAP is None:
        return "bubblewrap (bwrap) is not installed"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"{SYSTEM_PYTHON} is needed to run the agent's code as uid {NOBODY}"
    if platform.machine() not in ("x86_64", "aarch64"):
        return f"the seccomp emulation knows x86_64 and aarch64 syscall numbers, not {platform.machine()}"
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", BWRAP,
                            "--unshare-user", "--ro-bind", "/", "/", "true"],
                           check=False, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"this kernel refuses unprivileged user namespaces, so no setting could be checked: {probe.stderr.strip()}"
    return None


SKIP = _skip_reason() if shutil.which("setpriv") else "setpriv (util-linux) is not installed"
needs_root_bwrap = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

# ------------------------------------------------------------------------- reading the unit

#: Settings the harness models (everything that mounts, changes credentials or filters a syscall
#: bubblewrap or the agent makes while starting a sandbox).
MODELLED = {"User", "Group", "NoNewPrivileges", "CapabilityBoundingSet", "AmbientCapabilities", "ProtectSystem",
            "ProtectHome", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables", "ProtectKernelLogs",
            "ProtectKernelModules", "ProtectControlGroups", "ProtectHostname", "ProtectProc", "ProcSubset",
            "ReadOnlyPaths", "InaccessiblePaths", "RestrictNamespaces", "RestrictAddressFamilies",
            "SystemCallFilter", "SystemCallErrorNumber"}
#: Settings that take no part in starting a sandbox: how the service is started, stopped and
#: restarted, where its state lives, and filters on calls neither bwrap nor the lockdown makes
#: (setuid/setgid file modes, realtime scheduling, personality(2), the clock, other ABIs).
NOT_INVOLVED = {"Type", "Environment", "EnvironmentFile", "ExecStart", "ExecStartPost", "Restart", "RestartSec",
                "RestartPreventExitStatus", "KillMode", "KillSignal", "TimeoutStopSec", "StateDirectory",
                "StateDirectoryMode", "ConfigurationDirectory", "ConfigurationDirectoryMode", "UMask",
                "RestrictSUIDSGID", "RestrictRealtime", "LockPersonality", "ProtectClock", "SystemCallArchitectures"}

NAMESPACES = {"cgroup": 0x02000000, "ipc": 0x08000000, "net": 0x40000000, "mnt": 0x00020000,
              "pid": 0x20000000, "user": 0x10000000, "uts": 0x04000000}
FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17}
CAPS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "DAC_READ_SEARCH": 2, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6,
        "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_ADMIN": 12, "NET_RAW": 13, "SYS_CHROOT": 18,
        "SYS_PTRACE": 19, "SYS_ADMIN": 21, "MKNOD": 27, "AUDIT_WRITE": 29, "SETFCAP": 31}

#: systemd's ProtectKernelTunables= tables (src/core/namespace.c): (path, "ro" | "inaccessible").
KERNEL_TUNABLES_PROC = [("/proc/acpi", "ro"), ("/proc/apm", "ro"), ("/proc/asound", "ro"), ("/proc/bus", "ro"),
                        ("/proc/fs", "ro"), ("/proc/irq", "ro"), ("/proc/kallsyms", "inaccessible"),
                        ("/proc/kcore", "inaccessible"), ("/proc/latency_stats", "ro"), ("/proc/mtrr", "ro"),
                        ("/proc/scsi", "ro"), ("/proc/sys", "ro"), ("/proc/sysrq-trigger", "ro"),
                        ("/proc/timer_stats", "ro")]
#: Docker's default masked and read-only paths (moby daemon/pkg/oci/defaults.go), as balenaEngine applies them.
DOCKER_MASKED = ["/proc/asound", "/proc/acpi", "/proc/interrupts", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                 "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware",
                 "/sys/devices/virtual/powercap"]
DOCKER_READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
#: Docker's default capability set (what a container has before cap_add/cap_drop).
DOCKER_DEFAULT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP",
                       "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE"]


def unit_plan(eff: dict[str, Any]) -> dict[str, Any]:
    """What the harness does for a unit's effective settings."""
    unknown = set(eff) - MODELLED - NOT_INVOLVED
    assert not unknown, f"the harness neither models nor ignores {sorted(unknown)}: teach it, or list it in NOT_INVOLVED"

    def yes(key: str) -> bool:
        return eff.get(key, "no") in ("yes", "true", "1", "strict", "full", "read-only", "tmpfs")

    assert eff.get("SystemCallErrorNumber", "EPERM") == "EPERM", "the harness refuses filtered calls with EPERM"
    mounts: list[list[Any]] = []
    if eff.get("ProtectSystem") == "strict":
        mounts.append(["strict"])
    if yes("ProtectHome"):
        mounts += [["inaccessible", p] for p in ("/home", "/root", "/run/user")]
    if yes("PrivateTmp"):
        mounts += [["tmpfs", "/tmp", "1777"], ["tmpfs", "/var/tmp", "1777"]]
    if yes("PrivateDevices"):
        mounts.append(["privatedev"])
    proc_opts = []
    if eff.get("ProtectProc", "default") != "default":
        proc_opts.append(f"hidepid={eff['ProtectProc']}")
    if eff.get("ProcSubset", "all") == "pid":
        proc_opts.append("subset=pid")
    if proc_opts:
        mounts.append(["proc", ",".join(proc_opts)])
    if yes("ProtectKernelTunables"):
        mounts += [[how, p] for p, how in KERNEL_TUNABLES_PROC] + [["ro", "/sys"]]
    if yes("ProtectKernelModules"):
        mounts += [["inaccessible", "/usr/lib/modules"], ["inaccessible", "/lib/modules"]]
    if yes("ProtectKernelLogs"):
        mounts += [["inaccessible", "/proc/kmsg"], ["inaccessible", "/dev/kmsg"]]
    if yes("ProtectControlGroups"):
        mounts.append(["ro", "/sys/fs/cgroup"])
    mounts += [["ro", p.lstrip("-")] for p in eff.get("ReadOnlyPaths", [])]
    mounts += [["inaccessible", p.lstrip("-")] for p in eff.get("InaccessiblePaths", [])]
    deny = []
    for entry in eff.get("SystemCallFilter", []):
        assert entry.startswith("~") and entry[1:] in ("syslog",), f"the harness models SystemCallFilter=~syslog only, not {entry}"
        deny.append(entry[1:])
    if yes("ProtectKernelLogs"):
        deny.append("syslog")
    if yes("ProtectHostname"):
        deny += ["sethostname", "setdomainname"]
    ns = eff.get("RestrictNamespaces")
    if ns is not None and "ALL" not in ns:
        assert all(n in NAMESPACES for n in ns), f"the harness models an allow-list of namespace types, not {ns}"
    families = eff.get("RestrictAddressFamilies")
    user = eff.get("User", "root")
    assert user != "root", "the unit must not run the agent as root"
    return {"mounts": mounts, "uts": yes("ProtectHostname"), "uid": NOBODY,
            "keep_caps": [CAPS[c.removeprefix("CAP_")] for c in eff.get("CapabilityBoundingSet", [])] or [],
            "nnp": True,  # NoNewPrivileges=yes, and implied for a non-root service with seccomp filters
            "seccomp": {"namespaces": None if ns is None or "ALL" in ns else [NAMESPACES[n] for n in ns],
                        "families": None if families is None else [FAMILIES[f] for f in families],
                        "deny": deny}}


def container_plan(caps: list[str], seccomp_unconfined: bool) -> dict[str, Any]:
    """A Docker/balenaEngine container as the agent sees it: root, the given capabilities, /proc's
    masked and read-only paths; the default seccomp profile has no pivot_root at all, which the
    harness models (the rest of that profile allows what bwrap calls, given CAP_SYS_ADMIN)."""
    mounts = [["inaccessible", p] for p in DOCKER_MASKED] + [["ro", p] for p in DOCKER_READONLY]
    return {"mounts": mounts, "uts": False, "uid": None, "keep_caps": [CAPS[c] for c in caps], "nnp": False,
            "seccomp": {"namespaces": None, "families": None, "deny": [] if seccomp_unconfined else ["pivot_root"]}}


# ------------------------------------------------------------------------- the harness

#: Runs as root under /usr/bin/python3 -I: ``HARNESS <plan json> <argv...>``. Stdlib only.
HARNESS = r'''
import ctypes, json, os, platform, stat, sys
plan = json.loads(sys.argv[1]); argv = sys.argv[2:]
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18

def ck(r, what):
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"harness: {what}: {os.strerror(e)}")

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None
    ck(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {dst}")

def mounts_under(path):
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == path or mp.startswith(path.rstrip("/") + "/"):
                out.append(mp)
    return out

def remount_ro(mp):
    st = os.statvfs(mp)
    keep = (MS_NOSUID if st.f_flag & os.ST_NOSUID else 0) | (MS_NODEV if st.f_flag & os.ST_NODEV else 0) | \
           (MS_NOEXEC if st.f_flag & os.ST_NOEXEC else 0)
    mount(None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep)

ck(libc.unshare(0x00020000 | (0x04000000 if plan["uts"] else 0)), "unshare")
mount(None, "/", None, MS_REC | MS_PRIVATE)
scratch = plan["scratch"]
mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755")
os.mkdir(scratch + "/dir", 0); os.close(os.open(scratch + "/reg", os.O_CREAT | os.O_WRONLY, 0))
# systemd's "inaccessible" nodes, held open: the path of the scratch tmpfs may be covered later (PrivateTmp=)
inaccessible = {True: os.open(scratch + "/dir", os.O_PATH), False: os.open(scratch + "/reg", os.O_PATH)}
# the agent's code, held open: a checkout under /tmp or /var/tmp (a CI clone) is bound back, read-only,
# over the private /tmp (a real install lives in /opt or /usr, which PrivateTmp= leaves alone)
keep = {k: os.open(k, os.O_PATH) for k in plan.get("keep", [])}
skip = ("/proc", "/sys", "/dev")
for op in plan["mounts"]:
    kind, path = op[0], (op[1] if len(op) > 1 else None)
    if kind == "strict":  # ProtectSystem=strict: every mount read-only except the API filesystems
        for mp in mounts_under("/"):
            if not any(mp == s or mp.startswith(s + "/") for s in skip):
                remount_ro(mp)
    elif kind == "tmpfs":
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=" + op[2])
            for k, fd in keep.items():
                if k == path or k.startswith(path + "/"):
                    os.makedirs(k, exist_ok=True)
                    mount(f"/proc/self/fd/{fd}", k, None, MS_BIND | MS_REC)
                    remount_ro(k)
    elif kind == "privatedev":  # a tmpfs /dev with the nodes systemd copies in
        mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755")
        nodes = (("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0))
        for name, major, minor in nodes:
            os.mknod("/dev/" + name, stat.S_IFCHR, os.makedev(major, minor))
            os.chmod("/dev/" + name, 0o666)
        os.mkdir("/dev/pts")
        mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620")
        os.symlink("pts/ptmx", "/dev/ptmx")
        os.mkdir("/dev/shm"); mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        for i, name in enumerate(("stdin", "stdout", "stderr")):
            os.symlink(f"/proc/self/fd/{i}", "/dev/" + name)
        os.symlink("/proc/self/fd", "/dev/fd")
    elif kind == "proc":
        mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, op[1])
    elif kind == "ro":
        if os.path.exists(path):
            mount(path, path, None, MS_BIND | MS_REC)
            for mp in mounts_under(path):
                remount_ro(mp)
    elif kind == "inaccessible":
        if os.path.lexists(path) and not os.path.islink(path):
            mount(f"/proc/self/fd/{inaccessible[os.path.isdir(path)]}", path, None, MS_BIND)
            remount_ro(path)
    else:
        raise SystemExit(f"harness: unknown mount {op}")

if plan["uid"] is not None or plan["keep_caps"] is not None:  # the bounding set (CapabilityBoundingSet=, cap_add)
    for cap in range(64):
        if cap not in plan["keep_caps"] and libc.prctl(24, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:
            ck(-1, f"PR_CAPBSET_DROP {cap}")
if plan["uid"] is not None:  # User=: a non-root uid, whose capabilities go with the switch
    os.setgroups([]); os.setresgid(plan["uid"], plan["uid"], plan["uid"]); os.setresuid(plan["uid"], plan["uid"], plan["uid"])

ARCH = {"x86_64": (0xC000003E, dict(unshare=272, clone=56, clone3=435, setns=308, socket=41, syslog=103,
                                    sethostname=170, setdomainname=171, pivot_root=155)),
        "aarch64": (0xC00000B7, dict(unshare=97, clone=220, clone3=435, setns=268, socket=198, syslog=116,
                                     sethostname=161, setdomainname=162, pivot_root=41))}
LD, JEQ, JSET, RET, ALLOW = 0x20, 0x15, 0x45, 0x06, 0x7FFF0000
err = lambda e: 0x00050000 | e
sc = plan["seccomp"]
arch, nr = ARCH[platform.machine()]
blocks = []
if sc["namespaces"] is not None:  # RestrictNamespaces= (seccomp_restrict_namespaces)
    allowed = 0
    for f in sc["namespaces"]:
        allowed |= f
    blocked = 0x7E020000 & ~allowed
    for name in ("unshare", "clone"):
        blocks.append((nr[name], [(LD, 0, 0, 16), (JSET, 0, 1, blocked), (RET, 0, 0, err(1)), (RET, 0, 0, ALLOW)]))
    if allowed == 0:
        blocks.append((nr["setns"], [(RET, 0, 0, err(1))]))
    else:
        blocks.append((nr["setns"], [(LD, 0, 0, 24), (JEQ, 1, 0, 0), (JSET, 0, 1, blocked),
                                     (RET, 0, 0, err(1)), (RET, 0, 0, ALLOW)]))
    blocks.append((nr["clone3"], [(RET, 0, 0, err(38))]))
if sc["families"] is not None:  # RestrictAddressFamilies=
    fams = sc["families"]
    body = [(LD, 0, 0, 16)] + [(JEQ, len(fams) - i, 0, f) for i, f in enumerate(fams)]
    blocks.append((nr["socket"], body + [(RET, 0, 0, err(97)), (RET, 0, 0, ALLOW)]))
for name in sc["deny"]:
    blocks.append((nr[name], [(RET, 0, 0, err(1))]))
if plan["nnp"]:  # a container's root installs its filter with CAP_SYS_ADMIN instead, as runc does
    ck(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
if blocks:
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, ALLOW), (LD, 0, 0, 0)]
    for number, body in blocks:
        prog.append((JEQ, 0, len(body), number))
        prog += body
    prog.append((RET, 0, 0, ALLOW))
    class F(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]
    class P(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(F))]
    arr = (F * len(prog))(*[F(*i) for i in prog])
    ck(libc.prctl(22, 2, ctypes.byref(P(len(prog), ctypes.cast(arr, ctypes.POINTER(F)))), 0, 0), "PR_SET_SECCOMP")
os.chdir("/")
os.execve(argv[0], argv, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
'''

#: What runs under the emulated unit: the agent's own code prepares a sandbox spec (the probe
#: start of bwrap included) and says what a task would get. argv: REPO, "net" | "nonet".
AGENT_PROBE = r'''
import asyncio, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from mesh_agent.engine.environments import Environments, EnvError
spec = {"sandbox": True, "network": True} if sys.argv[2] == "net" else {"sandbox": True}
root = Path(tempfile.mkdtemp(prefix="mesh-envs-", dir="/tmp"))
try:
    kind = asyncio.run(Environments(root, bwrap=sys.argv[3]).kind(spec))
except EnvError as exc:
    print("ENVERROR:", exc)
else:
    print("SANDBOX-OK", " ".join(kind.wrap[:4]))
finally:
    import shutil
    shutil.rmtree(root, ignore_errors=True)
'''


def run_plan(plan: dict[str, Any], argv: list[str], scratch: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    scratch.mkdir(parents=True, exist_ok=True)
    plan = {**plan, "scratch": str(scratch), "keep": [str(REPO)]}
    return subprocess.run([SYSTEM_PYTHON, "-I", "-c", HARNESS, json.dumps(plan), *argv],
                          check=False, capture_output=True, text=True, timeout=timeout, cwd="/")


def agent_probe(plan: dict[str, Any], scratch: Path, network: bool = False) -> str:
    """What the agent reports when a shared user's first sandboxed task arrives under ``plan``."""
    p = run_plan(plan, [SYSTEM_PYTHON, "-I", "-c", AGENT_PROBE, str(REPO), "net" if network else "nonet", BWRAP or "bwrap"], scratch)
    out = (p.stdout + p.stderr).strip()
    assert p.returncode == 0 and ("SANDBOX-OK" in out or "ENVERROR:" in out), f"the harness itself failed ({p.returncode}): {out}"
    return out


def shipped_unit() -> dict[str, Any]:
    return effective(unit_settings(UNIT.read_text()))


def with_setting(key: str, value: str) -> dict[str, Any]:
    """The shipped unit with one more assignment, as a drop-in (``systemctl edit``) would add it."""
    return effective([*unit_settings(UNIT.read_text()), (key, value)])


#: The unit's hardening as shipped before issue 25 (only the settings that differ from now).
OLD_UNIT = [("RestrictNamespaces", ""), ("RestrictNamespaces", "yes"), ("ProtectKernelTunables", "yes"),
            ("ProtectKernelLogs", "yes"), ("ReadOnlyPaths", ""), ("SystemCallFilter", "")]

#: upstream says "creating", Debian's bwrap "create"
NAMESPACE_FAILURE = "No permissions to creat"
PROC_FAILURE = "Can't mount proc on /newroot/proc: Operation not permitted"

# ------------------------------------------------------------------------- systemd


def test_the_emulation_models_every_setting_of_the_unit() -> None:
    unit_plan(shipped_unit())  # raises for a setting neither modelled nor listed as not involved


@needs_root_bwrap
@pytest.mark.parametrize("network", [False, True], ids=["no-network", "network"])
def test_the_sandbox_starts_under_the_shipped_unit(tmp_path: Path, network: bool) -> None:
    out = agent_probe(unit_plan(shipped_unit()), tmp_path / "s", network)
    assert "SANDBOX-OK" in out and "--unshare-user" in out, out


@needs_root_bwrap
def test_under_the_old_unit_a_shared_users_task_gets_a_clear_error(tmp_path: Path) -> None:
    eff = effective([*unit_settings(UNIT.read_text()), *OLD_UNIT])
    assert eff["RestrictNamespaces"] == []
    out = agent_probe(unit_plan(eff), tmp_path / "s")
    assert out.startswith("ENVERROR: sandbox (bubblewrap) cannot start on this endpoint: ") and NAMESPACE_FAILURE in out, out


@needs_root_bwrap
def test_every_namespace_the_unit_allows_is_needed(tmp_path: Path) -> None:
    """"No more": take any one namespace type out of RestrictNamespaces= and no sandbox starts."""
    allowed = shipped_unit()["RestrictNamespaces"]
    for i, name in enumerate(allowed):
        eff = shipped_unit()
        eff["RestrictNamespaces"] = [n for n in allowed if n != name]
        out = agent_probe(unit_plan(eff), tmp_path / f"s{i}")
        assert out.startswith("ENVERROR:") and NAMESPACE_FAILURE in out, f"without {name}: {out}"


@needs_root_bwrap
@pytest.mark.parametrize("key, value, failure", [
    ("ProtectKernelTunables", "yes", PROC_FAILURE),
    ("ProtectKernelLogs", "yes", PROC_FAILURE),
    ("ProcSubset", "pid", "bwrap: Can't"),
    ("RestrictAddressFamilies", "~AF_NETLINK", "Failed to create NETLINK_ROUTE socket"),
    ("InaccessiblePaths", "/proc/keys", PROC_FAILURE),
], ids=["ProtectKernelTunables", "ProtectKernelLogs", "ProcSubset=pid", "no-AF_NETLINK", "a-mount-over-proc"])
def test_settings_that_would_break_the_sandbox(tmp_path: Path, key: str, value: str, failure: str) -> None:
    """Why the unit leaves these off: each alone stops every sandbox, with bwrap's own words."""
    if value.startswith("~"):  # RestrictAddressFamilies=~X: the shipped list without X
        eff = shipped_unit()
        eff[key] = [f for f in eff[key] if f != value[1:]]
    else:
        eff = with_setting(key, value)
    out = agent_probe(unit_plan(eff), tmp_path / "s")
    assert out.startswith("ENVERROR: sandbox (bubblewrap) cannot start on this endpoint: ") and failure in out, out


@needs_root_bwrap
def test_inside_the_sandbox_under_the_unit(tmp_path: Path) -> None:
    """What a function sees inside a sandbox started under the unit: uid 65534 (its own, mapped),
    no capability, no_new_privs, and no way to a user namespace of its own."""
    check = ("import os,re;s=open('/proc/self/status').read();"
             "caps=[l.split()[1] for l in s.splitlines() if l.startswith(('CapEff','CapPrm','CapBnd'))];"
             "nnp=re.search(r'NoNewPrivs:\\s*(\\d)',s).group(1);"
             "import ctypes;libc=ctypes.CDLL(None,use_errno=True);r=libc.unshare(0x10000000);e=ctypes.get_errno();"
             "print('UID',os.getuid(),'CAPS',set(caps),'NNP',nnp,'USERNS',r,e)")
    sandbox = [BWRAP or "bwrap", "--unshare-user", "--disable-userns", "--cap-drop", "ALL", "--unshare-pid",
               "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--unshare-net", "--die-with-parent",
               "--new-session", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(d):
            sandbox += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            sandbox += ["--ro-bind", d, d]
    p = run_plan(unit_plan(shipped_unit()), [*sandbox, "--", SYSTEM_PYTHON, "-I", "-c", check], tmp_path / "s")
    assert p.returncode == 0, p.stderr
    assert f"UID {NOBODY} CAPS {{'0000000000000000'}} NNP 1 USERNS -1" in p.stdout, p.stdout


# ------------------------------------------------------------------------- balena (Docker) and Apptainer


def compose_agent() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(COMPOSE.read_text())["services"]["agent"]


def compose_caps(service: dict[str, Any]) -> list[str]:
    caps = set(DOCKER_DEFAULT_CAPS)
    if "ALL" in service.get("cap_drop", []):
        caps = set()
    caps -= set(service.get("cap_drop", []))
    return sorted(caps | set(service.get("cap_add", [])))


@needs_root_bwrap
def test_the_sandbox_starts_in_the_balena_container(tmp_path: Path) -> None:
    """The agent runs as root in the container (entrypoint.sh) with the compose file's capabilities
    and seccomp setting, under Docker's masked /proc paths: bwrap runs as root, and the lockdown
    drops each sandbox to uid 65534 with no capability."""
    service = compose_agent()
    out = agent_probe(container_plan(compose_caps(service), "seccomp=unconfined" in service.get("security_opt", [])),
                      tmp_path / "s")
    assert "SANDBOX-OK" in out and "--unshare-user" not in out, out


@needs_root_bwrap
def test_every_capability_the_balena_service_adds_is_needed(tmp_path: Path) -> None:
    """"No more": without any one of the capabilities the sandbox needs, none starts. (CHOWN and
    DAC_OVERRIDE are the entrypoint's, for the volume; checked below.)"""
    caps = compose_caps(compose_agent())
    for i, cap in enumerate(c for c in caps if c not in ("CHOWN", "DAC_OVERRIDE")):
        out = agent_probe(container_plan([c for c in caps if c != cap], True), tmp_path / f"s{i}")
        assert out.startswith("ENVERROR: sandbox (bubblewrap) cannot start on this endpoint: "), f"without {cap}: {out}"


@needs_root_bwrap
def test_without_seccomp_unconfined_the_balena_sandbox_cannot_start(tmp_path: Path) -> None:
    out = agent_probe(container_plan(compose_caps(compose_agent()), False), tmp_path / "s")
    assert out.startswith("ENVERROR:") and "pivot_root" in out, out


@needs_root_bwrap
def test_the_balena_entrypoint_can_take_over_an_old_volume(tmp_path: Path) -> None:
    """The image used to run the agent as `mesh`: its volume holds 0700 directories and 0600 files
    of that user. With only the compose file's capabilities, root can still make them its own."""
    vol = tmp_path / "vol"
    (vol / "queue").mkdir(parents=True)
    (vol / "queue" / "queue.sqlite3").write_text("x")
    (vol / "agent.yaml").write_text("x")
    for p in (vol / "queue" / "queue.sqlite3", vol / "agent.yaml", vol / "queue", vol):
        os.chown(p, NOBODY, NOBODY)
        p.chmod(0o600 if p.is_file() else 0o700)
    script = f"chown -R root:root {vol} && chmod 0700 {vol} && cat {vol}/queue/queue.sqlite3"
    p = run_plan(container_plan(compose_caps(compose_agent()), True), ["/bin/sh", "-c", script], tmp_path / "s")
    assert p.returncode == 0 and p.stdout == "x", p.stderr


#: Runs as root: a child in a new user namespace that maps root and uid/gid 65534 to themselves sets
#: user.max_user_namespaces=0 there (the value is per user namespace; this machine's stays as it
#: is), becomes uid 65534 and execs argv. What a non-root agent meets on balenaOS.
NO_USERNS = r'''
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    if libc.unshare(0x10000000) != 0:
        os._exit(90)
    os.read(r, 1)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    os.execv(sys.argv[1], sys.argv[1:])
os.close(r)
import time
for _ in range(500):  # until the child is in its own user namespace (at most 5 s)
    if os.readlink(f"/proc/{pid}/ns/user") != os.readlink("/proc/self/ns/user"):
        break
    time.sleep(0.01)
for name, text in (("uid_map", "0 0 1\n65534 65534 1\n"), ("setgroups", "allow"), ("gid_map", "0 0 1\n65534 65534 1\n")):
    with open(f"/proc/{pid}/{name}", "w") as f:
        f.write(text)
os.write(w, b"x")
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
'''


@needs_root_bwrap
def test_an_unprivileged_agent_on_balenaos_reports_why(tmp_path: Path) -> None:
    """balenaOS ships user.max_user_namespaces=0: an agent that is not root in the container
    (MESH_AGENT_USER=mesh) cannot start a sandbox, and says so."""
    probe = [SYSTEM_PYTHON, "-I", "-c", AGENT_PROBE, str(REPO), "nonet", BWRAP or "bwrap"]
    p = subprocess.run([SYSTEM_PYTHON, "-I", "-c", NO_USERNS, *probe], check=False, capture_output=True, text=True, timeout=60, cwd="/")
    out = (p.stdout + p.stderr).strip()
    assert out.startswith("ENVERROR: sandbox (bubblewrap) cannot start on this endpoint: ") \
        and "max_*_namespaces exceeded (ENOSPC)" in out, out


@needs_root_bwrap
def test_the_sandbox_starts_inside_an_apptainer_like_user_namespace(tmp_path: Path) -> None:
    """Apptainer (unprivileged, the default since 1.1) runs the container in a user namespace,
    as the user's own uid: the agent's sandbox is then a nested user namespace, which works."""
    probe = [SYSTEM_PYTHON, "-I", "-c", AGENT_PROBE, str(REPO), "nonet", BWRAP or "bwrap"]
    p = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "unshare", "--user",
                        "--mount", "--map-current-user", *probe], check=False, capture_output=True, text=True, timeout=60, cwd="/")
    out = (p.stdout + p.stderr).strip()
    assert "SANDBOX-OK" in out and "--unshare-user" in out, out


@needs_root_bwrap
def test_apptainer_fakeroot_without_subordinate_ids_reports_why(tmp_path: Path) -> None:
    """``apptainer --fakeroot`` with only root mapped (no /etc/subuid entry): the agent is uid 0
    there, starts bwrap as root, and the lockdown cannot become uid 65534, which does not exist in
    that namespace: the task gets that error, and nothing runs as (fake) root."""
    probe = [SYSTEM_PYTHON, "-I", "-c", AGENT_PROBE, str(REPO), "nonet", BWRAP or "bwrap"]
    p = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "unshare", "--user",
                        "--mount", "--map-root-user", *probe], check=False, capture_output=True, text=True, timeout=60, cwd="/")
    out = (p.stdout + p.stderr).strip()
    assert out.startswith("ENVERROR: sandbox (bubblewrap) cannot start on this endpoint: ") \
        and "sandbox lockdown failed" in out, out
