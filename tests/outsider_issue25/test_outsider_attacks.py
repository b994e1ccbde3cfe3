"""Issue 25, attacked from outside: a hostile shared user against a real shared endpoint.

Set-up (harness.py): real Mosquitto, the real hub (in-process), one real ``mesh-agent start``
process, owned by user "demo" (A) and shared with "bob" (B) and "carol" (C); every test runs
once with the agent as root and once as uid 65534 (the ``mode`` of the ``se`` fixture).

Each test asserts a promise of issue 25 (docs/environments.md "The sandbox", docs/security.md).
A failing test is an escape; its message says what got out. Run:

    .venv/bin/python -m pytest tests/outsider_issue25 --confcutdir=tests/outsider_issue25 -p no:cacheprovider -q

``--confcutdir`` keeps the team's own tests/conftest.py out: this suite is independent of it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from cloud_hub.client._results import decode_row
from tests.outsider_issue25 import attacks, payloads
from tests.outsider_issue25.harness import (
    REPO, RUN, SharedEndpoint, runner_variant, build_sdist_with_backend, build_wheel, compile_audit_lib, nobody_processes, wait_for,
)

pytestmark = [pytest.mark.timeout(300)]

MODES = ["root", "nobody"]
_results: list[dict[str, Any]] = []  # what each attack did, written to last_run.json at the end


def record(mode: str, attack: str, outcome: Any, escape: bool) -> None:
    _results.append({"mode": mode, "attack": attack, "escape": escape, "outcome": outcome})


@pytest.fixture(scope="session", autouse=True)
def _write_results():
    yield
    report = os.environ.get("OUTSIDER_REPORT")  # a path: where to write what each attack did (off in CI)
    if not report:
        return
    out = Path(report)
    with contextlib.suppress(OSError):
        out.write_text(json.dumps(_results, indent=1, default=str))


# ------------------------------------------------------------------------------------------------ fixtures

SO_BYTES: bytes | None = None


def _prepare_wheels(se: SharedEndpoint) -> None:
    """What the attacker publishes where the endpoint's operator gets packages from."""
    global SO_BYTES
    w = se.wheels
    # a .pth that runs at interpreter start: it must run inside the sandbox, after the lockdown
    hook = (
        "import os\n"
        "try:\n"
        "    st = open('/proc/self/status').read()\n"
        "    keep = [l for l in st.splitlines() if l.startswith(('Seccomp:', 'NoNewPrivs:', 'CapEff:'))]\n"
        "    open('/tmp/oa-pth-ran', 'a').write('uid=%d ' % os.getuid() + ' '.join(keep) + '\\n')\n"
        f"    open({str(se.markers / 'pth-host')!r}, 'w').write('pth ran where the host is writable')\n"
        "except Exception:\n"
        "    pass\n"
    )
    build_wheel(w, "oapth", "1.0", {"oapth/__init__.py": b"X = 1\n", "oapth_hook.py": hook.encode(),
                                    "oapth-hook.pth": b"import oapth_hook\n"})
    # path traversal and a symlink out of the venv, written by the installer (as the agent)
    trav = str(se.markers / "traversal").lstrip("/")
    build_wheel(w, "oatrav", "1.0", {"oatrav/__init__.py": b"", f"../../../../../../../../../../{trav}": b"escaped\n",
                                     "oatrav-1.0.data/data/../../../../../../../../../../" + trav + "-data": b"escaped\n"})
    build_wheel(w, "oalink", "1.0", {"oalink/__init__.py": b"", "oalink/link/escaped-via-symlink": b"escaped\n"},
                symlinks={"oalink/link": str(se.markers)})
    # an sdist only: its in-tree build backend writes a marker if anything ever runs it
    build_sdist_with_backend(w, "oasdist", "1.0", se.markers / "sdist-backend-ran")
    if SO_BYTES is None:
        so = compile_audit_lib(se.root)
        SO_BYTES = so.read_bytes() if so is not None else b""
    if SO_BYTES:
        build_wheel(w, "oaaudit", "1.0", {"oaaudit/__init__.py": b"", "oaaudit/liboaaudit.so": SO_BYTES})
    for p in w.iterdir():
        p.chmod(0o644)


@pytest.fixture(scope="module", params=MODES)
def se(request):
    mode = request.param
    root = Path(tempfile.mkdtemp(prefix=f"oa-{mode}-", dir="/tmp"))
    endpoint = SharedEndpoint(root, mode, workers=3, task_timeout=60, memory_limit_mb=256)
    _prepare_wheels(endpoint)
    try:
        endpoint.start()
    except BaseException:
        endpoint.stop()
        raise
    yield endpoint
    endpoint.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def probe(se):
    paths = {k: str(v) for k, v in se.host_secrets().items()}
    paths["root_home"] = "/root"
    hub_port = int(se.mesh.url.rsplit(":", 1)[1])
    return se.run("bob", attacks.PROBE, paths, hub_port, se.mesh.broker.port, timeout=180)


# ------------------------------------------------------------------------------------------------ 3, 4: what the sandbox sees and holds


def test_no_privilege_inside(se, probe):
    st = probe["status"]
    bad = {k: v for k, v in st.items() if k.startswith("Cap") and int(v, 16) != 0}
    uid = probe["ids"][0]
    ok = (uid != 0 and probe["ids"][:4] == [uid] * 4 and not bad and st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
          and probe["ids"][4] == [])
    record(se.mode, "identity, capabilities, no_new_privs, seccomp mode", {"ids": probe["ids"], "status": st}, not ok)
    assert ok, f"privileges inside the sandbox: {st} ids={probe['ids']}"


def test_default_deny_filesystem_hides_host_secrets(se, probe):
    seen = sorted(k for k, v in probe["exists"].items() if v and k != "root_home")
    record(se.mode, "host paths (hub db, agent key/config/queue/log, broker, /home, /var, /srv, /etc/shadow...) in sight",
           {"visible": seen, "ls_root": probe["ls_root"], "ls": {k: probe["ls"][k] for k in ("/work/main", "/etc", "/dev")}}, bool(seen))
    assert not seen, f"host paths visible inside the sandbox: {seen}"


