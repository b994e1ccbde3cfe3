"""``mesh-agent``: init (enroll with the hub), start (foreground, systemd-friendly), status, queue ls."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any, Optional

import httpx
import typer
from rich.console import Console
from rich.table import Table

from mesh_agent.config import AgentConfig, ConfigError, Credentials, ZmqSettings, check_plaintext, load_config
from mesh_agent.redact import redact, register_secret


class _AgentCli(typer.Typer):
    """``typer.Typer`` whose unexpected failures (a bug, a disk gone) never print a secret.

    typer's own error display shows every local variable of every frame: after the settings are
    loaded, that is the MQTT password and the endpoint key. Here an unexpected exception prints
    Python's traceback (no local variables) with secrets masked (:mod:`mesh_agent.redact`), then one
    ``error:`` line, and exits 1. Expected errors keep their one line and exit codes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:  # SystemExit (click's exits, typer.Exit) passes through
            import traceback

            import click

            first = (str(exc).strip().splitlines() or [""])[0]
            tb = traceback.TracebackException.from_exception(exc)
            internal = (os.path.dirname(typer.__file__), os.path.dirname(click.__file__))
            tb.stack = traceback.StackSummary.from_list(  # our frames, not typer's and click's (as typer shows them)
                [f for f in tb.stack if not f.filename.startswith(internal) and not (f.filename == __file__ and f.name == "__call__")])
            sys.stdout.flush()
            sys.stderr.write(redact("".join(tb.format())))
            sys.stderr.write(f"error: unexpected failure: {type(exc).__name__}{': ' if first else ''}{redact(first)} "
                             "(a bug, or a damaged installation or data directory; the traceback above has secrets masked)\n")
            sys.stderr.flush()
            raise SystemExit(1) from None


app = _AgentCli(help="Continuum Mesh agent: runs functions from the hub, durably.", no_args_is_help=True, pretty_exceptions_show_locals=False)
queue_app = typer.Typer(help="Inspect the local durable queue.", pretty_exceptions_show_locals=False)
app.add_typer(queue_app, name="queue")
console = Console(soft_wrap=True)  # error lines name files: never break them mid-path

DEFAULT_CONFIG = Path(os.environ.get("MESH_AGENT_CONFIG", "~/.config/continuum-mesh/agent.yaml")).expanduser()
ConfigOpt = typer.Option(DEFAULT_CONFIG, "--config", "-c", help="agent config file (env MESH_AGENT_CONFIG)")


