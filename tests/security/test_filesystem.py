"""Default-deny filesystem (issue 25, item 3): the sandbox sees read-only /usr, /lib*, /bin, the
Python and venv it runs, a few /etc files, a private writable /tmp, and nothing else of the host:
not /root, /home, /var, /srv, not the hub's files, not the agent's data directory or key, not even
their mount points; no /etc/shadow, no /sys beyond CPU information, no device nodes but
null/zero/full/random/urandom/tty."""

from __future__ import annotations

from typing import Any

import pytest

from tests.security.conftest import SharedEndpoint
from tests.security.probes import walk_visible

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

#: top-level directories a sandbox may show whole (read-only): the system's programs and libraries
SYSTEM_TOPS = ["usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "tmp", "dev", "proc", "sys"]
#: bubblewrap's minimal /dev; ptmx is its own devpts instance (pseudo-terminals of the sandbox's own,
#: docs/environments.md), which reaches nothing of the host
ALLOWED_DEVICES = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx",
                   "/dev/pts/ptmx"}


def look_at(paths: list[str]) -> dict[str, Any]:
    """For each path: does it exist, what is in it (a directory) or how much of it could be read."""
    import os
    import re

    out: dict[str, Any] = {}
    for p in paths:
        r: dict[str, Any] = {"exists": os.path.exists(p), "lexists": os.path.lexists(p)}
        if os.path.isdir(p):
            try:
                r["listing"] = sorted(os.listdir(p))[:60]
            except OSError as exc:
                r["error"] = f"{type(exc).__name__}: {exc}"
        elif r["lexists"]:
            try:
                with open(p, "rb") as f:
                    data = f.read(4 << 20)
                r["read"] = len(data)
                r["hex64"] = sorted({m.decode() for m in re.findall(rb"[0-9a-f]{64}", data)})[:50]
            except OSError as exc:
                r["error"] = f"{type(exc).__name__}: {exc}"
        out[p] = r
    return out


def dump_hub_keys(db: str) -> dict[str, Any]:
    """Read every endpoint's HMAC key out of the hub's SQLite database, if the file is there."""
    import os
    import sqlite3

    if not os.path.exists(db):
        return {"exists": False}
    try:
        c = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
        rows = c.execute("SELECT id, hex(key) FROM endpoints").fetchall()
        return {"exists": True, "keys": {r[0]: r[1].lower() for r in rows}}
    except Exception as exc:  # noqa: BLE001
        return {"exists": True, "error": f"{type(exc).__name__}: {exc}"}


def visible_beyond(needed: list[str], system: list[str]) -> dict[str, Any]:
    return {"extra": walk_visible("/", needed, system)}


def list_devices() -> dict[str, Any]:
    """Every character or block device node under /dev (not following symlinks)."""
    import os
    import stat

    nodes: dict[str, str] = {}
    for root, dirs, files in os.walk("/dev"):
        for n in dirs + files:
            p = os.path.join(root, n)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                nodes[p] = f"{'c' if stat.S_ISCHR(st.st_mode) else 'b'} {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    return {"nodes": nodes, "named": {p: os.path.exists(p) for p in ("/dev/sda", "/dev/vda", "/dev/nvme0n1", "/dev/mem",
                                                                          "/dev/kmem", "/dev/kmsg", "/dev/port", "/dev/kvm")}}


def try_writes(dirs: list[str]) -> dict[str, str]:
    """Try to create a file in each directory; say what happened."""
    import os

    out: dict[str, str] = {}
    for d in dirs:
        p = os.path.join(d, f".mesh-sec-write-{os.getpid()}")
        try:
            with open(p, "w") as f:
                f.write("x")
            os.unlink(p)
            out[d] = "written"
        except OSError as exc:
            out[d] = f"{type(exc).__name__}: {exc.strerror}"
    return out


