"""A read-only view of the agent's validated settings, without pydantic.

Why: pydantic (and the schema code its first model loads) costs the agent process about 17 MB of
resident memory, most of a Raspberry Pi Zero's budget for the whole agent. ``mesh-agent start``
therefore validates the config and credentials with the pydantic models of
:mod:`mesh_agent.config` (clear one-line errors stay), dumps them, and execs the light runner
(:mod:`mesh_agent.run`), which rebuilds them here as :class:`Section` views: the same attribute
access the agent code uses (``cfg.mqtt.host``, ``cfg.queue_path``, ``creds.key_bytes``), read-only.

The views are not a second copy of the schema: which keys are nested sections and which are paths
comes from the pydantic models themselves (:func:`mesh_agent.config.shape_of`), shipped with the
dumped values. Stdlib only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

__all__ = ["ConfigError", "Section", "ConfigView", "CredentialsView", "MqttView", "VIEWS", "plain", "build", "SECRET_CREDENTIALS",
           "register_credentials"]

#: Fields of the credentials that no log line, error or repr may show (docs/security.md).
SECRET_CREDENTIALS = ("key", "mqtt_password", "globus_client_secret", "curve_secret")


def register_credentials(creds: Any) -> None:
    """Have every log line of this process mask the secret values of ``creds`` (a view or the model)."""
    from mesh_agent.redact import register_secret

    register_secret(*(getattr(creds, name, None) for name in SECRET_CREDENTIALS))


class ConfigError(ValueError):
    """The agent's config or credentials file is missing or wrong; the message names the problem."""


#: What a field holds, in a shape (see :func:`mesh_agent.config.shape_of`): a path, or a nested section.
PATH = "path"


class Section:
    """Read-only attributes over one validated, dumped section of the settings."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no setting {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"settings are read-only ({name})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self._values)})"  # names only: values may be secret


class ConfigView(Section):
    """The agent config (:class:`mesh_agent.config.AgentConfig`), as the running agent reads it."""

    __slots__ = ()

    @property
    def queue_path(self) -> Path:
        return self.data_dir / "queue.sqlite3"


class CredentialsView(Section):
    """The credentials (:class:`mesh_agent.config.Credentials`), as the running agent reads them."""

    __slots__ = ()

    @property
    def key_bytes(self) -> bytes:
        return bytes.fromhex(self.key)


class MqttView(Section):
    """``mqtt:`` (:class:`mesh_agent.config.MqttSettings`), with its one method."""

    __slots__ = ("_brokers",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        super().__init__(values)
        object.__setattr__(self, "_brokers", None)

    def broker_list(self) -> Any:
        """As :meth:`mesh_agent.config.MqttSettings.broker_list`: one list per settings object, so the
        position in it survives reconnects."""
        if self._brokers is None:
            from mesh_agent.transport.brokers import BrokerList, parse_hostport

            hosts = self._values.get("hosts") or []
            object.__setattr__(self, "_brokers", BrokerList([parse_hostport(h, self.port) for h in hosts] or [(self.host, self.port)]))
        return self._brokers


#: The view class of each section that has behaviour of its own (a property or method the agent
#: calls); every other section is a plain :class:`Section`. tests/unit/test_agent_settings.py checks
#: that each view offers every method and property of its pydantic model.
VIEWS: dict[str, type[Section]] = {"config": ConfigView, "config.mqtt": MqttView, "credentials": CredentialsView}


def _view(values: Mapping[str, Any], shape: Mapping[str, Any], where: str) -> Section:
    out: dict[str, Any] = {}
    for key, value in values.items():
        kind = shape.get(key)
        if value is None or kind is None:
            out[key] = value
        elif kind == PATH:
            out[key] = Path(value)
        else:  # a nested section
            out[key] = _view(value, kind, f"{where}.{key}")
    return VIEWS.get(where, Section)(out)


def build(config: Mapping[str, Any], credentials: Mapping[str, Any], shapes: Mapping[str, Any]) -> tuple[ConfigView, CredentialsView]:
    """Views of dumped (JSON) config and credentials; ``shapes`` says which keys are paths or sections."""
    cfg = _view(config, shapes.get("config", {}), "config")
    creds = _view(credentials, shapes.get("credentials", {}), "credentials")
    return cfg, creds  # type: ignore[return-value]


def plain(section: Any) -> dict[str, Any]:
    """A section as JSON-ready values (paths as strings), from a view or a pydantic model alike."""
    dump = getattr(section, "model_dump", None)
    if dump is not None:
        return dump(mode="json")
    return {k: plain(v) if isinstance(v, Section) else str(v) if isinstance(v, Path) else v for k, v in section._values.items()}
