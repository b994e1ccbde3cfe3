"""device_images/hub/: the hub's Containerfile and its compose file (hub, Mosquitto, PostgreSQL,
Prometheus), checked without a container daemon, as tests/unit/test_device_images.py does for the
agent's images.

Every command and flag the files give the hub is parsed by the real ``mesh-hub`` CLI, every
``MESH_HUB_*`` variable is a hub setting, the Prometheus config passes ``promtool check config``
with the shipped rules, its flags exist in the real ``prometheus``, and the Mosquitto config
starts a real Mosquitto (paths pointed at temporary files). A rename on one side breaks a test
instead of a deployment."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml

from cloud_hub.broker import free_port
from cloud_hub.cli import app
from cloud_hub.config import HubConfig
from tests.unit.test_device_images import _DOCKER_INSTRUCTIONS, instructions

ROOT = Path(__file__).resolve().parents[2]
HUB = ROOT / "device_images" / "hub"
RULES = ROOT / "cloud_hub" / "alerts" / "rules.yml"


def _compose() -> dict[str, Any]:
    return yaml.safe_load((HUB / "compose.yaml").read_text())


def _parse_hub_cli(args: list[str]) -> dict[str, Any]:
    """Parse ``mesh-hub ARGS`` with the real CLI, without running it; a wrong flag fails here."""
    group = typer.main.get_command(app)
    assert isinstance(group, click.Group)
    name, *rest = args
    assert name in group.commands, f"mesh-hub has no command {name!r}"
    try:
        return group.commands[name].make_context(name, list(rest)).params
    except click.UsageError as exc:
        raise AssertionError(f"mesh-hub {' '.join(args)}: {exc}") from None


def _extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


# ----------------------------------------------------------------- Containerfile


def test_containerfile_builds_from_the_repository_and_runs_the_hub_unprivileged() -> None:
    steps = instructions((HUB / "Containerfile").read_text())
    assert {word for word, _ in steps} <= _DOCKER_INSTRUCTIONS, "unknown instruction"
    froms = [args for word, args in steps if word == "FROM"]
    assert len(froms) == 2 and froms[0].endswith(" AS build"), "a build stage and a run stage"
    base = {f.split()[0] for f in froms}
    assert len(base) == 1, "both stages on the same Python, or the wheels would not install"
    assert re.fullmatch(r"docker\.io/library/python:3\.\d+-slim-bookworm", base.pop()), "a pinned, fully named base image"
    for word, args in steps:
        if word == "COPY" and not args.startswith("--from"):
            *srcs, _dst = args.split()
            for src in srcs:
                assert (ROOT / src).exists(), f"COPY source {src} is not in the build context (the repository root)"
    installs = " ".join(args for word, args in steps if word == "RUN")
    for extra in re.findall(r"continuum-mesh\[([a-z,]+)\]|\"\.\[([a-z,]+)\]\"", installs):
        for name in ",".join(extra).strip(",").split(","):
            assert name in _extras(), f"extra {name!r} is not in pyproject.toml"
    assert "hub" in installs and "postgres" in installs
    user = [args for word, args in steps if word == "USER"]
    assert user == ["mesh"] and "useradd --system --uid 1883" in installs, "unprivileged, the broker image's uid (compose)"
    assert [args for word, args in steps if word == "VOLUME"] == ["/var/lib/continuum-mesh"]
    assert [args for word, args in steps if word == "EXPOSE"] == ["8700 8701"]
    entry = yaml.safe_load(next(args for word, args in steps if word == "ENTRYPOINT"))
    cmd = yaml.safe_load(next(args for word, args in steps if word == "CMD"))
    assert entry == ["mesh-hub"]
    params = _parse_hub_cli(cmd)
    assert str(params["db"]).startswith("/var/lib/continuum-mesh/"), "the database lives on the volume"
    assert params["host"] == "0.0.0.0" and params["port"] == 8700 and params["zmq_bind"] == "tcp://0.0.0.0:8701"
    health = next(args for word, args in steps if word == "HEALTHCHECK")
    assert "http://127.0.0.1:8700/healthz" in health
    probe = yaml.safe_load(health.split("CMD", 1)[1].strip())
    assert probe[:2] == ["python", "-c"]
    compile(probe[2], "HEALTHCHECK", "exec")  # the probe is valid Python
    ignore = (HUB / "Containerfile.dockerignore").read_text()
    assert ".venv" in ignore and ".git" in ignore


def test_health_routes_the_images_probe_exist(tmp_path: Path) -> None:
    from cloud_hub.api.app import create_app

    paths = {getattr(r, "path", None) for r in create_app(HubConfig(db_path=tmp_path / "hub.sqlite3")).routes}
    assert {"/healthz", "/readyz"} <= paths


# ----------------------------------------------------------------- compose


def test_compose_services_and_wiring() -> None:
    c = _compose()
    services = c["services"]
    assert set(services) == {"postgres", "broker-init", "mosquitto", "hub", "prometheus"}
    for name, svc in services.items():
        for dep in svc.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
        for vol in svc.get("volumes", []):
            src = vol.split(":", 1)[0]
            if src.startswith("."):
                if src.startswith("./tls"):
                    continue  # made by `mesh-hub tls init --out tls` (the compose file's first steps say so)
                assert (HUB / src).exists(), f"{name}: bind-mount source {src} does not exist"
            else:
                assert src in c["volumes"], f"{name}: volume {src} is not declared"
        build = svc.get("build")
        if build:
            assert (HUB / build["context"] / build["dockerfile"]).resolve() == (HUB / "Containerfile").resolve()
    for name in ("hub", "broker-init"):
        assert services[name]["image"] == "continuum-mesh-hub:latest" and services[name]["build"]
    for name in ("postgres", "mosquitto", "prometheus"):
        image = services[name]["image"]
        assert re.fullmatch(r"docker\.io/[a-z-]+/[a-z-]+:[0-9][0-9a-z.-]*|docker\.io/[a-z-]+/[a-z-]+:v[0-9.]+", image), f"{image}: pin a version"
    assert services["hub"]["pid"] == "service:mosquitto", "the hub signals the broker to reload logins"
    assert services["broker-init"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["mosquitto"]["depends_on"]["broker-init"]["condition"] == "service_completed_successfully"
    ports = [p for svc in services.values() for p in svc.get("ports", [])]
    assert "1883:1883" not in ports and not any(p.endswith(":5432") for p in ports), "plain MQTT and PostgreSQL stay inside"
    assert "127.0.0.1:9090:9090" in ports


def test_compose_commands_parse_with_the_real_cli_and_env_names_hub_settings() -> None:
    c = _compose()
    services = c["services"]
    serve = _parse_hub_cli(services["hub"]["command"])
    assert serve["mqtt_host"] == "mosquitto" and serve["broker"] == "external" and serve["host"] == "0.0.0.0"
    assert str(serve["tls_cert"]).startswith("/tls/") and str(serve["tls_key"]).startswith("/tls/")
    init = _parse_hub_cli(services["broker-init"]["command"])
    fields = set(HubConfig.model_fields)
    env_example = (HUB / "env.example").read_text()
    for name in ("hub", "broker-init"):
        env = services[name]["environment"]
        for key in env:
            if key.startswith("MESH_HUB_"):
                assert key[len("MESH_HUB_"):].lower() in fields, f"{name}: {key} is not a hub setting"
        assert env["MESH_LOG_FORMAT"] == "json"
        assert env["MESH_HUB_DATABASE_URL"].startswith("postgresql://mesh:")
    text = (HUB / "compose.yaml").read_text()
    for var in set(re.findall(r"\$\{([A-Z_]+)", text)):
        assert re.search(rf"^{var}=", env_example, re.M), f"${{{var}}} is not in env.example"
    # The files the hub writes are the files the broker reads, through the same volume.
    hub_env = services["hub"]["environment"]
    mounts = {name: dict((v.split(":")[1], v.split(":")[0]) for v in services[name]["volumes"]) for name in services}
    assert mounts["hub"][hub_env["MESH_HUB_MQTT_AUTH_DIR"]] == "broker-auth" == mounts["broker-init"][str(init["out"])]
    conf = dict(line.split(None, 1) for line in (HUB / "mosquitto.conf").read_text().splitlines() if line and not line.startswith("#"))
    assert mounts["mosquitto"][str(Path(conf["password_file"]).parent)] == "broker-auth"
    assert mounts["mosquitto"][str(Path(conf["acl_file"]).parent)] == "broker-auth"
    assert mounts["mosquitto"][str(Path(conf["pid_file"]).parent)] == "broker-auth"
    assert Path(hub_env["MESH_HUB_MQTT_BROKER_PID_FILE"]).name == Path(conf["pid_file"]).name
    assert mounts["hub"][str(Path(hub_env["MESH_HUB_MQTT_BROKER_PID_FILE"]).parent)] == "broker-auth"
    assert hub_env["MESH_HUB_MQTT_PUBLIC_URL"].startswith("mqtts://") and hub_env["MESH_HUB_MQTT_PUBLIC_URL"].endswith(":8883")
    assert "8883:8883" in services["mosquitto"]["ports"]
    probe = services["hub"]["healthcheck"]["test"]
    assert probe[:3] == ["CMD", "python", "-c"] and "/readyz" in probe[3]
    compile(probe[3], "healthcheck", "exec")
    ignored = (HUB / ".gitignore").read_text().split()
    assert ".env" in ignored and "tls/" in ignored, "the secrets the steps make are never committed"


def test_prometheus_config_loads_the_shipped_rules_and_its_flags_exist(tmp_path: Path) -> None:
    c = _compose()
    prom = c["services"]["prometheus"]
    mounts = dict((v.split(":")[1], v.split(":")[0]) for v in prom["volumes"])
    cfg = yaml.safe_load((HUB / "prometheus.yml").read_text())
    (rule_path,) = cfg["rule_files"]
    assert (HUB / mounts[rule_path]).resolve() == RULES.resolve(), "Prometheus loads the rules the hub ships"
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "mesh-hub" and 'job="mesh-hub"' in RULES.read_text()
    assert job["static_configs"][0]["targets"] == ["hub:8700"] and job["metrics_path"] == "/metrics"
    assert mounts[job["tls_config"]["ca_file"]] == "./tls/ca.pem"
    _scrape_timeout_fits_10k(job, cfg.get("global", {}))
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        pytest.fail("prometheus and promtool are needed (Debian package prometheus)")
    helptext = subprocess.run(["prometheus", "--help"], capture_output=True, text=True, timeout=60)
    for arg in prom["command"]:
        flag = arg.split("=", 1)[0]
        assert f"{flag}=" in helptext.stdout + helptext.stderr, f"prometheus has no flag {flag}"
    # promtool checks the config and the rules it names: the same file, paths made local.
    local = dict(cfg, rule_files=[str(RULES)])
    local["scrape_configs"] = [dict(job, tls_config=dict(job["tls_config"], ca_file=str(tmp_path / "ca.pem")))]
    from cloud_hub.tls import init_dir

    init_dir(tmp_path / "tls", force=True)
    shutil.copy(tmp_path / "tls" / "ca.pem", tmp_path / "ca.pem")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(local))
    r = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def _seconds(d: str) -> float:
    """A Prometheus duration of one unit ("15s", "2m") in seconds."""
    m = re.fullmatch(r"(\d+)(ms|s|m|h)", d)
    assert m, f"unexpected duration {d!r}"
    return int(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m[2]]


def _scrape_timeout_fits_10k(job: dict[str, Any], glob: dict[str, Any]) -> None:
    """docs/operations.md measured a 10k-endpoint scrape at up to 8.9 s: the timeout must leave a
    margin above that (Prometheus's default is 10 s), and Prometheus refuses one above the interval."""
    timeout = _seconds(job.get("scrape_timeout") or glob.get("scrape_timeout") or "10s")
    interval = _seconds(job.get("scrape_interval") or glob.get("scrape_interval") or "1m")
    assert 10 < timeout <= interval, (timeout, interval)


def test_operations_guide_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    """The example prometheus.yml in docs/operations.md ("Monitoring"), as printed there, with the
    rule file pointed at the shipped rules."""
    text = (ROOT / "docs" / "operations.md").read_text()
    m = re.search(r"```yaml\n(# prometheus\.yml\n.*?)```", text, re.S)
    assert m, "docs/operations.md lost its example prometheus.yml"
    cfg = yaml.safe_load(m[1])
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "mesh-hub"
    _scrape_timeout_fits_10k(job, cfg.get("global", {}))
    if shutil.which("promtool") is None:
        pytest.fail("promtool is needed (Debian package prometheus)")
    (tmp_path / "prometheus.yml").write_text(m[1].replace("/etc/prometheus/rules/continuum-mesh.yml", str(RULES)))
    r = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr


def test_mosquitto_conf_starts_a_real_broker(tmp_path: Path) -> None:
    """The compose file's mosquitto.conf, its container paths pointed at files made here the way the
    deployment makes them (broker-config's writer, ``mesh-hub tls init``), its listeners on free
    loopback ports: Mosquitto must start, write its pid file and accept TLS connections."""
    from cloud_hub.broker import find_mosquitto
    from cloud_hub.broker_auth import write_broker_files
    from cloud_hub.tls import init_dir

    exe = find_mosquitto()
    if exe is None:
        pytest.fail("mosquitto is required: run ./taskw setup (apt-get install mosquitto)")
    auth = tmp_path / "auth"
    auth.mkdir()
    write_broker_files(auth, "mesh-hub", "pw-" + "x" * 20, "mesh", [])
    init_dir(tmp_path / "tls", force=True)
    plain, tls = free_port(), free_port()
    text = (HUB / "mosquitto.conf").read_text()
    text = (text.replace("/mosquitto/auth", str(auth)).replace("/mosquitto/tls", str(tmp_path / "tls"))
            .replace("listener 1883 0.0.0.0", f"listener {plain} 127.0.0.1").replace("listener 8883 0.0.0.0", f"listener {tls} 127.0.0.1"))
    assert "/mosquitto/" not in text, "every container path was mapped"
    # In the container the broker drops to uid 1883, which owns the auth volume; here, stay the user
    # who owns these temporary folders (as cloud_hub/broker.py does).
    import os
    import pwd

    text += f"\nuser {pwd.getpwuid(os.getuid()).pw_name}\n"
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(text)
    log = open(tmp_path / "mosquitto.log", "wb")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (auth / "mosquitto.pid").exists():
            assert proc.poll() is None, (tmp_path / "mosquitto.log").read_text()
            time.sleep(0.1)
        assert int((auth / "mosquitto.pid").read_text()) == proc.pid
        import ssl

        ctx = ssl.create_default_context(cafile=str(tmp_path / "tls" / "ca.pem"))
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", tls), timeout=5) as raw, ctx.wrap_socket(raw, server_hostname="localhost") as s:
                    assert s.version() is not None
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the TLS listener did not open"
                time.sleep(0.1)
        proc.send_signal(signal.SIGHUP)  # what the hub does after an enrollment: the broker reloads, stays up
        time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "mosquitto.log").read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
