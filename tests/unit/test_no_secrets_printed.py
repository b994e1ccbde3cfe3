"""Every address is checked, and no secret is printed (issue 25, item 7).

- the plaintext refusal covers every address an agent may dial (``mqtt.host``, each of
  ``mqtt.hosts``, ``hub_url``, an index URL with a password), loopback allowed;
- ``repr()``/``str()`` of every config object holds no secret;
- log lines (text and JSON, tracebacks included) mask passwords, keys and tokens;
- no typer app of the project shows local variables on an error.

Real ``mesh-agent`` / ``mesh-hub`` processes: tests/integration/test_no_secrets_cli.py.
"""

from __future__ import annotations

import ast
import io
import json
import logging
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from mesh_agent import redact as R
from mesh_agent.config import AgentConfig, ConfigError, Credentials, check_plaintext, load_config, plaintext_dials

ROOT = Path(__file__).resolve().parents[2]
KEY = "5e" * 32  # the endpoint's HMAC key
PASSWORD = "Mqtt-PW-marker-71"
GLOBUS_SECRET = "globus-secret-marker-93"
CURVE_SECRET = "CurveSecretMarker" + "x" * 23  # 40 characters, as z85


@pytest.fixture
def registry() -> Iterator[None]:
    """A clean secret registry, restored afterwards (it is process-wide)."""
    saved = R.registered()
    R.forget_secrets()
    try:
        yield
    finally:
        R.forget_secrets()
        R.register_secret(*reversed(saved))


@pytest.fixture
def root_saved() -> Iterator[None]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def _write(tmp_path: Path, **over: Any) -> Path:
    creds = tmp_path / "c.json"
    Credentials(endpoint_id="ep-1", key=KEY, mqtt_username="ep-1", mqtt_password=PASSWORD).save(creds)
    raw: dict[str, Any] = {"endpoint_id": "ep-1", "name": "pi", "hub_url": "http://127.0.0.1:8700", "data_dir": str(tmp_path / "q"),
                           "credentials_file": str(creds)}
    raw.update(over)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


# ------------------------------------------------------------------ every address is checked


REFUSED = [
    ({"mqtt": {"host": "broker.example.org"}}, "mqtt.host", "broker.example.org:1883"),
    ({"mqtt": {"hosts": ["example.invalid:1883"]}}, "mqtt.hosts[0]", "example.invalid:1883"),
    ({"mqtt": {"hosts": ["127.0.0.1:1883", "10.0.0.3"]}}, "mqtt.hosts[1]", "10.0.0.3:1883"),  # the second node, default port
    ({"mqtt": {"hosts": ["[::1]:1883", "[2001:db8::7]:1884"]}}, "mqtt.hosts[1]", "[2001:db8::7]:1884"),
    ({"mqtt": {"host": "hub.example.org", "port": 80, "transport": "websockets"}}, "mqtt.host", "hub.example.org:80"),  # ws://, no TLS
    ({"mqtt": {"host": "192.168.1.10", "port": 1884}, "gateway_id": "ep-0a"}, "mqtt.host", "192.168.1.10:1884"),  # a site gateway on the LAN
    ({"hub_url": "http://hub.example.org:8700"}, "hub_url", "http://hub.example.org:8700"),
    ({"environments": {"index_url": "http://mirror:IndexPW-55@pypi.lan/simple"}}, "environments.index_url", "pypi.lan"),
    ({"environments": {"find_links": ["/wheels", "http://u:IndexPW-55@10.0.0.9/wheels"]}}, "environments.find_links[1]", "10.0.0.9"),
]


@pytest.mark.parametrize("over, key, where", REFUSED)
def test_a_plaintext_address_off_the_machine_is_refused_in_one_line(tmp_path: Path, over: dict, key: str, where: str) -> None:  # type: ignore[type-arg]
    path = _write(tmp_path, **over)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg
    assert key in msg and where in msg, msg
    assert "insecure_plaintext: true" in msg and "refused" in msg
    assert "IndexPW-55" not in msg  # the password of a URL is never repeated in the error
    assert not (tmp_path / "q").exists()
    cfg, _ = load_config(_write(tmp_path, insecure_plaintext=True, **over))  # the explicit opt-out
    assert cfg.insecure_plaintext