class EnrollError(ConfigError):
    """The hub answered the enrollment with an error; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def enroll(
    hub_url: str,
    token: str,
    name: str,
    config_path: Path,
    *,
    transport: str = "mqtt",
    data_dir: Path | None = None,
    workers: int | None = None,
    prefetch: int = 256,
    task_timeout: float | None = None,
    mqtt_host: str | None = None,
    mqtt_port: int | None = None,
    zmq_address: str | None = None,
    tags: list[str] | None = None,
    hardware: str | None = None,
    gpu: bool = False,
    ca_hash: str | None = None,
    insecure_plaintext: bool = False,
    gateway_id: str | None = None,
) -> AgentConfig:
    """Register this device with the hub and write its config and credentials (both mode 0600).

    A ZeroMQ endpoint makes its CURVE keypair here and sends only the public key; the secret never
    leaves the device. The hub answers with its own CURVE public key (and, for MQTT, a broker login)."""
    _check_placement(tags, hardware)  # before the hub spends an enrollment token on us
    register_secret(token)  # masked in every log line and error of this process from now on
    request: dict[str, object] = {"token": token, "name": name, "transport": transport}
    if gateway_id is not None:  # behind a site gateway (docs/sites.md): the hub answers with its broker
        request["gateway_id"] = gateway_id
    curve_public = curve_secret = None
    if transport == "zmq":
        from mesh_agent.transport.zmq import curve_keypair

        curve_public, curve_secret = curve_keypair()
        request["curve_public"] = curve_public
    from mesh_agent.enroll_tls import HubTrust

    trust = HubTrust.establish(hub_url, ca_hash, insecure_plaintext=insecure_plaintext)  # before the token is sent anywhere
    r = trust.post(f"{hub_url.rstrip('/')}/v1/endpoints/enroll", json=request)
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise EnrollError(f"hub refused enrollment ({r.status_code}): {detail}", r.status_code)
    info = r.json()
    data_dir = (data_dir or config_path.parent / name).expanduser().resolve()
    mqtt = info.get("mqtt") or {}
    register_secret(info.get("key"), mqtt.get("password"))
    ca_file = trust.save_ca(info.get("ca_pem"), data_dir)
    cfg = AgentConfig(
        endpoint_id=info["endpoint_id"],
        name=name,
        hub_url=hub_url,
        transport=transport,  # type: ignore[arg-type]
        mqtt=trust.mqtt_settings(mqtt, ca_file, host=mqtt_host, port=mqtt_port),
        insecure_plaintext=insecure_plaintext,
        zmq=ZmqSettings(address=zmq_address or info.get("zmq_address") or "tcp://127.0.0.1:8701"),
        data_dir=data_dir,
        credentials_file=config_path.with_name(config_path.stem + ".credentials.json").resolve(),
        workers=workers,
        prefetch=prefetch,
        task_timeout=task_timeout,
        heartbeat_s=float(info.get("heartbeat_s", 5.0)),
        tags=tags or [],
        hardware=hardware,
        gpu=gpu,
        gateway_id=gateway_id,
    )
    check_plaintext(cfg, config_path)  # a plaintext broker on another machine: refuse before writing anything
    Credentials(
        endpoint_id=cfg.endpoint_id, key=info["key"], mqtt_username=mqtt.get("username"), mqtt_password=mqtt.get("password"),
        curve_public=curve_public, curve_secret=curve_secret, hub_curve_key=info.get("zmq_server_key") if transport == "zmq" else None,
    ).save(cfg.credentials_file)
    cfg.save(config_path)
    return cfg


def existing_enrollment(config_path: Path) -> str | None:
    """Describe the enrollment already at ``config_path`` (its config or credentials file), or None.

    Why: a second ``mesh-agent init`` with the defaults used to overwrite the first device's config
    and credentials silently and leave its endpoint orphaned at the hub."""
    creds = config_path.with_name(config_path.stem + ".credentials.json")
    found = [p for p in (config_path, creds) if p.exists()]
    if not found:
        return None
    who = ""
    try:
        import yaml

        raw = yaml.safe_load(config_path.read_text()) if config_path.exists() else None
        if isinstance(raw, dict) and raw.get("endpoint_id"):
            who = f" of endpoint {raw['endpoint_id']}" + (f" ({raw['name']})" if raw.get("name") else "")
    except (OSError, ValueError, yaml.YAMLError):
        pass
    return f"an enrollment{who} already exists: {' and '.join(str(p) for p in found)}"


def _check_placement(tags: list[str] | None, hardware: str | None) -> None:
    from pydantic import TypeAdapter, ValidationError

    from mesh_agent.config import Tag

    try:
        TypeAdapter(list[Tag]).validate_python(tags or [])
        TypeAdapter(Optional[Tag]).validate_python(hardware)
    except ValidationError as exc:
        raise ConfigError(f"bad tag or hardware class (letters, digits and _.:- only, 1-64 characters): {exc.errors()[0]['input']!r}") from None


def _load(config: Path) -> tuple[AgentConfig, Credentials]:
    from mesh_agent.settings import register_credentials

    try:
        cfg, creds = load_config(config)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {redact(str(exc))}")
        raise typer.Exit(2) from None
    register_credentials(creds)  # from here on, no log line or error of this process shows them
    return cfg, creds


@app.command()
def init(
    hub: str = typer.Option(..., "--hub", help="hub URL, e.g. https://hub.example.org"),
    token: str = typer.Option(..., "--token", help="enrollment token from the hub"),
    name: str = typer.Option(os.uname().nodename.split(".")[0], "--name", help="endpoint name"),
    transport: str = typer.Option("mqtt", "--transport", help="mqtt (edge) or zmq (LAN/HPC)"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="where the durable queue lives"),
    workers: Optional[int] = typer.Option(None, "--workers", help="worker processes (default: one per core)"),
    tag: Optional[list[str]] = typer.Option(None, "--tag", help="placement label (repeatable), for {\"tags\": [...]} selectors"),
    hardware: Optional[str] = typer.Option(None, "--hardware", help="hardware class shared by identical devices, e.g. pi4"),
    gpu: bool = typer.Option(False, "--gpu", help="functions may use a GPU here"),
    ca_hash: Optional[str] = typer.Option(None, "--ca-hash", help="sha256:... of the hub's CA, printed with the enrollment token; "
                                          "the CA the hub sends (and its HTTPS certificate) must match it"),
    insecure_plaintext: bool = typer.Option(False, "--insecure-plaintext", help="allow http:// and plaintext MQTT to another machine"),
    force: bool = typer.Option(False, "--force", help="replace an existing enrollment at --config (the old endpoint stays enrolled at the hub)"),
    gateway: Optional[str] = typer.Option(None, "--gateway", help="endpoint id of the site gateway this device dials on its LAN "
                                          "(docs/sites.md); the hub answers with the gateway's broker address"),
    config: Path = ConfigOpt,
) -> None:
    """Enroll this device with the hub and write its config."""
    existing = existing_enrollment(config)
    if existing and not force:  # checked before the hub spends a token on us
        console.print(f"[red]error:[/red] {existing}. Pass --force to replace it, or give a second agent on this machine "
                      "its own files: -c/--config other.yaml (and --data-dir for its queue)", highlight=False)
        raise typer.Exit(2)
    try:
        cfg = enroll(hub, token, name, config, transport=transport, data_dir=data_dir, workers=workers,
                     tags=tag, hardware=hardware, gpu=gpu, ca_hash=ca_hash, insecure_plaintext=insecure_plaintext,
                     gateway_id=gateway)
    except (ConfigError, httpx.HTTPError, ConnectionError) as exc:
        console.print(f"[red]error:[/red] {redact(str(exc))}")
        raise typer.Exit(2) from None
    console.print(f"enrolled as [bold]{cfg.endpoint_id}[/bold]; config written to {config}")


LogFormatOpt = typer.Option(None, "--log-format", help="text or json (one object per line); default: the config's log_format, "
                            "else MESH_LOG_FORMAT, else text")


def _setup_logs(level: str, fmt: Optional[str], fields: Optional[dict[str, str]] = None) -> str:
    """The shared set-up (mesh_agent/_logs.py); a wrong format is one error line and exit 2."""
    from mesh_agent._logs import resolve_format, setup_logging

    try:
        chosen = resolve_format(fmt)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    setup_logging(level, stream=sys.stderr, fmt=chosen, fields=fields)
    return chosen


@app.command()
def start(config: Path = ConfigOpt, log_level: str = typer.Option("INFO", "--log-level"), log_format: Optional[str] = LogFormatOpt) -> None:
    """Run the agent in the foreground until SIGTERM or SIGINT (systemd: Type=simple).

    On first boot (no config file) with ``MESH_HUB_URL`` and ``MESH_ENROLL_TOKEN`` set, the
    device enrolls itself first (see :mod:`mesh_agent.bootstrap`).
    """
    _setup_logs(log_level, log_format)  # connect/disconnect/online lines; repeats rate-limited
    from mesh_agent.bootstrap import HubUnreachable, ensure_enrolled

    try:
        ensure_enrolled(config)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {redact(str(exc))}")
        # 4: try again later (systemd/balena restart us); 2: a human must fix the settings.
        raise typer.Exit(4 if isinstance(exc, HubUnreachable) else 2) from None
    cfg, creds = _load(config)
    log_format = _setup_logs(log_level, log_format or cfg.log_format)  # the config's format, unless the flag said otherwise
    from mesh_agent.config import runner_payload
    from mesh_agent.datasets import worker_env
    from mesh_agent.run import hand_over

    # Validated here, with clear errors; then this process becomes the light runner (same pid, so
    # SIGTERM from systemd still reaches the agent), which never loads pydantic, typer, rich or httpx.
    try:
        fd = hand_over(runner_payload(cfg, creds, worker_env=worker_env(cfg.endpoint_id, cfg.name, cfg.datasets, cfg.data_dir)))
    except ValueError as exc:  # ConfigError included
        console.print(f"[red]error:[/red] {config}: {redact(str(exc))}")
        raise typer.Exit(2) from None
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "mesh_agent.run", "--settings-fd", str(fd), "--log-level", log_level,
                                "--log-format", log_format])


@app.command()
def gateway(config: Path = ConfigOpt, log_level: str = typer.Option("INFO", "--log-level"), log_format: Optional[str] = LogFormatOpt) -> None:
    """Run this endpoint as its site's gateway (the config's ``site:`` section; docs/sites.md): the
    site's devices dial its own Mosquitto, it relays their frames over its one uplink and keeps
    work moving while the uplink is down."""
    _setup_logs(log_level, log_format)
    cfg, creds = _load(config)
    _setup_logs(log_level, log_format or cfg.log_format, fields={"endpoint_id": cfg.endpoint_id})
    if cfg.site is None:
        console.print(f"[red]error:[/red] {config}: no site: section (site.listen_port, site.hold); see docs/sites.md")
        raise typer.Exit(2)
    from mesh_agent.gateway import run_gateway

    try:
        run_gateway(cfg, creds)
    except (ValueError, RuntimeError) as exc:
        console.print(f"[red]error:[/red] {redact(str(exc))}")
        raise typer.Exit(2) from None


def _store_view(cfg: AgentConfig) -> tuple[dict[str, int], list[dict[str, object]]]:
    from mesh_agent.store import AgentStore, StoreError

    async def q() -> tuple[dict[str, int], list[dict[str, object]]]:
        store = await AgentStore(cfg.queue_path).open()
        try:
            return await store.counts(), await store.listing()
        finally:
            await store.close()

    try:
        return asyncio.run(q())
    except StoreError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(3) from None


@app.command()
def status(config: Path = ConfigOpt) -> None:
    """Endpoint identity and local queue depth (works offline)."""
    cfg, _ = _load(config)
    counts, _ = _store_view(cfg)
    t = Table(title=f"endpoint {cfg.name}", show_header=False)
    for k, v in [("endpoint id", cfg.endpoint_id), ("hub", cfg.hub_url), ("transport", cfg.transport),
                 ("queue", str(cfg.queue_path)), ("tasks waiting", counts["queued"]), ("results not yet acked", counts["done"]),
                 ("results delivered (retained ids)", counts["acked"])]:
        t.add_row(k, str(v))
    console.print(t)


@queue_app.command("ls")
def queue_ls(config: Path = ConfigOpt) -> None:
    """Tasks and results held on this device."""
    cfg, _ = _load(config)
    _, rows = _store_view(cfg)
    t = Table("task", "function", "state", "ok")
    for r in rows:
        t.add_row(str(r["id"]), str(r["function_id"])[:12], str(r["state"]), "" if r["ok"] is None else str(bool(r["ok"])))
    console.print(t)


@queue_app.command("recover")
def queue_recover(config: Path = ConfigOpt) -> None:
    """Move a damaged queue database aside and keep every task and result still readable in it.

    Whatever cannot be read back is sent again by the hub when the agent next says hello (it lists
    the tasks it holds; the hub re-queues the ones missing). Run it while the agent is stopped."""
    cfg, _ = _load(config)
    from mesh_agent.recover import recover_queue

    try:
        report = recover_queue(cfg.queue_path)
    except (OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"damaged queue moved to {report.moved_to}")
    t = Table("kept", "count", title=f"recovered into {report.damaged}")
    for state, n in report.tasks.items():
        t.add_row(f"tasks {state}", str(n))
    t.add_row("function bodies", str(report.functions))
    console.print(t)
    if report.unreadable_rows or report.dropped_without_body or report.read_errors:
        console.print(f"not kept: {report.unreadable_rows} unusable rows, {report.dropped_without_body} tasks without their function body, "
                      f"{report.read_errors} unreadable row lookups; the hub re-sends every task not kept on the next connection")
    for note in report.notes:
        console.print(f"note: {note}", markup=False)


if __name__ == "__main__":
    app()


envs_app = typer.Typer(help="Environments this endpoint built (docs/environments.md).", pretty_exceptions_show_locals=False)
app.add_typer(envs_app, name="envs")


def _environments(cfg: AgentConfig) -> "Any":
    from mesh_agent.engine.environments import Environments

    return Environments(cfg.data_dir / "envs")


@envs_app.command("ls")
def envs_ls(config: Path = ConfigOpt) -> None:
    """Venvs held on disk (most recently used first) and specs that failed to build."""
    cfg, _ = _load(config)
    envs = _environments(cfg)
    t = Table("venv", "MB", "packages", title=f"venvs in {envs.root} ({envs.held_bytes() / 2**20:.1f} MB)")
    for key in envs.held():
        v = envs._venvs[key]
        t.add_row(key, f"{v.bytes / 2**20:.1f}", ", ".join(v.pins)[:80])
    console.print(t)
    if envs.failed:
        f = Table("spec id", "why", title="failed (not built again until the spec changes, or `mesh-agent envs forget`)")
        for sid, why in envs.failed.items():
            f.add_row(sid, why[:160])
        console.print(f)


@envs_app.command("forget")
def envs_forget(spec_id: str, config: Path = ConfigOpt) -> None:
    """Let a spec that failed be built again (after the index or the image was fixed). Run it
    while the agent is stopped: a running agent keeps its own list."""
    cfg, _ = _load(config)
    envs = _environments(cfg)
    if spec_id not in envs.failed:
        console.print(f"[red]error:[/red] no failure recorded for {spec_id!r} in {envs.root} (see `mesh-agent envs ls`)")
        raise typer.Exit(2)
    envs.forget_failure(spec_id)
    console.print(f"forgot the failure of {spec_id}: its next task builds it again")