def test_no_home_directory_in_sight(se, probe):
    """docs: "Home directories, /root, ... are not there (os.path.exists is false)"."""
    # Where the interpreter itself lives under a home directory (pyenv under /root), the path to it is
    # recreated (docs/environments.md) and nothing else: the home directory's contents stay out.
    import sys

    toward = [p for p in Path(sys.base_prefix).parts[1:3]] if sys.base_prefix.startswith("/root/") else []
    listing = probe["ls"]["/root"]
    there = probe["exists"]["root_home"] and listing != toward[1:2]
    record(se.mode, "/root (a home directory) exists in the sandbox beyond the interpreter's path", {"/root": listing}, there)
    assert not there, f"/root holds more than the path to the interpreter in the sandbox: {listing}"


def test_only_tmp_is_writable(se, probe):
    # /tmp, and /dev/shm where it is a small tmpfs of its own (bounded: test_scratch_space_is_bounded)
    wrote = sorted(d for d, r in probe["writes"].items() if r == "WROTE" and d not in ("/tmp", "/dev/shm"))
    record(se.mode, "write outside /tmp (/, /etc, /dev, /dev/shm, /usr, code dirs)", probe["writes"], bool(wrote))
    assert not wrote, (f"writable outside the private /tmp: {wrote} (tmpfs without the /tmp size bound: the "
                       "sandbox root and /dev are tmpfs owned by the sandbox user)")


def test_links_and_proc_tricks(se, probe):
    links, reads = probe["links"], probe["reads"]
    fds = probe["fds"]
    leaked = {fd: t for fd, t in fds.items() if not (t.startswith(("pipe:", "socket:", "/dev/null")) or "ENOENT" in t)}
    bad = [k for k, v in links.items() if v in ("READ", "LINKED")]
    bad += [p for p in ("/proc/1/environ", "/proc/1/maps", "/proc/kcore", "/dev/mem", "/dev/kmsg", "/etc/shadow") if reads[p].startswith("read")
            and p not in ("/proc/1/environ", "/proc/1/maps")]  # PID 1 is the task itself (bwrap --as-pid-1)
    record(se.mode, "symlink/hardlink out of /tmp, /proc/self/fd, /proc/1, /dev nodes",
           {"links": links, "reads": reads, "fds": fds, "signalable": probe["signalable"]}, bool(bad or leaked))
    assert not bad and not leaked, f"reachable: {bad}, inherited fds: {leaked}"
    assert all(abs(p) <= 2 for p in probe["signalable"]), f"processes outside the sandbox can be signalled: {probe['signalable']}"
    assert probe["tiocsti"].startswith("open /dev/tty") or probe["tiocsti"] != "INJECTED"


DENIED = ("ptrace_traceme", "ptrace_attach_1", "process_vm_readv", "process_vm_writev", "io_uring_setup", "io_uring_enter",
          "io_uring_register", "userfaultfd", "keyctl_get_session", "add_key", "request_key", "bpf", "perf_event_open",
          "unshare_user", "unshare_mnt", "unshare_net", "setns", "clone_newuser", "clone_newns", "mount", "umount2",
          "pivot_root", "open_tree", "move_mount", "fsopen", "fsmount", "fspick", "mount_setattr", "name_to_handle_at",
          "open_by_handle_at", "syslog", "acct", "swapon", "init_module", "finit_module", "kexec_load")


def test_kernel_doors_are_shut(se, probe):
    sc = probe["syscalls"]
    open_ = {n: sc[n] for n in DENIED if list(sc[n]) != ["err", "EPERM"]}
    if list(sc["clone3"]) != ["err", "ENOSYS"]:
        open_["clone3"] = sc["clone3"]
    socks = probe["sockets"]
    for k in ("unix_stream", "unix_dgram"):
        if socks[k] != "PermissionError:EPERM":
            open_[k] = socks[k]
    for k in ("hub_http", "broker", "internet", "packet"):
        if socks[k] in ("CONNECTED", "OPENED"):
            open_[k] = socks[k]
    record(se.mode, "ptrace, process_vm_*, io_uring, userfaultfd, keyctl, bpf, perf, namespaces, mounts, AF_UNIX, host ports",
           {"syscalls": sc, "sockets": socks, "tiocsti": probe["tiocsti"]}, bool(open_))
    assert not open_, f"calls the filter should refuse went through: {open_}"


def test_foreign_abi_kills(se):
    r = se.run("bob", attacks.FOREIGN_ABI, timeout=60)
    alive = {k: v for k, v in r.items() if k != "native_getpid" and v.get("killed_by") != "SIGSYS"}
    record(se.mode, "int 0x80 (ia32) and x32 syscalls", r, bool(alive))
    assert r["native_getpid"] == {"exit": 101}
    assert not alive, f"foreign-ABI calls not killed: {alive}"


def test_pid1_of_the_sandbox_is_not_a_way_around_the_filter(se):
    """bubblewrap's init (PID 1 inside) has no seccomp filter. Where /proc/1/mem is writable (same
    uid, no capability gap: an unprivileged agent) a tenant plants code in it and makes every call
    the filter refuses: AF_UNIX sockets without network, io_uring, the keyring, int 0x80."""
    try:
        r = se.run("bob", attacks.PID1_INJECT, attacks.PID1_SHELLCODE, timeout=90)
    except Exception as exc:  # the task is PID 1 itself now (bwrap --as-pid-1): writing its own code killed it
        r = {"injected": False, "ended": f"{type(exc).__name__}: {exc}"[:300]}
    got = r.get("from_pid1") if r.get("injected") else None
    bypass = isinstance(got, dict) and any(got.get(k, -1) >= 0 for k in ("socket_af_unix", "io_uring_setup", "keyctl_session", "userfaultfd", "int80_getpid"))
    record(se.mode, "code injected into the sandbox's PID 1 (bwrap init, no seccomp) via /proc/1/mem", r, bypass)
    assert se.agent_alive() and se.owner_still_served()
    assert not bypass, f"seccomp bypassed through PID 1 (bwrap init, Seccomp: 0): {got} (pid1 {r.get('pid1')})"


# ------------------------------------------------------------------------------------------------ 3: mountinfo and env vars


