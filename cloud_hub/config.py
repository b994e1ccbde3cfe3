"""Hub settings (pydantic): file, CLI flags and ``MESH_HUB_*`` environment variables all land here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["HubConfig"]


class HubConfig(BaseModel):
    """Secrets (broker password, metrics token, Globus client secret) are left out of repr()/str(),
    and the password of ``database_url`` is masked there (docs/security.md)."""

    model_config = ConfigDict(extra="forbid")

    db_path: Path = Path("hub.sqlite3")
    database_url: str | None = Field(None, description="postgresql://... : PostgreSQL instead of db_path; replicas may share it")
    replica_id: str | None = Field(None, description="this replica's name among several sharing database_url (default: random)")
    mqtt_client_id: str = Field("mesh-hub", description="MQTT client id; each replica needs its own")
    host: str = "127.0.0.1"
    port: int = Field(8700, ge=0, le=65535)
    # MQTT: the broker the hub connects to, and the address it tells agents to use.
    mqtt_host: str | None = "127.0.0.1"
    mqtt_port: int = Field(1883, ge=1, le=65535)
    mqtt_prefix: str = "mesh"
    mqtt_username: str | None = None
    mqtt_password: str | None = Field(None, repr=False)
    mqtt_public_host: str | None = None
    # TLS (docs/security.md#tls): the broker URL agents are told at enrollment (mqtts://host:8883 or
    # wss://host:443/mqtt; default mqtt://mqtt_public_host:mqtt_port), the CA they are given (its
    # sha256 goes out with every enrollment token, for `mesh-agent init --ca-hash`), HTTPS for the API.
    mqtt_public_url: str | None = Field(None, pattern=r"^(mqtt|mqtts|ws|wss)://[^/\s:]+(:\d{1,5})?(/\S*)?$")
    mqtt_tls: bool = Field(False, description="the hub's own broker link uses TLS (verified with tls_ca_file, else the system's CAs)")
    insecure_plaintext: bool = Field(False, description="allow the hub's broker login over plain MQTT to a broker that is not "
                                     "on this machine (its password would cross the network in clear)")
    tls_ca_file: Path | None = Field(None, description="PEM CA that signs the broker's (and API's) certificate; sent to agents at enrollment")
    tls_cert_file: Path | None = Field(None, description="HTTPS for the REST API: certificate chain (PEM)")
    tls_key_file: Path | None = Field(None, description="HTTPS for the REST API: its private key (PEM)")
    # Per-endpoint broker logins and ACLs (docs/security.md): where the hub writes Mosquitto's
    # password_file and acl_file (on start and after each enrollment), and the broker's pid to SIGHUP.
    mqtt_auth_dir: Path | None = None
    mqtt_broker_pid_file: Path | None = Field(None, description="pid file of the broker to SIGHUP after a rewrite (one pid a line: several nodes)")
    # A clustered broker (docs/operations.md, "Clustered broker"): what the files in mqtt_auth_dir are
    # written for, and the other nodes the hub's own link fails over to (mqtt_host:mqtt_port first).
    mqtt_broker_kind: Literal["mosquitto", "nats"] = Field("mosquitto", description="mosquitto: password_file + acl_file; nats: nats_auth.conf")
    mqtt_hosts: list[str] = Field(default_factory=list, description="further broker nodes, host:port each (MESH_HUB_MQTT_HOSTS=a:1883,b:1883)")
    # ZeroMQ: where the hub's ROUTER binds, and the address agents connect to.
    zmq_bind: str | None = "tcp://127.0.0.1:8701"
    zmq_public: str | None = None
    heartbeat_s: float = Field(5.0, gt=0, description="agents beat this often")
    lost_after_s: float = Field(15.0, gt=0, description="silence after which an endpoint is offline")
    # Metered MQTT agents (profile: metered) beat only on change; the broker's will tells the hub
    # when one goes silent. See docs/protocol.md, "Liveness and idle cost", for the bytes each costs.
    mqtt_lost_after_s: float = Field(360.0, ge=2, description="offline bound for MQTT agents that beat on change: keepalive = (bound - slack) / 1.5")
    beat_max_s: float = Field(1800.0, gt=0, description="longest an MQTT agent that beats on change stays silent (it is lost after this + mqtt_lost_after_s if its will never came)")
    lease_s: float = Field(30.0, gt=0, description="a dispatched task not acked by then is re-queued")
    site_hold_s: float = Field(3600.0, gt=0, description="a task leased ahead to a site gateway (docs/sites.md) and not acked by its device by then is re-queued: the bound on work stranded at a dead gateway")
    max_payload_bytes: int = Field(10 * 2**20, ge=1024, description="largest function body or argument blob")
    max_batch: int = Field(50_000, ge=1)
    # Embedded store (docs/data.md): a Redis subset on its own port for multiprocessing and refs when no Redis is configured.
    kv_host: str | None = Field("127.0.0.1", description="where the embedded store listens; '' = off")
    kv_port: int = Field(0, ge=0, le=65535, description="its port (0: any free one; GET /v1/kv tells clients)")
    kv_public_host: str | None = Field(None, description="the host endpoints reach it at (default kv_host)")
    kv_max_bytes: int = Field(256 << 20, ge=1 << 20, description="its memory budget; a write past it is refused whole")
    stream: bool = Field(True, description="offer the SDK's WebSocket stream at /v1/stream (docs/protocol.md); off: SDKs use REST")
    # Admission control and fair share (cloud_hub/admission.py, docs/operations.md "Limits, shares and 429").
    limits: dict[str, Any] = Field(default_factory=dict, description='{"user": {"max_queued": N, "max_running": N}, "users": {name: {...}}, '
                                   '"function": {...}, "functions": {function id: {...}}}; MESH_HUB_LIMITS takes the JSON')
    shares: dict[str, float] = Field(default_factory=dict, description="user name -> weight on shared endpoints (default 1); MESH_HUB_SHARES=alice=3,bob=1")
    fair_dispatch: bool = Field(True, description="take turns between users on an endpoint; off: plain arrival order (FIFO)")
    # Memoization (mesh_agent/protocol/memo.py, docs/sdk.md "Memoization").
    memo_ttl_s: float = Field(86400.0, gt=0, description="how long a cached result answers repeats (at most result_ttl_s: results are pruned then)")
    memo_max_entries: int = Field(100_000, ge=1, description="cached results kept per user; the least recently used go first")
    memo_max_result_bytes: int = Field(2**20, ge=0, description="larger results are not cached")
    task_ttl_s: float = Field(30 * 86400, gt=0, description="default expiry of a task that never ran")
    result_ttl_s: float = Field(7 * 86400, gt=0)
    frame_ttl_s: float = Field(120.0, gt=0, description="lifetime of one signed message")
    bootstrap_user: str | None = Field(None, description="create this user at start-up if missing")
    # Prometheus (cloud_hub/metrics.py, docs/operations.md "Monitoring").
    metrics: bool = Field(True, description="serve Prometheus metrics at /metrics")
    metrics_token: str | None = Field(None, description="if set, /metrics wants 'Authorization: Bearer <token>' (it names endpoints)", repr=False)
    metrics_endpoint_detail: Literal["alerts", "full"] = Field("alerts", description="alerts: per-endpoint series only for what the shipped alerts need; full: also bytes and device counters per endpoint")
    metrics_max_functions: int = Field(100, ge=1, description="distinct function labels on task counters; the rest count as function='other'")
    scheduler_policy: str = Field("delta-outage-aware", description="placement policy for endpoint 'auto' / lists / tag selectors")
    late_binding: bool = Field(True, description="send an endpoint only a few scheduler-placed tasks beyond its workers and keep the "
                               "rest in the hub, where an endpoint that runs out of work takes them over (docs/scheduler.md, "
                               "'Late binding'); false: each endpoint gets its whole share at once, up to its prefetch")
    scheduler_save_s: float = Field(30.0, gt=0, description="how often learned scheduler profiles are saved (and at shutdown)")
    # Globus Auth (cloud_hub/globus_auth.py): accept Globus access tokens issued for this client.
    globus_client_id: str | None = None
    globus_client_secret: str | None = Field(None, repr=False)
    globus_scope: str | None = Field(None, description="a scope the token must carry (the hub's own scope)")
    globus_allowed_domains: list[str] = Field(default_factory=list, description="identity domains that get a hub user on first use")
    globus_users: dict[str, str] = Field(default_factory=dict, description="Globus username -> hub user name")
    globus_cache_s: float = Field(60.0, ge=0, description="how long an introspection answer is reused")

    def __repr_args__(self) -> Any:
        from mesh_agent.redact import redact_value

        for name, value in super().__repr_args__():
            yield name, redact_value(value)  # database_url: postgresql://user:***@host/db

    def secrets(self) -> tuple[str | None, ...]:
        """What no log line of the hub may show (registered with mesh_agent.redact when the hub starts)."""
        from urllib.parse import urlsplit

        try:
            db_password = urlsplit(self.database_url).password if self.database_url else None
        except ValueError:
            db_password = None
        return (self.mqtt_password, self.metrics_token, self.globus_client_secret, db_password)

    @field_validator("mqtt_host", "zmq_bind", "database_url", "kv_host", mode="before")
    @classmethod
    def _empty_is_none(cls, v: object) -> object:
        """``--mqtt-host ''`` / ``MESH_HUB_MQTT_HOST=`` mean "no MQTT at all", never "the default broker"."""
        return None if isinstance(v, str) and not v.strip() else v

    @model_validator(mode="after")
    def _broker_login(self) -> "HubConfig":
        """A hub that writes the broker's password file (``mqtt_auth_dir``) runs a broker that refuses
        anonymous clients: it logs in as ``mqtt_username`` (default ``mesh-hub``) and needs its password.
        Refuse to start without one rather than connect anonymously (docs/operations.md)."""
        if self.mqtt_auth_dir is not None and self.mqtt_host:
            if not self.mqtt_username:
                self.mqtt_username = "mesh-hub"
            if not self.mqtt_password:
                raise ValueError(
                    "MESH_HUB_MQTT_AUTH_DIR is set, so the broker refuses anonymous clients, but the hub has no broker password: "
                    f"set MESH_HUB_MQTT_PASSWORD (the hub logs in as MESH_HUB_MQTT_USERNAME, here {self.mqtt_username!r})"
                )
        return self

    @field_validator("mqtt_hosts", mode="before")
    @classmethod
    def _host_list(cls, v: object) -> object:
        """``MESH_HUB_MQTT_HOSTS="10.0.0.2:1883,10.0.0.3:1883"``; each entry must parse as host[:port]."""
        from mesh_agent.transport.brokers import parse_hostport

        items = [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v
        for item in items if isinstance(items, list) else []:
            parse_hostport(str(item), 1883)
        return items

    @model_validator(mode="after")
    def _no_password_in_clear(self) -> "HubConfig":
        """The hub's own broker login never crosses a network in clear (docs/security.md, "Every
        address is checked"): a broker node off this machine needs ``mqtt_tls``, or the operator's
        explicit ``insecure_plaintext``, whenever the hub logs in with a password."""
        if self.mqtt_tls or self.insecure_plaintext or not self.mqtt_password or not self.mqtt_host:
            return self
        from mesh_agent.tls import is_loopback

        for host, port in self.broker_nodes():
            if not is_loopback(host):
                raise ValueError(f"the hub would send its broker password in clear to {host}:{port}: set MESH_HUB_MQTT_TLS=1 "
                                 "(TLS to the broker), or MESH_HUB_INSECURE_PLAINTEXT=1 on a network you trust")
        return self

    def broker_nodes(self) -> list[tuple[str, int]]:
        """The hub's own link's brokers, in order: ``mqtt_host:mqtt_port``, then ``mqtt_hosts`` (a port left out is ``mqtt_port``)."""
        from mesh_agent.transport.brokers import parse_hostport

        first = [(self.mqtt_host, self.mqtt_port)] if self.mqtt_host else []
        rest = [parse_hostport(h, self.mqtt_port) for h in self.mqtt_hosts]
        return first + [b for b in rest if b not in first]

    @field_validator("limits", mode="before")
    @classmethod
    def _json_limits(cls, v: object) -> object:
        """``MESH_HUB_LIMITS='{"user": {"max_queued": 100000}}'``."""
        if isinstance(v, str):
            import json

            try:
                return json.loads(v) if v.strip() else {}
            except ValueError as exc:
                raise ValueError(f"limits is not valid JSON: {exc}") from None
        return v

    @field_validator("shares", mode="before")
    @classmethod
    def _share_pairs(cls, v: object) -> object:
        """``MESH_HUB_SHARES="alice=3,bob=1"`` (or JSON)."""
        if isinstance(v, str):
            import json

            if v.strip().startswith("{"):
                return json.loads(v)
            out: dict[str, object] = {}
            for p in (x.strip() for x in v.split(",") if x.strip()):
                if "=" not in p:
                    raise ValueError(f"shares: {p!r} is not name=weight")
                k, w = p.split("=", 1)
                try:
                    out[k.strip()] = float(w)
                except ValueError:
                    raise ValueError(f"shares: the weight of {k.strip()!r} is not a number: {w!r}") from None
            return out
        return v

    @model_validator(mode="after")
    def _admission(self) -> "HubConfig":
        """Limits and shares are checked at start-up: a hub never runs with limits it misread."""
        from cloud_hub.admission import parse_policy

        parse_policy(self.limits, self.shares, self.fair_dispatch)
        return self

    def admission_policy(self) -> "Any":
        from cloud_hub.admission import parse_policy

        return parse_policy(self.limits, self.shares, self.fair_dispatch)

    @field_validator("globus_allowed_domains", mode="before")
    @classmethod
    def _comma_list(cls, v: object) -> object:
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    @field_validator("globus_users", mode="before")
    @classmethod
    def _pairs(cls, v: object) -> object:
        """``MESH_HUB_GLOBUS_USERS="alice@uni.edu=alice,bob@lab.org=bob"``."""
        if isinstance(v, str):
            return dict(p.split("=", 1) for p in v.split(",") if "=" in p)
        return v

    @field_validator("scheduler_policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from scheduler.policies import POLICIES

        if v not in POLICIES or v == "oracle":
            raise ValueError(f"unknown scheduler policy {v!r}; choose one of: {', '.join(p for p in POLICIES if p != 'oracle')}")
        return v

    @classmethod
    def from_env(cls, **overrides: object) -> "HubConfig":
        """``MESH_HUB_PORT=9000`` etc.; explicit overrides win."""
        env = {
            k[len("MESH_HUB_") :].lower(): v
            for k, v in os.environ.items()
            if k.startswith("MESH_HUB_") and k[len("MESH_HUB_") :].lower() in cls.model_fields
        }
        env.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(env)
