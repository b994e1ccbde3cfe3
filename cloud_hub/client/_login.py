"""``mesh-hub login`` / ``logout`` / ``whoami``: save a hub URL and token in a profile of the user's
config file (``cloud_hub.client._config``), checked against the hub first, so ``Client()`` and
``Executor(endpoint_id=...)`` need no arguments afterwards."""

from __future__ import annotations

import sys
from typing import Optional

import typer

__all__ = ["login", "logout", "whoami"]


def _fail(line: str) -> None:
    print(f"error: {line}", file=sys.stderr)
    raise typer.Exit(1)


def login(
    url: Optional[str] = typer.Option(None, "--url", envvar="MESH_HUB_URL", help="the hub, e.g. https://hub.example.org"),
    token: Optional[str] = typer.Option(None, "--token", help="an API token (`mesh-hub token create`); prompted for when not given"),
    profile: str = typer.Option("default", "--profile", envvar="MESH_PROFILE", help="profile name (several hubs side by side)"),
    ca_file: Optional[str] = typer.Option(None, "--ca-file", help="CA certificate for an https hub with a private CA"),
    default: Optional[bool] = typer.Option(None, "--default/--no-default", help="make this the default profile (the first one is)"),
    check: bool = typer.Option(True, "--check/--no-check", help="check the URL and token against the hub before saving"),
) -> None:
    """Save a hub URL and API token in a profile (~/.config/continuum-mesh/config.yaml, mode 0600)."""
    from cloud_hub.client._client import AuthError, Client, HubError, HubUnreachable
    from cloud_hub.client._config import ConfigError, save_profile

    if not url:
        _fail("give the hub with --url (or MESH_HUB_URL)")
    if not token:
        token = typer.prompt("API token", hide_input=True)
    assert url is not None and token is not None
    try:
        if check:
            with Client(url, token, verify=ca_file) as c:
                c.request("GET", "/v1/results/cursor")  # any authenticated route: proves URL and token
        path = save_profile(profile, url, token, ca_file, make_default=default)
    except (ConfigError, AuthError, HubError, HubUnreachable, OSError) as exc:
        _fail(str(exc))
    print(f"logged in to {url.rstrip('/')} as profile {profile!r} (saved in {path})")


def logout(profile: str = typer.Option("default", "--profile", envvar="MESH_PROFILE")) -> None:
    """Remove a profile (its token) from the config file."""
    from cloud_hub.client._config import ConfigError, config_path, remove_profile

    try:
        gone = remove_profile(profile)
    except ConfigError as exc:
        _fail(str(exc))
    print(f"removed profile {profile!r} from {config_path()}" if gone else f"no profile {profile!r} in {config_path()}")


def whoami(profile: Optional[str] = typer.Option(None, "--profile")) -> None:
    """Which hub the SDK would use, from where, and whether the token works."""
    from cloud_hub.client._client import AuthError, Client, HubError, HubUnreachable
    from cloud_hub.client._config import ConfigError

    try:
        with Client(profile=profile) as c:
            c.request("GET", "/v1/results/cursor")
            print(f"{c.url} ({c.config_source}): token accepted")
    except (ConfigError, AuthError, HubError, HubUnreachable) as exc:
        _fail(str(exc))
