"""SDK configuration without code (issue 18 item 2): `mesh-hub login` writes a 0600 profile file,
``Client()`` and ``Executor(endpoint_id=...)`` need nothing else, ``MESH_HUB_URL`` / ``MESH_TOKEN``
override the file, ``MESH_PROFILE`` picks a profile; each misconfiguration is one clear line.

A real hub (HubThread, SQLite file) on a free loopback port; the login CLI runs as a subprocess.
"""

from __future__ import annotations

import http.server
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from cloud_hub.broker import free_port
from cloud_hub.client import AuthError, Client, ConfigError, Executor, HubUnreachable, NotAHub
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from mesh_agent.cli import enroll

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    d = tmp_path_factory.mktemp("sdkcfg")
    with HubThread(HubConfig(db_path=d / "hub.sqlite3", port=0, mqtt_host=None, zmq_bind="tcp://127.0.0.1:*", bootstrap_user="alice")) as h:
        c = Client(h.url, h.token)
        h.endpoint_id = enroll(h.url, c.create_enrollment_token(), "pi", d / "agent.yaml", transport="zmq").endpoint_id
        c.close()
        yield h


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private config location and no inherited SDK settings."""
    for k in ("MESH_HUB_URL", "MESH_TOKEN", "MESH_PROFILE", "MESH_CA_FILE", "XDG_CONFIG_HOME"):
        monkeypatch.delenv(k, raising=False)
    path = tmp_path / "cfg" / "continuum-mesh" / "config.yaml"
    monkeypatch.setenv("MESH_CONFIG", str(path))
    return path


def _cli(*args: str, env_path: Path, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESH_")}
    env.update({"MESH_CONFIG": str(env_path), **(extra or {})})
    return subprocess.run([sys.executable, "-m", "cloud_hub.cli", *args], capture_output=True, text=True, env=env, timeout=120)


def test_login_writes_a_0600_profile_and_client_needs_no_arguments(hub: Any, env: Path) -> None:
    out = _cli("login", "--url", hub.url, "--token", hub.token, env_path=env)
    assert out.returncode == 0, out.stderr
    assert "logged in" in out.stdout and str(env) in out.stdout
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    assert stat.S_IMODE(env.parent.stat().st_mode) == 0o700
    saved = yaml.safe_load(env.read_text())
    assert saved["default_profile"] == "default" and saved["profiles"]["default"]["hub_url"] == hub.url
    with Client() as c:
        assert c.url == hub.url and "profile 'default'" in c.config_source
        assert c.list_endpoints()[0]["id"] == hub.endpoint_id
    ex = Executor(endpoint_id=hub.endpoint_id)  # nothing but where to run
    try:
        assert ex.client.url == hub.url and ex.endpoint == hub.endpoint_id
    finally:
        ex.shutdown(wait=False)
    who = _cli("whoami", env_path=env)
    assert who.returncode == 0 and "token accepted" in who.stdout


def test_login_refuses_a_bad_token_and_saves_nothing(hub: Any, env: Path) -> None:
    out = _cli("login", "--url", hub.url, "--token", "cm_not-a-real-token", env_path=env)
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "refused the token" in out.stderr
    assert not env.exists()


def test_environment_overrides_the_profile_and_profiles_are_picked(hub: Any, env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cloud_hub.client._config import save_profile

    save_profile("default", hub.url, "cm_stale-token")
    save_profile("lab", hub.url, hub.token)
    with pytest.raises(AuthError, match="refused the token .* profile 'default'"):
        Client().list_endpoints()
    monkeypatch.setenv("MESH_PROFILE", "lab")
    assert Client().list_endpoints()[0]["id"] == hub.endpoint_id
    monkeypatch.delenv("MESH_PROFILE")
    monkeypatch.setenv("MESH_TOKEN", hub.token)  # the environment beats the file
    assert Client().list_endpoints()[0]["id"] == hub.endpoint_id
    monkeypatch.setenv("MESH_PROFILE", "nope")
    with pytest.raises(ConfigError, match=r"no profile 'nope' in .*profiles: default, lab.*mesh-hub login --profile nope"):
        Client()


def test_no_configuration_at_all_says_how_to_log_in(env: Path) -> None:
    with pytest.raises(ConfigError, match=r"no hub URL: run `mesh-hub login --url URL`"):
        Client()


def test_no_token_says_how_to_get_one(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_HUB_URL", "http://127.0.0.1:9")
    with pytest.raises(ConfigError) as err:
        Client()
    assert str(err.value).startswith("no hub token: run `mesh-hub login --url http://127.0.0.1:9`") and "MESH_TOKEN" in str(err.value)
    assert "\n" not in str(err.value)


def test_wrong_url_is_one_line_connection_refused(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()  # nothing listens there
    monkeypatch.setenv("MESH_HUB_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MESH_TOKEN", "cm_x")
    with pytest.raises(HubUnreachable) as err:
        Executor(endpoint_id="ep-x")
    line = str(err.value)
    assert f"cannot reach the hub at http://127.0.0.1:{port} (connection refused)" in line and "\n" not in line


def test_a_url_that_is_not_a_hub_says_so(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = b"<html>a web page</html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        monkeypatch.setenv("MESH_HUB_URL", f"http://127.0.0.1:{srv.server_port}")
        monkeypatch.setenv("MESH_TOKEN", "cm_x")
        with pytest.raises(NotAHub, match=r"does not answer like a Continuum Mesh hub .*text/html.*check the URL"):
            Client().list_endpoints()
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_404_from_another_api_is_not_a_hub(hub: Any, env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESH_HUB_URL", hub.url + "/elsewhere")  # JSON 404s, but no /v1 API there
    monkeypatch.setenv("MESH_TOKEN", hub.token)
    with pytest.raises(NotAHub, match="does not answer like a Continuum Mesh hub"):
        Client().list_endpoints()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("profiles: [unclosed\n", "not valid YAML (line 2)"),
        ("profiles:\n  default: {hub_url: 'ftp://x', token: t}\n", "profiles.default.hub_url: hub_url must start with http"),
        ("colour: blue\n", "colour: Extra inputs are not permitted"),
    ],
)
def test_an_unreadable_config_file_is_one_line_naming_it(env: Path, content: str, why: str) -> None:
    env.parent.mkdir(parents=True)
    env.write_text(content)
    with pytest.raises(ConfigError) as err:
        Client()
    assert str(err.value).startswith(f"cannot read the mesh config file {env}: ") and why in str(err.value)
    assert "\n" not in str(err.value)


def test_a_config_file_without_permission_is_one_line(env: Path) -> None:
    if os.geteuid() == 0:
        # root reads any file: use a folder in the file's place instead (also unreadable as a file)
        env.mkdir(parents=True)
        with pytest.raises(ConfigError, match=rf"cannot read the mesh config file {env}: Is a directory"):
            Client()
        return
    env.parent.mkdir(parents=True)
    env.write_text("profiles: {}\n")
    env.chmod(0)
    with pytest.raises(ConfigError, match="Permission denied"):
        Client()


def test_full_environment_never_reads_a_broken_file(hub: Any, env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env.parent.mkdir(parents=True)
    env.write_text("::: not yaml [")
    monkeypatch.setenv("MESH_HUB_URL", hub.url)
    monkeypatch.setenv("MESH_TOKEN", hub.token)
    assert Client().list_endpoints()[0]["id"] == hub.endpoint_id
