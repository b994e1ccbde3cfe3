"""``Hub``: what the hub's routes share (config, store, dispatcher, result bus, placement,
admission, access store, token cache, metrics) and its start and stop. The app
(``cloud_hub.api.app``) builds one; routers get it through ``cloud_hub.api.deps.HubDep``; the
console and ``cloud_hub.server`` use it too. Service layer: it imports nothing of ``cloud_hub.api``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from cloud_hub.config import HubConfig
from cloud_hub.dispatcher import Dispatcher, ResultBus
from cloud_hub.placement import PlacementService
from cloud_hub.service.admit import Admission
from cloud_hub.service.schemas import EndpointOut
from cloud_hub.store import hash_token, make_store, token_id
from cloud_hub.store.access import AccessStore
from mesh_agent.transport import HubLink

__all__ = ["Hub", "endpoint_out"]

log = logging.getLogger("cloud_hub")

#: How long a good API token is taken on trust before the store is read again: the longest a
#: revoked token still works on a hub that served it just before (every replica alike).
TOKEN_RECHECK_S = 5.0


def _hub_mqtt_tls(cfg: HubConfig) -> Any:
    """The hub's own broker link over TLS (``mqtt_tls``), verified against ``tls_ca_file``."""
    if not cfg.mqtt_tls:
        return None
    from mesh_agent.tls import client_context

    return client_context(cfg.tls_ca_file)


