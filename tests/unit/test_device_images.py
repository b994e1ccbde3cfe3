"""device_images/: what can be checked without a Pi, a balena account or Apptainer.

The compose file, balena.yml, the Dockerfile template, the Apptainer recipe and the systemd unit
are parsed, rendered and cross-checked against each other and against the agent's own
environment variables, so a rename on one side breaks a test instead of a fleet.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from mesh_agent.bootstrap import ENV_VARS

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "device_images"
BALENA = IMAGES / "balena"
UNIT = IMAGES / "systemd" / "continuum-mesh-agent.service"
DEF = IMAGES / "apptainer" / "continuum-mesh-agent.def"

_DOCKER_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME", "USER",
    "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}


def _version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def render(template: str, arch: str) -> str:
    """What the balena builder does with a Dockerfile.template for a fleet of ``arch``."""
    return template.replace("%%BALENA_ARCH%%", arch)


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    logical = ""
    for line in dockerfile.splitlines():
        stripped = line.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        logical += stripped[:-1] + " " if stripped.endswith("\\") else stripped
        if not stripped.endswith("\\"):
            word, _, rest = logical.partition(" ")
            out.append((word.upper(), rest.strip()))
            logical = ""
    assert not logical, "dangling line continuation"
    return out


# ----------------------------------------------------------------- balena


@pytest.mark.parametrize("arch", ["armv7hf", "aarch64"])
def test_dockerfile_template_renders_for_pi_architectures(arch: str) -> None:
    text = render((BALENA / "Dockerfile.template").read_text(), arch)
    assert "%%" not in text, "an unrendered balena variable is left"
    steps = instructions(text)
    assert {word for word, _ in steps} <= _DOCKER_INSTRUCTIONS, "unknown Dockerfile instruction"
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) == 2, "a build stage and a run stage"
    images = [f.split()[0] for f in froms]
    for image in images:
        assert re.fullmatch(rf"balenalib/{arch}-debian-python:[0-9.]+-bookworm-(build|run)", image), image
    # both stages on the same Python, or the built wheels would not install
    assert images[0].rsplit("-", 1)[0] == images[1].rsplit("-", 1)[0]
    assert froms[0].endswith(" AS build") and images[1].endswith("-run")
    # every COPY from the build context names something that exists in it
    copied: dict[str, str] = {}
    for word, args in steps:
        if word == "COPY" and not args.startswith("--from"):
            src, dst = args.split()
            assert (BALENA / src).exists(), f"COPY source {src} missing from the build context"
            copied[dst] = src
    entry = json.loads(next(args for word, args in steps if word == "ENTRYPOINT"))
    assert entry[0] in copied, "the entrypoint is a file the image copies in"
    assert os.access(BALENA / copied[entry[0]], os.X_OK)
    env = " ".join(args for word, args in steps if word == "ENV")
    assert "MESH_AGENT_CONFIG=/data/agent.yaml" in env and "MESH_DATA_DIR=/data/queue" in env


def test_compose_builds_the_template_and_keeps_the_queue_on_a_named_volume() -> None:
    compose = yaml.safe_load((BALENA / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"agent"}
    svc = compose["services"]["agent"]
    context = BALENA / svc["build"]["context"]
    assert (context / svc["build"]["dockerfile"]).is_file()
    assert svc["restart"] == "always"
    mounts = dict(v.split(":", 1) for v in svc["volumes"])
    assert set(mounts) <= set(compose["volumes"]), "every mounted volume is declared (named, not a bind mount)"
    assert list(mounts.values()) == ["/data"]
    env = svc["environment"]
    assert Path(env["MESH_AGENT_CONFIG"]).parent == Path("/data")
    assert Path(env["MESH_DATA_DIR"]).is_relative_to("/data"), "the SQLite queue lives on the volume"
    assert "MESH_ENROLL_TOKEN" not in env, "secrets come from device variables, not the repository"


def test_balena_yml_names_variables_the_agent_reads() -> None:
    meta = yaml.safe_load((BALENA / "balena.yml").read_text())
    assert meta["type"] == "sw.application" and meta["version"] == _version()
    data = meta["data"]
    assert data["defaultDeviceType"] in data["supportedDeviceTypes"]
    names = {k for item in data["applicationEnvironmentVariables"] for k in item}
    assert "MESH_HUB_URL" in names and names <= set(ENV_VARS), names - set(ENV_VARS)


def test_scripts_parse() -> None:
    scripts = [IMAGES / "build-wheel.sh", BALENA / "push.sh", BALENA / "entrypoint.sh", IMAGES / "systemd" / "install.sh"]
    for script in scripts:
        shell = "sh" if script.read_text().startswith("#!/bin/sh") else "bash"
        r = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, f"{script.name}: {r.stderr}"
        assert os.access(script, os.X_OK), f"{script.name} is not executable"


def test_install_script_refuses_bad_options_before_touching_the_system() -> None:
    script = IMAGES / "systemd" / "install.sh"
    r = subprocess.run(["bash", str(script), "--transport", "carrier-pigeon"], capture_output=True, text=True)
    assert r.returncode == 2 and "install.sh:" in r.stderr
    r = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "--hub" in r.stdout


# ----------------------------------------------------------------- systemd


def _unit_settings() -> list[tuple[str, str, str]]:
    section, out = "", []
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key, value))
    return out


def test_unit_runs_as_own_user_with_queue_under_var_lib() -> None:
    settings = _unit_settings()
    svc = {k: v for s, k, v in settings if s == "Service"}
    env = dict(v.split("=", 1) for s, k, v in settings if s == "Service" and k == "Environment")
    assert svc["Restart"] == "on-failure"
    assert svc["User"] == svc["Group"] == "continuum-mesh"
    assert svc["StateDirectory"] == "continuum-mesh"
    assert env["MESH_AGENT_CONFIG"].startswith("/var/lib/continuum-mesh/")
    assert env["MESH_DATA_DIR"].startswith("/var/lib/continuum-mesh/")
    for hardening in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices"):
        assert svc[hardening] in ("yes", "strict"), hardening
    # exit codes the CLI reserves for "a person must fix this" are not restarted in a loop
    assert set(svc["RestartPreventExitStatus"].split()) == {"2", "3"}
    # the unit starts the same CLI the install script installs
    assert svc["ExecStart"].startswith("/opt/continuum-mesh/venv/bin/mesh-agent start")
    assert "/opt/continuum-mesh/venv" in (IMAGES / "systemd" / "install.sh").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify insists the ExecStart binary exists: point it at a stand-in in a temp dir; every
    # other directive is checked as written.
    exe = tmp_path / "bin" / "mesh-agent"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/continuum-mesh/venv/bin/mesh-agent", str(exe)))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys or bad values and only warns: any output is a failure
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


# ----------------------------------------------------------------- Apptainer


def test_apptainer_definition_is_well_formed() -> None:
    text = DEF.read_text()
    header: dict[str, str] = {}
    sections: dict[str, list[str]] = {}
    current: str | None = None
    for line in text.splitlines():
        if line.startswith("%"):
            current = line.split()[0][1:]
            sections[current] = []
        elif current is None:
            if line.strip() and not line.startswith("#"):
                key, _, value = line.partition(":")
                header[key.strip()] = value.strip()
        else:
            sections[current].append(line)
    assert header["Bootstrap"] == "docker" and re.fullmatch(r"python:3\.1[0-9]+-slim-\w+", header["From"])
    assert set(sections) <= {"labels", "files", "post", "environment", "runscript", "test", "help", "setup", "startscript"}
    for line in sections["files"]:
        if line.strip():
            src = line.split()[0]
            assert (DEF.parent / src).exists(), f"%files source {src} missing (paths are relative to the build folder)"
    assert "[hpc]" in "\n".join(sections["post"]), "the image carries Parsl for engine: parsl"
    assert "exec mesh-agent" in "\n".join(sections["runscript"])
    labels = dict(line.split(None, 1) for line in sections["labels"] if line.strip())
    assert labels["org.opencontainers.image.version"] == _version()
