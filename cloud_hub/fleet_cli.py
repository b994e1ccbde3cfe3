"""``mesh-hub fleet``: balena fleet devices and their enrollment tokens (see cloud_hub/fleet.py)."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

__all__ = ["fleet_app"]

fleet_app = typer.Typer(help="balena fleets: device online state, per-device enrollment tokens.", no_args_is_help=True,
                        pretty_exceptions_show_locals=False)
console = Console()

BalenaToken = typer.Option("", "--balena-token", envvar="BALENA_API_TOKEN", help="balena API token (env BALENA_API_TOKEN)")
BalenaApi = typer.Option(None, "--balena-api-url", envvar="BALENA_API_URL", help="API URL (openBalena); default https://api.balena-cloud.com/")


def _fail(exc: Exception) -> typer.Exit:
    console.print(f"[red]error:[/red] {exc}")
    return typer.Exit(2)


@fleet_app.command("ls")
def fleet_ls(fleet: str = typer.Argument(..., help="fleet slug, e.g. my-org/field-pis"),
             balena_token: str = BalenaToken, balena_api_url: Optional[str] = BalenaApi) -> None:
    """The fleet's devices: online state, last contact, whether they hold an enrollment token."""
    from cloud_hub.fleet import TOKEN_VAR, BalenaFleet, FleetError

    try:
        with BalenaFleet(balena_token, api_url=balena_api_url) as bf:
            devices = bf.devices(fleet)
    except FleetError as exc:
        raise _fail(exc) from None
    t = Table("device", "uuid", "online", "last seen", "enroll token", title=f"fleet {fleet}")
    for d in devices:
        t.add_row(d.name, d.uuid[:7], "[green]online[/green]" if d.online else "[red]offline[/red]", d.last_seen or "-",
                  "set" if TOKEN_VAR in d.env else "-")
    console.print(t)
    console.print(f"{sum(d.online for d in devices)}/{len(devices)} online")


@fleet_app.command("push-tokens")
def fleet_push_tokens(
    fleet: str = typer.Argument(..., help="fleet slug, e.g. my-org/field-pis"),
    hub: Optional[str] = typer.Option(None, "--hub", help="hub URL used to mint tokens (default: MESH_HUB_URL, else the `mesh-hub login` profile)"),
    token: Optional[str] = typer.Option(None, "--token", help="your hub API token (default: MESH_TOKEN, else the `mesh-hub login` profile)"),
    profile: Optional[str] = typer.Option(None, "--profile", help="the `mesh-hub login` profile to use (default: MESH_PROFILE, else the default one)"),
    device_hub_url: Optional[str] = typer.Option(None, "--device-hub-url", help="hub URL as devices reach it (default: the hub URL above)"),
    ttl_s: float = typer.Option(7 * 86400, "--ttl-s", help="token lifetime in seconds"),
    force: bool = typer.Option(False, "--force", help="also devices that have a token or are enrolled"),
    device: Optional[List[str]] = typer.Option(None, "--device", help="only these device names (repeatable)"),
    balena_token: str = BalenaToken,
    balena_api_url: Optional[str] = BalenaApi,
) -> None:
    """Mint one single-use enrollment token per device and set it as its device variable.

    The hub and your token come from the same place as the SDK's (``mesh-hub login``; MESH_HUB_URL and
    MESH_TOKEN override the profile; --hub and --token override both)."""
    import httpx

    from cloud_hub.client import Client, ConfigError, HubError
    from cloud_hub.fleet import BalenaFleet, FleetError, push_tokens

    try:
        client = Client(hub, token, profile=profile)  # no request yet: arguments, environment, profile (cloud_hub/client/_config.py)
    except ConfigError as exc:
        raise _fail(exc) from None
    try:
        with client, BalenaFleet(balena_token, api_url=balena_api_url) as bf:
            outcomes = push_tokens(bf, fleet, client, device_hub_url or client.url, ttl_s=ttl_s, force=force,
                                   only=set(device) if device else None)
    except (FleetError, HubError, httpx.HTTPError, ConnectionError) as exc:
        raise _fail(exc) from None
    t = Table("device", "result", title=f"fleet {fleet}")
    for o in outcomes:
        t.add_row(o.device, o.action)
    console.print(t)
