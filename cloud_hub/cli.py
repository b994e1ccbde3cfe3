"""``mesh-hub``: serve the hub, manage users and tokens, run an embedded broker."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from cloud_hub.config import HubConfig
from cloud_hub.fleet_cli import fleet_app

app = typer.Typer(help="Continuum Mesh hub.", no_args_is_help=True, pretty_exceptions_show_locals=False)
token_app = typer.Typer(help="API tokens (stored hashed; shown once).", pretty_exceptions_show_locals=False)
app.add_typer(token_app, name="token")
app.add_typer(fleet_app, name="fleet")
# The SDK's configuration (cloud_hub/client/_login.py): `mesh-hub login`, then Client() needs no arguments.
from cloud_hub.client._login import login, logout, whoami  # noqa: E402

app.command(help="Save a hub URL and API token in a profile (~/.config/continuum-mesh/config.yaml, mode 0600).")(login)
app.command(help="Remove a profile from the SDK's config file.")(logout)
app.command(help="Which hub and token the SDK would use, and whether the hub accepts them.")(whoami)
from cloud_hub.backup_cli import backup, restore  # noqa: E402

app.command()(backup)
app.command()(restore)
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
    log_format: Optional[str] = typer.Option(None, "--log-format", envvar="MESH_LOG_FORMAT",
                                             help="text or json (one object per line, with endpoint, task, function and FL run ids)"),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", envvar="MESH_HUB_TLS_CERT_FILE", help="HTTPS: certificate chain (PEM)"),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", envvar="MESH_HUB_TLS_KEY_FILE", help="HTTPS: private key (PEM)"),
) -> None:
    """Run the hub (REST API, dispatcher, MQTT and ZeroMQ links) in the foreground."""
    from pydantic import ValidationError

    from mesh_agent._logs import setup_logging

    try:
        setup_logging(log_level, fmt=log_format)  # repeated warnings (an unreachable broker) are rate-limited
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    from cloud_hub.server import serve as run

    try:
        # '' stays '' here: the config turns it into "none"; None would fall back to the default broker.
        cfg = HubConfig.from_env(db_path=db, database_url=database_url, host=host, port=port, mqtt_host=mqtt_host, mqtt_port=mqtt_port,
                                 zmq_bind=zmq_bind, tls_cert_file=tls_cert, tls_key_file=tls_key)
    except ValidationError as exc:
        err = exc.errors()[0]
        console.print(f"[red]error:[/red] hub settings: {'.'.join(map(str, err['loc'])) or ''}{': ' if err['loc'] else ''}{err['msg'].removeprefix('Value error, ')}",
                      markup=True, highlight=False)
        raise typer.Exit(2) from None
    embedded = None
    if broker not in ("embedded", "external"):
        console.print(f"[red]error:[/red] --broker must be 'embedded' or 'external', not {broker!r}")
        raise typer.Exit(2)
    if broker == "embedded" and not cfg.mqtt_host:
        console.print("[red]error:[/red] --broker embedded needs MQTT: drop --mqtt-host '' (or use --broker external)")
        raise typer.Exit(2)
    if broker == "embedded":
        import secrets

        from cloud_hub.broker import BrokerError, MosquittoBroker

        # Locked down like a production broker: a login per endpoint, topic ACLs written by the hub.
        workdir = cfg.db_path.resolve().parent / "broker"
        login = (cfg.mqtt_username or "mesh-hub", cfg.mqtt_password or secrets.token_urlsafe(24))
        cfg = cfg.model_copy(update={"mqtt_username": login[0], "mqtt_password": login[1], "mqtt_auth_dir": workdir,
                                     "mqtt_broker_pid_file": workdir / "broker.pid"})
        try:
            embedded = MosquittoBroker(workdir, port=cfg.mqtt_port, hub_login=login).start()
        except BrokerError as exc:
            # One line, non-zero: never fall back to whatever broker answers on that port.
            Console(stderr=True, soft_wrap=True).print(f"error: {exc}", markup=False, highlight=False)
            raise typer.Exit(1) from None
        # Printed only now that our own mosquitto holds the port with the password and ACL files.
        console.print(f"embedded mosquitto on 127.0.0.1:{cfg.mqtt_port} (per-endpoint logins and ACLs in {workdir})")
    from cloud_hub.server import HubStartError

    try:
        run(cfg)
    except HubStartError as exc:
        Console(stderr=True, soft_wrap=True).print(f"error: hub did not start: {exc}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    except ValueError as exc:  # settings found wrong while building the server (e.g. --tls-cert without --tls-key)
        Console(stderr=True, soft_wrap=True).print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    finally:
        if embedded:
            embedded.stop()


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``30d``, ``2w``, combined as ``1d12h``, or plain seconds; > 0."""
    import re

    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        seconds = float(t)
    elif t and re.fullmatch(r"(\d+(\.\d+)?[smhdw])+", t):
        seconds = sum(float(n) * _UNITS[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)([smhdw])", t))
    else:
        raise ValueError(f"--expires-in {text!r} is not a duration: use e.g. 90s, 30m, 12h, 30d, 2w or 1d12h")
    if not 0 < seconds <= 100 * 365 * 86400:
        raise ValueError(f"--expires-in {text!r} must be more than 0 and at most 100 years")
    return seconds


def _store_cli(db: Path, database_url: Optional[str], work: Any, *, must_exist: bool = True) -> Any:
    """Run ``work(store)`` on the hub database; a store error is one line and exit code 2."""
    from cloud_hub.store import StoreError, make_store

    if must_exist and not database_url and not db.exists():
        console.print(f"[red]error:[/red] {db}: no such hub database (give --db or --database-url)", highlight=False)
        raise typer.Exit(2)

    async def q() -> Any:
        store = await make_store(HubConfig(db_path=db, database_url=database_url)).open()
        try:
            return await work(store)
        finally:
            await store.close()

    try:
        return asyncio.run(q())
    except StoreError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None


def _when(t: Optional[float]) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t)) if t else "-"


