"""The light settings views the agent runner reads instead of the pydantic models.

Why these checks: the runner must see exactly what the CLI validated (same values, paths as paths,
nested sections), must not be able to change it, and must get it from an inherited descriptor,
never argv or the environment (the credentials are secret)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mesh_agent.config import AgentConfig, Credentials, GlobusStaging, MqttTls, runner_payload, shape_of
from mesh_agent.run import hand_over, read_settings
from mesh_agent.settings import ConfigView, CredentialsView, Section, build, plain


def _full(tmp_path: Path) -> tuple[AgentConfig, Credentials]:
    cfg = AgentConfig.model_validate({
        "endpoint_id": "ep-1", "name": "pi", "hub_url": "http://127.0.0.1:8700", "data_dir": str(tmp_path / "q"),
        "credentials_file": str(tmp_path / "creds.json"), "workers": 2, "profile": "metered", "tags": ["solar", "field"],
        "mqtt": {"host": "127.0.0.1", "port": 8883, "tls": {"ca_file": str(tmp_path / "ca.pem"), "server_name": "hub"}},
        "globus": {"local_collection": "c-1", "local_root": str(tmp_path / "g")},
        "datasets": {"digits": "fl.datasets:digits", "scans": {"path": "s.npz", "kwargs": {"i": 1}}},
        "allowed_functions": ["ab" * 32],
    })
    creds = Credentials(endpoint_id="ep-1", key="cd" * 32, mqtt_username="u", mqtt_password="secret-pw")
    return cfg, creds


def _view(cfg: AgentConfig, creds: Credentials) -> tuple[ConfigView, CredentialsView]:
    p = runner_payload(cfg, creds)
    return build(p["config"], p["credentials"], p["shapes"])


def test_views_read_what_the_models_validated(tmp_path: Path) -> None:
    cfg, creds = _full(tmp_path)
    view, cview = _view(cfg, creds)
    assert plain(view) == cfg.model_dump(mode="json") and plain(cview) == creds.model_dump(mode="json")
    assert view.mqtt.tls.ca_file == tmp_path / "ca.pem" and isinstance(view.mqtt.tls.ca_file, Path)
    assert view.mqtt.tls.cert_file is None and view.mqtt.host == "127.0.0.1" and view.mqtt.port == 8883
    assert view.queue_path == cfg.queue_path and isinstance(view.data_dir, Path)
    assert view.globus.local_root == tmp_path / "g" and plain(view.globus) == cfg.globus.model_dump(mode="json")
    assert view.parsl.provider == cfg.parsl.provider and view.parsl.max_blocks == cfg.parsl.max_blocks
    assert view.datasets == cfg.model_dump(mode="json")["datasets"]  # data, not sections
    assert not isinstance(view.datasets["scans"], Section)
    assert cview.key_bytes == creds.key_bytes


def test_views_are_read_only_and_do_not_show_secrets(tmp_path: Path) -> None:
    view, cview = _view(*_full(tmp_path))
    with pytest.raises(AttributeError, match="read-only"):
        view.workers = 9
    with pytest.raises(AttributeError, match="read-only"):
        view.mqtt.host = "evil"
    with pytest.raises(AttributeError, match="no setting 'nope'"):
        view.nope
    assert "secret-pw" not in repr(cview) and "cd" * 32 not in repr(cview)


def test_shape_comes_from_the_models() -> None:
    shape = shape_of(AgentConfig)
    assert shape["data_dir"] == "path" and shape["mqtt"]["tls"] == shape_of(MqttTls) and shape["globus"] == shape_of(GlobusStaging)
    assert "datasets" not in shape and "tags" not in shape and "workers" not in shape


def test_hand_over_reaches_an_exec_d_process_through_the_descriptor_only(tmp_path: Path) -> None:
    cfg, creds = _full(tmp_path)
    payload = runner_payload(cfg, creds)
    fd = hand_over(payload)
    try:
        code = ("import os,sys,json; from mesh_agent.run import read_settings; p=read_settings(int(sys.argv[1])); "
                "s=p['credentials']['mqtt_password']; print(s, open('/proc/self/cmdline','rb').read().count(s.encode()), "
                "sum(s in v for v in os.environ.values()))")
        out = subprocess.run([sys.executable, "-c", code, str(fd)], pass_fds=(fd,), capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["secret-pw", "0", "0"]


def test_read_settings_closes_its_descriptor(tmp_path: Path) -> None:
    fd = hand_over({"x": "y" * 200_000})  # larger than a pipe holds: memfd where the system has it
    assert read_settings(fd) == {"x": "y" * 200_000}
    with pytest.raises(OSError):
        os.fstat(fd)


def _sections(model: type, where: str) -> list[tuple[str, type]]:
    """(view path, pydantic model) of the model and every nested section, from the annotations."""
    from pydantic import BaseModel

    out = [(where, model)]
    for name, kind in shape_of(model).items():
        if isinstance(kind, dict):
            ann = model.model_fields[name].annotation
            sub = next(a for a in (getattr(ann, "__args__", None) or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel))
            out += _sections(sub, f"{where}.{name}")
    return out


#: Written by `mesh-agent init`/the CLI only; the running agent never saves its settings.
_CLI_ONLY = {"save"}


def test_every_view_offers_the_methods_and_properties_of_its_model(tmp_path: Path) -> None:
    """A method added to a config model (and called by the agent) must exist on the runner's view too:
    otherwise the agent works in-process and fails only once exec'd (AttributeError at connect)."""
    from mesh_agent.settings import VIEWS

    for where, model in _sections(AgentConfig, "config") + _sections(Credentials, "credentials"):
        wanted = {n for n, v in vars(model).items() if not n.startswith(("_", "model_")) and (callable(v) or isinstance(v, property))}
        view = VIEWS.get(where, Section)
        missing = {n for n in wanted - _CLI_ONLY if not hasattr(view, n)}
        assert not missing, f"{view.__name__} (for {model.__name__} at {where}) lacks {sorted(missing)}: add them in mesh_agent/settings.py"


def test_mqtt_view_broker_list_matches_the_model(tmp_path: Path) -> None:
    cfg, creds = _full(tmp_path)
    if "hosts" not in type(cfg.mqtt).model_fields:
        pytest.skip("no mqtt.hosts in this config model")
    cfg = AgentConfig.model_validate({**cfg.model_dump(), "mqtt": {**cfg.mqtt.model_dump(), "hosts": ["127.0.0.1:1884", "[::1]"]}})
    view, _ = _view(cfg, creds)
    assert view.mqtt.broker_list().brokers == cfg.mqtt.broker_list().brokers == [("127.0.0.1", 1884), ("::1", 8883)]
    assert view.mqtt.broker_list() is view.mqtt.broker_list()  # one list per settings object: position survives reconnects