def list_processes(agent_pid: int) -> dict[str, Any]:
    import os

    procs: dict[int, str] = {}
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                with open(f"/proc/{n}/cmdline", "rb") as f:
                    procs[int(n)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
            except OSError:
                pass
    return {"procs": procs, "agent_visible": os.path.exists(f"/proc/{agent_pid}"), "me": os.getpid()}


# ---------------------------------------------------------------------------------------------- tests


def test_agent_data_dir_key_and_config_are_not_even_mount_points(shared: SharedEndpoint) -> None:
    paths = [str(shared.data_dir), str(shared.data_dir / "queue.sqlite3"), str(shared.key_file),
             str(shared.key_file.parent), str(shared.config_file)]
    seen = shared.run("b", look_at, paths).expect()
    leaked = [p for p, r in seen.items() if shared.key_hex in r.get("hex64", [])]
    assert not leaked, f"the sandbox READ THE AGENT'S KEY from {leaked}"
    visible = {p: r for p, r in seen.items() if r["lexists"]}
    assert not visible, f"the agent's own paths (or the mount points hiding them) are visible in the sandbox: {visible}"


def test_hub_database_and_broker_files_are_not_visible(shared: SharedEndpoint) -> None:
    hub_db = str(shared.mesh.hub_cfg.db_path)
    broker = shared.mesh.broker.workdir
    dumped = shared.run("b", dump_hub_keys, hub_db).expect()
    assert shared.key_hex not in (dumped.get("keys") or {}).values(), (
        f"the sandbox read every endpoint's HMAC key out of the hub's database {hub_db}: {dumped}")
    seen = shared.run("b", look_at, [str(shared.workdir), hub_db, str(broker), str(broker / "password_file"),
                                     str(broker / "acl_file")]).expect()
    visible = {p: r for p, r in seen.items() if r["lexists"]}
    assert not visible, f"the hub's files are visible in the sandbox: {visible}"


def test_root_home_var_srv_are_not_visible(shared: SharedEndpoint) -> None:
    tops = ["/root", "/home", "/var", "/srv", "/mnt", "/media", "/opt", "/boot", "/run"]
    seen = shared.run("b", look_at, tops).expect()
    wrong = {}
    for p, r in seen.items():
        if not r["lexists"]:
            continue
        # Only a directory on the way to the interpreter (the root agent's Python lives under /root/.pyenv)
        # may show, and then only what leads there.
        inner = {n for n in shared.runtime_paths if n.startswith(p + "/")}
        ok_names = {n[len(p) + 1:].split("/")[0] for n in inner}
        if not inner or set(r.get("listing", ["?"])) - ok_names:
            wrong[p] = r.get("listing", r)
    assert not wrong, f"host directories are visible in the sandbox (beyond the path to its interpreter): {wrong}"


def test_only_system_dirs_and_the_workers_runtime_are_visible(shared: SharedEndpoint) -> None:
    extra = shared.run("b", visible_beyond, shared.runtime_paths, SYSTEM_TOPS).expect()["extra"]
    assert not extra, (f"{len(extra)} host paths outside the system directories and the worker's runtime "
                       f"{shared.runtime_paths} are visible, e.g. {extra[:25]}")


def test_etc_holds_only_a_few_harmless_files(shared: SharedEndpoint) -> None:
    secret = ["/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/sudoers", "/etc/ssh", "/etc/mosquitto", "/etc/ssl/private"]
    seen = shared.run("b", look_at, ["/etc", *secret]).expect()
    shown = {p: r for p, r in seen.items() if p != "/etc" and r["lexists"]}
    assert not shown, f"sensitive /etc entries are visible in the sandbox: {shown}"
    listing = seen["/etc"].get("listing", [])
    assert len(listing) <= 40, f"/etc shows {len(listing)}+ entries, not 'a few files': {listing}"


def test_sys_exposes_only_cpu_information(shared: SharedEndpoint) -> None:
    paths = ["/sys", "/sys/devices", "/sys/devices/system", "/sys/class/net", "/sys/block", "/sys/firmware", "/sys/kernel",
             "/sys/fs/cgroup", "/sys/module", "/sys/bus"]
    seen = shared.run("b", look_at, paths).expect()
    problems = {}
    for p, allowed in (("/sys", {"devices"}), ("/sys/devices", {"system"}), ("/sys/devices/system", {"cpu", "node"})):
        extra = set(seen[p].get("listing", [])) - allowed
        if extra:
            problems[p] = sorted(extra)
    for p in paths[3:]:
        if seen[p]["lexists"]:
            problems[p] = "visible"
    assert not problems, f"/sys shows more than CPU information: {problems}"


def test_dev_holds_only_null_zero_full_random_urandom_tty(shared: SharedEndpoint) -> None:
    seen = shared.run("b", list_devices).expect()
    named = {p: e for p, e in seen["named"].items() if e}
    assert not named, f"disk, memory or kernel-log devices are visible in the sandbox: {named}"
    extra = {p: d for p, d in seen["nodes"].items() if p not in ALLOWED_DEVICES}
    assert not extra, f"device nodes beyond null/zero/full/random/urandom/tty: {extra}"


def test_nothing_but_the_private_tmp_is_writable(shared: SharedEndpoint) -> None:
    dirs = ["/", "/usr", "/etc", "/var/tmp", "/dev", "/dev/shm", "/run", "/home", "/root", "/srv", str(shared.workdir),
            str(shared.data_dir), str(shared.key_file.parent), *shared.runtime_paths, "/tmp"]
    seen = shared.run("b", try_writes, dirs).expect()
    assert seen["/tmp"] == "written", f"the sandbox's own scratch /tmp is not writable: {seen['/tmp']}"
    # /dev/shm is the sandbox's own small tmpfs (POSIX semaphores need it); its bound is checked by
    # test_limits.py::test_no_unbounded_writable_filesystem_besides_tmp
    written = sorted(d for d, r in seen.items() if r == "written" and d not in ("/tmp", "/dev/shm"))
    assert not written, (f"the sandbox can write outside its private /tmp: {written} (where these are the sandbox's "
                         "own tmpfs rather than the host's, they are still RAM that its 64 MB /tmp bound does not cover)")


def test_proc_shows_only_the_sandbox_own_processes(shared: SharedEndpoint) -> None:
    seen = shared.run("b", list_processes, shared.agent_pid).expect()
    procs = {int(k): v for k, v in seen["procs"].items()}
    foreign = {pid: cmd for pid, cmd in procs.items()
               if any(s in cmd for s in ("mesh_agent.cli", "mosquitto", "pytest", "systemd", "/sbin/init"))}
    assert not seen["agent_visible"] or "mesh_agent.cli" not in procs.get(shared.agent_pid, ""), \
        f"/proc/{shared.agent_pid} (the agent) is visible in the sandbox"
    assert not foreign, f"processes outside the sandbox are visible in its /proc: {foreign}"
    assert len(procs) <= 8, f"the sandbox sees {len(procs)} processes, not just its own few: {procs}"


def test_a_pip_environment_sandbox_hides_the_agents_paths_too(shared: SharedEndpoint) -> None:
    """The venv lives under the agent's data directory; binding it into the sandbox must not bring
    the data directory (or its name) along."""
    paths = [str(shared.data_dir), str(shared.data_dir / "envs"), str(shared.data_dir / "queue.sqlite3"), str(shared.key_file)]
    seen = shared.run("c", look_at, paths, environment={"pip": ["meshtoy==1.0"]}, timeout=400, task_timeout_s=120).expect()
    visible = {p: r for p, r in seen.items() if r["lexists"]}
    assert not visible, f"in a pip environment's sandbox the agent's data directory shows: {visible}"
