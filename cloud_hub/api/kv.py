"""``GET /v1/kv``: the address of the hub's embedded store for the signed-in user (docs/data.md).

Why an API route: the SDK asks for it when no Redis is configured, so a deployment without Redis
needs no setting at all. The URL carries a credential that opens only this user's key space
(cloud_hub.kv.server), never the API token, so it may travel in task arguments to endpoints.
The store starts with the hub (this router's lifespan) unless ``kv_host`` is empty.
"""

from __future__ import annotations

import secrets
import ssl
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, HTTPException

from cloud_hub.api.deps import ERRORS, HubDep, UserDep
from cloud_hub.kv.keyspace import KVError
from cloud_hub.kv.server import KVServer

__all__ = ["router"]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    hub = app.state.hub
    cfg = hub.cfg
    server = None
    if cfg.kv_host:
        ctx = None
        if cfg.tls_cert_file and cfg.tls_key_file:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(str(cfg.tls_cert_file), str(cfg.tls_key_file))

        async def task_result(user: str, task_id: str) -> tuple[bool, bytes] | None:
            rows = await hub.store.results(user, [task_id])  # the user's own tasks only
            if not rows:
                return None
            # A pickle from a device you did not mark trusted (someone else's, or one of yours that
            # could have been stolen) is not handed to your other endpoints, which unpickle it.
            if not rows[0].get("trusted", False):
                ep = rows[0].get("endpoint_id")
                whose = "an endpoint shared with you" if not rows[0].get("own_endpoint") else \
                    f"your endpoint {ep}, which you have not marked trusted (client.set_endpoint_trusted({ep!r}, True))"
                raise KVError(f"ERR task {task_id} ran on {whose}: its result is not passed to another endpoint "
                              "(fetch it with future.result() and pass the value)")
            return bool(rows[0]["ok"]), bytes(rows[0]["data"] or b"")

        # Kept in the hub's database: a restarted hub (on a fixed kv_port) accepts the URLs it gave
        # out, and its empty store then answers "lost" for old refs instead of refusing the login.
        access = getattr(hub, "access", None)
        secret = bytes.fromhex(await access.secret("kv_store_secret", lambda: secrets.token_hex(32))) if access is not None \
            else secrets.token_bytes(32)
        server = KVServer(cfg.kv_host, cfg.kv_port, secret=secret, max_bytes=cfg.kv_max_bytes,
                          ssl_context=ctx, public_host=cfg.kv_public_host, task_result=task_result)
        await server.start()
    hub.kv = server
    try:
        yield
    finally:
        hub.kv = None
        if server is not None:
            await server.stop()


router = APIRouter(lifespan=_lifespan)


@router.get("/v1/kv", responses=ERRORS)
async def kv_address(h: HubDep, user: UserDep) -> dict[str, Any]:
    """This user's URL for the embedded store (redis:// or rediss://), its limits, and that it
    is the hub's memory (a hub restart loses its data)."""
    server = getattr(h, "kv", None)
    if server is None:
        raise HTTPException(404, "this hub runs no embedded store (kv_host is empty): configure a Redis (MESH_REDIS_URL)")
    return {"url": server.url(user), "max_bytes": server.keys.max_bytes, "max_value_bytes": server.keys.max_value_bytes,
            "durable": False}