ALLOWED = [
    {},
    {"mqtt": {"host": "localhost"}},
    {"mqtt": {"host": "127.0.0.2", "hosts": ["127.0.0.1:1883", "[::1]:1884", "localhost", "node.localhost:1885"]}},
    {"mqtt": {"host": "broker.example.org", "hosts": ["a.example.org:8883", "b.example.org:8883"], "tls": {}}},  # TLS covers every node
    {"transport": "zmq", "zmq": {"address": "tcp://10.0.0.5:8701"}, "mqtt": {"host": "broker.example.org"}},  # CURVE; MQTT not dialled
    {"hub_url": "https://hub.example.org"},
    {"hub_url": "http://[::1]:8700"},
    {"environments": {"index_url": "http://pypi.lan/simple", "find_links": ["http://10.0.0.9/wheels"]}},  # no password to leak
    {"environments": {"index_url": "https://u:IndexPW-55@pypi.lan/simple"}},
]


@pytest.mark.parametrize("over", ALLOWED)
def test_loopback_tls_curve_and_secret_free_links_pass(tmp_path: Path, over: dict) -> None:  # type: ignore[type-arg]
    cfg = AgentConfig.model_validate(yaml.safe_load(_write(tmp_path, **over).read_text()))
    check_plaintext(cfg)


def test_every_dialled_broker_is_listed() -> None:
    cfg = AgentConfig(endpoint_id="ep-1", name="pi", hub_url="http://127.0.0.1:8700", data_dir=Path("/q"), credentials_file=Path("/c"),
                      mqtt={"host": "h0", "port": 1000, "hosts": ["h1", "h2:2000", "[fe80::1]"]})  # type: ignore[arg-type]
    keys = [(k, a) for k, a, _ in plaintext_dials(cfg)]
    assert keys == [("mqtt.host", "mqtt://h0:1000"), ("mqtt.hosts[0]", "mqtt://h1:1000"), ("mqtt.hosts[1]", "mqtt://h2:2000"),
                    ("mqtt.hosts[2]", "mqtt://[fe80::1]:1000"), ("hub_url", "http://127.0.0.1:8700")]


def test_enroll_refuses_a_plaintext_hub_before_sending_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from mesh_agent.cli import enroll

    def no_network(*a: Any, **k: Any) -> Any:
        raise AssertionError("dialled the hub")

    monkeypatch.setattr(httpx, "post", no_network)
    monkeypatch.setattr(httpx, "get", no_network)
    with pytest.raises(ConfigError, match="plaintext hub URL http://u:\\*\\*\\*@hub.example.org refused") as err:
        enroll("http://u:HubPW-77@hub.example.org", "ce_" + "t" * 43, "pi", tmp_path / "agent.yaml")
    assert "HubPW-77" not in str(err.value) and "ce_ttt" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ reprs hold no secret


def _no_secret(text: str, *secrets: str) -> None:
    for s in secrets:
        assert s not in text, f"{s!r} in {text!r}"


def test_credentials_repr_and_str_hold_no_secret() -> None:
    creds = Credentials(endpoint_id="ep-1", key=KEY, mqtt_username="ep-1", mqtt_password=PASSWORD, globus_client_id="gid",
                        globus_client_secret=GLOBUS_SECRET, curve_public="P" * 40, curve_secret=CURVE_SECRET, hub_curve_key="H" * 40)
    for text in (repr(creds), str(creds), f"{creds}", f"{creds!r}"):
        _no_secret(text, KEY, PASSWORD, GLOBUS_SECRET, CURVE_SECRET)
        assert "ep-1" in text  # who, not how
    assert creds.model_dump()["key"] == KEY and creds.key_bytes  # the values themselves are intact
    from rich.pretty import pretty_repr

    _no_secret(pretty_repr(creds), KEY, PASSWORD, GLOBUS_SECRET, CURVE_SECRET)


def test_agent_config_repr_masks_url_passwords(tmp_path: Path) -> None:
    cfg = AgentConfig(endpoint_id="ep-1", name="pi", hub_url="https://u:HubPW-77@hub.example.org", data_dir=tmp_path, credentials_file=tmp_path / "c",
                      environments={"index_url": "https://mirror:IndexPW-55@pypi.lan/simple", "find_links": ["https://x:LinkPW-66@w.lan/"]})  # type: ignore[arg-type]
    for text in (repr(cfg), str(cfg), repr(cfg.environments)):
        _no_secret(text, "HubPW-77", "IndexPW-55", "LinkPW-66")
    assert "https://mirror:***@pypi.lan/simple" in repr(cfg)
    assert cfg.hub_url == "https://u:HubPW-77@hub.example.org"  # only the display is masked


