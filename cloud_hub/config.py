"""Hub settings (pydantic): file, CLI flags and ``MESH_HUB_*`` environment variables all land here."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["HubConfig"]


class HubConfig(BaseModel):
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
    mqtt_password: str | None = None
    mqtt_public_host: str | None = None
    # Per-endpoint broker logins and ACLs (docs/security.md): where the hub writes Mosquitto's
    # password_file and acl_file (on start and after each enrollment), and the broker's pid to SIGHUP.
    mqtt_auth_dir: Path | None = None
    mqtt_broker_pid_file: Path | None = None
    # ZeroMQ: where the hub's ROUTER binds, and the address agents connect to.
    zmq_bind: str | None = "tcp://127.0.0.1:8701"
    zmq_public: str | None = None
    heartbeat_s: float = Field(5.0, gt=0, description="agents beat this often")
    lost_after_s: float = Field(15.0, gt=0, description="silence after which an endpoint is offline")
    lease_s: float = Field(30.0, gt=0, description="a dispatched task not acked by then is re-queued")
    max_payload_bytes: int = Field(10 * 2**20, ge=1024, description="largest function body or argument blob")
    max_batch: int = Field(50_000, ge=1)
    task_ttl_s: float = Field(30 * 86400, gt=0, description="default expiry of a task that never ran")
    result_ttl_s: float = Field(7 * 86400, gt=0)
    frame_ttl_s: float = Field(120.0, gt=0, description="lifetime of one signed message")
    bootstrap_user: str | None = Field(None, description="create this user at start-up if missing")
    scheduler_policy: str = Field("delta-outage-aware", description="placement policy for endpoint 'auto' / lists / tag selectors")
    scheduler_save_s: float = Field(30.0, gt=0, description="how often learned scheduler profiles are saved (and at shutdown)")
    # Globus Auth (cloud_hub/globus_auth.py): accept Globus access tokens issued for this client.
    globus_client_id: str | None = None
    globus_client_secret: str | None = None
    globus_scope: str | None = Field(None, description="a scope the token must carry (the hub's own scope)")
    globus_allowed_domains: list[str] = Field(default_factory=list, description="identity domains that get a hub user on first use")
    globus_users: dict[str, str] = Field(default_factory=dict, description="Globus username -> hub user name")
    globus_cache_s: float = Field(60.0, ge=0, description="how long an introspection answer is reused")

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