@token_app.command("create")
def token_create(
    user: str = typer.Option(..., "--user", help="user name (created if missing)"),
    name: str = typer.Option("cli", "--name"),
    expires_in: Optional[str] = typer.Option(None, "--expires-in", help="the token stops working after this long: 90s, 30m, 12h, 30d, 2w, 1d12h "
                                             "(default: until revoked)"),
    db: Path = typer.Option(Path("hub.sqlite3"), "--db"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar="MESH_HUB_DATABASE_URL", help="postgresql://... instead of --db"),
) -> None:
    """Create an API token for a user and print it (only its hash is stored); its id goes to stderr."""
    import sys
    import time

    expires = None
    if expires_in is not None:
        try:
            expires = time.time() + parse_duration(expires_in)  # checked before the database is touched
        except ValueError as exc:
            console.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(2) from None

    async def create(store: Any) -> str:
        uid = await store.create_user(user)
        return str(await store.create_api_token(uid, name, expires))

    tok = _store_cli(db, database_url, create, must_exist=False)
    from cloud_hub.store import token_id

    print(tok)
    print(f"token id {token_id(tok)} for user {user!r}" + (f", expires {_when(expires)}" if expires else ", no expiry")
          + f"; revoke it with `mesh-hub token revoke {token_id(tok)}`", file=sys.stderr)


@token_app.command("ls")
def token_ls(
    user: Optional[str] = typer.Option(None, "--user", help="only this user's tokens"),
    db: Path = typer.Option(Path("hub.sqlite3"), "--db"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar="MESH_HUB_DATABASE_URL", help="postgresql://... instead of --db"),
) -> None:
    """API tokens: id, user, name, created, expires, revoked (never the token: only its hash is stored)."""
    import time

    async def ls(store: Any) -> list[dict[str, Any]]:
        return list(await store.list_api_tokens(user))

    rows = _store_cli(db, database_url, ls)
    from rich.table import Table

    t = Table("id", "user", "name", "created", "expires", "state")
    now = time.time()
    for r in rows:
        state = ("revoked" if r["revoked"] else "expired" if r["expires"] and r["expires"] <= now else "good")
        t.add_row(r["id"], r["user"], r["name"] or "", _when(r["created"]), _when(r["expires"]), state)
    console.print(t)


