"""``mesh-hub``: serve the hub, manage users and tokens, run an embedded broker."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from cloud_hub.config import HubConfig
from cloud_hub.fleet_cli import fleet_app

app = typer.Typer(help="Continuum Mesh hub.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens (stored hashed; shown once).")
app.add_typer(token_app, name="token")
app.add_typer(fleet_app, name="fleet")
console = Console(soft_wrap=True)  # error lines name files: never break them mid-path


@app.command()
def serve(
    db: Path = typer.Option(Path("hub.sqlite3"), "--db", help="SQLite database file"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar="MESH_HUB_DATABASE_URL", help="postgresql://... instead of --db"),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8700, "--port"),
    mqtt_host: Optional[str] = typer.Option("127.0.0.1", "--mqtt-host", help="broker the hub connects to ('' for none)"),
    mqtt_port: int = typer.Option(1883, "--mqtt-port"),
    zmq_bind: Optional[str] = typer.Option("tcp://127.0.0.1:8701", "--zmq-bind", help="ZeroMQ ROUTER address ('' for none)"),
    broker: str = typer.Option("external", "--broker", help="'embedded' spawns a local mosquitto on --mqtt-port"),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Run the hub (REST API, dispatcher, MQTT and ZeroMQ links) in the foreground."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cloud_hub.server import serve as run

    cfg = HubConfig.from_env(db_path=db, database_url=database_url, host=host, port=port, mqtt_host=mqtt_host or None, mqtt_port=mqtt_port, zmq_bind=zmq_bind or None)
    embedded = None
    if broker == "embedded":
        import secrets

        from cloud_hub.broker import MosquittoBroker

        # Locked down like a production broker: a login per endpoint, topic ACLs written by the hub.
        workdir = cfg.db_path.resolve().parent / "broker"
        login = (cfg.mqtt_username or "mesh-hub", cfg.mqtt_password or secrets.token_urlsafe(24))
        cfg = cfg.model_copy(update={"mqtt_username": login[0], "mqtt_password": login[1], "mqtt_auth_dir": workdir,
                                     "mqtt_broker_pid_file": workdir / "broker.pid"})
        embedded = MosquittoBroker(workdir, port=cfg.mqtt_port, hub_login=login).start()
        console.print(f"embedded mosquitto on 127.0.0.1:{cfg.mqtt_port} (per-endpoint logins and ACLs in {workdir})")
    try:
        run(cfg)
    finally:
        if embedded:
            embedded.stop()


@token_app.command("create")
def token_create(
    user: str = typer.Option(..., "--user", help="user name (created if missing)"),
    name: str = typer.Option("cli", "--name"),
    db: Path = typer.Option(Path("hub.sqlite3"), "--db"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar="MESH_HUB_DATABASE_URL", help="postgresql://... instead of --db"),
) -> None:
    """Create an API token for a user and print it (only its hash is stored)."""
    from cloud_hub.store import StoreError, make_store

    async def q() -> str:
        store = await make_store(HubConfig(db_path=db, database_url=database_url)).open()
        try:
            uid = await store.create_user(user)
            return await store.create_api_token(uid, name)
        finally:
            await store.close()

    try:
        print(asyncio.run(q()))
    except StoreError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


@app.command("broker-config")
def broker_config(
    out: Path = typer.Option(..., "--out", help="directory for password_file and acl_file (readable by mosquitto)"),
    db: Path = typer.Option(Path("hub.sqlite3"), "--db"),
    hub_user: Optional[str] = typer.Option(None, "--hub-user", help="the hub's own broker user (env MESH_HUB_MQTT_USERNAME; default mesh-hub)"),
    hub_password: Optional[str] = typer.Option(None, "--hub-password", help="its password (env MESH_HUB_MQTT_PASSWORD)"),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="topic prefix (env MESH_HUB_MQTT_PREFIX; default mesh)"),
    reload_pid_file: Optional[Path] = typer.Option(None, "--reload", help="pid file of a running mosquitto to SIGHUP afterwards"),
) -> None:
    """Write Mosquitto password_file and acl_file: one login per endpoint, each limited to its own topics.

    The hub rewrites the same files itself after every enrollment when MESH_HUB_MQTT_AUTH_DIR is set;
    this command is for a broker on another machine or a first setup."""
    from pydantic import ValidationError

    from cloud_hub.broker_auth import BROKER_CONF_LINES, reload_broker, write_broker_files
    from cloud_hub.store import SqliteStore, StoreError
    from cloud_hub.store.access import AccessStore

    try:
        cfg = HubConfig.from_env(db_path=db, mqtt_username=hub_user, mqtt_password=hub_password, mqtt_prefix=prefix)
    except ValidationError as exc:
        console.print(f"[red]error:[/red] hub settings: {exc}")
        raise typer.Exit(2) from None
    if not cfg.mqtt_password:
        console.print("[red]error:[/red] the hub's own broker password is needed: pass --hub-password or set MESH_HUB_MQTT_PASSWORD "
                      "(the same value the hub runs with)")
        raise typer.Exit(2)
    if not db.exists():
        console.print(f"[red]error:[/red] {db}: no such hub database")
        raise typer.Exit(2)

    async def accounts() -> list:  # type: ignore[type-arg]
        store = await SqliteStore(db).open()
        try:
            return await AccessStore(store).broker_accounts()
        finally:
            await store.close()

    try:
        rows = asyncio.run(accounts())
        pw, acl = write_broker_files(out, cfg.mqtt_username or "mesh-hub", cfg.mqtt_password, cfg.mqtt_prefix, rows)
    except (StoreError, OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"wrote {pw} and {acl}: the hub user and {len(rows)} endpoint logins")
    if reload_pid_file is not None:
        console.print("mosquitto reloaded" if reload_broker(reload_pid_file) else f"[yellow]no process for {reload_pid_file}[/yellow]")
    console.print("mosquitto.conf needs:\n" + BROKER_CONF_LINES.format(dir=out.resolve()), markup=False)


if __name__ == "__main__":
    app()