def test_settings_views_of_the_runner_name_fields_only(tmp_path: Path) -> None:
    from mesh_agent.config import runner_payload
    from mesh_agent.settings import build

    cfg = AgentConfig(endpoint_id="ep-1", name="pi", hub_url="http://127.0.0.1:8700", data_dir=tmp_path, credentials_file=tmp_path / "c")
    creds = Credentials(endpoint_id="ep-1", key=KEY, mqtt_password=PASSWORD, curve_secret=CURVE_SECRET)
    payload = runner_payload(cfg, creds)
    view_cfg, view_creds = build(payload["config"], payload["credentials"], payload["shapes"])
    for text in (repr(view_cfg), repr(view_creds), str(view_creds)):
        _no_secret(text, KEY, PASSWORD, CURVE_SECRET)


def test_hub_config_repr_holds_no_secret() -> None:
    from cloud_hub.config import HubConfig

    cfg = HubConfig(database_url="postgresql://mesh:DbPW-42@db.internal:5432/mesh", mqtt_password=PASSWORD, metrics_token="metrics-token-marker",
                    globus_client_id="gid", globus_client_secret=GLOBUS_SECRET)
    for text in (repr(cfg), str(cfg)):
        _no_secret(text, "DbPW-42", PASSWORD, "metrics-token-marker", GLOBUS_SECRET)
    assert "postgresql://mesh:***@db.internal:5432/mesh" in repr(cfg)
    assert set(cfg.secrets()) == {PASSWORD, "metrics-token-marker", GLOBUS_SECRET, "DbPW-42"}


def test_enrollment_messages_and_settings_hold_no_secret_in_repr(tmp_path: Path) -> None:
    from cloud_hub.api.schemas import EnrollBatchIn, EnrollIn, EnrollOut, EnrollTokenOut, MqttInfo
    from mesh_agent.bootstrap import EnvEnrollment
    from mesh_agent.staging import _Settings

    token = "ce_" + "T" * 43
    objs = [
        EnvEnrollment(hub_url="https://hub.example.org", enroll_token=token, name="pi"),
        EnrollIn(token=token, name="pi"),
        EnrollBatchIn(token=token, endpoints=[{"name": "pi"}]),  # type: ignore[list-item]
        EnrollTokenOut(token=token, expires_in_s=1.0, uses=1),
        EnrollOut(endpoint_id="ep-1", key=KEY, transport="mqtt", heartbeat_s=5.0, zmq_address=None,
                  mqtt=MqttInfo(host="h", port=1, topic_prefix="mesh", username="u", password=PASSWORD)),
        _Settings("c", tmp_path, tmp_path, 1.0, 1.0, "gid", GLOBUS_SECRET),
    ]
    for obj in objs:
        _no_secret(repr(obj) + str(obj), token, KEY, PASSWORD, GLOBUS_SECRET)


# ------------------------------------------------------------------ redaction of text