class Hub:
    """What the routes share: config, store, dispatcher, result bus, token cache."""

    def __init__(self, cfg: HubConfig) -> None:
        self.cfg = cfg
        self.store = make_store(cfg)
        self.bus = ResultBus()
        self.dispatcher = Dispatcher(cfg, self.store, self.bus)
        self.placement = PlacementService(cfg, self.store, self.dispatcher.kick, self.dispatcher.allow_list)
        self.admission = Admission(cfg, self.store, self.dispatcher)  # limits, shares, memoization (cloud_hub/service/admit.py)
        #: Endpoints and functions each user's accepted submits named (cloud_hub/service/submit.py).
        self.refs_seen: dict[str, tuple[set[str], set[str]]] = {}
        self.dispatcher.observer = self.admission.observer(self.placement)
        self._token_cache: dict[str, tuple[str, float | None, float]] = {}  # token hash -> (user, expires, checked at)
        self.bootstrap_token: str | None = None
        self.startup_error: BaseException | None = None
        self.globus = _globus_auth(cfg, self.store)
        self.access = AccessStore(self.store)
        self._broker_lock = asyncio.Lock()
        self.started = False
        from cloud_hub.metrics import HubMetrics

        self.metrics = HubMetrics(self)  # /metrics (cloud_hub/metrics.py)

    async def refresh_broker_auth(self) -> None:
        """Rewrite the broker's password and ACL files from the database and make it reload them
        (``mqtt_broker_kind`` nats: the ``nats_auth.conf`` every node includes; every pid SIGHUPed)."""
        if self.cfg.mqtt_auth_dir is None:
            return
        from cloud_hub.broker_auth import reload_broker, write_broker_files

        if not (self.cfg.mqtt_username and self.cfg.mqtt_password):
            raise ValueError("mqtt_auth_dir is set but the hub has no broker login: set mqtt_username and mqtt_password")
        async with self._broker_lock:
            accounts = await self.access.broker_accounts()
            peers: list[tuple[str, str]] = []
            if self.dispatcher.replicated:  # other replicas' broker users stay in the files
                from cloud_hub.replicas import broker_peers

                peers = await broker_peers(self.store, self.cfg.mqtt_username, self.cfg.mqtt_password)
            if self.cfg.mqtt_broker_kind == "nats":
                from cloud_hub.broker_nats import write_nats_auth

                await asyncio.to_thread(write_nats_auth, self.cfg.mqtt_auth_dir, self.cfg.mqtt_username, self.cfg.mqtt_password,
                                        self.cfg.mqtt_prefix, accounts, peers)
            else:
                await asyncio.to_thread(
                    write_broker_files, self.cfg.mqtt_auth_dir, self.cfg.mqtt_username, self.cfg.mqtt_password, self.cfg.mqtt_prefix, accounts,
                    peers,
                )
            if self.cfg.mqtt_broker_pid_file is not None and not await asyncio.to_thread(reload_broker, self.cfg.mqtt_broker_pid_file):
                log.warning("broker pid file %s names no running process; the broker reads the new files when it starts", self.cfg.mqtt_broker_pid_file)

    @property
    def zmq_link(self) -> Any:
        return next((link for link in self.dispatcher.links if link.name == "zmq"), None)

    async def start(self) -> None:
        await self.store.open()
        if hasattr(self.store, "listen"):  # PostgreSQL: hear about other replicas' tasks and results
            await self.store.listen({
                "mesh_tasks": self.dispatcher.kick,
                "mesh_results": lambda user: self.bus.notify({user}),
                "mesh_released": self.dispatcher.on_released,
            })
        await self.placement.start()
        await self.refresh_broker_auth()  # before our own MQTT link logs in
        links: list[HubLink] = []
        if self.cfg.mqtt_host:
            from mesh_agent.transport.brokers import BrokerList
            from mesh_agent.transport.mqtt import MqttHubLink

            links.append(
                MqttHubLink(
                    self.cfg.mqtt_host,
                    self.cfg.mqtt_port,
                    username=self.cfg.mqtt_username,
                    password=self.cfg.mqtt_password,
                    prefix=self.cfg.mqtt_prefix,
                    identifier=self.cfg.mqtt_client_id,
                    tls_context=_hub_mqtt_tls(self.cfg),
                    brokers=BrokerList(self.cfg.broker_nodes()),  # mqtt_hosts: a cluster's other nodes to fail over to
                    # REST must not wait on the broker: a broker that drops packets would hold the
                    # API down for the whole connect timeout. The link connects in the background;
                    # /readyz answers 503 with the reason until it is up.
                    first_attempt_wait_s=0,
                )
            )
        if self.cfg.zmq_bind:
            from mesh_agent.transport.zmq import ZmqHubLink, curve_keypair

            secret = await self.access.secret("zmq_curve_secret", lambda: curve_keypair()[1])
            links.append(ZmqHubLink(self.cfg.zmq_bind, secret_key=secret, clients=await self.access.curve_clients()))
        await self.dispatcher.start(links)
        await self.metrics.start()  # count results and FL rounds from here on
        self.started = True  # the store is open and migrated, the links are started

    async def readiness(self) -> tuple[bool, dict[str, Any]]:
        """What /readyz reports: database reachable, migrations done, broker connected (or why not)."""
        checks: dict[str, Any] = {"migrations": "done" if self.started else "not run yet"}
        try:
            await asyncio.wait_for(self.store.last_result_seq(), 5)
            checks["database"] = "ok"
        except Exception as exc:  # any failure is "not ready", with the reason
            checks["database"] = f"unreachable: {type(exc).__name__}: {exc}"
        for link in self.dispatcher.links:
            if link.name == "mqtt":
                checks["broker"] = "connected" if getattr(link, "connected", True) else (getattr(link, "last_error", None) or "not connected")
        if not self.cfg.mqtt_host:
            checks["broker"] = "none configured"
        elif "broker" not in checks:
            checks["broker"] = "not connected yet"
        ok = checks["database"] == "ok" and self.started and checks["broker"] in ("connected", "none configured")
        return ok, checks

    async def stop(self) -> None:
        await self.dispatcher.stop()
        await self.placement.stop()
        await self.store.close()

    @property
    def zmq_address(self) -> str | None:
        if self.cfg.zmq_public:
            return self.cfg.zmq_public
        for link in self.dispatcher.links:
            if link.name == "zmq":
                return link.bind  # type: ignore[attr-defined, no-any-return]
        return None

    async def user_for(self, token: str) -> str | None:
        return (await self._api_token(token))[0]

    async def _api_token(self, token: str) -> tuple[str | None, str]:
        """(user id or None, why refused) for a hub API token. A good token is cached for
        :data:`TOKEN_RECHECK_S` (and never past its expiry); then the store is read again, so a
        revocation written by ``mesh-hub token revoke`` (another process, or another replica's
        database) holds within that time. Refusals are not cached."""
        h = hash_token(token)
        now = time.time()
        hit = self._token_cache.get(h)
        if hit is not None:
            uid, expires, checked = hit
            if now - checked < TOKEN_RECHECK_S and (expires is None or now < expires):
                return uid, ""
            self._token_cache.pop(h, None)
        state = await self.store.api_token_state(token)
        if state is None:
            return None, "invalid API token"
        uid, expires, revoked = state
        if revoked is not None:
            return None, f"API token {token_id(token)} was revoked at {_utc(revoked)}"
        if expires is not None and expires <= now:
            return None, f"API token {token_id(token)} expired at {_utc(expires)}"
        if len(self._token_cache) >= 100_000:  # bounded: drop the oldest checks
            for k in list(self._token_cache)[:10_000]:
                self._token_cache.pop(k, None)
        self._token_cache[h] = (uid, expires, now)
        return uid, ""

    async def auth(self, token: str) -> tuple[str | None, str]:
        """(user id or None, why refused): hub API tokens first, then Globus Auth if configured."""
        uid, why = await self._api_token(token)
        if uid is not None or self.globus is None or token.startswith("cm_"):
            return uid, why
        verdict = await self.globus.user_for(token)
        return verdict.user_id, verdict.reason


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _globus_auth(cfg: HubConfig, store: Any) -> Any:
    if not cfg.globus_client_id:
        return None
    from cloud_hub.globus_auth import GlobusAuth  # imports globus-sdk only when configured

    return GlobusAuth(cfg.globus_client_id, cfg.globus_client_secret or "", store.create_user, required_scope=cfg.globus_scope,
                      allowed_domains=cfg.globus_allowed_domains, users=cfg.globus_users, cache_s=cfg.globus_cache_s)


