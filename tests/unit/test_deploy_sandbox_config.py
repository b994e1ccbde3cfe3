"""What the deployment files allow the agent's bubblewrap sandbox, read from the files themselves
(issue 25, item 6; docs/operations.md, "Sandbox under systemd, balena and Apptainer"): exactly the
namespaces and capabilities the sandbox's own command line (mesh_agent/engine/environments.py)
needs, and no more. tests/integration/test_deploy_sandbox.py applies the same settings to a real
bwrap; these checks only read files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from mesh_agent.engine.environments import bwrap_argv

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "device_images"
UNIT = IMAGES / "systemd" / "continuum-mesh-agent.service"
COMPOSE = IMAGES / "balena" / "docker-compose.yml"


def unit_settings(text: str) -> list[tuple[str, str]]:
    """The [Service] assignments of a unit file, in order (continuation lines joined)."""
    out: list[tuple[str, str]] = []
    section = ""
    for raw in re.sub(r"\\\n", " ", text).splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]" and "=" in line:
            key, value = line.split("=", 1)
            out.append((key.strip(), value.strip()))
    return out


_LISTS = ("RestrictNamespaces", "RestrictAddressFamilies", "CapabilityBoundingSet", "AmbientCapabilities",
          "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem", "BindReadOnlyPaths", "BindPaths",
          "SystemCallFilter")


def effective(settings: list[tuple[str, str]]) -> dict[str, Any]:
    """The value each setting ends up with, as systemd merges repeated assignments: list settings
    accumulate and an empty assignment resets them; RestrictNamespaces=yes allows none (``[]``),
    =no all (``["ALL"]``); other settings: the last assignment wins."""
    out: dict[str, Any] = {}
    for key, value in settings:
        if key in _LISTS:
            if value == "":
                out[key] = []
            elif key == "RestrictNamespaces" and value in ("yes", "no", "true", "false"):
                out[key] = [] if value in ("yes", "true") else ["ALL"]
            else:
                out.setdefault(key, []).extend(value.split())
        else:
            out[key] = value
    return out


#: bwrap options and the namespace type each creates (RestrictNamespaces= names).
_UNSHARE = {"--unshare-user": {"user", "mnt"}, "--unshare-user-try": {"user", "mnt"}, "--unshare-pid": {"pid"},
            "--unshare-ipc": {"ipc"}, "--unshare-uts": {"uts"}, "--unshare-net": {"net"},
            "--unshare-cgroup": {"cgroup"}, "--unshare-cgroup-try": {"cgroup"},
            "--unshare-all": {"user", "mnt", "pid", "ipc", "uts", "net", "cgroup"}}


def namespaces_of(argv: list[str]) -> set[str]:
    """The namespace types a bwrap command line creates (every bwrap has its own mount namespace)."""
    out = {"mnt"}
    for a in argv[: argv.index("--")] if "--" in argv else argv:
        out |= _UNSHARE.get(a, set())
    return out


def unprivileged_sandbox_namespaces() -> set[str]:
    """What the agent's sandboxes need when the agent is not root (the systemd unit's case): a
    sandbox without network and one granted it."""
    return {ns for net in (False, True) for ns in namespaces_of(bwrap_argv([], [], net, "bwrap", privileged=False))}


def test_the_unit_allows_exactly_the_namespaces_of_the_sandbox() -> None:
    eff = effective(unit_settings(UNIT.read_text()))
    allowed = eff.get("RestrictNamespaces")
    assert allowed is not None and "ALL" not in allowed, "the unit must restrict namespaces to an allow-list"
    assert not any(a.startswith("~") for a in allowed), allowed
    assert set(allowed) == unprivileged_sandbox_namespaces(), (
        f"RestrictNamespaces={' '.join(allowed)}, but the sandbox's command line creates "
        f"{' '.join(sorted(unprivileged_sandbox_namespaces()))}")
    assert len(allowed) == len(set(allowed))


def test_the_unit_gives_no_capability_and_no_privilege_gain() -> None:
    eff = effective(unit_settings(UNIT.read_text()))
    assert eff.get("CapabilityBoundingSet") == []
    assert eff.get("AmbientCapabilities", []) == []
    assert eff.get("NoNewPrivileges") == "yes"  # fine: the sandbox is unprivileged bwrap, never setuid
    assert eff.get("User") not in (None, "", "root", "0"), "the unit runs the agent as its own unprivileged user"
    # unprivileged: the agent's sandboxes take the user-namespace path, which needs no capability
    assert "--unshare-user" in bwrap_argv([], [], False, "bwrap", privileged=False)


def test_the_unit_leaves_proc_whole_so_a_sandbox_can_mount_its_own() -> None:
    """A new /proc in a user namespace is refused while a mount covers part of the /proc the
    service sees (the kernel's mount_too_revealing): no setting may put one there."""
    eff = effective(unit_settings(UNIT.read_text()))
    for key in ("ProtectKernelTunables", "ProtectKernelLogs"):
        assert eff.get(key, "no") in ("no", "false", "0"), f"{key}= covers files under /proc"
    assert eff.get("ProcSubset", "all") == "all", "ProcSubset=pid: a procfs without /proc/sys"
    for key in ("ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem", "BindReadOnlyPaths", "BindPaths"):
        for path in eff.get(key, []):
            assert not path.lstrip("-+").startswith("/proc"), f"{key}={path}"
    assert eff.get("ProtectProc", "default") in ("default", "invisible", "noaccess", "ptraceable")  # a new procfs: fine
    # what ProtectKernelTunables=/ProtectKernelLogs= would have given that does not touch /proc is kept
    assert "/sys" in eff.get("ReadOnlyPaths", [])
    assert "~syslog" in eff.get("SystemCallFilter", [])
    assert eff.get("PrivateDevices") == "yes"  # no /dev/kmsg


def test_the_unit_lets_a_sandbox_bring_up_its_loopback() -> None:
    eff = effective(unit_settings(UNIT.read_text()))
    families = eff.get("RestrictAddressFamilies", [])
    assert "AF_NETLINK" in families, "bwrap --unshare-net configures the sandbox's loopback over rtnetlink"
    assert set(families) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}


