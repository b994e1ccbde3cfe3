"""First-boot enrollment from environment variables (balena device variables, systemd, Apptainer).

A fleet device has no one at a keyboard to run ``mesh-agent init``: its image carries the
agent, and the fleet manager hands it the hub URL and a per-device enrollment token as
environment variables. ``mesh-agent start`` calls :func:`ensure_enrolled` first: with no config
file yet and ``MESH_HUB_URL`` set, it enrolls once, writes config and credentials (mode 0600) to
the persistent volume, and the same process then starts. Later boots find the config and never
touch the token again, so a single-use token is all a device needs (``mesh-hub fleet`` pushes
exactly that).

Why retries live here: a Pi's first boot often comes before its link does (slow DHCP, a modem
still attaching). Transport errors and 5xx answers are retried with capped backoff (the one
policy of mesh_agent/backoff.py) for ``MESH_ENROLL_WAIT_S`` seconds; a refusal (4xx: a wrong,
expired or used-up token) is final and reported at once, without writing anything.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from typing import Callable, Literal, Mapping

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mesh_agent.backoff import Backoff, retry
from mesh_agent.config import AgentConfig, ConfigError

__all__ = ["EnvEnrollment", "ENV_VARS", "HubUnreachable", "from_env", "ensure_enrolled"]

log = logging.getLogger("mesh_agent.bootstrap")

#: Enrollment retries (mesh_agent/backoff.py): 4 s doubling to 60 s, times 0.5-1.0, for ``wait_s``
#: (the deadline is set per call). The last wait is cut to end at the deadline, one last try then.
_ENROLL = Backoff(base=4.0, cap=60.0, jitter=(0.5, 1.0))

#: Environment variable -> field of :class:`EnvEnrollment`; documented in docs/operations.md.
ENV_VARS: dict[str, str] = {
    "MESH_HUB_URL": "hub_url",
    "MESH_ENROLL_TOKEN": "enroll_token",
    "MESH_AGENT_NAME": "name",
    "MESH_TRANSPORT": "transport",
    "MESH_DATA_DIR": "data_dir",
    "MESH_WORKERS": "workers",
    "MESH_PREFETCH": "prefetch",
    "MESH_TASK_TIMEOUT": "task_timeout",
    "MESH_MQTT_HOST": "mqtt_host",
    "MESH_MQTT_PORT": "mqtt_port",
    "MESH_ZMQ_ADDRESS": "zmq_address",
    "MESH_ENROLL_WAIT_S": "wait_s",
    "MESH_CA_HASH": "ca_hash",
}


class HubUnreachable(ConfigError):
    """Enrollment could not reach the hub in time: worth retrying later, unlike a refusal."""


class EnvEnrollment(BaseModel):
    """What a device needs to enroll itself, read from ``MESH_*`` variables."""

    model_config = ConfigDict(extra="forbid")

    hub_url: str = Field(pattern=r"^https?://\S+$")
    enroll_token: str = Field(min_length=1, repr=False)  # never in a repr, a log line or an error
    name: str = Field(min_length=1, max_length=128)
    transport: Literal["mqtt", "zmq"] = "mqtt"
    data_dir: Path | None = None
    workers: int | None = Field(None, ge=1)
    prefetch: int = Field(256, ge=0)
    task_timeout: float | None = Field(None, gt=0)
    mqtt_host: str | None = None
    mqtt_port: int | None = Field(None, ge=1, le=65535)
    zmq_address: str | None = None
    wait_s: float = Field(600.0, ge=0, description="how long to keep retrying an unreachable hub")
    ca_hash: str | None = Field(None, description="sha256:... of the hub's CA (from the enrollment token's output), pinned as by `init --ca-hash`")


def _default_name(env: Mapping[str, str]) -> str:
    """balena sets BALENA_DEVICE_NAME_AT_INIT; elsewhere the short host name."""
    return env.get("BALENA_DEVICE_NAME_AT_INIT") or socket.gethostname().split(".")[0]


def from_env(env: Mapping[str, str] | None = None) -> EnvEnrollment | None:
    """The enrollment settings in ``env``, ``None`` when ``MESH_HUB_URL`` is unset.

    Raises :class:`ConfigError` naming the variable when one is missing or malformed.
    """
    env = os.environ if env is None else env
    if not env.get("MESH_HUB_URL"):
        return None
    raw: dict[str, str] = {field: env[var] for var, field in ENV_VARS.items() if env.get(var, "") != ""}
    if "enroll_token" not in raw:
        raise ConfigError("MESH_HUB_URL is set but MESH_ENROLL_TOKEN is not: the device cannot enroll without a token")
    raw.setdefault("name", _default_name(env))
    try:
        return EnvEnrollment.model_validate(raw)
    except ValidationError as exc:
        field_to_var = {f: v for v, f in ENV_VARS.items()}
        problems = "; ".join(f"{field_to_var.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"bad enrollment environment: {problems}") from None


def ensure_enrolled(
    config_path: Path,
    env: Mapping[str, str] | None = None,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> Literal["configured", "enrolled", "none"]:
    """Enroll from the environment when ``config_path`` does not exist yet.

    Returns ``"configured"`` if a config file is already there (the token is ignored),
    ``"enrolled"`` after a successful first-boot enrollment, ``"none"`` when neither a config nor
    ``MESH_HUB_URL`` exists (the caller then reports the missing config as before).
    Raises :class:`ConfigError` on a refusal or when the hub stays unreachable; nothing is
    written in either case.
    """
    from mesh_agent.cli import EnrollError, enroll  # the same code path as `mesh-agent init`

    config_path = Path(config_path)
    settings = from_env(env)
    if config_path.exists():
        if settings is not None:
            log.info("config %s exists; MESH_ENROLL_TOKEN is not used again", config_path)
        return "configured"
    if settings is None:
        return "none"
    attempts = 0

    def once() -> AgentConfig:
        nonlocal attempts
        attempts += 1
        return enroll(
            settings.hub_url, settings.enroll_token, settings.name, config_path,
            transport=settings.transport, data_dir=settings.data_dir, workers=settings.workers,
            prefetch=settings.prefetch, task_timeout=settings.task_timeout, mqtt_host=settings.mqtt_host,
            mqtt_port=settings.mqtt_port, zmq_address=settings.zmq_address, ca_hash=settings.ca_hash,
        )

    def retryable(exc: BaseException) -> bool:  # 4xx: refused for good; 5xx: the hub is having a bad moment
        return isinstance(exc, httpx.TransportError) or (isinstance(exc, EnrollError) and exc.status >= 500)

    def why(exc: BaseException) -> str:
        return f"hub {settings.hub_url} unreachable: {exc}" if isinstance(exc, httpx.TransportError) else str(exc)

    def note(attempt: int, exc: BaseException, delay: float) -> None:
        log.warning("enrollment attempt %d failed (%s); retrying in %.0f s", attempt, why(exc), delay)

    try:
        cfg = retry(once, retry_on=retryable, policy=_ENROLL.replace(deadline=settings.wait_s), sleep=sleep, on_retry=note)
    except (httpx.TransportError, EnrollError) as exc:
        if not retryable(exc):
            raise
        raise HubUnreachable(f"could not enroll after {attempts} attempt(s) in {settings.wait_s:g} s: {why(exc)}") from None
    log.info("enrolled as %s (%s) with %s", cfg.endpoint_id, settings.name, settings.hub_url)
    return "enrolled"
