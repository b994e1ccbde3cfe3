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
from contextlib import asynccontextmanager
from typing import Annotated, Any, AsyncIterator

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from cloud_hub import __version__
from cloud_hub.api import access as access_api
from cloud_hub.api import fl as fl_api
from cloud_hub.api import kv as kv_api
from cloud_hub.api import scheduler as scheduler_api
from cloud_hub.api import stream as stream_api
from cloud_hub.api import task_groups as task_groups_api
from cloud_hub.api import cancel as cancel_api
from cloud_hub.api.task_groups import CODE_METHODS, checked_functions
from cloud_hub.api.deps import ERRORS, HubDep, UserDep
from cloud_hub.api.errors import service_error_response, validation_error_response
from cloud_hub.api.metrics import make_router as metrics_router
from cloud_hub.api.schemas import (
    BatchIn,
    BatchOut,
    CaOut,
    EnrollBatchIn,
    EnrollBatchOut,
    EnrollIn,
    EnrollOut,
    EnrollTokenIn,
    EnrollTokenOut,
    FunctionIn,
    FunctionOut,
    MqttInfo,
    ResultOut,
    ResultsOut,
    TaskOut,
    TaskStatus,
    WaitIn,
)
from cloud_hub.config import HubConfig
from cloud_hub.console import router as console_router
from cloud_hub.service.errors import ServiceError
from cloud_hub.service.hub import Hub, endpoint_out
from cloud_hub.service.schemas import EndpointOut, TaskIn
from cloud_hub.service.submit import accept, check_size
from cloud_hub.store import StoreFull
from mesh_agent.protocol import SerializationError, function_id, method_of, new_key

__all__ = ["create_app"]

log = logging.getLogger("cloud_hub")


def _ca_pem(cfg: HubConfig) -> str | None:
    """The CA agents are given at enrollment (read each time: an operator may renew it)."""
    if cfg.tls_ca_file is None:
        return None
    try:
        return cfg.tls_ca_file.read_text()
    except OSError as exc:
        raise HTTPException(500, f"the hub's CA file {cfg.tls_ca_file} cannot be read: {exc.strerror}") from None


def _broker_url(cfg: HubConfig) -> str | None:
    if cfg.mqtt_public_url:
        return cfg.mqtt_public_url
    if not cfg.mqtt_host:
        return None
    return f"mqtt://{cfg.mqtt_public_host or cfg.mqtt_host}:{cfg.mqtt_port}"