@token_app.command("revoke")
def token_revoke(
    which: str = typer.Argument(..., help="the token's id (`mesh-hub token ls`; a unique prefix of at least tk_ + 6 digits) or the token itself"),
    db: Path = typer.Option(Path("hub.sqlite3"), "--db"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar="MESH_HUB_DATABASE_URL", help="postgresql://... instead of --db"),
) -> None:
    """Revoke an API token. Hubs refuse it within a few seconds (each re-reads a token it trusts every
    5 s; with replicas, every replica alike), and web console sessions signed in with it end at once."""
    async def revoke(store: Any) -> dict[str, Any]:
        return dict(await store.revoke_api_token(which))

    r = _store_cli(db, database_url, revoke)
    if r["already"]:
        print(f"token {r['id']} ({r['name']}) was already revoked at {_when(r['revoked'])}; nothing changed")
    else:
        print(f"revoked token {r['id']} ({r['name']})")


@app.command("broker-config")
def broker_config(
    out: Path = typer.Option(..., "--out", help="directory for password_file and acl_file (readable by mosquitto)"),
    db: Path = typer.Option(Path("hub.sqlite3"), "--db"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar="MESH_HUB_DATABASE_URL", help="postgresql://... instead of --db"),
    group: Optional[str] = typer.Option(None, "--group", help="group of the files, the one Mosquitto runs as "
                                        "(default: the --out folder's group if it is setgid, else 'mosquitto' if it exists)"),
    hub_user: Optional[str] = typer.Option(None, "--hub-user", help="the hub's own broker user (env MESH_HUB_MQTT_USERNAME; default mesh-hub)"),
    hub_password: Optional[str] = typer.Option(None, "--hub-password", help="its password (env MESH_HUB_MQTT_PASSWORD)"),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="topic prefix (env MESH_HUB_MQTT_PREFIX; default mesh)"),
    reload_pid_file: Optional[Path] = typer.Option(None, "--reload", help="pid file of a running mosquitto to SIGHUP afterwards"),
    tls_cert: Optional[Path] = typer.Option(None, "--tls-cert", help="server certificate chain (PEM): adds a TLS listener (mesh-hub tls init, Let's Encrypt fullchain.pem)"),
    tls_key: Optional[Path] = typer.Option(None, "--tls-key", help="its private key (PEM), readable by the mosquitto user"),
    tls_ca: Optional[Path] = typer.Option(None, "--tls-ca", help="CA file for the listener (ours: ca.pem; Let's Encrypt: chain.pem); default: ca.pem next to --tls-cert"),
    tls_port: int = typer.Option(8883, "--tls-port", help="MQTT over TLS listener port"),
    ws_port: Optional[int] = typer.Option(None, "--ws-port", help="also MQTT over secure WebSockets on this port (e.g. 443)"),
    listen: Optional[str] = typer.Option(None, "--listen", help="address the TLS listeners bind to (default: every interface)"),
    require_client_cert: bool = typer.Option(False, "--require-client-cert", help="mutual TLS: clients need a certificate signed by --tls-ca"),
    kind: str = typer.Option("mosquitto", "--kind", help="mosquitto (password_file + acl_file) or nats (nats_auth.conf for every node of a NATS cluster)"),
) -> None:
    """Write Mosquitto password_file and acl_file: one login per endpoint, each limited to its own topics.

    --kind nats writes nats_auth.conf instead, the users and subject permissions every node of a
    NATS cluster includes (docs/operations.md, "Clustered broker"); --reload SIGHUPs each pid in the file.

    With --tls-cert/--tls-key it also writes listeners.conf: an MQTT-over-TLS listener (default 8883)
    and, with --ws-port, MQTT over secure WebSockets (include it from mosquitto.conf).

    The hub rewrites the same files itself after every enrollment when MESH_HUB_MQTT_AUTH_DIR is set;
    this command is for a broker on another machine or a first setup."""
    from pydantic import ValidationError

    from cloud_hub.broker_auth import BROKER_CONF_LINES, group_id, reload_broker, write_broker_files
    from cloud_hub.store import StoreError, make_store
    from cloud_hub.store.access import AccessStore

    if kind not in ("mosquitto", "nats"):
        console.print(f"[red]error:[/red] --kind must be 'mosquitto' or 'nats', not {kind!r}", markup=True, highlight=False)
        raise typer.Exit(2)
    try:
        cfg = HubConfig.from_env(db_path=db, database_url=database_url, mqtt_username=hub_user, mqtt_password=hub_password, mqtt_prefix=prefix)
    except ValidationError as exc:
        console.print(f"[red]error:[/red] hub settings: {exc.errors()[0]['msg'].removeprefix('Value error, ')}")
        raise typer.Exit(2) from None
    if not cfg.mqtt_password:
        console.print("[red]error:[/red] the hub's own broker password is needed: pass --hub-password or set MESH_HUB_MQTT_PASSWORD "
                      "(the same value the hub runs with)")
        raise typer.Exit(2)
    if not cfg.database_url and not db.exists():
        console.print(f"[red]error:[/red] {db}: no such hub database (start the hub once, or run `mesh-hub token create`, to create it)")
        raise typer.Exit(2)
    try:
        if group is not None:
            group_id(group)  # before anything is written
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None

    listeners = None
    if tls_cert or tls_key:
        listeners = _tls_listeners(tls_cert, tls_key, tls_ca, tls_port, ws_port, listen, require_client_cert)  # checked before writing

    async def accounts() -> list:  # type: ignore[type-arg]
        store = await make_store(cfg).open()
        try:
            return await AccessStore(store).broker_accounts()
        finally:
            await store.close()

    if kind == "nats":
        try:
            nats_rows = asyncio.run(accounts())
        except StoreError as exc:
            console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
            raise typer.Exit(2) from None
        _nats_config(cfg, out, nats_rows, group, reload_pid_file, tls_cert, tls_key, tls_ca, require_client_cert)
        return
    try:
        rows = asyncio.run(accounts())
        pw, acl = write_broker_files(out, cfg.mqtt_username or "mesh-hub", cfg.mqtt_password, cfg.mqtt_prefix, rows, group=group)
    except (StoreError, OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    import grp as _grp

    st = pw.stat()
    try:
        gname = _grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        gname = str(st.st_gid)
    console.print(f"wrote {pw} and {acl} (mode {st.st_mode & 0o777:o}, group {gname}): the hub user and {len(rows)} endpoint logins",
                  markup=False, highlight=False)
    if reload_pid_file is not None:
        console.print("mosquitto reloaded" if reload_broker(reload_pid_file) else f"[yellow]no process for {reload_pid_file}[/yellow]")
    console.print("mosquitto.conf needs:\n" + BROKER_CONF_LINES.format(dir=out.resolve()), markup=False)
    if listeners is not None:
        from cloud_hub.tls import write_pem

        conf = write_pem(out / "listeners.conf", listeners.encode())
        console.print(f"TLS listeners in {conf} (add `include_dir` or paste them after the other settings):\n{listeners}", markup=False, highlight=False)


def _nats_config(cfg: HubConfig, out: Path, rows: list, group: Optional[str], reload_pid_file: Optional[Path],  # type: ignore[type-arg]
                 tls_cert: Optional[Path], tls_key: Optional[Path], tls_ca: Optional[Path], require_client_cert: bool) -> None:
    """``broker-config --kind nats``: write nats_auth.conf, SIGHUP the nodes, print what a node's config needs."""
    from cloud_hub.broker_auth import reload_broker
    from cloud_hub.broker_nats import NATS_AUTH_FILE, write_nats_auth

    try:
        path, skipped = write_nats_auth(out, cfg.mqtt_username or "mesh-hub", cfg.mqtt_password or "", cfg.mqtt_prefix, rows, group=group)
    except (OSError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    console.print(f"wrote {path}: the hub user and {len(rows) - len(skipped)} endpoint logins", markup=False, highlight=False)
    if skipped:
        console.print(f"[yellow]left out (enrolled before the hub kept a bcrypt hash; enroll them again):[/yellow] {', '.join(skipped)}")
    if reload_pid_file is not None:
        console.print("nats-server reloaded" if reload_broker(reload_pid_file) else f"[yellow]no process for {reload_pid_file}[/yellow]")
    tls = ""
    if tls_cert and tls_key:
        ca = tls_ca or tls_cert.parent / "ca.pem"
        tls = (f"\n  tls {{ cert_file: \"{tls_cert.resolve()}\", key_file: \"{tls_key.resolve()}\", ca_file: \"{ca.resolve()}\""
               + (", verify: true" if require_client_cert else "") + " }")
    console.print(
        "each node's nats-server.conf needs (names and addresses are yours; see docs/operations.md):\n"
        "server_name: n1                      # unique per node: clustered JetStream needs it\n"
        "max_payload: 16MB                    # the hub's frames go up to 10 MB\n"
        "jetstream { store_dir: /var/lib/nats-server/jetstream }\n"
        "cluster { name: mesh, listen: 0.0.0.0:6222, routes: [nats-route://n2:6222, nats-route://n3:6222] }\n"
        f"mqtt {{ listen: 0.0.0.0:{8883 if tls else 1883}, ack_wait: \"30s\", max_ack_pending: 1000, stream_replicas: 3{tls} }}\n"
        f"include \"{NATS_AUTH_FILE}\"                # relative to the config file's folder: copy {path} next to it",
        markup=False, highlight=False)


def _tls_listeners(cert: Optional[Path], key: Optional[Path], ca: Optional[Path], port: int, ws_port: Optional[int], listen: Optional[str],
                   require_client_cert: bool) -> str:
    """Check the certificate files (any issuer) and render the TLS / wss listener lines."""
    from cloud_hub.broker import BrokerTls, tls_listener_conf
    from cloud_hub.tls import TlsSetupError, load_certs, load_server_pair

    try:
        if not (cert and key):
            raise TlsSetupError("a TLS listener needs both --tls-cert and --tls-key")
        load_server_pair(cert, key)
        ca = ca or cert.with_name("ca.pem")
        load_certs(ca)
    except TlsSetupError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    for p in (port, ws_port):
        if p is not None and not 1 <= p <= 65535:
            console.print(f"[red]error:[/red] port {p} out of range 1-65535")
            raise typer.Exit(2)
    tls = BrokerTls(ca, cert, key, require_certificate=require_client_cert)
    out = tls_listener_conf(port, listen, tls)
    if ws_port:
        out += tls_listener_conf(ws_port, listen, tls, websockets=True)
    return out


tls_app = typer.Typer(help="Certificates for a self-hosted hub (private CA), and their fingerprints.", pretty_exceptions_show_locals=False)
app.add_typer(tls_app, name="tls")


@tls_app.command("init")
def tls_init(
    out: Path = typer.Option(..., "--out", help="directory for ca.pem, ca.key, server.pem, server.key (keys 0600)"),
    host: Optional[list[str]] = typer.Option(None, "--host", help="a name or IP the hub and broker are reached by (repeatable); localhost and 127.0.0.1 are always in"),
    force: bool = typer.Option(False, "--force", help="replace an existing CA (devices enrolled with the old one must enroll again)"),
) -> None:
    """Make a private CA and a server certificate signed by it (for the broker's TLS listeners and HTTPS)."""
    from cloud_hub.tls import TlsSetupError, init_dir

    try:
        files = init_dir(out, host or [], force=force)
    except (TlsSetupError, OSError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"wrote {files.ca_cert}, {files.ca_key} (keep it offline), {files.server_cert}, {files.server_key}", markup=False, highlight=False)
    console.print(f"CA hash: {files.ca_hash}", markup=False, highlight=False)
    console.print(f"hub: MESH_HUB_TLS_CA_FILE={files.ca_cert}  mesh-hub serve --tls-cert {files.server_cert} --tls-key {files.server_key}\n"
                  f"broker: mesh-hub broker-config --out DIR --tls-cert {files.server_cert} --tls-key {files.server_key}\n"
                  f"devices: mesh-agent init --hub https://HOST:PORT --token TOKEN --ca-hash {files.ca_hash}", markup=False, highlight=False)


@tls_app.command("hash")
def tls_hash(cert: Path = typer.Argument(..., help="a PEM certificate (the CA devices should pin)")) -> None:
    """Print ``sha256:<hex>`` of a certificate, the value ``mesh-agent init --ca-hash`` takes."""
    from cloud_hub.tls import TlsSetupError, fingerprint, load_certs

    try:
        print(fingerprint(load_certs(cert)[0]))
    except TlsSetupError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None


if __name__ == "__main__":
    app()
