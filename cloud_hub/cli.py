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
console = Console()


@app.command()
def serve(
    db: Path = typer.Option(Path("hub.sqlite3"), "--db", help="SQLite database file"),
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

    cfg = HubConfig.from_env(db_path=db, host=host, port=port, mqtt_host=mqtt_host or None, mqtt_port=mqtt_port, zmq_bind=zmq_bind or None)
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
) -> None:
    """Create an API token for a user and print it (only its hash is stored)."""
    from cloud_hub.store import SqliteStore, StoreError

    async def q() -> str:
        store = await SqliteStore(db).open()
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


if __name__ == "__main__":
    app()
