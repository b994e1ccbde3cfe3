"""balena fleets: list a fleet's devices and give each one its own enrollment token.

``mesh-hub fleet ls`` and ``mesh-hub fleet push-tokens`` use the official balena-sdk. A device
enrolls itself on first boot from the device variables ``MESH_HUB_URL`` and
``MESH_ENROLL_TOKEN`` (see ``mesh_agent/bootstrap.py``); this module mints one single-use token
per device through the hub's REST API and sets it as that device's variable, so a token that
leaks from one device enrolls nothing else, and a used token is worthless.

Why a private settings folder: balena-sdk keeps its settings, including the API token, in a
``balena.cfg`` file. Each :class:`BalenaFleet` writes its own into a fresh 0700 temporary folder
(removed on close) instead of touching the user's ``~/.balena``; the same file carries
``api_endpoint`` for openBalena or another API URL.
"""

from __future__ import annotations

import configparser
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["BalenaFleet", "FleetDevice", "FleetError", "PushOutcome", "push_tokens"]

#: Device variables the agent reads on first boot (mesh_agent.bootstrap.ENV_VARS).
HUB_VAR, TOKEN_VAR, NAME_VAR = "MESH_HUB_URL", "MESH_ENROLL_TOKEN", "MESH_AGENT_NAME"


class FleetError(RuntimeError):
    """balena refused or could not answer; the message says what to fix."""


@dataclass
class FleetDevice:
    uuid: str
    name: str
    online: bool
    last_seen: str | None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class PushOutcome:
    device: str
    action: str  # "pushed", "skipped: ..."


def _describe(exc: Exception) -> str:
    status = getattr(exc, "status_code", None)
    if status == 401:
        return "balena refused the API token (401): create one in the dashboard (Preferences > Access tokens)"
    if status is not None:
        return f"balena API error {status}: {getattr(exc, 'body', exc)}"
    return f"{type(exc).__name__}: {getattr(exc, 'message', exc)}"


class BalenaFleet:
    """A balena-sdk client with its own settings folder; a context manager."""

    def __init__(self, api_token: str, *, api_url: str | None = None, balena_host: str = "balena-cloud.com") -> None:
        try:
            from balena import Balena
            from balena.settings import DEFAULT_SETTINGS
        except ImportError as exc:
            raise FleetError(f"balena-sdk is not installed (pip install 'continuum-mesh[fleet]'): {exc}") from None
        if not api_token:
            raise FleetError("no balena API token (--balena-token or BALENA_API_TOKEN)")
        self._dir = Path(tempfile.mkdtemp(prefix="mesh-balena-"))
        os.chmod(self._dir, 0o700)
        settings = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in DEFAULT_SETTINGS.items()}
        api = (api_url.rstrip("/") + "/") if api_url else f"https://api.{balena_host}/"
        settings.update(
            balena_host=balena_host, builder_url=f"https://builder.{balena_host}/", api_endpoint=api,
            pine_endpoint=f"{api}{settings['api_version']}/", data_directory=str(self._dir), cache_directory=str(self._dir / "cache"),
        )
        cfg = configparser.ConfigParser()
        cfg["Settings"] = settings
        fd = os.open(self._dir / "balena.cfg", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            cfg.write(f)
        self.sdk: Any = Balena({"data_directory": str(self._dir), "balena_host": balena_host})
        self.sdk.auth.login_with_token(api_token)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "BalenaFleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def devices(self, fleet: str) -> list[FleetDevice]:
        """The fleet's devices (by slug, e.g. ``my-org/field-pis``) with online state and variables."""
        from balena.exceptions import ApplicationNotFound

        try:
            rows = self.sdk.models.device.get_all_by_application(
                fleet, {"$select": ["id", "uuid", "device_name", "is_online", "last_connectivity_event"]})
            env_rows = self.sdk.models.device.env_var.get_all_by_application(fleet)
        except ApplicationNotFound:
            raise FleetError(f"no balena fleet {fleet!r} visible with this token (use the slug, e.g. my-org/field-pis)") from None
        except Exception as exc:
            raise FleetError(_describe(exc)) from None
        env: dict[int, dict[str, str]] = {}
        for e in env_rows:
            dev = e["device"]["__id"] if isinstance(e["device"], dict) else e["device"]
            env.setdefault(dev, {})[e["name"]] = e["value"]
        return [
            FleetDevice(uuid=r["uuid"], name=r["device_name"], online=bool(r["is_online"]),
                        last_seen=r.get("last_connectivity_event"), env=env.get(r["id"], {}))
            for r in rows
        ]

    def set_env(self, device_uuid: str, name: str, value: str) -> None:
        try:
            self.sdk.models.device.env_var.set(device_uuid, name, value)
        except Exception as exc:
            raise FleetError(f"setting {name} on device {device_uuid[:7]}: {_describe(exc)}") from None


def push_tokens(
    fleet: BalenaFleet,
    slug: str,
    hub: Any,
    device_hub_url: str,
    *,
    ttl_s: float = 7 * 86400,
    force: bool = False,
    only: set[str] | None = None,
) -> list[PushOutcome]:
    """Give every device of ``slug`` that needs one a fresh single-use enrollment token.

    A device is skipped when it already has ``MESH_ENROLL_TOKEN`` or an endpoint of its name is
    enrolled in the hub (``force`` pushes anyway, e.g. after wiping a device). ``hub`` is a
    :class:`cloud_hub.client.Client`. Everything is read and checked before the first write, so
    a wrong fleet, token or device name changes nothing.
    """
    devices = fleet.devices(slug)
    names = {d.name for d in devices}
    if only and only - names:
        raise FleetError(f"no device named {sorted(only - names)[0]!r} in fleet {slug}")
    enrolled = {e["name"] for e in hub.list_endpoints()}  # also proves the hub token works
    outcomes: list[PushOutcome] = []
    for d in devices:
        if only and d.name not in only:
            continue
        if not force and TOKEN_VAR in d.env:
            outcomes.append(PushOutcome(d.name, "skipped: already has a token"))
            continue
        if not force and d.name in enrolled:
            outcomes.append(PushOutcome(d.name, "skipped: already enrolled"))
            continue
        token = hub.create_enrollment_token(ttl_s=ttl_s, uses=1)
        fleet.set_env(d.uuid, HUB_VAR, device_hub_url)
        fleet.set_env(d.uuid, NAME_VAR, d.name)
        fleet.set_env(d.uuid, TOKEN_VAR, token)  # last: a device never sees a token without its hub URL
        outcomes.append(PushOutcome(d.name, "pushed"))
    return outcomes