def test_mountinfo_does_not_name_the_data_directory(se):
    """docs: the venv is at a fixed path "so not even the name of the agent's data directory shows"."""
    # The kernel shows a bind's source path in mountinfo, so the name may show (docs/environments.md
    # says so); what must hold is that nothing there is reachable.
    mi = se.run("bob", attacks.MOUNTINFO, environment={"pip": ["oapth"]}, timeout=180)
    named = [ln for ln in mi.splitlines() if str(se.data_dir) in ln]
    paths = sorted({tok for ln in named for tok in ln.split() if tok.startswith(str(se.data_dir))})
    reach = se.run("bob", "def main(paths):\n    import os\n    return [p for p in paths if os.path.exists(p)]", paths,
                   timeout=120) if paths else []
    record(se.mode, "host paths named in /proc/self/mountinfo are reachable", reach, bool(reach))
    assert not reach, f"paths of the agent's data directory are reachable in the sandbox: {reach}"


def _submit_env(se: SharedEndpoint, user: str, src: str, args: tuple, environment: dict[str, Any], timeout: float = 180) -> Any:
    """Submit through the SDK; where the SDK refuses the spec, straight to the hub's REST API as a
    hostile client would. Returns the value, or ``("refused", where, detail)``."""
    try:
        return se.run(user, src, *args, environment=environment, timeout=timeout)
    except ValueError as exc:  # EnvSpecError: the SDK's own check; a hostile client skips it
        sdk = str(exc)[:200]
    c = se.clients[user]
    spec = c.task_spec(se.ep, c.register_function(RUN), (src, *args))
    spec["environment"] = environment
    try:
        tid = c.request("POST", "/v1/tasks", json=spec)["task_id"]
    except Exception as exc:  # noqa: BLE001 - HubError 422
        return ("refused", "sdk and hub", f"sdk: {sdk} | hub: {str(exc)[:200]}")
    rows = c.wait_results([tid], timeout_s=min(timeout, 55))
    ok, value = decode_row(rows[0]) if rows else (False, "no result")
    return value if ok else ("refused", "agent", f"{type(value).__name__}: {str(value)[:300]}")


def test_tenant_env_vars_do_not_reach_bubblewrap_on_the_host(se):
    """A spec's env_vars set in bubblewrap's environment reach bubblewrap's dynamic loader, which
    runs on the host as the agent before any namespace exists: LD_DEBUG_OUTPUT writes where it says."""
    before = set(os.listdir(se.markers))
    target = se.markers / "ld-debug-output"
    r = _submit_env(se, "bob", "def main():\n    return 'plain task'\n", (),
                    {"env_vars": {"LD_DEBUG": "libs", "LD_DEBUG_OUTPUT": str(target)}})
    made = sorted(set(os.listdir(se.markers)) - before)
    files = {n: (os.stat(se.markers / n).st_uid, (se.markers / n).read_text(errors="replace")[:200]) for n in made if n.startswith("ld-debug")}
    record(se.mode, "env_vars LD_DEBUG/LD_DEBUG_OUTPUT: a file written on the host by the agent's bwrap", {"result": r, "files": files}, bool(files))
    assert not files, f"a tenant's env var made the agent write host files (owner uid, head): {files}"


def test_ld_audit_from_own_wheel_runs_code_as_the_agent(se):
    """The full chain an outsider needs: publish a wheel with a .so (wheels only is fine), read the
    venv's host path from /proc/self/mountinfo, then set LD_AUDIT to it: the agent's bwrap loads it
    on the host, as the agent (root, or 65534), and it reads the agent's credentials file."""
    if not SO_BYTES:
        pytest.skip("no C compiler to build the audit library")
    mi = se.run("bob", attacks.MOUNTINFO, environment={"pip": ["oaaudit"]}, timeout=180)
    line = [ln for ln in mi.splitlines() if " /opt/mesh-venv" in ln]
    assert line, "no venv mount"
    root_field = line[0].split()[3]
    host_venv = root_field.split("/envs/venvs/")[0] + "/envs/venvs/" + root_field.split("/envs/venvs/")[1].split("/")[0] \
        if "/envs/venvs/" in root_field else str(se.data_dir / "envs" / "venvs" / "unknown")
    data_dir = host_venv.split("/envs/venvs/")[0]  # `mesh-agent init`: <config dir>/<name>, credentials beside it
    creds = str(Path(data_dir).parent / (Path(data_dir).name + ".credentials.json"))
    lib = f"{host_venv}/lib/python3.11/site-packages/oaaudit/liboaaudit.so"
    mark = se.markers / "ld-audit"
    r = _submit_env(se, "bob", "def main():\n    return 'innocent'\n", (),
                    {"pip": ["oaaudit"], "env_vars": {"LD_AUDIT": lib, "OA_MARK": str(mark), "OA_STEAL": creds}})
    text = mark.read_text(errors="replace") if mark.exists() else ""
    key = se.credentials()["key"]
    stolen = key in text
    record(se.mode, "LD_AUDIT -> tenant's .so from its wheel, path learnt from mountinfo: code runs in bwrap on the host",
           {"task_result": r, "mount_line": line[0][:200], "marker": text[:600], "agent_key_stolen": stolen}, bool(text))
    assert not text, f"tenant code ran on the host as the agent{' and stole its HMAC key' if stolen else ''}:\n{text[:400]}"


def test_other_users_tasks_cannot_be_cancelled_or_leased(se):
    """Cancellation (new): bob names the owner's task id, and the owner's task group name."""
    owner, bob = se.clients["demo"], se.clients["bob"]
    fid = owner.register_function(RUN)
    group = f"train-{se.mode}"
    spec = owner.task_spec(se.ep, fid, ("import time\ndef main():\n    time.sleep(5)\n    return 'owner done'\n",))
    ids, _ = owner.submit_batch_placed([spec, spec], task_group_id=group)
    tries = {}
    for name, call in (("cancel_tasks", lambda: bob.cancel_tasks(ids[:1])),
                       ("cancel_task", lambda: bob.request("POST", f"/v1/tasks/{ids[0]}/cancel")),
                       ("cancel_group", lambda: bob.cancel_task_group(group)),
                       ("lease_group", lambda: bob.renew_task_group_lease(group, 0.5))):
        try:
            tries[name] = f"accepted: {call()}"
        except Exception as exc:  # noqa: BLE001
            tries[name] = f"{type(exc).__name__}: {str(exc)[:120]}"
    time.sleep(2)
    rows = _wait_rows(owner, ids, 120)
    values = [decode_row(r) for r in rows]
    hurt = [v for ok, v in values if v != "owner done"]
    record(se.mode, "bob cancels / leases the owner's tasks and task group", {"bob": tries, "owner_results": [str(v)[:80] for _, v in values]}, bool(hurt))
    assert not hurt and len(values) == 2, f"the owner's tasks were changed by another user: {values} ({tries})"