@pytest.mark.parametrize("text, secret", [
    ("cannot connect to postgresql://mesh:DbPW-42@db:5432/mesh", "DbPW-42"),
    ("redis://:KvPW-1234567@127.0.0.1:6379/0 refused", "KvPW-1234567"),
    ("settings: mqtt_password='Mqtt-PW-marker-71', key=...", "Mqtt-PW-marker-71"),
    ('{"mqtt_password": "Mqtt-PW-marker-71", "x": 1}', "Mqtt-PW-marker-71"),
    ("globus_client_secret=GSecret-88 then", "GSecret-88"),
    ("Authorization: Bearer abcdefghijklmnop123", "abcdefghijklmnop123"),
    ("enroll with ce_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789-_abcd now", "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
    ("api token cm_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789-_abcd", "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
])
def test_known_secret_shapes_are_masked(text: str, secret: str) -> None:
    out = R.redact(text)
    assert secret not in out and R.MASK in out


@pytest.mark.parametrize("text", [
    "online: ep-1 via mqtt to mqtts://hub.example.org:8883 (hub https://hub.example.org:8700/v1)",
    "task 9f" + "0" * 62 + " done; function " + "a" * 64,
    "wrote password_file and acl_file to /var/lib/mosquitto",
    "token id tk_123456 for user 'alice'",
    "http://host:8080/path?x=1",
])
def test_ordinary_lines_are_left_alone(text: str, registry: None) -> None:
    assert R.redact(text) == text


def test_registered_values_are_masked_anywhere(registry: None) -> None:
    R.register_secret(KEY, PASSWORD, None, "short")  # None and values under 6 characters are ignored
    assert set(R.registered()) == {KEY, PASSWORD}
    assert R.redact(f"frame signed with {KEY}, login {PASSWORD}x, short") == f"frame signed with {R.MASK}, login {R.MASK}x, short"
    R.register_secret(bytes.fromhex(KEY))  # bytes: as their hex
    assert R.mask_url("https://u:pw@h/x") == "https://u:***@h/x" and R.mask_url("https://h:443/x") == "https://h:443/x"


# ------------------------------------------------------------------ logs


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_records_with_secrets_are_masked(fmt: str, root_saved: None, registry: None) -> None:
    from mesh_agent._logs import setup_logging
    from mesh_agent.settings import register_credentials

    register_credentials(Credentials(endpoint_id="ep-1", key=KEY, mqtt_password=PASSWORD, globus_client_secret=GLOBUS_SECRET))
    buf = io.StringIO()
    setup_logging("DEBUG", stream=buf, fmt=fmt)
    log = logging.getLogger("mesh_agent.test")
    log.warning("broker login %s with key %s", PASSWORD, KEY)
    log.info("database postgresql://mesh:DbPW-42@db/mesh, token=ce_%s", "z" * 43)
    try:
        raise RuntimeError(f"failed with {PASSWORD} and {GLOBUS_SECRET}")
    except RuntimeError:
        log.exception("unexpected")
    out = buf.getvalue()
    _no_secret(out, PASSWORD, KEY, GLOBUS_SECRET, "DbPW-42", "z" * 43)
    assert out.count(R.MASK) >= 6 and "RuntimeError" in out
    if fmt == "json":
        lines = [json.loads(line) for line in out.splitlines()]
        assert lines[0]["msg"] == f"broker login {R.MASK} with key {R.MASK}" and "RuntimeError" in lines[2]["exc"]


def test_the_runner_registers_its_credentials(tmp_path: Path, registry: None) -> None:
    from mesh_agent.config import runner_payload
    from mesh_agent.settings import build, register_credentials

    cfg = AgentConfig(endpoint_id="ep-1", name="pi", hub_url="http://127.0.0.1:8700", data_dir=tmp_path, credentials_file=tmp_path / "c")
    payload = runner_payload(cfg, Credentials(endpoint_id="ep-1", key=KEY, mqtt_password=PASSWORD, curve_secret=CURVE_SECRET))
    _, creds = build(payload["config"], payload["credentials"], payload["shapes"])
    register_credentials(creds)  # what mesh_agent.run does with the view
    assert set(R.registered()) == {KEY, PASSWORD, CURVE_SECRET}


# ------------------------------------------------------------------ no CLI shows local variables


def _typer_calls() -> list[tuple[Path, ast.Call]]:
    found = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if rel[0].startswith(".") or rel[0] in {"build", "node_modules"} or "site-packages" in rel:
            continue
        try:
            tree = ast.parse(path.read_text(), str(path))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name == "Typer" or name == "_AgentCli":
                    found.append((path, node))
    return found


def test_every_typer_app_hides_local_variables() -> None:
    calls = _typer_calls()
    assert len(calls) >= 8  # mesh-agent (3), mesh-hub (3), fleet, mesh-sim, mesh-fl
    for path, call in calls:
        kw = {k.arg: k.value for k in call.keywords}
        v = kw.get("pretty_exceptions_show_locals")
        assert isinstance(v, ast.Constant) and v.value is False, f"{path}:{call.lineno}: typer app without pretty_exceptions_show_locals=False"


def test_the_installed_apps_hide_local_variables() -> None:
    from cloud_hub.cli import app as hub
    from cloud_hub.fleet_cli import fleet_app
    from fl.flower.cli import app as fl
    from mesh_agent.cli import app as agent
    from sim.cli import app as sim

    for app in (agent, hub, fleet_app, sim, fl):
        assert app.pretty_exceptions_show_locals is False
