"""Agent configuration: one YAML file written by ``mesh-agent init``, validated by pydantic.

Secrets (the endpoint's signing key, broker password) live in a separate credentials file, both
written with mode 0600, so the config can be shown or copied without leaking the key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, ValidationError, field_validator, model_validator

from mesh_agent.datasets import DatasetDecl, DatasetName
from mesh_agent.settings import PATH, ConfigError

__all__ = ["AgentConfig", "Credentials", "ConfigError", "MqttTls", "check_plaintext", "plaintext_dials", "GlobusStaging", "ParslSettings", "load_config",
           "write_private", "shape_of", "runner_payload"]


#: A placement label (``tags:`` in the config, ``{"tags": [...]}`` selectors at the hub).
Tag = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class MqttTls(BaseModel):
    """``mqtt.tls``: MQTT over TLS (mqtts, or wss with ``transport: websockets``).

    ``ca_file`` is the CA the broker's certificate must chain to (``mesh-agent init`` writes the
    hub's, pinned by ``--ca-hash``); without it the system trust store is used (Let's Encrypt).
    ``cert_file``/``key_file``: a client certificate for brokers that require one (mutual TLS).
    ``server_name``: the name to verify when ``host`` is an IP address or another alias.
    ``pin_sha256``: also require the server certificate to have this fingerprint."""

    model_config = ConfigDict(extra="forbid")
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    pin_sha256: str | None = Field(None, pattern=r"^sha256:[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _pair(self) -> "MqttTls":
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("mutual TLS needs both cert_file and key_file")
        return self


class MqttSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    host: str = "127.0.0.1"
    port: int = Field(1883, ge=1, le=65535)
    keepalive: int | None = Field(None, ge=1, description="MQTT keepalive, s; default: lan 30, metered what the hub's welcome asks (never above its offline bound)")
    topic_prefix: str = "mesh"
    tls: MqttTls | None = Field(None, description="MQTT over TLS; required for a broker that is not on this machine")
    transport: Literal["tcp", "websockets"] = Field("tcp", description="websockets: MQTT over (secure) WebSockets, e.g. port 443")
    websocket_path: str = Field("/mqtt", pattern=r"^/\S*$")
    hosts: list[str] = Field(default_factory=list, description="several brokers of one cluster, 'host:port' each, tried in order: on a lost "
                             "connection the agent moves to the next (docs/operations.md, Clustered broker); when set, host/port are not used")
    _brokers: Any = PrivateAttr(None)

    @field_validator("hosts")
    @classmethod
    def _hostports(cls, v: list[str]) -> list[str]:
        """Each entry parses as host[:port] now, so a typo is a one-line config error, not a link that never connects."""
        from mesh_agent.transport.brokers import parse_hostport

        for entry in v:
            parse_hostport(entry, 1883)
        return v

    def broker_list(self) -> Any:
        """The agent's :class:`~mesh_agent.transport.brokers.BrokerList`: ``hosts`` (a port left out is ``port``),
        else the single ``host:port``. One object per settings object, so the position in the list
        survives reconnects (make_link builds a new link for each)."""
        if self._brokers is None:
            from mesh_agent.transport.brokers import BrokerList, parse_hostport

            self._brokers = BrokerList([parse_hostport(h, self.port) for h in self.hosts] or [(self.host, self.port)])
        return self._brokers


class ZmqSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str = "tcp://127.0.0.1:5555"


class ParslSettings(BaseModel):
    """``engine: parsl``: where Parsl's HighThroughputExecutor gets its workers (HPC).

    ``provider`` picks the Parsl provider: ``local`` (this machine; tests, a big workstation),
    ``slurm`` or ``pbspro`` (batch jobs from a login node). Blocks are batch jobs; Parsl's
    ``htex_auto_scale`` strategy keeps between ``min_blocks`` and ``max_blocks`` of them,
    submitting more while tasks wait and releasing idle ones after ``max_idletime`` seconds.
    """

    model_config = ConfigDict(extra="forbid")
    provider: Literal["local", "slurm", "pbspro"] = "local"
    min_blocks: int = Field(0, ge=0)
    init_blocks: int = Field(1, ge=0)
    max_blocks: int = Field(1, ge=1)
    nodes_per_block: int = Field(1, ge=1)
    max_workers_per_node: int | None = Field(None, ge=1, description="default: cores / cores_per_worker")
    cores_per_worker: float = Field(1.0, gt=0)
    parallelism: float = Field(1.0, gt=0, le=1, description="blocks per waiting task Parsl aims for")
    max_idletime: float = Field(120.0, ge=0, description="seconds an idle block is kept")
    strategy_period: float = Field(5.0, gt=0, description="seconds between scaling decisions")
    walltime: str = Field("01:00:00", pattern=r"^\d+:\d{2}:\d{2}$")
    partition: str | None = None  # slurm
    qos: str | None = None  # slurm
    account: str | None = None  # slurm, pbspro
    queue: str | None = None  # pbspro
    scheduler_options: str = Field("", description="extra #SBATCH / #PBS lines")
    worker_init: str = Field("", description="shell run before workers start, e.g. 'module load python'")
    launcher: Literal["single", "srun", "mpiexec"] = "single"
    address: str | None = Field(None, description="address workers use to reach this agent; default loopback for local, detected otherwise")
    heartbeat_period: int = Field(30, ge=1, description="seconds; also how often a dead worker is noticed")
    heartbeat_threshold: int = Field(120, ge=2, description="seconds of silence before a node is declared lost")

    @model_validator(mode="after")
    def _blocks_in_order(self) -> "ParslSettings":
        if not self.min_blocks <= self.init_blocks <= self.max_blocks:
            raise ValueError(f"need min_blocks <= init_blocks <= max_blocks, got {self.min_blocks}, {self.init_blocks}, {self.max_blocks}")
        if self.provider != "slurm" and (self.partition or self.qos):
            raise ValueError("partition and qos apply to provider 'slurm' only")
        if self.provider != "pbspro" and self.queue:
            raise ValueError("queue applies to provider 'pbspro' only")
        return self


class GlobusStaging(BaseModel):
    """``globus:``: this endpoint's own Globus collection, where task inputs are staged to.

    ``local_root`` is the local directory that the collection's ``/`` maps to (for Globus Connect
    Personal, its shared folder). The client id and secret of the Globus service client that
    runs the transfers go in the credentials file (``globus_client_id``, ``globus_client_secret``).
    """

    model_config = ConfigDict(extra="forbid")
    local_collection: str = Field(min_length=1, description="collection (endpoint) id of this machine")
    local_root: Path
    staging_dir: Path | None = Field(None, description="under local_root; default <local_root>/.mesh-staging")
    timeout_s: float = Field(3600.0, gt=0, description="a transfer not done by then fails the task and is cancelled")
    poll_s: float = Field(2.0, gt=0, description="longest wait between transfer status checks")


class SiteSettings(BaseModel):
    """``site:`` of a gateway's config: the broker its devices dial on the LAN, and how much work it
    holds for them ahead of time (docs/sites.md)."""

    model_config = ConfigDict(extra="forbid")
    listen_host: str = Field("127.0.0.1", description="where the site's Mosquitto listens")
    listen_port: int = Field(1884, ge=1, le=65535)
    public_host: str | None = Field(None, description="the address devices dial, if not listen_host")
    hold: int = Field(64, ge=0, le=100_000, description="tasks for the site's devices the hub may lease to this gateway ahead of time")
    cache_bodies: bool = Field(True, description="function bodies cross the uplink once per site: the hub sends each to the "
                               "gateway once, the gateway hands it to its devices, which check it by its hash (the function id)")
    mosquitto: str = Field("mosquitto", description="the Mosquitto binary")
    store_port: int | None = Field(None, ge=0, le=65535, description="the site's content-addressed blob store on the LAN "
                                   "(hierarchical FL: models and updates, mesh_agent/site_store.py); default listen_port + 1, 0: off")
    frames: bool = Field(True, description="relay the devices' frames in batched, compressed site frames (site_up/site_down) "
                         "when the hub reads them; off: one MQTT message per device frame on the device's own topic")
    batch_s: float = Field(1.0, ge=0.0, le=30.0, description="how long a device frame may wait at the gateway for others to share "
                           "its site_up (a hello goes at once; 16 KB of frames also flush)")


class _MaskedRepr(BaseModel):
    """repr()/str() with URL passwords and registered secrets masked (a mirror at https://user:pw@...)."""

    def __repr_args__(self) -> Any:
        from mesh_agent.redact import redact_value

        for name, value in super().__repr_args__():
            yield name, redact_value(value)


class EnvironmentsSettings(_MaskedRepr):
    """``environments:`` how this endpoint builds the environments tasks ask for (docs/environments.md).
    The package index is the operator's choice, never a task's: point it at your own mirror."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="run tasks that name an environment (venv, container, sandbox); off: they fail with a clear error")
    index_url: str | None = Field(None, description="package index uv installs from (default: uv's, PyPI); e.g. a site mirror")
    find_links: list[str] = Field(default_factory=list, max_length=16, description="directories or URLs of wheels (uv --find-links)")
    no_index: bool = Field(False, description="install only from find_links (offline endpoints)")
    disk_budget_mb: int = Field(2048, ge=1, description="venvs are evicted least recently used first beyond this")
    keep_warm_s: float = Field(300.0, ge=0, description="an environment's workers stay warm this long after their last task")
    prewarm: list[dict[str, Any]] = Field(default_factory=list, max_length=8, description="environment specs built at start, "
                                          "each with one worker kept warm, e.g. [{pip: [numpy]}, {sandbox: true}]")
    sandbox_tmp_mb: int = Field(64, ge=1, le=65536, description="size of a sandbox's private /tmp (a tmpfs: RAM)")
    sandbox_nproc: int = Field(256, ge=8, le=65536, description="processes and threads one sandbox may hold (a fork bomb stops here)")
    sandbox_uid: int = Field(65534, ge=1, le=2**31 - 2, description="host uid/gid of the owner's own sandboxed tasks when the "
                             "agent runs as root (never 0); another user's run as a uid of their own")
    tenant_network: bool = Field(False, description="let other users' sandboxed tasks ask for the network; they then reach "
                                 "this machine's loopback services (broker, databases) too")

    @field_validator("prewarm")
    @classmethod
    def _specs(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        from mesh_agent.protocol.environment import normalize

        out = []
        for i, spec in enumerate(v):
            try:
                norm = normalize(spec)
            except ValueError as exc:
                raise ValueError(f"prewarm[{i}]: {exc}") from None
            if norm is not None:
                out.append(norm)
        return out


class AgentConfig(_MaskedRepr):
    model_config = ConfigDict(extra="forbid")

    endpoint_id: str
    name: str
    hub_url: str
    transport: Literal["mqtt", "zmq"] = "mqtt"
    mqtt: MqttSettings = MqttSettings()
    zmq: ZmqSettings = ZmqSettings()
    data_dir: Path
    credentials_file: Path
    workers: int | None = Field(None, ge=1, description="worker processes; default one per core")
    prefetch: int = Field(256, ge=0, description="tasks held beyond the worker count, to hide link latency")
    task_timeout: float | None = Field(None, gt=0)
    memory_limit_mb: int | None = Field(None, ge=16)
    heartbeat_s: float = Field(5.0, gt=0)
    # Footprint on metered links and small devices (mesh_agent/profile.py, docs/protocol.md "Liveness").
    profile: Literal["metered", "lan"] | None = Field(
        None, description="metered: keepalive + will, heartbeats only on change, compression, workers on demand; "
        "lan: beats every heartbeat_s, warm workers. Default: metered for MQTT to a broker not on this machine, else lan")
    worker_idle_s: float | None = Field(None, ge=0, description="end workers idle this long, start them on the next task; default: metered 60, lan never")
    compress: bool | None = Field(None, description="zlib for frame bodies over 1 KiB; default: metered yes, lan no")
    heartbeat_min_s: float | None = Field(None, gt=0, description="metered: state changes are reported at most this often; default 30")
    max_batch: int = Field(32, ge=1, description="tasks per chunk handed to one worker")
    start_now_max: int | None = Field(None, ge=0, le=4096, description="extra workers beyond the pool for tasks that must start "
                                      "at once (a multiprocessing Process); default 4 per pool worker, at least 8")
    durable_sync: Literal["full", "normal"] = "full"
    log_format: Literal["text", "json"] | None = Field(
        None, description="text or json (one object per line, with task, endpoint and function ids); "
        "`mesh-agent start --log-format` wins, default: MESH_LOG_FORMAT, else text")
    gateway_id: str | None = Field(None, pattern=r"^ep-[0-9a-f]+$", description="this device dials the site gateway with this "
                                   "endpoint id on its LAN (docs/sites.md): its results and acks are signed to stay valid while the uplink is down")
    site: "SiteSettings | None" = Field(None, description="run as a site gateway (`mesh-agent gateway`, docs/sites.md)")
    engine: Literal["local", "parsl"] = Field("local", description="local: warm worker pool; parsl: HPC batch jobs")
    parsl: ParslSettings = ParslSettings()
    globus: GlobusStaging | None = None
    # What the hub's scheduler may select this endpoint by (sent in every hello).
    tags: list[Tag] = Field(default_factory=list, max_length=32, description="labels for tag selectors, e.g. [field-data, solar]")
    hardware: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,64}$",
                                 description="hardware class shared by identical devices (their run-time profiles are pooled), e.g. pi4")
    gpu: bool = Field(False, description="a GPU usable by functions (tasks may require one)")
    datasets: dict[DatasetName, DatasetDecl] = Field(default_factory=dict, description="named datasets on this device (FL): module:function, a path, or {loader|path, kwargs}")
    allowed_functions: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] | None = Field(
        None, description="local allow-list of function ids this device runs (None: any the hub allows)"
    )
    queue_max_mb: int | None = Field(
        None, ge=1, description="cap on the queue database (SQLite max_page_count); when reached, new tasks are refused as on a full disk"
    )
    insecure_plaintext: bool = Field(
        False, description="allow plaintext MQTT and http:// to a host that is not this machine (traffic crosses the network in clear)"
    )
    environments: EnvironmentsSettings = EnvironmentsSettings()

    @property
    def queue_path(self) -> Path:
        return self.data_dir / "queue.sqlite3"

    def save(self, path: Path) -> None:
        write_private(path, yaml.safe_dump(json.loads(self.model_dump_json()), sort_keys=False))


class Credentials(BaseModel):
    model_config = ConfigDict(extra="forbid")
    endpoint_id: str
    # Secret fields are left out of repr()/str() (docs/security.md): a printed or logged
    # Credentials object shows who, never the key or a password.
    key: str = Field(pattern=r"^[0-9a-f]{64}$", description="hex HMAC key shared with the hub", repr=False)
    mqtt_username: str | None = None
    mqtt_password: str | None = Field(None, repr=False)
    globus_client_id: str | None = None  # data staging (GlobusStaging)
    globus_client_secret: str | None = Field(None, repr=False)
    # ZeroMQ CURVE (z85): this agent's keypair, and the hub's public key learnt at enrollment.
    curve_public: str | None = Field(None, min_length=40, max_length=40)
    curve_secret: str | None = Field(None, min_length=40, max_length=40, repr=False)
    hub_curve_key: str | None = Field(None, min_length=40, max_length=40)

    @property
    def key_bytes(self) -> bytes:
        return bytes.fromhex(self.key)

    def save(self, path: Path) -> None:
        write_private(path, self.model_dump_json(indent=2))


def shape_of(model: type[BaseModel]) -> dict[str, Any]:
    """Which fields of ``model`` are paths (``"path"``) or nested models (their own shape), read off
    the model's annotations: what :mod:`mesh_agent.settings` needs to rebuild attribute access from
    dumped JSON without pydantic, and without a hand-kept copy of this schema."""
    shape: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        kinds = [a for a in (get_args(field.annotation) or (field.annotation,)) if a is not type(None)]
        if get_origin(field.annotation) not in (None, Union, UnionType):
            continue  # containers (lists, the datasets mapping) hold data, not sections
        for kind in kinds:
            if kind is Path:
                shape[name] = PATH
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                shape[name] = shape_of(kind)
    return shape


def runner_payload(cfg: AgentConfig, creds: Credentials, **extra: Any) -> dict[str, Any]:
    """Validated settings, dumped for the light runner (:mod:`mesh_agent.run`) with their shapes."""
    return {
        "config": cfg.model_dump(mode="json"),
        "credentials": creds.model_dump(mode="json"),
        "shapes": {"config": shape_of(AgentConfig), "credentials": shape_of(Credentials)},
        **extra,
    }


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, atomically (no window where it is world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _errors(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or '(file)'}: {e['msg']}" for e in exc.errors())


def plaintext_dials(cfg: AgentConfig) -> list[tuple[str, str, str]]:
    """Every address this agent may dial in clear with a secret on the wire, as (config key, address, what is sent).

    - MQTT without ``mqtt.tls`` (tcp or ws): ``mqtt.host`` and each entry of ``mqtt.hosts`` (the
      agent fails over between them; a site gateway's uplink dials ``mqtt.host``), carrying the
      broker password in CONNECT. A device behind a site gateway dials the gateway here too.
    - ``hub_url`` with ``http://``: enrollment sends the token and receives the key over it.
    - ``environments.index_url`` / ``find_links`` with ``http://user:password@``: the password.
    ZeroMQ is left out: its link is always CURVE-encrypted (the credentials must hold the keys)."""
    from urllib.parse import urlsplit

    from mesh_agent.transport.brokers import parse_hostport

    out: list[tuple[str, str, str]] = []
    if cfg.transport == "mqtt" and cfg.mqtt.tls is None:
        scheme = "ws" if cfg.mqtt.transport == "websockets" else "mqtt"
        out.append(("mqtt.host", f"{scheme}://{_hostport(cfg.mqtt.host, cfg.mqtt.port)}", "MQTT login"))
        for i, entry in enumerate(cfg.mqtt.hosts):
            host, port = parse_hostport(entry, cfg.mqtt.port)
            out.append((f"mqtt.hosts[{i}]", f"{scheme}://{_hostport(host, port)}", "MQTT login"))
    url = urlsplit(cfg.hub_url)
    if url.scheme == "http":
        out.append(("hub_url", cfg.hub_url, "enrollment token and endpoint key"))
    envs = cfg.environments
    for key, link in [("environments.index_url", envs.index_url)] + [(f"environments.find_links[{i}]", x) for i, x in enumerate(envs.find_links)]:
        u = urlsplit(link or "")
        if u.scheme == "http" and u.password:
            out.append((key, link or "", "index password"))
    return out


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_of(address: str) -> str:
    from urllib.parse import urlsplit

    try:
        return urlsplit(address).hostname or ""
    except ValueError:
        return ""


def check_plaintext(cfg: AgentConfig, path: Path | str = "config") -> None:
    """Refuse links that would cross the network in clear, unless ``insecure_plaintext: true``.

    Every address the agent may dial is checked (:func:`plaintext_dials`), not only the first broker.
    Loopback stays allowed (the demo, tests, a broker on the device itself): nothing leaves the machine.
    The error is one line naming the key, the address (password masked) and the fix."""
    if cfg.insecure_plaintext:
        return
    from mesh_agent.redact import mask_url
    from mesh_agent.tls import is_loopback

    for key, address, what in plaintext_dials(cfg):
        if is_loopback(_host_of(address)):
            continue
        shown = mask_url(address)
        if key.startswith("mqtt."):
            hostport = shown.split("://", 1)[1]
            raise ConfigError(f"{path}: {key}: plaintext MQTT to {hostport} refused: that host is not this machine and the {what} "
                              "would cross the network in clear; configure mqtt.tls (mesh-agent init --ca-hash does) or set insecure_plaintext: true")
        if key == "hub_url":
            raise ConfigError(f"{path}: plaintext hub_url {shown} refused: the {what} would cross the network in clear; "
                              "use https:// or set insecure_plaintext: true")
        raise ConfigError(f"{path}: {key}: {shown} refused: the {what} would cross the network in clear; "
                          "use https:// (or a path or file:// URL) or set insecure_plaintext: true")


def load_config(path: Path) -> tuple[AgentConfig, Credentials]:
    """Load and validate config + credentials; raise ConfigError naming the file and field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file (run `mesh-agent init` first)") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    try:
        cfg = AgentConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_errors(exc)}") from None
    check_plaintext(cfg, path)
    if cfg.transport == "mqtt" and cfg.mqtt.tls is not None:
        from mesh_agent.tls import TlsError, client_context

        t = cfg.mqtt.tls
        try:  # a missing or damaged CA/client certificate fails here, not at every reconnect
            client_context(t.ca_file, cert_file=t.cert_file, key_file=t.key_file, server_name=t.server_name, pin_sha256=t.pin_sha256)
        except TlsError as exc:
            raise ConfigError(f"{path}: mqtt.tls: {exc}") from None
    try:
        creds = Credentials.model_validate_json(cfg.credentials_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{cfg.credentials_file}: credentials file missing") from None
    except ValidationError as exc:
        raise ConfigError(f"{cfg.credentials_file}: {_errors(exc)}") from None
    except OSError as exc:
        raise ConfigError(f"{cfg.credentials_file}: cannot read credentials: {exc.strerror}") from None
    if cfg.globus is not None and not (creds.globus_client_id and creds.globus_client_secret):
        raise ConfigError(f"{cfg.credentials_file}: `globus:` staging is configured but globus_client_id / globus_client_secret are missing")
    if creds.endpoint_id != cfg.endpoint_id:
        raise ConfigError(f"{cfg.credentials_file}: credentials are for endpoint {creds.endpoint_id}, config is for {cfg.endpoint_id}")
    if cfg.transport == "zmq" and not (creds.curve_public and creds.curve_secret and creds.hub_curve_key):
        raise ConfigError(
            f"{cfg.credentials_file}: no ZeroMQ CURVE keys (curve_public, curve_secret, hub_curve_key); "
            "this endpoint was enrolled by an older mesh-agent: run `mesh-agent init` again"
        )
    return cfg, creds