# ------------------------------------------------------------------------------------------------ 1: the channel


CHANNEL_CASES = ["pickle", "pickle_after_R", "garbage", "oversize", "negative", "huge_valid"]


@pytest.mark.parametrize("kind", CHANNEL_CASES)
def test_channel_frames_are_never_unpickled_and_end_only_that_worker(se, kind):
    marker = se.markers / f"agent-unpickled-{kind}"
    import pickle as _p

    evil = _p.dumps(payloads._R(os.system, (f"touch {marker}",)), protocol=2)
    fut = se.submit("bob", attacks.CHANNEL, kind, evil)
    try:
        r = fut.result(timeout=120)
        outcome = {"result": r}
    except Exception as exc:  # noqa: BLE001
        outcome = {"error": type(exc).__name__, "message": str(exc)[:300]}
    escaped = marker.exists()
    served = se.agent_alive() and se.owner_still_served()
    record(se.mode, f"write to the channel fd: {kind}", {**outcome, "agent_ran_pickle": escaped, "endpoint_serves": served}, escaped or not served)
    assert not escaped, "the agent unpickled a frame a worker wrote"
    assert served, "the endpoint stopped serving the owner"
    assert "error" in outcome and "malformed frame" in outcome.get("message", "") or kind == "huge_valid", outcome


def test_forged_result_for_another_users_task_is_refused(se):
    owner = se.clients["demo"]
    fid = owner.register_function(RUN)
    tid = owner.submit(se.ep, fid, "import time\ndef main():\n    time.sleep(6)\n    return 'real owner result'\n")
    time.sleep(1.5)  # let it start
    try:
        r = se.run("bob", attacks.CHANNEL, "forge_other", tid, timeout=90)
        outcome: Any = r
    except Exception as exc:  # noqa: BLE001
        outcome = f"{type(exc).__name__}: {str(exc)[:200]}"
    rows = owner.wait_results([tid], timeout_s=55)
    ok, value = decode_row(rows[0]) if rows else (None, None)
    record(se.mode, "forged result frame for the owner's running task id", {"bob": outcome, "owner_got": value}, value != "real owner result")
    assert value == "real owner result", f"the owner's task got {value!r}"


def test_tenant_failures_do_not_block_the_owners_function(se):
    """The scheduler blocks a function on an endpoint where it failed with ModuleNotFoundError,
    ImportError or MemoryError. A tenant's sandboxed task, sent to an explicit endpoint, must not
    take the owner's function (the same body: a library function by reference, an FL client, a
    common helper) off that endpoint for the owner's "auto" placement."""
    fn = runner_variant(f"shared-helper-{se.mode}")
    owner_ex = se.executor("demo", "auto")
    before = owner_ex.submit(fn, "def main():\n    return 'owner ok'\n").result(timeout=90)
    bob_ex = se.executor("bob")
    try:
        bob_ex.submit(fn, "def main():\n    import oa_no_such_module_xyz\n").result(timeout=90)
    except Exception as exc:  # noqa: BLE001
        bob_err = f"{type(exc).__name__}: {str(exc)[:120]}"
    time.sleep(1.0)
    try:
        after: Any = owner_ex.submit(fn, "def main():\n    return 'owner ok'\n").result(timeout=90)
    except Exception as exc:  # noqa: BLE001
        after = f"{type(exc).__name__}: {str(exc)[:300]}"
    record(se.mode, "tenant's ModuleNotFoundError blocks the owner's function (same body) for auto placement",
           {"owner_before": before, "bob": bob_err, "owner_after": after}, after != "owner ok")
    assert before == "owner ok"
    assert after == "owner ok", f"after one failure of bob's the owner cannot place the same function: {after}"


