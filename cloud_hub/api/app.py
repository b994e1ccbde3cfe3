"""The hub's ASGI app: REST API under ``/v1``, OpenAPI at ``/openapi.json``.

Every write is committed to the store before the response is sent, so a 2xx means the task
survives a hub crash. Validation happens before the transaction: a bad batch changes nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import sqlite3
import time
import uuid
from contextlib import asynccontextmanager
from typing import Annotated, Any, AsyncIterator

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from cloud_hub import __version__
from cloud_hub.api.schemas import (
    BatchIn,
    BatchOut,
    EndpointOut,
    EnrollIn,
    EnrollOut,
    EnrollTokenIn,
    EnrollTokenOut,
    ErrorOut,
    FunctionIn,
    FunctionOut,
    MqttInfo,
    ResultOut,
    ResultsOut,
    TaskIn,
    TaskOut,
    TaskStatus,
    WaitIn,
)
from cloud_hub.config import HubConfig
from cloud_hub.globus_auth import GlobusUnavailable
from cloud_hub.console import router as console_router
from cloud_hub.dispatcher import Dispatcher, ResultBus
from cloud_hub.placement import PlacementError, PlacementService
from cloud_hub.store import hash_token, make_store
from cloud_hub.store.access import AccessStore
from mesh_agent.protocol import SerializationError, function_id, method_of, new_key
from mesh_agent.transport import HubLink

__all__ = ["create_app", "Hub"]

log = logging.getLogger("cloud_hub")
_bearer = HTTPBearer(auto_error=False)
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorOut},
    403: {"model": ErrorOut},
    404: {"model": ErrorOut},
    409: {"model": ErrorOut},
    413: {"model": ErrorOut},
    422: {"model": ErrorOut},
}


class Hub:
    """What the routes share: config, store, dispatcher, result bus, token cache."""

    def __init__(self, cfg: HubConfig) -> None:
        self.cfg = cfg
        self.store = make_store(cfg)
        self.bus = ResultBus()
        self.dispatcher = Dispatcher(cfg, self.store, self.bus)
        self.placement = PlacementService(cfg, self.store, self.dispatcher.kick, self.dispatcher.allow_list)
        self.dispatcher.observer = self.placement
        self._token_cache: dict[str, str] = {}
        self.bootstrap_token: str | None = None
        self.globus = _globus_auth(cfg, self.store)
        self.access = AccessStore(self.store)
        self._broker_lock = asyncio.Lock()

    async def refresh_broker_auth(self) -> None:
        """Rewrite the broker's password and ACL files from the database and make it reload them."""
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
            await asyncio.to_thread(
                write_broker_files, self.cfg.mqtt_auth_dir, self.cfg.mqtt_username, self.cfg.mqtt_password, self.cfg.mqtt_prefix, accounts,
                peers,
            )
            if self.cfg.mqtt_broker_pid_file is not None and not reload_broker(self.cfg.mqtt_broker_pid_file):
                log.warning("broker pid file %s names no running process; the broker reads the new files when it starts", self.cfg.mqtt_broker_pid_file)

    @property
    def zmq_link(self) -> Any:
        return next((link for link in self.dispatcher.links if link.name == "zmq"), None)

    async def start(self) -> None:
        await self.store.open()
        if hasattr(self.store, "listen"):  # PostgreSQL: hear about other replicas' tasks and results
            await self.store.listen({"mesh_tasks": self.dispatcher.kick, "mesh_results": lambda user: self.bus.notify({user})})
        await self.placement.start()
        await self.refresh_broker_auth()  # before our own MQTT link logs in
        links: list[HubLink] = []
        if self.cfg.mqtt_host:
            from mesh_agent.transport.mqtt import MqttHubLink

            links.append(
                MqttHubLink(
                    self.cfg.mqtt_host,
                    self.cfg.mqtt_port,
                    username=self.cfg.mqtt_username,
                    password=self.cfg.mqtt_password,
                    prefix=self.cfg.mqtt_prefix,
                    identifier=self.cfg.mqtt_client_id,
                )
            )
        if self.cfg.zmq_bind:
            from mesh_agent.transport.zmq import ZmqHubLink, curve_keypair

            secret = await self.access.secret("zmq_curve_secret", lambda: curve_keypair()[1])
            links.append(ZmqHubLink(self.cfg.zmq_bind, secret_key=secret, clients=await self.access.curve_clients()))
        await self.dispatcher.start(links)

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
        h = hash_token(token)
        uid = self._token_cache.get(h)
        if uid is None:
            uid = await self.store.user_for_token(token)
            if uid is not None:
                self._token_cache[h] = uid
        return uid

    async def auth(self, token: str) -> tuple[str | None, str]:
        """(user id or None, why refused): hub API tokens first, then Globus Auth if configured."""
        uid = await self.user_for(token)
        if uid is not None or self.globus is None or token.startswith("cm_"):
            return uid, "invalid API token"
        verdict = await self.globus.user_for(token)
        return verdict.user_id, verdict.reason