def create_app(cfg: HubConfig) -> FastAPI:
    hub = Hub(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            await hub.start()
        except Exception as exc:  # `mesh-hub serve` reports it in one line and exits non-zero
            hub.startup_error = exc
            raise
        if cfg.bootstrap_user:
            uid = await hub.store.create_user(cfg.bootstrap_user)
            hub.bootstrap_token = await hub.store.create_api_token(uid, "bootstrap")
        try:
            yield
        finally:
            log.info("hub shutting down")
            await hub.stop()
            log.info("hub stopped")

    app = FastAPI(title="Continuum Mesh hub", version=__version__, lifespan=lifespan, responses=ERRORS)
    app.state.hub = hub

    @app.exception_handler(StoreFull)
    async def _disk_full(request: Request, exc: StoreFull) -> JSONResponse:
        """507 Insufficient Storage: the request changed nothing (its transaction rolled back
        whole) and may be retried, with the same idempotency key, once space is freed."""
        log.error("refused %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse(status_code=507, content={"detail": str(exc)})

    # A refusal of the service layer (cloud_hub/service/errors.py): its status, detail and headers,
    # as the HTTPException the routes raised when these rules lived here.
    app.add_exception_handler(ServiceError, service_error_response)
    app.add_exception_handler(RequestValidationError, validation_error_response)

    app.include_router(scheduler_api.router)
    app.include_router(console_router)  # web console at /console (docs/console.md)
    app.include_router(metrics_router())  # Prometheus at /metrics (docs/operations.md, "Monitoring")

    # Health for load balancers and systemd; no token needed (they reveal no user data).
    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        """200 while the process lives and serves HTTP."""
        return {"ok": True, "version": __version__}

    @app.get("/readyz")
    async def readyz(h: HubDep) -> Any:
        """200 when the database answers, migrations ran and the broker is connected; else 503 with why."""
        from fastapi.responses import JSONResponse

        ok, checks = await h.readiness()
        return JSONResponse({"ready": ok, **checks}, status_code=200 if ok else 503)

    @app.get("/v1/health")
    async def health(h: HubDep) -> dict[str, Any]:
        return {"ok": True, "version": __version__, "links": [link.name for link in h.dispatcher.links]}

    # -------------------------------------------------------------- functions
    @app.post("/v1/functions", response_model=FunctionOut, status_code=201)
    async def register_function(body: FunctionIn, h: HubDep, user: UserDep) -> FunctionOut:
        check_size(h, "function body", body.body)
        try:
            if method_of(body.body) not in CODE_METHODS:
                raise SerializationError(f"function body must be serialized code ({', '.join(CODE_METHODS)})")
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
        pem = _ca_pem(cfg)
        token = await h.store.create_enroll_token(user, body.ttl_s, body.uses)
        # The CA's hash travels with the token (like kubeadm's --discovery-token-ca-cert-hash), so a
        # device can check the CA it is sent at enrollment without anyone copying CA files around.
        from mesh_agent.tls import ca_hash_of_pem

        return EnrollTokenOut(token=token, expires_in_s=body.ttl_s, uses=body.uses, ca_hash=ca_hash_of_pem(pem) if pem else None,
                              broker_url=_broker_url(cfg))

    @app.get("/v1/tls/ca", response_model=CaOut, responses=ERRORS)
    async def tls_ca() -> CaOut:
        """The hub's CA (public, no token): a device fetches it, checks it against the hash it was
        given with its enrollment token, and only then talks to the hub with it."""
        pem = _ca_pem(cfg)
        if pem is None:
            raise HTTPException(404, "this hub has no CA configured (MESH_HUB_TLS_CA_FILE); it uses publicly trusted certificates or none")
        from mesh_agent.tls import ca_hash_of_pem

        return CaOut(ca_pem=pem, ca_hash=ca_hash_of_pem(pem))

    @app.post("/v1/endpoints/enroll", response_model=EnrollOut, status_code=201)
    async def enroll(body: EnrollIn, h: HubDep) -> EnrollOut:
        if body.transport == "mqtt" and not cfg.mqtt_host:
            raise HTTPException(422, "this hub has no MQTT broker configured; enroll with transport 'zmq'")
        if body.transport == "zmq" and not h.zmq_address:
            raise HTTPException(422, "this hub has no ZeroMQ listener configured; enroll with transport 'mqtt'")
        zlink = h.zmq_link
        if body.transport == "zmq" and not _valid_curve_key(body.curve_public):
            raise HTTPException(422, "a ZeroMQ endpoint must send its CURVE public key (curve_public, 40 z85 characters); upgrade mesh-agent")
        if body.gateway_id is not None and body.transport != "mqtt":
            raise HTTPException(422, "a device behind a site gateway enrolls with transport 'mqtt' (it dials the gateway's broker)")
        key = new_key()
        # Per-endpoint broker login: the password is shown once, the hub keeps a Mosquitto $7$ hash.
        from cloud_hub.broker_auth import broker_hash, new_broker_password

        password = new_broker_password() if body.transport == "mqtt" else None
        try:
            ep = await h.store.enroll_endpoint(
                body.token, body.name, body.transport, key,
                mqtt_hash=broker_hash(password) if password else None,  # $7$ (Mosquitto) and bcrypt (NATS)
                curve_key=body.curve_public if body.transport == "zmq" else None,
                gateway_id=body.gateway_id,
            )
        except sqlite3.IntegrityError:  # the unique CURVE key index; the token use was rolled back with it
            raise HTTPException(409, "this CURVE public key is already enrolled: make a new keypair for each endpoint") from None
        except ValueError as exc:  # a gateway that is not the user's: the transaction (token use included) rolled back
            raise HTTPException(422, str(exc)) from None
        if ep is None:
            raise HTTPException(401, "enrollment token is invalid, expired or used up")
        h.dispatcher.add_endpoint_key(ep["id"], key)
        log.info("enrolled endpoint %s (name %r, transport %s)", ep["id"], body.name, body.transport, extra={"endpoint_id": ep["id"]})
        if body.transport == "zmq" and zlink is not None and body.curve_public:
            zlink.allow_client(body.curve_public, ep["id"])
        if password:
            await h.refresh_broker_auth()
        if body.gateway_id is not None:  # after the broker's ACL lets the gateway relay this device
            await h.dispatcher.add_site_device(ep["id"], body.gateway_id)
        mqtt = None
        if cfg.mqtt_host:
            mqtt = MqttInfo(host=cfg.mqtt_public_host or cfg.mqtt_host, port=cfg.mqtt_port, topic_prefix=cfg.mqtt_prefix,
                            username=ep["id"] if password else None, password=password, url=_broker_url(cfg))
            site = h.dispatcher.site_broker(body.gateway_id) if body.gateway_id else None
            if site is not None:  # the device dials its gateway's broker on the LAN, with the same login
                mqtt = MqttInfo(host=site[0], port=site[1], topic_prefix=cfg.mqtt_prefix, username=ep["id"], password=password,
                                url=f"mqtt://{site[0]}:{site[1]}")
        return EnrollOut(
            endpoint_id=ep["id"], key=key.hex(), transport=body.transport, heartbeat_s=cfg.heartbeat_s, ca_pem=_ca_pem(cfg),
            mqtt=mqtt, zmq_address=h.zmq_address, zmq_server_key=zlink.public_key if zlink is not None else None,
        )

    @app.post("/v1/endpoints/enroll-batch", response_model=EnrollBatchOut, status_code=201)
    async def enroll_batch(body: EnrollBatchIn, h: HubDep) -> EnrollBatchOut:
        """Enroll many endpoints with one multi-use token: one transaction (all or none), one
        rewrite of the broker's password and ACL files and one reload, instead of N of each (a
        fleet or a load harness enrolling thousands would otherwise rewrite the files N times)."""
        if body.transport == "mqtt" and not cfg.mqtt_host:
            raise HTTPException(422, "this hub has no MQTT broker configured; enroll with transport 'zmq'")
        if body.transport == "zmq" and not h.zmq_address:
            raise HTTPException(422, "this hub has no ZeroMQ listener configured; enroll with transport 'mqtt'")
        zlink = h.zmq_link
        if body.transport == "zmq":
            for i, e in enumerate(body.endpoints):
                if not _valid_curve_key(e.curve_public):
                    raise HTTPException(422, f"endpoints[{i}]: a ZeroMQ endpoint must send its CURVE public key (curve_public, 40 z85 characters)")
            if len({e.curve_public for e in body.endpoints}) != len(body.endpoints):
                raise HTTPException(422, "the same CURVE public key appears twice: make a new keypair for each endpoint")
        from cloud_hub.broker_auth import broker_hash, new_broker_password

        keys = [new_key() for _ in body.endpoints]
        passwords = [new_broker_password() for _ in body.endpoints] if body.transport == "mqtt" else []
        hashes = await asyncio.to_thread(lambda: [broker_hash(pw) for pw in passwords])  # ~1 ms each: off the event loop
        items = [{"name": e.name, "transport": body.transport, "key": keys[i], "mqtt_hash": hashes[i] if hashes else None,
                  "curve_key": e.curve_public if body.transport == "zmq" else None} for i, e in enumerate(body.endpoints)]
        try:
            eps = await h.store.enroll_endpoints(body.token, items)
        except sqlite3.IntegrityError:  # the unique CURVE key index; nothing was written
            raise HTTPException(409, "a CURVE public key in this batch is already enrolled: make a new keypair for each endpoint") from None
        if eps is None:
            raise HTTPException(401, f"enrollment token is invalid, expired or has fewer than {len(items)} uses left")
        for i, ep in enumerate(eps):
            h.dispatcher.add_endpoint_key(ep["id"], keys[i])
            if body.transport == "zmq" and zlink is not None:
                zlink.allow_client(body.endpoints[i].curve_public, ep["id"])
        if passwords:
            await h.refresh_broker_auth()
        log.info("enrolled %d endpoints in one batch (transport %s)", len(eps), body.transport)
        pem = _ca_pem(cfg)
        out = []
        for i, ep in enumerate(eps):
            mqtt = None
            if cfg.mqtt_host:
                mqtt = MqttInfo(host=cfg.mqtt_public_host or cfg.mqtt_host, port=cfg.mqtt_port, topic_prefix=cfg.mqtt_prefix,
                                username=ep["id"] if passwords else None, password=passwords[i] if passwords else None, url=_broker_url(cfg))
            out.append(EnrollOut(endpoint_id=ep["id"], key=keys[i].hex(), transport=body.transport, heartbeat_s=cfg.heartbeat_s, ca_pem=pem,
                                 mqtt=mqtt, zmq_address=h.zmq_address, zmq_server_key=zlink.public_key if zlink is not None else None))
        return EnrollBatchOut(endpoints=out)

    @app.get("/v1/endpoints", response_model=list[EndpointOut])
    async def list_endpoints(h: HubDep, user: UserDep) -> list[EndpointOut]:
        return [endpoint_out(h, e) for e in await h.store.list_endpoints(user_id=user)]

    @app.get("/v1/endpoints/{endpoint_id}", response_model=EndpointOut)
    async def get_endpoint(endpoint_id: str, h: HubDep, user: UserDep) -> EndpointOut:
        rows = await h.store.list_endpoints(user_id=user, endpoint_id=endpoint_id)
        if not rows:
            raise HTTPException(404, f"unknown endpoint {endpoint_id}")
        return endpoint_out(h, rows[0])

    # -------------------------------------------------------------- tasks
    app.include_router(access_api.router)
    app.include_router(task_groups_api.router)
    app.include_router(cancel_api.router)  # cancel tasks and groups, driver leases (cloud_hub/api/cancel.py)

    @app.post("/v1/tasks", response_model=TaskOut, status_code=201)
    async def submit(body: TaskIn, h: HubDep, user: UserDep) -> TaskOut:
        ids, eps = await accept(h, user, [body], body.idempotency_key)
        return TaskOut(task_id=ids[0], endpoint_id=eps[0])

    @app.post("/v1/tasks/batch", response_model=BatchOut, status_code=201)
    async def submit_batch(body: BatchIn, h: HubDep, user: UserDep) -> BatchOut:
        if len(body.tasks) > cfg.max_batch:
            raise HTTPException(413, f"batch of {len(body.tasks)} tasks exceeds the limit of {cfg.max_batch}")
        if any(t.idempotency_key is not None for t in body.tasks):
            raise HTTPException(422, "idempotency_key belongs on the batch, not on its tasks")
        functions = checked_functions(h, body.functions)  # bodies riding with the batch (cloud_hub/api/task_groups.py)
        ids, eps = await accept(h, user, body.tasks, body.idempotency_key, functions=functions, group=body.task_group_id)
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
        return {"cursor": await h.store.last_result_seq(user)}

    app.include_router(fl_api.router)
    app.include_router(kv_api.router)  # /v1/kv and the embedded store's lifespan (cloud_hub/api/kv.py)
    app.include_router(stream_api.router)  # /v1/stream: the SDK's WebSocket (cloud_hub/api/stream.py)
    return app


def _valid_curve_key(key: str | None) -> bool:
    if not key or len(key) != 40:
        return False
    import zmq.utils.z85

    try:
        return len(zmq.utils.z85.decode(key.encode("ascii"))) == 32
    except Exception:  # KeyError for a char outside z85, struct.error for an overflowing group, ...
        return False


def _result_out(r: dict[str, Any]) -> ResultOut:
    return ResultOut(task_id=r["task_id"], ok=r["ok"], data=base64.b64encode(r["data"] or b"").decode(), started=r["started"], finished=r["finished"],
                     endpoint_id=r.get("endpoint_id"), own_endpoint=r.get("own_endpoint", False), trusted=r.get("trusted", False))