def test_forged_timestamps_do_not_break_the_hub(se):
    """A worker reports when its task started and finished; a tenant writes its own result frame
    with started=-1e308, finished=1e308 (each finite, their difference is not)."""
    attempts = []
    for _ in range(4):  # until one forged frame is taken (see _forge for why one may not be)
        try:
            attempts.append(se.run("bob", attacks.CHANNEL, "forge_own_times", [-1.0e308, 1.0e308], timeout=90))
        except Exception as exc:  # noqa: BLE001
            attempts.append(f"{type(exc).__name__}: {str(exc)[:120]}")
        if attempts.count(42) >= 2:
            break
    time.sleep(1.0)
    owner = se.clients["demo"]
    checks: dict[str, Any] = {}
    for name, call in (("list_endpoints", lambda: owner.list_endpoints()),
                       ("scheduler_decisions", lambda: owner.scheduler_decisions(limit=5)),
                       ("bob_scheduler_decisions", lambda: se.clients["bob"].scheduler_decisions(limit=5)),
                       ("owner_task", lambda: se.owner_still_served()),
                       ("owner_auto_new_function", lambda: se.executor("demo", "auto").submit(
                           runner_variant(f"ts-{se.mode}-{os.getpid()}"), "def main():\n    return 5\n").result(timeout=60))):
        try:
            call()
            checks[name] = "ok"
        except Exception as exc:  # noqa: BLE001
            checks[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    broken = {k: v for k, v in checks.items() if v != "ok"}
    poisoned: list[str] = []
    with contextlib.suppress(Exception):  # white box: the in-process hub's scheduler state
        txt = json.dumps(se.mesh.hub.hub.placement.sched.to_dict(), default=str)
        poisoned = [txt[max(0, m.start() - 120):m.start() + 12] for m in re.finditer("Infinity|NaN", txt)][:3]
    record(se.mode, "result frames with started=-1e308, finished=1e308 (scheduler profiles)",
           {"bob": attempts, "checks": checks, "scheduler_state_inf": poisoned}, bool(broken or poisoned))
    assert not poisoned, f"the hub's scheduler learnt an infinite time from a tenant's result: {poisoned[:1]}; checks: {checks}"
    assert not broken, f"hub calls broke after a result with extreme timestamps: {broken}"


# ------------------------------------------------------------------------------------------------ 8: the SDK's decoder


_VICTIM = r'''
import json, sys
from cloud_hub.client import Client
url, token, tid = sys.argv[1:4]
try:
    v = Client(url, token).get_result(tid, timeout_s=60)
    try:
        import numpy as np
        if isinstance(v, np.ndarray):
            v.sum(); repr(v)
    except Exception:
        pass
    print(json.dumps({"ok": True, "type": type(v).__name__}))
except BaseException as e:
    print(json.dumps({"ok": False, "exc": type(e).__name__, "msg": str(e)[:600]}))
'''


def _victim_decodes(se: SharedEndpoint, user: str, tid: str) -> dict[str, Any]:
    """The user's SDK, in a process of its own (a crash there is a result, not a dead test run)."""
    p = subprocess.run([sys.executable, "-c", _VICTIM, se.mesh.url, se.tokens[user], tid], capture_output=True, text=True,
                       timeout=120, cwd=str(REPO))
    line = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        out = json.loads(line)
    except ValueError:
        out = {"ok": None, "stdout": p.stdout[-300:]}
    out["rc"] = p.returncode
    if p.returncode != 0:
        out["stderr"] = p.stderr[-500:]
    return out


def _forge(se: SharedEndpoint, user: str, ok: bool, data: bytes) -> str:
    """A task whose stored result is exactly ``data`` (written to the channel by the task itself).
    The worker exits a second after forging, which may take the next task dispatched to it along:
    such a task simply tries again."""
    c = se.clients[user]
    fid = c.register_function(RUN)
    for _ in range(5):
        tid = c.submit(se.ep, fid, attacks.CHANNEL, "forge_own", [ok, data])
        rows = _wait_rows(c, [tid], 90)
        if rows and base64.b64decode(rows[0]["data"]) == data:
            return tid
    raise AssertionError("could not get a forged result stored")


def _wait_rows(c: Any, ids: list[str], timeout: float) -> list[dict[str, Any]]:
    """Result rows of all ``ids`` (the hub answers as soon as some are done)."""
    got: dict[str, dict[str, Any]] = {}
    end = time.monotonic() + timeout
    while len(got) < len(ids) and time.monotonic() < end:
        for r in c.wait_results([i for i in ids if i not in got], timeout_s=min(30, max(1, end - time.monotonic()))):
            got[r["task_id"]] = r
    return [got[i] for i in ids if i in got]


@pytest.mark.parametrize("victim", ["bob_shared", "owner_untrusted"])
def test_hostile_results_are_data_only(se, victim):
    marker = str(se.markers / f"sdk-{victim}")
    user = "bob" if victim == "bob_shared" else "demo"
    if victim == "owner_untrusted":
        se.clients["demo"].set_endpoint_trusted(se.ep, False)
    got: dict[str, Any] = {}
    try:
        for name, data in payloads.code_payloads(marker).items():
            got[name] = _victim_decodes(se, user, _forge(se, user, True, data))
        for name, data in payloads.error_payloads(marker).items():
            got["error:" + name] = _victim_decodes(se, user, _forge(se, user, False, data))
        for name, data in payloads.dos_payloads().items():
            got["dos:" + name] = _victim_decodes(se, user, _forge(se, user, True, data))
        got["control:numpy_data"] = _victim_decodes(se, user, _forge(se, user, True, payloads.data_payload()))
    finally:
        if victim == "owner_untrusted":
            se.clients["demo"].set_endpoint_trusted(se.ep, True)
    ran = sorted(p.name for p in se.markers.iterdir() if p.name.startswith(f"sdk-{victim}"))
    crashed = {k: v for k, v in got.items() if v["rc"] != 0}
    unpickled = {k: v for k, v in got.items() if k in payloads.code_payloads("x") and v.get("exc") != "UntrustedResult"}
    bad_exc = {k: v for k, v in got.items() if k.startswith("error:") and v.get("exc") in ("SystemExit", "KeyboardInterrupt", "GeneratorExit")}
    setting = "trusted_endpoints" if user == "bob" else "set_endpoint_trusted"
    unnamed = {k: v for k, v in got.items() if v.get("exc") == "UntrustedResult" and setting not in v.get("msg", "")}
    escape = bool(ran or crashed or unpickled or bad_exc)
    record(se.mode, f"crafted results decoded by the SDK ({victim})", got, escape)
    assert got["control:numpy_data"].get("type") == "dict", got["control:numpy_data"]
    assert not ran, f"code from a result ran in the user's process: {ran}"
    assert not crashed, f"the user's process crashed decoding: {crashed}"
    assert not unpickled, f"not refused as UntrustedResult: {unpickled}"
    assert not bad_exc, f"exceptions that end a program were raised in the user's process: {bad_exc}"
    assert not unnamed, f"UntrustedResult without naming {setting}: {unnamed}"


def test_rejected_frames_are_counted_per_endpoint_and_reason(se):
    """A thief with the device's broker login publishes junk and forged frames on its up topic."""
    if se.mode != "root":
        pytest.skip("hub-side check: once is enough")
    import httpx
    import paho.mqtt.client as mqtt

    from mesh_agent.protocol.envelope import Envelope, Kind, encode

    creds = se.credentials()
    ep = creds["endpoint_id"]
    good_key = bytes.fromhex(creds["key"])
    frames = {
        "malformed": b"\x00\x01 not a frame at all",
        "bad_mac": encode(Envelope(Kind.HEARTBEAT, ep, {"x": 1}), os.urandom(32)),
        "wrong_direction": encode(Envelope(Kind.TASKS, ep, {"tasks": []}), good_key),
        "stale": encode(Envelope(Kind.HEARTBEAT, ep, {"x": 1}, ts=time.time() - 3600, exp=time.time() - 3500), good_key),
    }
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"thief-{os.getpid()}")
    c.username_pw_set(creds["mqtt_username"], creds["mqtt_password"])
    c.connect("127.0.0.1", se.mesh.broker.port)
    c.loop_start()
    try:
        for f in frames.values():
            c.publish(f"mesh/ep/{ep}/up", f, qos=1).wait_for_publish(10)
    finally:
        time.sleep(1.0)
        c.loop_stop()
        c.disconnect()

    def counters() -> dict[str, float]:
        text = httpx.get(f"{se.mesh.url}/metrics", timeout=10).text
        out = {}
        for m in re.finditer(r'mesh_frames_rejected_total\{([^}]*)\}\s+([0-9.e+]+)', text):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.get("endpoint") == ep:
                out[labels.get("reason", "?")] = float(m.group(2))
        return out

    wait_for(lambda: set(frames) <= set(counters()), 15)
    got = counters()
    missing = sorted(set(frames) - set(got))
    record(se.mode, "junk and forged frames from a stolen device login -> /metrics", got, bool(missing))
    assert not missing, f"rejected frames not counted by endpoint and reason: missing {missing}, have {got}"
    assert se.agent_alive() and se.owner_still_served()