def _globus_auth(cfg: HubConfig, store: Any) -> Any:
    if not cfg.globus_client_id:
        return None
    from cloud_hub.globus_auth import GlobusAuth  # imports globus-sdk only when configured

    return GlobusAuth(cfg.globus_client_id, cfg.globus_client_secret or "", store.create_user, required_scope=cfg.globus_scope,
                      allowed_domains=cfg.globus_allowed_domains, users=cfg.globus_users, cache_s=cfg.globus_cache_s)


def _hub(request: Request) -> Hub:
    return request.app.state.hub  # type: ignore[no-any-return]


async def _user(
    request: Request, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    if cred is None or cred.scheme.lower() != "bearer":
        raise HTTPException(401, "missing API token (Authorization: Bearer ...)", headers={"WWW-Authenticate": "Bearer"})
    try:
        uid, why = await _hub(request).auth(cred.credentials)
    except GlobusUnavailable as exc:  # the token is neither good nor bad yet: the client may retry
        raise HTTPException(503, str(exc), headers={"Retry-After": "5"}) from None
    if uid is None:
        raise HTTPException(401, why, headers={"WWW-Authenticate": "Bearer"})
    return uid


HubDep = Annotated[Hub, Depends(_hub)]
UserDep = Annotated[str, Depends(_user)]


def create_app(cfg: HubConfig) -> FastAPI:
    hub = Hub(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await hub.start()
        if cfg.bootstrap_user:
            uid = await hub.store.create_user(cfg.bootstrap_user)
            hub.bootstrap_token = await hub.store.create_api_token(uid, "bootstrap")
        try:
            yield
        finally:
            await hub.stop()

    app = FastAPI(title="Continuum Mesh hub", version=__version__, lifespan=lifespan, responses=_ERRORS)
    app.state.hub = hub
    from cloud_hub.api import scheduler as scheduler_api  # here: it imports this module's dependencies

    app.include_router(scheduler_api.router)
    app.include_router(console_router)  # web console at /console (docs/console.md)

    @app.get("/v1/health")
    async def health(h: HubDep) -> dict[str, Any]:
        return {"ok": True, "version": __version__, "links": [link.name for link in h.dispatcher.links]}

    # -------------------------------------------------------------- functions
    @app.post("/v1/functions", response_model=FunctionOut, status_code=201)
    async def register_function(body: FunctionIn, h: HubDep, user: UserDep) -> FunctionOut:
        _check_size(h, "function body", body.body)
        try:
            if method_of(body.body) not in ("dill", "source", "pickle"):
                raise SerializationError("function body must be serialized code (dill, source or pickle)")
        except SerializationError as exc:
            raise HTTPException(422, str(exc)) from None
        fid = function_id(body.body)
        await h.store.put_function(user, fid, body.body, body.name)
        return FunctionOut(function_id=fid, name=body.name)

    @app.get("/v1/functions", response_model=list[FunctionOut])
    async def list_functions(h: HubDep, user: UserDep) -> list[FunctionOut]:
        return [FunctionOut(function_id=f["id"], name=f["name"], created=f["created"], size=f["size"]) for f in await h.store.list_functions(user)]

    # -------------------------------------------------------------- endpoints
    @app.post("/v1/enrollment-tokens", response_model=EnrollTokenOut, status_code=201)
    async def create_enrollment_token(body: EnrollTokenIn, h: HubDep, user: UserDep) -> EnrollTokenOut:
        token = await h.store.create_enroll_token(user, body.ttl_s, body.uses)
        return EnrollTokenOut(token=token, expires_in_s=body.ttl_s, uses=body.uses)

    @app.post("/v1/endpoints/enroll", response_model=EnrollOut, status_code=201)
    async def enroll(body: EnrollIn, h: HubDep) -> EnrollOut:
        if body.transport == "mqtt" and not cfg.mqtt_host:
            raise HTTPException(422, "this hub has no MQTT broker configured; enroll with transport 'zmq'")
        if body.transport == "zmq" and not h.zmq_address:
            raise HTTPException(422, "this hub has no ZeroMQ listener configured; enroll with transport 'mqtt'")
        zlink = h.zmq_link
        if body.transport == "zmq" and not _valid_curve_key(body.curve_public):
            raise HTTPException(422, "a ZeroMQ endpoint must send its CURVE public key (curve_public, 40 z85 characters); upgrade mesh-agent")
        key = new_key()
        # Per-endpoint broker login: the password is shown once, the hub keeps a Mosquitto $7$ hash.
        from cloud_hub.broker_auth import mosquitto_hash, new_broker_password

        password = new_broker_password() if body.transport == "mqtt" else None
        try:
            ep = await h.store.enroll_endpoint(
                body.token, body.name, body.transport, key,
                mqtt_hash=mosquitto_hash(password) if password else None,
                curve_key=body.curve_public if body.transport == "zmq" else None,
            )
        except sqlite3.IntegrityError:  # the unique CURVE key index; the token use was rolled back with it
            raise HTTPException(409, "this CURVE public key is already enrolled: make a new keypair for each endpoint") from None
        if ep is None:
            raise HTTPException(401, "enrollment token is invalid, expired or used up")
        h.dispatcher.add_endpoint_key(ep["id"], key)
        if body.transport == "zmq" and zlink is not None and body.curve_public:
            zlink.allow_client(body.curve_public, ep["id"])
        if password:
            await h.refresh_broker_auth()
        mqtt = None
        if cfg.mqtt_host:
            mqtt = MqttInfo(host=cfg.mqtt_public_host or cfg.mqtt_host, port=cfg.mqtt_port, topic_prefix=cfg.mqtt_prefix,
                            username=ep["id"] if password else None, password=password)
        return EnrollOut(
            endpoint_id=ep["id"], key=key.hex(), transport=body.transport, heartbeat_s=cfg.heartbeat_s,
            mqtt=mqtt, zmq_address=h.zmq_address, zmq_server_key=zlink.public_key if zlink is not None else None,
        )

    @app.get("/v1/endpoints", response_model=list[EndpointOut])
    async def list_endpoints(h: HubDep, user: UserDep) -> list[EndpointOut]:
        return [_endpoint_out(h, e) for e in await h.store.list_endpoints(user_id=user)]

    @app.get("/v1/endpoints/{endpoint_id}", response_model=EndpointOut)
    async def get_endpoint(endpoint_id: str, h: HubDep, user: UserDep) -> EndpointOut:
        rows = await h.store.list_endpoints(user_id=user, endpoint_id=endpoint_id)
        if not rows:
            raise HTTPException(404, f"unknown endpoint {endpoint_id}")
        return _endpoint_out(h, rows[0])

    # -------------------------------------------------------------- tasks
    from cloud_hub.api.access import router as access_router  # imports UserDep/HubDep from here

    app.include_router(access_router)

    @app.post("/v1/tasks", response_model=TaskOut, status_code=201)
    async def submit(body: TaskIn, h: HubDep, user: UserDep) -> TaskOut:
        ids, eps = await _accept(h, user, [body])
        return TaskOut(task_id=ids[0], endpoint_id=eps[0])

    @app.post("/v1/tasks/batch", response_model=BatchOut, status_code=201)
    async def submit_batch(body: BatchIn, h: HubDep, user: UserDep) -> BatchOut:
        if len(body.tasks) > cfg.max_batch:
            raise HTTPException(413, f"batch of {len(body.tasks)} tasks exceeds the limit of {cfg.max_batch}")
        ids, eps = await _accept(h, user, body.tasks)
        return BatchOut(task_ids=ids, endpoint_ids=eps)

    @app.get("/v1/tasks/{task_id}", response_model=TaskStatus)
    async def task_status(task_id: str, h: HubDep, user: UserDep) -> TaskStatus:
        t = await h.store.get_task(task_id, user)
        if t is None:
            raise HTTPException(404, f"unknown task {task_id}")
        if t["ok"] is not None:
            t["ok"] = bool(t["ok"])
        return TaskStatus(**t)

    # -------------------------------------------------------------- results
    @app.post("/v1/results/wait", response_model=ResultsOut)
    async def wait_results(body: WaitIn, h: HubDep, user: UserDep) -> ResultsOut:
        """Long poll: results among ``task_ids`` that are ready, waiting up to ``timeout_s`` for the first."""
        deadline = time.monotonic() + body.timeout_s
        while True:
            ev = h.bus.event(user)
            rows = await h.store.results(user, body.task_ids)
            left = deadline - time.monotonic()
            if rows or left <= 0:
                return ResultsOut(results=[_result_out(r) for r in rows], cursor=max((r["seq"] for r in rows), default=0))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ev.wait(), left)

    @app.get("/v1/results/stream", response_model=ResultsOut)
    async def result_stream(
        h: HubDep,
        user: UserDep,
        after: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 2000,
        timeout_s: Annotated[float, Query(ge=0, le=60)] = 20.0,
    ) -> ResultsOut:
        """All of the caller's results after cursor ``after``, long-polling when there are none yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            ev = h.bus.event(user)
            rows = await h.store.results_after(user, after, limit)
            left = deadline - time.monotonic()
            if rows or left <= 0:
                return ResultsOut(results=[_result_out(r) for r in rows], cursor=rows[-1]["seq"] if rows else after)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ev.wait(), left)

    @app.get("/v1/results/cursor")
    async def result_cursor(h: HubDep, user: UserDep) -> dict[str, int]:
        """Where a new stream reader should start: results stored after this belong to later tasks."""
        return {"cursor": await h.store.last_result_seq()}

    from cloud_hub.api.fl import router as fl_router  # here: it imports this module's auth dependencies

    app.include_router(fl_router)
    return app


def _check_size(h: Hub, what: str, blob: bytes) -> None:
    if len(blob) > h.cfg.max_payload_bytes:
        raise HTTPException(
            413,
            f"{what} is {len(blob)} bytes, over the {h.cfg.max_payload_bytes}-byte limit; "
            "stage large data separately and pass a reference",
        )


async def _accept(h: Hub, user: str, tasks: list[TaskIn]) -> tuple[list[str], list[str]]:
    """Validate every task, place those with a selector ("auto", a list, tags), then insert all
    (with the placement decisions) in one transaction, then wake the dispatcher."""
    for i, t in enumerate(tasks):
        _check_size(h, f"task {i} arguments", t.args)
        try:
            method_of(t.args)
        except SerializationError as exc:
            raise HTTPException(422, f"task {i} arguments: {exc}") from None
    eps: set[str] = set()
    for t in tasks:
        if isinstance(t.endpoint_id, list):
            eps.update(t.endpoint_id)
        elif isinstance(t.endpoint_id, str) and t.endpoint_id != "auto":
            eps.add(t.endpoint_id)
    fids = {t.function_id for t in tasks}
    found_eps, found_fids = await h.store.owned_refs(user, eps, fids)
    if eps - found_eps:
        raise HTTPException(404, f"unknown endpoint {sorted(eps - found_eps)[0]}")
    if fids - found_fids:
        raise HTTPException(404, f"unknown function {sorted(fids - found_fids)[0]} (register it first)")
    now = time.time()
    rows = [
        {
            "id": uuid.uuid4().hex,
            "user_id": user,
            "endpoint_id": t.endpoint_id if isinstance(t.endpoint_id, str) and t.endpoint_id != "auto" else None,
            "function_id": t.function_id,
            "args": t.args,
            "created": now,
            "expires": now + (t.ttl_s or h.cfg.task_ttl_s),
            "timeout": t.timeout_s,
        }
        for t in tasks
    ]
    try:
        decisions = await h.placement.place(user, tasks, rows, now)
    except PlacementError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    for i, r in enumerate(rows):  # on the endpoint each task will run on, named or placed
        allowed = h.dispatcher.allow_list(r["endpoint_id"])
        if allowed is not None and r["function_id"] not in allowed:
            h.placement.retract(r["id"] for r in rows)
            raise HTTPException(403, f"task {i}: function {r['function_id']} is not on endpoint {r['endpoint_id']}'s allow-list")
    try:
        await h.store.insert_tasks(rows, also=h.placement.writer(decisions))
    except BaseException:
        h.placement.retract(r["id"] for r in rows)
        raise
    for ep in {r["endpoint_id"] for r in rows}:
        h.dispatcher.kick(ep)
    return [r["id"] for r in rows], [r["endpoint_id"] for r in rows]


def _valid_curve_key(key: str | None) -> bool:
    if not key or len(key) != 40:
        return False
    import zmq.utils.z85

    try:
        return len(zmq.utils.z85.decode(key.encode("ascii"))) == 32
    except Exception:  # KeyError for a char outside z85, struct.error for an overflowing group, ...
        return False


def _endpoint_out(h: Hub, e: dict[str, Any]) -> EndpointOut:
    live = h.dispatcher.session_info(e["id"])
    info = dict(e["info"])
    if live:
        info.update(live)
    # With replicas, another one may hold the session: trust the shared row while it is fresh.
    online = live is not None or (h.dispatcher.replicated and bool(e["online"]) and time.time() - (e["last_seen"] or 0) < h.cfg.lost_after_s)
    return EndpointOut(
        id=e["id"], name=e["name"], transport=e["transport"], online=online, last_seen=(live or {}).get("last_seen", e["last_seen"]),
        created=e["created"], queued=e["queued"], in_flight=e["in_flight"], info=info,
    )


def _result_out(r: dict[str, Any]) -> ResultOut:
    return ResultOut(task_id=r["task_id"], ok=r["ok"], data=base64.b64encode(r["data"] or b"").decode(), started=r["started"], finished=r["finished"])
