"""A whole mesh on one machine: real Mosquitto, a real hub, agents as real OS processes.

The demo, the tests, the benchmarks and the outage simulator all build on this, so they
exercise exactly what a deployment runs: ``mesh-agent start`` processes that can be SIGKILLed
and restarted against their own SQLite queues, talking to the hub through a real broker.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from cloud_hub.broker import MosquittoBroker
from cloud_hub.client import Client
from cloud_hub.config import HubConfig
from cloud_hub.server import HubThread
from mesh_agent.cli import enroll
from mesh_agent.config import AgentConfig

__all__ = ["AgentProcess", "GatewayProcess", "LocalMesh"]

log = logging.getLogger(__name__)


class AgentProcess:
    """One ``mesh-agent start`` process with its own config and queue directory."""

    def __init__(self, cfg: AgentConfig, config_path: Path, log_path: Path) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_id(self) -> str:
        return self.cfg.endpoint_id

    def start(self) -> "AgentProcess":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mesh_agent.cli", "start", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the agent and its workers: a power cut, as far as the queue can tell."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, as systemd does; SIGKILL if it does not exit in time."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


class GatewayProcess(AgentProcess):
    """``mesh-agent gateway`` for an enrolled endpoint whose config has a ``site:`` section; its site
    Mosquitto is its child, in its process group, so :meth:`kill` is a power cut of the whole box."""

    def start(self) -> "GatewayProcess":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mesh_agent.cli", "gateway", "--config", str(self.config_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        log.close()
        return self


class LocalMesh:
    """Broker + hub (SQLite) + agents under one working directory; a context manager."""

    def __init__(self, workdir: Path, *, heartbeat_s: float = 1.0, lost_after_s: float = 4.0, lease_s: float = 10.0,
                 hub_overrides: dict[str, Any] | None = None, hub_process: bool = False, tls: bool = False,
                 mqtt_transport: str = "tcp", broker_factory: Callable[[Path, tuple[str, str]], Any] | None = None) -> None:
        """``hub_process=True`` runs the hub as its own ``mesh-hub serve`` process, as deployed
        (benchmarks: the SDK and hub then do not share a GIL); tests use the in-process hub to
        look at its dispatcher.

        ``tls=True``: certificates from ``mesh-hub tls init`` (``tls_files``), the broker gets a TLS
        listener (and a wss one with ``mqtt_transport="websockets"``) that the hub advertises, the
        REST API is HTTPS, and agents enroll with the CA hash from their token (pinned), so their
        MQTT links and enrollment are encrypted and verified as in the field.

        ``broker_factory(workdir, hub_login)``: another broker than one Mosquitto, e.g.
        ``cloud_hub.broker_nats.NatsCluster``; its ``hub_settings()`` (kind, every node) go to the hub."""
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tls_files = None
        tls_settings: dict[str, Any] = {}
        broker_tls: dict[str, Any] = {}
        if tls:
            from cloud_hub.broker import BrokerTls, free_port
            from cloud_hub.tls import init_dir

            self.tls_files = f = init_dir(self.workdir / "tls", force=True)
            broker_tls = {"tls": BrokerTls(f.ca_cert, f.server_cert, f.server_key),
                          "ws_port": free_port() if mqtt_transport == "websockets" else None}
            tls_settings = {"tls_ca_file": f.ca_cert, "tls_cert_file": f.server_cert, "tls_key_file": f.server_key}
        # The broker runs as in production: no anonymous clients, a login per endpoint, topic ACLs
        # (written by the hub on start and on every enrollment, reloaded with SIGHUP).
        hub_login = ("mesh-hub", secrets.token_urlsafe(24))
        self.broker: Any = (broker_factory(self.workdir / "broker", hub_login) if broker_factory is not None
                            else MosquittoBroker(self.workdir / "broker", hub_login=hub_login, **broker_tls))
        nodes = {k: v for k, v in getattr(self.broker, "hub_settings", dict)().items() if k in ("mqtt_broker_kind", "mqtt_hosts")}
        if tls:
            tls_settings["mqtt_public_url"] = (f"wss://127.0.0.1:{self.broker.ws_port}/mqtt" if mqtt_transport == "websockets"
                                               else f"mqtts://127.0.0.1:{self.broker.tls_port}")
        self.hub_cfg = HubConfig(
            db_path=self.workdir / "hub.sqlite3", port=0, mqtt_port=self.broker.port, zmq_bind="tcp://127.0.0.1:*",
            heartbeat_s=heartbeat_s, lost_after_s=lost_after_s, lease_s=lease_s, bootstrap_user="demo",
            mqtt_username=hub_login[0], mqtt_password=hub_login[1],
            mqtt_auth_dir=self.broker.workdir, mqtt_broker_pid_file=self.broker.pid_path, **{**tls_settings, **nodes, **(hub_overrides or {})},
        )
        self.hub: HubThread | None = None
        self.hub_process = hub_process
        self._hub_proc: subprocess.Popen[bytes] | None = None
        self.agents: list[AgentProcess] = []
        self._client: Client | None = None
        self._token: str | None = None

    # ---------------------------------------------------------------- parts
    def start(self) -> "LocalMesh":
        self.broker.start()
        try:
            self.start_hub()
        except BaseException:
            self.broker.stop()  # a caller whose start failed has nothing to stop: do not leave the broker running
            raise
        return self

    def start_hub(self) -> HubThread | None:
        if self.hub_process:
            self._start_hub_process()
            return None
        cfg = self.hub_cfg
        fresh = self.hub is None and cfg.port == 0
        if self.hub is not None:  # restart: keep the same port and ZeroMQ address so agents find it
            cfg = cfg.model_copy(update={"port": self.hub.cfg.port, "zmq_bind": self.hub.hub.zmq_address})
        hub = self._start_hub_thread(cfg, retries=2 if fresh else 0)
        self.hub, self.hub_cfg = hub, hub.cfg
        if self._token is None:
            self._token = hub.token
        return hub

    @staticmethod
    def _start_hub_thread(cfg: HubConfig, retries: int) -> HubThread:
        """Start a hub thread. uvicorn exits (SystemExit(1), after the lifespan's shutdown) when
        its bind fails: another process took the port ``free_port`` drew between its check and
        this bind (seen once in a full parallel suite). A fresh hub then draws another port."""
        for attempt in range(retries + 1):
            try:
                return HubThread(cfg).start()
            except RuntimeError as exc:
                if attempt == retries or "SystemExit" not in str(exc):
                    raise
                log.warning("the hub could not start on its drawn port (%s); drawing another", exc)
        raise AssertionError("unreachable")

    def stop_hub(self) -> None:
        if self.hub is not None:
            self.hub.stop()
        if self._hub_proc is not None and self._hub_proc.poll() is None:
            self._hub_proc.terminate()
            try:
                self._hub_proc.wait(15)
            except subprocess.TimeoutExpired:
                self._hub_proc.kill()
                self._hub_proc.wait(5)

    def kill_hub(self) -> None:
        """SIGKILL the hub process (``hub_process=True``): a crash, no graceful shutdown."""
        if not self.hub_process:
            raise RuntimeError("kill_hub needs LocalMesh(hub_process=True); an in-process hub can only stop_hub()")
        if self._hub_proc is not None and self._hub_proc.poll() is None:
            self._hub_proc.kill()
            self._hub_proc.wait(10)

    def _start_hub_process(self) -> None:
        import asyncio

        import httpx

        from cloud_hub.broker import free_port
        from cloud_hub.store import SqliteStore

        cfg = self.hub_cfg
        if cfg.port == 0 or (cfg.zmq_bind or "").endswith("*"):
            cfg = self.hub_cfg = cfg.model_copy(update={"port": free_port(), "zmq_bind": f"tcp://127.0.0.1:{free_port()}"})
        if self._token is None:
            async def mint() -> str:
                store = await SqliteStore(cfg.db_path).open()
                try:
                    return await store.create_api_token(await store.create_user("demo"), "localmesh")
                finally:
                    await store.close()

            self._token = asyncio.run(mint())
        passed = {"heartbeat_s": cfg.heartbeat_s, "lost_after_s": cfg.lost_after_s, "lease_s": cfg.lease_s, "mqtt_username": cfg.mqtt_username,
                  "mqtt_password": cfg.mqtt_password, "mqtt_auth_dir": cfg.mqtt_auth_dir, "mqtt_broker_pid_file": cfg.mqtt_broker_pid_file,
                  "tls_ca_file": cfg.tls_ca_file, "mqtt_public_url": cfg.mqtt_public_url, "tls_cert_file": cfg.tls_cert_file,
                  "tls_key_file": cfg.tls_key_file, "mqtt_broker_kind": cfg.mqtt_broker_kind, "mqtt_hosts": ",".join(cfg.mqtt_hosts) or None}
        env = dict(os.environ, **{f"MESH_HUB_{k.upper()}": str(v) for k, v in passed.items() if v is not None})
        log = open(self.workdir / "hub.log", "ab")
        self._hub_proc = subprocess.Popen(
            [sys.executable, "-m", "cloud_hub.cli", "serve", "--db", str(cfg.db_path), "--port", str(cfg.port),
             "--mqtt-port", str(cfg.mqtt_port), "--zmq-bind", str(cfg.zmq_bind), "--log-level", "WARNING"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._hub_proc.poll() is not None:
                raise RuntimeError(f"hub process exited: {(self.workdir / 'hub.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=1, verify=self._verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("hub process did not answer /v1/health within 30 s")

    @property
    def url(self) -> str:
        if self.hub_process:
            return f"{'https' if self.hub_cfg.tls_cert_file else 'http'}://{self.hub_cfg.host}:{self.hub_cfg.port}"
        assert self.hub is not None
        return self.hub.url

    @property
    def _verify(self) -> Any:
        """The SDK trusts our CA only (HTTPS with tls=True)."""
        if self.tls_files is None:
            return True
        from mesh_agent.tls import client_context

        return client_context(self.tls_files.ca_cert)

    @property
    def token(self) -> str:
        assert self._token is not None
        return self._token

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self.url, self.token, verify=self._verify)
        return self._client

    def add_agent(self, name: str, transport: str = "mqtt", *, workers: int | None = 2, prefetch: int = 256,
                  task_timeout: float | None = None, start: bool = True, tags: list[str] | None = None,
                  hardware: str | None = None, data_dir: Path | None = None, trusted: bool = True, **settings: Any) -> AgentProcess:
        """Enroll and (by default) start an agent; ``settings`` are further AgentConfig fields.

        ``trusted``: the agent runs on this machine, as the user, so its owner (the mesh's user)
        marks it trusted at enrollment and gets its results unpickled; ``False`` leaves it as a
        newly enrolled field device is, data only (docs/security.md)."""
        token = self.client.create_enrollment_token()
        config_path = self.workdir / "agents" / f"{name}.yaml"
        cfg = enroll(self.url, token, name, config_path, transport=transport, workers=workers, prefetch=prefetch, task_timeout=task_timeout,
                     tags=tags, hardware=hardware, data_dir=data_dir, ca_hash=getattr(token, "ca_hash", None))
        if trusted:
            self.client.set_endpoint_trusted(cfg.endpoint_id, True)
        if settings:
            cfg = AgentConfig.model_validate({**cfg.model_dump(), **settings})
            cfg.save(config_path)
        agent = AgentProcess(cfg, config_path, self.workdir / "agents" / f"{name}.log")
        self.agents.append(agent)
        return agent.start() if start else agent

    def add_gateway(self, name: str, *, site_port: int | None = None, hold: int = 64, uplink_port: int | None = None,
                    start: bool = True, **settings: Any) -> "GatewayProcess":
        """Enroll an endpoint and run it as a site gateway (``mesh-agent gateway``, docs/sites.md) whose
        site Mosquitto listens on ``site_port`` (a free one by default); ``uplink_port``: dial the hub's
        broker through this port instead (a fault proxy)."""
        from cloud_hub.broker import free_port

        site = {"listen_host": "127.0.0.1", "listen_port": site_port or free_port(), "store_port": free_port(), "hold": hold,
                **settings.pop("site", {})}
        agent = self.add_agent(name, start=False, site=site, **settings)
        cfg = agent.cfg
        if uplink_port is not None:
            cfg = AgentConfig.model_validate({**cfg.model_dump(), "mqtt": {**cfg.mqtt.model_dump(), "port": uplink_port}})
            cfg.save(agent.config_path)
        gw = GatewayProcess(cfg, agent.config_path, agent.log_path)
        self.agents[self.agents.index(agent)] = gw
        return gw.start() if start else gw

    def add_site_device(self, name: str, gateway: "GatewayProcess", *, start: bool = True, workers: int | None = 1,
                        prefetch: int = 4, **settings: Any) -> AgentProcess:
        """Enroll a device behind ``gateway`` (it dials the gateway's site broker) and start it."""
        token = self.client.create_enrollment_token()
        path = self.workdir / "agents" / f"{name}.yaml"
        site = gateway.cfg.site
        cfg = enroll(self.url, token, name, path, workers=workers, prefetch=prefetch, gateway_id=gateway.endpoint_id,
                     mqtt_host=site.listen_host, mqtt_port=site.listen_port, ca_hash=getattr(token, "ca_hash", None))
        self.client.set_endpoint_trusted(cfg.endpoint_id, True)  # on this machine, as the user (see add_agent)
        if settings:
            cfg = AgentConfig.model_validate({**cfg.model_dump(), **settings})
            cfg.save(path)
        dev = AgentProcess(cfg, path, self.workdir / "agents" / f"{name}.log")
        self.agents.append(dev)
        return dev.start() if start else dev

    def wait_online(self, *agents: AgentProcess, timeout: float = 30.0, online: bool = True) -> None:
        want = {a.endpoint_id for a in (agents or self.agents)}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = {e["id"]: e["online"] for e in self.client.list_endpoints()}
            if all(states.get(e) == online for e in want):
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {a.cfg.name}\n{a.log_path.read_text()[-3000:]}" for a in self.agents if a.endpoint_id in want and a.log_path.exists())
        raise TimeoutError(f"agents not {'online' if online else 'offline'} within {timeout}s\n{logs}")

    def stop(self) -> None:
        for a in self.agents:
            a.stop(timeout=10)
        if self._client is not None:
            self._client.close()
            self._client = None
        self.stop_hub()
        self.broker.stop()

    def __enter__(self) -> "LocalMesh":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