# ------------------------------------------------------------------------------------------------ the endpoint keeps serving


def test_fork_bomb_stops_at_the_limit_and_owner_is_served(se):
    before = len(nobody_processes()) if se.mode == "root" else None
    fut = se.submit("bob", attacks.FORK_BOMB, 8)
    time.sleep(3)
    t0 = time.monotonic()
    served = se.owner_still_served(timeout=60)
    owner_latency = time.monotonic() - t0
    try:
        r: Any = fut.result(timeout=120)
    except Exception as exc:  # noqa: BLE001
        r = f"{type(exc).__name__}: {str(exc)[:200]}"
    left = wait_for(lambda: len(nobody_processes()) <= (before or 0) + 3, 30) if se.mode == "root" else True
    record(se.mode, "fork bomb", {"bomb": r, "owner_served": served, "owner_latency_s": round(owner_latency, 1), "cleaned": left}, not served)
    assert served and se.agent_alive()
    assert isinstance(r, dict) and r["forked"] <= 256, r
    assert left, "fork bomb processes left behind"


def test_kill_everything_in_sight(se):
    try:
        r: Any = se.run("bob", attacks.KILL_ALL, timeout=60)
    except Exception as exc:  # noqa: BLE001
        r = f"{type(exc).__name__}: {str(exc)[:200]}"
    alive = se.agent_alive() and se.owner_still_served()
    record(se.mode, "kill(-1, SIGKILL) from inside", {"result": r, "agent_and_owner_fine": alive}, not alive)
    assert alive


def test_scratch_space_is_bounded(se):
    r = se.run("bob", attacks.FILL_TMP, 160, timeout=180)
    over = {k: v["bytes"] >> 20 for k, v in r.items() if k != "tmp" and v["bytes"] > (64 << 20 if k == "dev_shm" else 0)}
    bounded = r["tmp"]["stopped"] == "ENOSPC" and r["tmp"]["bytes"] <= 64 << 20
    served = se.owner_still_served()
    record(se.mode, "fill /tmp (64 MB) and other tmpfs (/dev/shm, /dev, /)", {**r, "owner_served": served}, bool(over) or not bounded)
    assert served and bounded, r
    assert not over, f"RAM-backed space beyond the /tmp bound written (MB): {over}"


def test_memory_limit_holds(se):
    r = se.run("bob", attacks.MEMORY, 512, timeout=120)
    escaped = bool(r.get("allocated_after_raise_mb"))
    record(se.mode, "raise RLIMIT_AS soft limit to the hard limit, then allocate 512 MB (limit 256 MB)", r, escaped)
    assert se.owner_still_served()
    assert not escaped, f"the memory limit is only a soft limit the task raises itself: {r}"


def test_stdout_flood_is_bounded_and_attributed(se):
    marker = f"oa-flood-{se.mode}-{os.getpid()}"
    size_before = se.agent.log_path.stat().st_size
    fut = se.submit("bob", attacks.FLOOD_OUTPUT, 30, marker)
    r = fut.result(timeout=180)
    served = se.owner_still_served()
    time.sleep(1)
    with open(se.agent.log_path, "rb") as f:
        f.seek(size_before)
        new = f.read().decode(errors="replace")
    mine = [ln for ln in new.splitlines() if "task " in ln and ("AAAA" in ln or marker in ln)]
    raw_ctl = [ln for ln in new.splitlines() if marker in ln and any(c in ln for c in "\x1b\x00\x07\r")]
    forged_start = [ln for ln in new.splitlines() if ln.startswith(marker)]
    logged = sum(len(ln) for ln in mine)
    reopened_is_pipe = r["fd1"].startswith("pipe:")  # and reopening it by path gives that pipe or nothing
    escape = logged > 64 * 1024 or bool(raw_ctl) or bool(forged_start) or not reopened_is_pipe or not served
    record(se.mode, "30 MB of stdout, control characters, a forged log line, /proc/self/fd/1 reopened",
           {"fds": r, "log_bytes_for_task": logged, "raw_control_chars": raw_ctl[:2], "forged_line_start": forged_start[:2],
            "growth": len(new)}, escape)
    assert served and reopened_is_pipe
    assert logged <= 64 * 1024, f"{logged} bytes of one task's output in the agent's log"
    assert not raw_ctl and not forged_start
    assert any(f"task {fut.task_id}" in ln for ln in mine), "output not attributed to the task"  # type: ignore[attr-defined]


def test_tenants_cannot_see_each_other(se):
    secret = f"bob-secret-{os.urandom(6).hex()}"
    w = se.submit("bob", attacks.TMP_SECRET_WRITER, secret, 10)
    time.sleep(2)
    r = se.run("carol", attacks.TMP_SECRET_READER, secret, 8, timeout=120)
    w.result(timeout=120)
    record(se.mode, "carol scans /tmp, /dev/shm, / and /proc while bob's task holds a secret", r, bool(r["found"]))
    assert not r["found"], f"carol found bob's secret: {r['found']}"