def test_the_old_unit_would_have_refused_every_sandbox() -> None:
    """The unit as shipped before issue 25 (RestrictNamespaces=yes) allowed none of them."""
    eff = effective([*unit_settings(UNIT.read_text()), ("RestrictNamespaces", "yes")])
    assert eff["RestrictNamespaces"] == [] and unprivileged_sandbox_namespaces() - set(eff["RestrictNamespaces"])


# ------------------------------------------------------------------------- balena


def compose_agent() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(COMPOSE.read_text())["services"]["agent"]


def test_the_balena_service_is_not_privileged_and_keeps_only_what_the_sandbox_needs() -> None:
    svc = compose_agent()
    assert not svc.get("privileged", False)
    assert svc.get("cap_drop") == ["ALL"]
    # bwrap as root (balenaOS has no unprivileged user namespaces): namespaces, mounts, pivot_root,
    # the loopback; the lockdown (mesh_agent/engine/_lockdown.py): setresuid/setresgid after emptying
    # the bounding set; the entrypoint: taking over the volume.
    root_argv = bwrap_argv([], [], False, "bwrap", privileged=True)
    kept = {root_argv[i + 1].removeprefix("CAP_") for i, a in enumerate(root_argv) if a == "--cap-add"}
    assert kept == {"SETUID", "SETGID", "SETPCAP"}, root_argv
    assert set(svc.get("cap_add", [])) == {"SYS_ADMIN", "NET_ADMIN", *kept, "CHOWN", "DAC_OVERRIDE"}
    assert len(svc["cap_add"]) == len(set(svc["cap_add"]))
    assert "--unshare-user" not in root_argv  # so no user namespace, and no "systempaths=unconfined"
    # Docker's default seccomp profile has no pivot_root(2); "systempaths=..." is a docker CLI
    # option that balenaEngine's API would refuse, and AppArmor is not in balenaOS.
    assert svc.get("security_opt") == ["seccomp=unconfined"]
    assert "userns_mode" not in svc and "pid" not in svc and "network_mode" not in svc


def test_the_balena_image_runs_the_agent_as_root_in_its_container_and_has_bwrap() -> None:
    entry = (IMAGES / "balena" / "entrypoint.sh").read_text()
    assert '"${MESH_AGENT_USER:-root}"' in entry and "exec mesh-agent" in entry
    docker = (IMAGES / "balena" / "Dockerfile.template").read_text()
    assert re.search(r"install_packages[^\n]*\bbubblewrap\b", docker)


def test_the_apptainer_image_has_bwrap() -> None:
    recipe = (IMAGES / "apptainer" / "continuum-mesh-agent.def").read_text()
    post = recipe.split("%post", 1)[1].split("\n%", 1)[0]
    assert re.search(r"apt-get install[^\n]*\bbubblewrap\b", post), post
    assert "bwrap --version" in recipe.split("%test", 1)[1]
