"""Where the SDK finds its hub and token: arguments, then ``MESH_HUB_URL`` / ``MESH_TOKEN``, then a
profile in the user's config file (written by ``mesh-hub login``).

The file is ``$XDG_CONFIG_HOME/continuum-mesh/config.yaml`` (``~/.config/...`` by default;
``MESH_CONFIG`` names another), mode 0600 because it holds tokens::

    default_profile: default
    profiles:
      default: {hub_url: "https://hub.example.org", token: "cm_...", ca_file: null}
      lab:     {hub_url: "http://10.0.0.5:8700", token: "cm_..."}

``MESH_PROFILE`` picks a profile. The file is read only when arguments and environment leave
something unset, so a broken file never stops a fully configured environment.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

__all__ = ["ConfigError", "HubSettings", "config_path", "resolve", "save_profile", "remove_profile", "load_config"]


class ConfigError(ValueError):
    """The SDK cannot tell which hub to use or with which token; the message says how to fix it."""


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hub_url: str = Field(min_length=1)
    token: str = Field(min_length=1)
    ca_file: str | None = None

    @field_validator("hub_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"hub_url must start with http:// or https://, not {v!r}")
        return v.rstrip("/")


class ConfigFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    default_profile: str = "default"
    profiles: dict[str, Profile] = Field(default_factory=dict)


@dataclass(frozen=True)
class HubSettings:
    """What a :class:`Client` connects with, and where each part came from (for error messages)."""

    url: str
    token: str
    ca_file: str | None
    source: str


def config_path() -> Path:
    if os.environ.get("MESH_CONFIG"):
        return Path(os.environ["MESH_CONFIG"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "continuum-mesh" / "config.yaml"


def load_config(path: Path | None = None) -> ConfigFile:
    """The config file, or an empty one when there is none; any other problem is one clear line."""
    import yaml

    path = path or config_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        return ConfigFile()
    except OSError as exc:
        raise ConfigError(f"cannot read the mesh config file {path}: {exc.strerror}") from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"cannot read the mesh config file {path}: not valid YAML{where}; fix it or run `mesh-hub login` again") from None
    try:
        return ConfigFile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"cannot read the mesh config file {path}: {loc}: {err['msg'].removeprefix('Value error, ')}") from None


def resolve(url: str | None = None, token: str | None = None, profile: str | None = None) -> HubSettings:
    """Arguments win, then ``MESH_HUB_URL`` / ``MESH_TOKEN``, then the profile."""
    url = url or os.environ.get("MESH_HUB_URL") or None
    token = token or os.environ.get("MESH_TOKEN") or None
    ca = os.environ.get("MESH_CA_FILE") or None
    name = profile or os.environ.get("MESH_PROFILE") or None
    source = "arguments/environment"
    if url is None or token is None or name is not None:
        path = config_path()
        cfg = load_config(path)
        name = name or cfg.default_profile
        prof = cfg.profiles.get(name)
        if prof is None and (profile or os.environ.get("MESH_PROFILE")):
            have = ", ".join(sorted(cfg.profiles)) or "none"
            raise ConfigError(f"no profile {name!r} in {path} (profiles: {have}); run `mesh-hub login --profile {name} --url URL`")
        if prof is not None:
            url, token = url or prof.hub_url, token or prof.token
            ca = ca or prof.ca_file
            source = f"profile {name!r} in {path}"
        if url is None:
            raise ConfigError(f"no hub URL: run `mesh-hub login --url URL` (saves it in {path}) or set MESH_HUB_URL")
        if token is None:
            raise ConfigError(f"no hub token: run `mesh-hub login --url {url}` (saves it in {path}) or set MESH_TOKEN")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"hub URL {url!r} must start with http:// or https:// (from {source})")
    return HubSettings(url.rstrip("/"), token, ca, source)


def _write(path: Path, cfg: ConfigFile) -> None:
    """Atomically, mode 0600 from the first byte (the file holds tokens), folder 0700."""
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".config-", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg.model_dump(exclude_none=True), f, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_profile(name: str, url: str, token: str, ca_file: str | None = None, *, make_default: bool | None = None) -> Path:
    """Add or replace a profile. The first profile saved becomes the default."""
    path = config_path()
    cfg = load_config(path)
    prof = Profile(hub_url=url, token=token, ca_file=ca_file)
    first = not cfg.profiles
    cfg.profiles[name] = prof
    if make_default or (make_default is None and first):
        cfg.default_profile = name
    _write(path, cfg)
    return path


def remove_profile(name: str) -> bool:
    path = config_path()
    cfg = load_config(path)
    if cfg.profiles.pop(name, None) is None:
        return False
    _write(path, cfg)
    return True


def _describe(settings: Any) -> str:  # for `mesh-hub login` output
    return f"{settings.url} ({settings.source})"