# ------------------------------------------------------------------------------------------------ 2: another user's pip environment


def test_pth_in_a_wheel_runs_only_inside_the_locked_sandbox(se):
    r = se.run("bob", attacks.PTH_CHECK, environment={"pip": ["oapth"]}, timeout=180)
    host = (se.markers / "pth-host").exists()
    locked = "Seccomp:\t2" in r["pth_log"] and "NoNewPrivs:\t1" in r["pth_log"] and "uid=0 " not in r["pth_log"] \
        and "CapEff:\t0000000000000000" in r["pth_log"]
    record(se.mode, "wheel with a .pth file", {**r, "host_marker": host}, host or not locked)
    assert not host, "the .pth ran where it could write on the host"
    assert locked, f".pth ran before the lockdown: {r}"


@pytest.mark.parametrize("pkg", ["oatrav", "oalink"])
def test_wheel_cannot_write_outside_its_venv(se, pkg):
    try:
        r: Any = se.run("bob", "def main():\n    return 'installed'\n", environment={"pip": [pkg]}, timeout=180)
    except Exception as exc:  # noqa: BLE001
        r = f"{type(exc).__name__}: {str(exc)[:300]}"
    out = sorted(p.name for p in se.markers.iterdir() if p.name.startswith(("traversal", "escaped")))
    out += ["escaped-via-symlink"] if (se.markers / "escaped-via-symlink").exists() else []
    record(se.mode, f"malicious wheel at install time ({pkg}: {'../ paths' if pkg == 'oatrav' else 'symlink entry'})", {"task": r, "written": out}, bool(out))
    assert not out, f"the installer wrote outside the venv: {out}"


def test_sdist_build_backend_never_runs_for_another_user(se):
    marker = se.markers / "sdist-backend-ran"
    try:
        r: Any = se.run("bob", "def main():\n    return 'built'\n", environment={"pip": ["oasdist"]}, timeout=240)
    except Exception as exc:  # noqa: BLE001
        r = f"{type(exc).__name__}: {str(exc)[:400]}"
    ran = marker.exists()
    clear = isinstance(r, str) and "EnvError" in r and "wheel" in r
    record(se.mode, "sdist with an in-tree build backend requested by a tenant", {"task": r, "backend_ran": ran}, ran or not clear)
    assert not ran, f"the tenant's build backend ran outside the sandbox: {marker.read_text()[:300]}"
    assert clear, f"no clear wheels-only error: {r}"
    # control: the owner's own spec may build from source, which proves the backend was runnable
    with contextlib.suppress(Exception):
        se.run("demo", "def main():\n    return 'built'\n", environment={"pip": ["oasdist"]}, timeout=240)
    record(se.mode, "control: owner builds the same sdist (backend allowed for the owner)", {"backend_ran": marker.exists()}, False)


# ------------------------------------------------------------------------------------------------ 6: no sandbox, no run


def test_task_fails_closed_where_the_sandbox_cannot_start(se, tmp_path):
    if se.mode != "root":
        pytest.skip("one broken deployment is enough")
    fake = Path(tempfile.mkdtemp(prefix="oa-fakebin-", dir="/tmp"))
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: simulated: No permissions to create new namespace' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    agent = se.add_broken_agent(fake)
    marker = se.markers / "ran-unsandboxed"
    try:
        r: Any = se.run("bob", attacks.HOST_WRITE, str(marker), endpoint=agent.endpoint_id, timeout=120)
    except Exception as exc:  # noqa: BLE001
        r = f"{type(exc).__name__}: {str(exc)[:400]}"
    owner = se.run("demo", "def main():\n    return 'owner ok'\n", endpoint=agent.endpoint_id, timeout=120)
    shutil.rmtree(fake, ignore_errors=True)
    record(se.mode, "bubblewrap cannot start: tenant task", {"task": r, "marker": marker.exists(), "owner": owner}, marker.exists())
    assert not marker.exists(), "the tenant's task ran unsandboxed"
    assert "EnvError" in str(r) and "cannot start" in str(r) and "simulated" in str(r), r
    assert owner == "owner ok"


# ------------------------------------------------------------------------------------------------ a tenant's own network grant


def test_network_is_not_the_tenants_to_grant(se):
    """``network: true`` is part of the spec a tenant sends; the owner cannot refuse it. Then the
    sandbox shares the host's network namespace: the owner's loopback services, AF_UNIX sockets."""
    hub_port = int(se.mesh.url.rsplit(":", 1)[1])
    r = se.run("bob", attacks.NETWORK_PROBE, hub_port, environment={"network": True}, timeout=120)
    got_metrics = "mesh_" in r["hub_metrics"]
    names_owner = se.ep in r["hub_metrics"]
    record(se.mode, "tenant grants itself network: hub /metrics on loopback, AF_UNIX, host ports",
           {"metrics_read": got_metrics, "metrics_name_owner_endpoint": names_owner, "af_unix": r["af_unix"],
            "bound_host_port": r["bound_host_port"], "proc_net_tcp_lines": len(str(r.get("proc_net_tcp", "")).splitlines())},
           got_metrics)
    assert not got_metrics, "a tenant who grants itself network reads the owner's hub metrics over loopback"


# ------------------------------------------------------------------------------------------------ 7: plaintext and secrets


def _agent_start_with(se: SharedEndpoint, tmp: Path, **changes: Any) -> subprocess.CompletedProcess[str]:
    import yaml

    cfg = yaml.safe_load(se.agent.config_path.read_text())
    for k, v in changes.items():
        node = cfg
        *path, last = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = v
    cfg["data_dir"] = str(tmp / "data")
    creds = tmp / "c.credentials.json"
    shutil.copy(se.agent.cfg.credentials_file, creds)
    cfg["credentials_file"] = str(creds)
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return _run_bounded([sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(path)], 30)


