"""Builds and what a tenant's pip environment brings onto the host (issue 25, item 2).

1. A source distribution's build backend never runs outside the sandbox. The endpoint's
   ``find_links`` holds ``hostilepkg-1.0.tar.gz`` (no wheel of it exists): its in-tree backend
   appends a line to a host marker file and reads the agent's key as soon as any frontend imports
   it (tests/security/packages.py). Either the build runs inside the sandbox or the endpoint takes
   wheels only for tenants and fails the task with a clear error naming the package.
2. Even a wheel (nothing runs at install) puts files the tenant chose on the host, at a path the
   tenant can learn. Nothing the tenant controls may make the agent, bubblewrap or the lockdown
   load them outside the sandbox or before it is locked down (``env_vars: {LD_AUDIT: ...}``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.security.conftest import SharedEndpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def what_the_build_saw() -> dict[str, Any]:
    import hostilepkg

    return dict(hostilepkg.BUILD_SAW)


def toy_version() -> str:
    import meshtoy

    return meshtoy.VERSION


def test_sdist_build_backend_of_a_tenant_never_runs_outside_the_sandbox(shared: SharedEndpoint) -> None:
    out = shared.run("b", what_the_build_saw, environment={"pip": ["hostilepkg==1.0"]}, timeout=400, task_timeout_s=120)
    ran = shared.build_marker.read_text() if shared.build_marker.exists() else ""
    assert shared.key_hex not in ran, f"A TENANT'S BUILD BACKEND READ THE AGENT'S KEY on the host: {ran[:500]}"
    assert not ran, f"a tenant's sdist build backend ran outside the sandbox (it wrote the host marker): {ran[:500]}"
    if out.ok:  # built inside the sandbox: what the backend saw there
        assert out.value.get("key") is None, f"the build inside the sandbox read the agent's key: {out.value}"
        assert not out.value.get("marker_written"), f"the build inside the sandbox wrote a host file: {out.value}"
    else:
        msg = str(out.error)
        assert not out.timed_out, "the task with an sdist-only requirement never got an answer"
        assert "hostilepkg" in msg and any(w in msg.lower() for w in ("wheel", "source distribution", "sdist", "binary")), \
            f"an sdist-only requirement must fail with a clear error naming the package and why: {msg[:800]}"


def test_wheel_environment_of_a_tenant_still_builds_and_runs(shared: SharedEndpoint) -> None:
    """Control: wheels-only or sandboxed builds still give a tenant a working pip environment."""
    out = shared.run("c", toy_version, environment={"pip": ["meshtoy==1.0"]}, timeout=400, task_timeout_s=120)
    assert out.ok and out.value == "1.0", f"a tenant's pip environment from a wheel does not work: {out.describe()}"


def host_paths_in_my_venv(needle: str) -> dict[str, Any]:
    """Look through the venv this task runs in for host paths (scripts, pyvenv.cfg, RECORD files)."""
    import os
    import sys

    hits: dict[str, str] = {}
    for root, _dirs, files in os.walk(sys.prefix):
        for n in files:
            p = os.path.join(root, n)
            try:
                with open(p, "rb") as f:
                    data = f.read(1 << 20)
            except OSError:
                continue
            i = data.find(needle.encode())
            if i >= 0:
                hits[p] = data[max(0, i - 80):i + 160].decode(errors="replace")
            if len(hits) >= 5:
                return {"prefix": sys.prefix, "hits": hits}
    return {"prefix": sys.prefix, "hits": hits}


def audit_library_path() -> str:
    import os

    import auditlib

    return os.path.join(os.path.dirname(auditlib.__file__), "mesh_sec_audit.so")


def test_a_tenants_venv_does_not_name_the_agents_data_directory(shared: SharedEndpoint) -> None:
    """docs: the venv is bound 'at a fixed path: the data directory's name does not show'. Its own
    scripts and pyvenv.cfg were written by uv on the host, with host paths in them."""
    seen = shared.run("c", host_paths_in_my_venv, "/envs/venvs/", environment={"pip": ["meshtoy==1.0"]},
                      timeout=400, task_timeout_s=120).expect()
    assert not seen["hits"], f"files of a tenant's venv name where the agent keeps its data on the host: {seen}"


def test_a_tenants_loader_variables_cannot_load_its_library_outside_the_sandbox(shared: SharedEndpoint) -> None:
    """Two steps. B installs a plain wheel (nothing runs at install) that carries a shared library:
    the file is now on the host, in B's venv under the agent's data directory. Then B asks for the
    same environment with ``env_vars: {LD_AUDIT: <that file>}`` (LD_PRELOAD and LD_LIBRARY_PATH are
    refused, LD_AUDIT is not): whatever the agent starts with the tenant's variables before the
    sandbox is in place (bubblewrap itself, as root for a root agent) would load it."""
    if shared.audit_library is None:
        pytest.skip("no C compiler for the shared library")
    spec = {"pip": ["auditlib==1.0"]}
    inside = shared.run("b", audit_library_path, environment=spec, timeout=400, task_timeout_s=120).expect()
    found = sorted((shared.data_dir / "envs").glob("venvs/*/lib/python*/site-packages/auditlib/mesh_sec_audit.so"))
    assert found, f"the tenant's wheel was not installed where expected (inside the sandbox it is at {inside})"
    host_path = str(found[0])
    try:
        out = shared.run("b", audit_library_path, environment={**spec, "env_vars": {"LD_AUDIT": host_path}},
                         timeout=300, task_timeout_s=60)
    except ValueError as exc:  # refused before anything is queued: the loader's variables are reserved
        assert "LD_AUDIT" in str(exc) and "reserved" in str(exc), exc
        assert not shared.audit_marker.exists()
        return
    time.sleep(1.0)
    ran = shared.audit_marker.read_text() if shared.audit_marker.exists() else ""
    assert shared.key_hex not in ran, f"A TENANT'S LIBRARY RAN OUTSIDE THE SANDBOX AND READ THE AGENT'S KEY: {ran[:400]}"
    assert not ran, f"a tenant's library was loaded outside the sandbox through LD_AUDIT: {ran[:400]} ({out.describe()})"


def audit_log() -> list[str]:
    try:
        with open("/tmp/mesh-sec-audit.log") as f:
            return f.read().splitlines()
    except OSError:
        return []


def test_a_tenants_loader_variables_never_run_its_code_before_the_lockdown(shared: SharedEndpoint) -> None:
    """The same library named by its path inside the sandbox (where the venv is bound): a loader
    variable that reaches the programs bubblewrap starts before the lockdown (the lockdown's own
    Python: uid 0 and CAP_SETUID for a root agent, no seccomp yet) runs tenant code with privileges.
    Every load the library reports must be in a process that is already locked down."""
    if shared.audit_library is None:
        pytest.skip("no C compiler for the shared library")
    spec = {"pip": ["auditlib==1.0"]}
    inside = shared.run("b", audit_library_path, environment=spec, timeout=400, task_timeout_s=120).expect()
    try:
        out = shared.run("b", audit_log, environment={**spec, "env_vars": {"LD_AUDIT": inside, "SEC_NONCE": "inside"}},
                         timeout=300, task_timeout_s=60)
    except ValueError as exc:  # refused before anything is queued: the loader's variables are reserved
        assert "LD_AUDIT" in str(exc) and "reserved" in str(exc), exc
        return
    Path("/tmp/mesh-sec-audit.log").unlink(missing_ok=True)  # (only there if it ran on the host)
    lines = out.value if out.ok else []
    early = [ln for ln in lines if "Seccomp:\t0" in ln or "NoNewPrivs:\t0" in ln or " uid=0" in ln
             or ("CapEff:" in ln and "CapEff:\t0000000000000000" not in ln)]
    assert not early, f"a tenant's library ran in the sandbox before its lockdown: {early} ({out.describe()})"