def _kept_per_day(kept: Any) -> dict[str, float] | None:
    """Bytes per day from the counters an endpoint's info keeps (written by whichever replica held it)."""
    from cloud_hub.dispatcher import per_day

    try:
        return per_day([float(kept[k]) for k in ("bytes_in", "bytes_out", "frames_in", "frames_out", "since")])
    except (KeyError, TypeError, ValueError):
        return None


def endpoint_out(h: Hub, e: dict[str, Any]) -> EndpointOut:
    live = h.dispatcher.session_info(e["id"])
    info = dict(e["info"])
    if live:
        info.update(live)
    # With replicas, another one may hold the session: trust the shared row while it is fresh, by the
    # bound its hello chose (an MQTT agent that beats on change is silent up to beat_max_s).
    bound = h.dispatcher.silence_bound(info.get("beats") == "adaptive")
    online = live is not None or (h.dispatcher.replicated and bool(e["online"]) and time.time() - (e["last_seen"] or 0) < bound)
    traffic = h.dispatcher.bytes_per_day(e["id"]) or _kept_per_day(info.get("traffic"))
    if traffic is not None:  # frame bytes (no TCP/IP or TLS overhead), agent -> hub is "up"
        info["bytes_per_day"] = {"up": round(traffic["in"]), "down": round(traffic["out"]), "since": traffic["since"]}
    return EndpointOut(
        id=e["id"], name=e["name"], transport=e["transport"], online=online, last_seen=(live or {}).get("last_seen", e["last_seen"]),
        created=e["created"], queued=e["queued"], in_flight=e["in_flight"], info=info, trusted=bool(e.get("trusted", False)),
    )