def _run_bounded(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run; a command still running at ``timeout`` (it accepted the config) is killed, rc None."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, p.returncode, out, err)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, err = p.communicate(timeout=20)
        return subprocess.CompletedProcess(argv, None, out, err)  # type: ignore[arg-type]


def test_plaintext_addresses_are_refused(se, tmp_path):
    if se.mode != "root":
        pytest.skip("config checks: once is enough")
    secret = se.credentials()["mqtt_password"]
    cases = {
        "mqtt.host": {"mqtt.host": "broker.example.org"},
        "mqtt.hosts[1]": {"mqtt.hosts": ["127.0.0.1:1883", "10.9.8.7:1883"]},
        "hub_url": {"hub_url": "http://hub.example.org:8700"},
        "environments.index_url": {"environments.index_url": "http://u:pw-in-url@pypi.example.org/simple"},
        "environments.find_links[0]": {"environments.find_links": ["http://u:pw-in-url@wheels.example.org/"]},
        "mqtt.host ipv4-mapped": {"mqtt.host": "::ffff:10.1.2.3"},
    }
    got = {}
    for name, ch in cases.items():
        d = tmp_path / re.sub(r"\W", "_", name)
        d.mkdir()
        p = _agent_start_with(se, d, **ch)
        text = p.stdout + p.stderr
        got[name] = {"rc": p.returncode, "out": text.strip()[-300:], "leaks_password": "pw-in-url" in text or secret in text}
    refused = {k: v for k, v in got.items() if v["rc"] == 2 and "refused" in v["out"]}
    # the hub's own broker link: a broker on another machine, with a password, without TLS
    env = dict(os.environ, MESH_HUB_MQTT_USERNAME="mesh-hub", MESH_HUB_MQTT_PASSWORD="hub-broker-pw-123")
    hub = subprocess.Popen([sys.executable, "-m", "cloud_hub.cli", "serve", "--db", str(tmp_path / "h.sqlite3"), "--port", "0",
                            "--mqtt-host", "192.0.2.10", "--zmq-bind", "tcp://127.0.0.1:*"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO))
    try:
        out, _ = hub.communicate(timeout=8)
        hub_refused = hub.returncode not in (None, 0) and "plaintext" in out.lower()
    except subprocess.TimeoutExpired:
        hub.terminate()
        out, _ = hub.communicate(timeout=20)
        hub_refused = False
    got["hub: MESH_HUB_MQTT_HOST=192.0.2.10 without TLS"] = {"refused": hub_refused, "out": out.strip()[-400:]}
    not_refused = sorted(set(cases) - set(refused))
    leaks = [k for k, v in got.items() if v.get("leaks_password")]
    record(se.mode, "plaintext broker/hub addresses (agent config keys; the hub's own broker link)", got,
           bool(not_refused or leaks or not hub_refused))
    assert not leaks, f"a password printed: {leaks}"
    assert not not_refused, f"plaintext not refused: {not_refused}: {got}"
    assert hub_refused, f"the hub dials a broker on another machine in plaintext with its password: {out[-300:]}"


def test_reprs_cli_and_logs_keep_secrets(se, tmp_path):
    if se.mode != "root":
        pytest.skip("once is enough")
    from cloud_hub.config import HubConfig
    from mesh_agent.config import AgentConfig, Credentials

    creds = se.credentials()
    c = Credentials.model_validate(creds)
    a = AgentConfig.model_validate({**json.loads(se.agent.cfg.model_dump_json()),
                                    "environments": {"index_url": "https://u:idx-secret-pw@pypi.example.org/simple"}})
    h = HubConfig(db_path=tmp_path / "x.sqlite3", mqtt_password="hub-mqtt-secret-1", metrics_token="metrics-secret-2",
                  database_url="postgresql://u:db-secret-3@db/x")
    texts = {"Credentials": repr(c) + str(c), "AgentConfig": repr(a) + str(a), "HubConfig": repr(h) + str(h)}
    # an unexpected failure inside each CLI while a local variable holds a secret: shown locals would print it
    agent_cli = (
        "import sys, mesh_agent.cli as c\n"
        "def boom(cfg):\n"
        "    secret_in_a_local = open(str(cfg.credentials_file)).read()\n"
        "    raise RuntimeError('unexpected failure ' + str(len(secret_in_a_local)))\n"
        "c._store_view = boom\n"
        f"sys.argv = ['mesh-agent', 'status', '--config', {str(se.agent.config_path)!r}]\n"
        "c.app()\n"
    )
    p = _run_bounded([sys.executable, "-c", agent_cli], 60)
    texts["mesh-agent cli, unexpected error"] = f"rc={p.returncode}\n" + p.stdout + p.stderr
    hub_cli = (
        "import sys, cloud_hub.cli as c\n"
        "def boom(*a, **k):\n"
        f"    token_in_a_local = {se.tokens['demo']!r}\n"
        "    raise RuntimeError('unexpected failure')\n"
        "c._store_cli = boom\n"
        f"sys.argv = ['mesh-hub', 'token', 'ls', '--db', {str(se.hub_db)!r}]\n"
        "c.app()\n"
    )
    p = _run_bounded([sys.executable, "-c", hub_cli], 60)
    texts["mesh-hub cli, unexpected error"] = f"rc={p.returncode}\n" + p.stdout + p.stderr
    texts["agent log"] = se.agent_log()
    secrets = [creds["key"], creds["mqtt_password"], "idx-secret-pw", "hub-mqtt-secret-1", "metrics-secret-2", "db-secret-3",
               se.tokens["demo"]]
    leaked = {name: [s[:6] + "..." for s in secrets if s in t] for name, t in texts.items()}
    leaked = {k: v for k, v in leaked.items() if v}
    locals_shown = [k for k, t in texts.items() if "cli" in k and (re.search(r"─ locals ─|secret_in_a_local\s*[=│]|token_in_a_local\s*[=│]", t))]
    record(se.mode, "secrets in reprs, CLI failures and the agent log", {"leaked": leaked, "locals": locals_shown,
                                                                           "agent_cli_tail": texts["mesh-agent cli, unexpected error"][-400:],
                                                                           "hub_cli_tail": texts["mesh-hub cli, unexpected error"][-400:]},
           bool(leaked or locals_shown))
    assert not leaked, f"secrets shown: {leaked}"
    assert not locals_shown
