"""Resource limits (issue 25, item 6): a fork bomb inside the sandbox is contained and the owner is
still served; filling /tmp is bounded (a tmpfs with a size limit, not the agent's disk); the memory
limit holds, also against a function that tries to raise it."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.security.conftest import MEMORY_LIMIT_MB, SharedEndpoint, owner_probe
from tests.security.probes import run_in_child, run_native

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

#: at most this many processes may a sandbox hold at once (the attack tries FORK_ATTEMPT)
FORK_LIMIT = 1024
FORK_ATTEMPT = 4096
#: the largest private /tmp a sandbox may get (RAM on a Pi); larger counts as unbounded
MAX_SCRATCH_BYTES = 2 << 30


def fork_bomb(helper: bytes, attempt: int, hold_s: int, token: str) -> dict[str, Any]:
    import json

    r = run_native(helper, ["forkhold", str(attempt), str(hold_s)], timeout=hold_s + 90, argv0=token)
    try:
        r["result"] = json.loads(r.get("stdout", "").strip().splitlines()[0])
    except (ValueError, IndexError):
        pass
    return r


def spawn_one() -> dict[str, Any]:
    import subprocess

    try:
        subprocess.run(["true"], check=True, timeout=30)
        return {"spawned": True}
    except Exception as exc:  # noqa: BLE001
        return {"spawned": False, "error": f"{type(exc).__name__}: {exc}"}


def fill_tmp(max_bytes: int) -> dict[str, Any]:
    import errno
    import os

    st = os.statvfs("/tmp")
    out: dict[str, Any] = {"size": st.f_blocks * st.f_frsize}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == "/tmp":
                sep = parts.index("-")
                out["mount"] = {"fstype": parts[sep + 1], "options": parts[sep + 3]}
    if out["size"] <= max_bytes:  # only then fill it: an unbounded one would take the machine's RAM or disk
        chunk = b"\xa5" * (1 << 20)
        written = 0
        fd = os.open("/tmp/mesh-sec-fill", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while written < max_bytes + (64 << 20):
                try:
                    written += os.write(fd, chunk)
                except OSError as exc:
                    out["stopped_by"] = errno.errorcode.get(exc.errno or 0, str(exc))
                    break
        finally:
            os.close(fd)
            os.unlink("/tmp/mesh-sec-fill")
        out["written"] = written
    return out


def exceed_memory(target_mb: int) -> dict[str, Any]:
    """Raise the address-space limit as far as it goes, then touch ``target_mb`` (in a forked child,
    so that the worker keeps the limits it had)."""

    def attempt() -> dict[str, Any]:
        import mmap
        import resource

        out: dict[str, Any] = {"before": resource.getrlimit(resource.RLIMIT_AS)}
        _soft, hard = out["before"]
        for want in ((hard, hard), (resource.RLIM_INFINITY, resource.RLIM_INFINITY)):
            try:
                resource.setrlimit(resource.RLIMIT_AS, want)
                out.setdefault("raised_to", []).append(list(want))
            except (ValueError, OSError) as exc:
                out.setdefault("raise_errors", []).append(f"{type(exc).__name__}: {exc}")
        out["after"] = resource.getrlimit(resource.RLIMIT_AS)
        blocks = []
        touched = 0
        try:
            while touched < target_mb:
                m = mmap.mmap(-1, 64 << 20)
                for i in range(0, 64 << 20, 4096):
                    m[i] = 1
                blocks.append(m)
                touched += 64
        except (MemoryError, OSError) as exc:
            out["stopped_by"] = f"{type(exc).__name__}: {exc}"
        out["touched_mb"] = touched
        for m in blocks:
            m.close()
        return out

    return run_in_child(attempt, timeout=120)


def writable_places(dirs: list[str]) -> dict[str, Any]:
    """Where a file can be created, and how big that filesystem says it may grow."""
    import os

    out: dict[str, Any] = {}
    for d in dirs:
        p = os.path.join(d, f".mesh-sec-probe-{os.getpid()}")
        try:
            with open(p, "w") as f:
                f.write("x")
            os.unlink(p)
        except OSError:
            continue
        st = os.statvfs(d)
        out[d] = st.f_blocks * st.f_frsize
    return out


def _host_procs(token: str) -> int:
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "cmdline").read_bytes().startswith(token.encode()):
                    n += 1
            except OSError:
                pass
    return n


def _start_bomb(shared: SharedEndpoint, hold_s: int) -> tuple[Any, Any, str, int]:
    if shared.helper is None:
        pytest.skip("no C compiler for the fork-bomb helper")
    token = f"mesh-sec-bomb-{uuid.uuid4().hex[:10]}"
    ex, fut = shared.submit("b", fork_bomb, shared.helper, FORK_ATTEMPT, hold_s, token, task_timeout_s=hold_s + 120)
    # Wait until the bomb has made all the processes it can: the count on the host stops growing.
    deadline = time.monotonic() + 90
    peak, stable_since = 0, time.monotonic()
    while time.monotonic() < deadline and not fut.done():
        n = _host_procs(token)
        if n > peak:
            peak, stable_since = n, time.monotonic()
        elif peak >= 50 and time.monotonic() - stable_since > 1.5:
            break
        time.sleep(0.1)
    return ex, fut, token, peak


def test_fork_bomb_is_contained_and_the_owner_is_still_served(shared: SharedEndpoint) -> None:
    ex, fut, token, peak = _start_bomb(shared, hold_s=20)
    owner = shared.run("a", owner_probe, str(shared.key_file), timeout=60, task_timeout_s=45)
    peak = max(peak, _host_procs(token))
    bomb = shared.wait(ex, fut, 180)
    assert owner.ok, f"the owner's task (which starts a process) failed while a sandbox held a fork bomb: {owner.describe()}"
    forked = (bomb.value or {}).get("result", {}).get("forked") if bomb.ok else None
    assert peak <= FORK_LIMIT + 2, f"a sandbox held {peak} processes at once on the host (limit {FORK_LIMIT})"
    assert forked is not None, f"the fork bomb did not report (so its limit is unknown): {bomb.describe()}"
    assert forked < FORK_LIMIT, f"a sandbox forked {forked} processes (tried {FORK_ATTEMPT}); not contained"


def test_fork_bomb_by_one_tenant_does_not_stop_another_tenant(shared: SharedEndpoint) -> None:
    ex, fut, _token, peak = _start_bomb(shared, hold_s=20)
    other = shared.run("c", spawn_one, timeout=90, task_timeout_s=60)
    shared.wait(ex, fut, 180)
    assert peak >= 50, "the fork bomb never got going, so this proved nothing"
    assert other.ok and other.value["spawned"], \
        f"while B's sandbox held a fork bomb, C's sandboxed task could not start a process: {other.describe()}"


def test_tmp_is_a_size_limited_tmpfs_and_filling_it_spares_the_agents_disk(shared: SharedEndpoint) -> None:
    st0 = os.statvfs(shared.data_dir)
    seen = shared.run("b", fill_tmp, MAX_SCRATCH_BYTES, timeout=240, task_timeout_s=180).expect()
    st1 = os.statvfs(shared.data_dir)
    lost_mb = (st0.f_bavail - st1.f_bavail) * st0.f_frsize / 2**20
    assert seen.get("mount", {}).get("fstype") == "tmpfs", f"the sandbox's /tmp is not a private tmpfs: {seen}"
    assert seen["size"] <= MAX_SCRATCH_BYTES, (f"the sandbox's /tmp may grow to {seen['size'] / 2**30:.1f} GiB "
                                               f"(no size limit worth the name): {seen}")
    assert seen.get("stopped_by") == "ENOSPC" and seen["written"] <= seen["size"] + (1 << 20), \
        f"filling the sandbox's /tmp did not stop at its size: {seen}"
    assert lost_mb < 64, f"filling a sandbox's /tmp took {lost_mb:.0f} MiB of the agent's disk"


def test_memory_limit_cannot_be_raised_or_exceeded(shared: SharedEndpoint) -> None:
    target = 2 * MEMORY_LIMIT_MB
    out = shared.run("b", exceed_memory, target, timeout=180, task_timeout_s=150)
    if out.ok:  # (a worker killed for its memory is a limit that held)
        seen = out.value.get("value", out.value)
        assert seen.get("touched_mb", 0) < target, (
            f"a sandboxed task raised its memory limit ({MEMORY_LIMIT_MB} MB, the engine's memory_limit_mb) and "
            f"touched {seen.get('touched_mb')} MB: {seen}")


def test_no_unbounded_writable_filesystem_besides_tmp(shared: SharedEndpoint) -> None:
    """The 64 MB /tmp is only a bound if nothing else in the sandbox takes writes: the sandbox's
    own root, /etc, /dev, /dev/shm (tmpfs without a size: half the machine's RAM each)."""
    dirs = ["/", "/etc", "/dev", "/dev/shm", "/usr", "/proc", "/sys", "/run", "/var", "/var/tmp", "/home", "/root",
            *shared.runtime_paths]
    seen = shared.run("b", writable_places, dirs).expect()
    big = {d: f"{n / 2**30:.1f} GiB" for d, n in seen.items() if n > MAX_SCRATCH_BYTES}
    assert not big, f"a sandboxed task can write to RAM- or disk-backed filesystems without a useful size limit: {big}"


def test_fork_bomb_cannot_make_another_tenants_new_environment_fail_for_good(shared: SharedEndpoint) -> None:
    """C asks for an environment no worker is warm for (a fresh variable), while B's bomb holds every
    process its uid may have. Whatever C's first task gets, once the bomb is over the same spec must
    run: a sandbox that could not start during the bomb must not be remembered as failed."""
    env = {"env_vars": {"SEC_NONCE": uuid.uuid4().hex}}
    ex, fut, _token, peak = _start_bomb(shared, hold_s=25)
    during = shared.run("c", spawn_one, environment=env, timeout=150, task_timeout_s=60)
    shared.wait(ex, fut, 180)
    assert peak >= 50, "the fork bomb never got going, so this proved nothing"
    after = shared.run("c", spawn_one, environment=env, timeout=150, task_timeout_s=60)
    assert after.ok and after.value["spawned"], (
        f"after B's fork bomb was over, C's environment still does not run: {after.describe()} "
        f"(during the bomb: {during.describe()})")
