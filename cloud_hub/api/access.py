"""Who may use an endpoint: sharing, function allow-lists, revocation (``/v1/endpoints/{id}/...``).

Rules (docs/security.md): a user sees and uses only their own endpoints and those an owner shared
with them. Only the owner shares, sets the allow-list, marks it trusted, or revokes. An endpoint the caller cannot see
is a 404, exactly like one that does not exist (no probing for ids); one the caller may use but
not manage is a 403 that says so.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Response
from pydantic import BaseModel, ConfigDict, Field

from cloud_hub.api.deps import HubDep, UserDep
from cloud_hub.service.hub import Hub
from mesh_agent.protocol import serialize

__all__ = ["router"]

router = APIRouter(prefix="/v1/endpoints", tags=["access"])
log = logging.getLogger("cloud_hub")
EndpointId = Annotated[str, Path(min_length=1, max_length=100)]
UserName = Annotated[str, Path(min_length=1, max_length=200)]
FunctionId = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ShareOut(BaseModel):
    endpoint_id: str
    user: str
    created: float | None = None


class AllowIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    function_ids: list[FunctionId] | None = Field(
        description="function ids this endpoint may run; null removes the list (any function of its users)", max_length=10_000
    )


class AllowOut(BaseModel):
    endpoint_id: str
    function_ids: list[str] | None
    failed_tasks: int = Field(0, description="tasks still queued for functions now off the list, failed with cloud_hub.FunctionNotAllowed")


class TrustIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    trusted: bool = Field(description="true: your SDK unpickles this endpoint's results (they may run code on your machine); "
                          "false: data only (JSON, plain containers, numpy arrays), the default for a new endpoint")


class TrustOut(BaseModel):
    endpoint_id: str
    trusted: bool


class RevokeOut(BaseModel):
    endpoint_id: str
    revoked: bool
    failed_tasks: int


async def _require(h: Hub, user: str, endpoint_id: str, *, owner: bool, action: str) -> None:
    role = await h.access.role(user, endpoint_id)
    if role is None:
        raise HTTPException(404, f"unknown endpoint {endpoint_id}")
    if owner and role != "owner":
        raise HTTPException(403, f"only the owner of endpoint {endpoint_id} can {action}")


def _error_blob(kind: str, message: str) -> bytes:
    return serialize({"type": kind, "message": message, "traceback": "", "exception": None})


@router.get("/{endpoint_id}/shares", response_model=list[ShareOut])
async def list_shares(endpoint_id: EndpointId, h: HubDep, user: UserDep) -> list[ShareOut]:
    await _require(h, user, endpoint_id, owner=True, action="list its shares")
    return [ShareOut(endpoint_id=endpoint_id, **s) for s in await h.access.shares(endpoint_id)]


@router.put("/{endpoint_id}/shares/{user_name}", response_model=ShareOut)
async def share(endpoint_id: EndpointId, user_name: UserName, h: HubDep, user: UserDep) -> ShareOut:
    """Let another user list this endpoint and submit their own functions to it."""
    await _require(h, user, endpoint_id, owner=True, action="share it")
    if await h.access.user_name(user) == user_name:
        raise HTTPException(422, "an owner cannot share an endpoint with themselves")
    if await h.access.share(endpoint_id, user_name) is None:
        raise HTTPException(404, f"unknown user {user_name}")
    h.placement.set_shared(endpoint_id, await h.access.shared_user_ids(endpoint_id))
    return ShareOut(endpoint_id=endpoint_id, user=user_name)


@router.delete("/{endpoint_id}/shares/{user_name}", status_code=204)
async def unshare(endpoint_id: EndpointId, user_name: UserName, h: HubDep, user: UserDep) -> Response:
    """Withdraw a share. Tasks that user already submitted stay (they were accepted: invariant 1)."""
    await _require(h, user, endpoint_id, owner=True, action="change its shares")
    if not await h.access.unshare(endpoint_id, user_name):
        raise HTTPException(404, f"endpoint {endpoint_id} is not shared with {user_name}")
    h.placement.set_shared(endpoint_id, await h.access.shared_user_ids(endpoint_id))
    return Response(status_code=204)


@router.get("/{endpoint_id}/allowed-functions", response_model=AllowOut)
async def get_allow_list(endpoint_id: EndpointId, h: HubDep, user: UserDep) -> AllowOut:
    await _require(h, user, endpoint_id, owner=False, action="read its allow-list")
    allowed = h.dispatcher.allow_list(endpoint_id)
    return AllowOut(endpoint_id=endpoint_id, function_ids=None if allowed is None else sorted(allowed))


@router.put("/{endpoint_id}/allowed-functions", response_model=AllowOut)
async def set_allow_list(endpoint_id: EndpointId, body: AllowIn, h: HubDep, user: UserDep) -> AllowOut:
    """Restrict the endpoint to these function ids: submit refuses others with 403, and the agent
    (which gets the list with every welcome and tasks frame) refuses to run others."""
    await _require(h, user, endpoint_id, owner=True, action="set its allow-list")

    def blob(task_id: str, fid: str) -> bytes:
        return _error_blob("cloud_hub.FunctionNotAllowed", f"function {fid} is no longer on endpoint {endpoint_id}'s allow-list")

    failed = await h.access.set_allow_list(endpoint_id, body.function_ids, blob)
    h.dispatcher.set_allow_list(endpoint_id, None if body.function_ids is None else frozenset(body.function_ids))
    if failed:
        h.bus.notify({u for _, u in failed})
        h.placement.tasks_ended([t for t, _ in failed], time.time())
    allowed = h.dispatcher.allow_list(endpoint_id)
    return AllowOut(endpoint_id=endpoint_id, function_ids=None if allowed is None else sorted(allowed), failed_tasks=len(failed))


@router.put("/{endpoint_id}/trusted", response_model=TrustOut)
async def set_trusted(endpoint_id: EndpointId, body: TrustIn, h: HubDep, user: UserDep) -> TrustOut:
    """Mark the endpoint trusted, or not (owner only). Its owner's SDK unpickles results only from
    endpoints marked trusted; from any other it decodes data only, so a stolen device cannot send
    a result that runs code on its owner's machine (docs/security.md). Users it is shared with are
    not affected: they trust it only with ``Client(..., trusted_endpoints=[...])``."""
    await _require(h, user, endpoint_id, owner=True, action="mark it trusted")
    trusted = await h.access.set_trusted(endpoint_id, body.trusted)
    log.info("endpoint %s marked %s by its owner", endpoint_id, "trusted" if trusted else "untrusted", extra={"endpoint_id": endpoint_id})
    return TrustOut(endpoint_id=endpoint_id, trusted=trusted)


class GatewayIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gateway_id: str | None = Field(description="the site gateway that serves this device from now on (docs/sites.md); null: none, "
                                   "it dials the hub's broker", pattern=r"^ep-[0-9a-f]+$", max_length=40)


class GatewayOut(BaseModel):
    endpoint_id: str
    gateway_id: str | None
    previous: str | None
    requeued_tasks: int = Field(0, description="tasks leased ahead to the previous gateway, back in the queue")


@router.put("/{endpoint_id}/gateway", response_model=GatewayOut)
async def set_gateway(endpoint_id: EndpointId, body: GatewayIn, h: HubDep, user: UserDep) -> GatewayOut:
    """Move a device to another site gateway, or off gateways (owner only). The device's own config
    must then name the new broker (``mqtt.host``/``mqtt.port``); its login is the same everywhere."""
    await _require(h, user, endpoint_id, owner=True, action="move it to another gateway")
    if body.gateway_id is not None:
        await _require(h, user, body.gateway_id, owner=True, action="put devices behind it")
    try:
        old, n = await h.store.set_gateway(endpoint_id, body.gateway_id)
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from None
    await h.refresh_broker_auth()  # the new gateway's login may relay it, the old one no longer
    await h.dispatcher.move_site_device(endpoint_id, old, body.gateway_id)
    log.info("endpoint %s moved from gateway %s to %s (%d tasks re-queued)", endpoint_id, old, body.gateway_id, n, extra={"endpoint_id": endpoint_id})
    return GatewayOut(endpoint_id=endpoint_id, gateway_id=body.gateway_id, previous=old, requeued_tasks=n)


@router.delete("/{endpoint_id}", response_model=RevokeOut)
async def revoke(endpoint_id: EndpointId, h: HubDep, user: UserDep) -> Any:
    """Revoke a lost or retired device: its key, broker login and CURVE key stop working at once,
    and its unfinished tasks fail with ``cloud_hub.EndpointRevoked`` (resubmit them elsewhere)."""
    await _require(h, user, endpoint_id, owner=True, action="revoke it")
    failed = await h.access.revoke(
        endpoint_id, lambda tid: _error_blob("cloud_hub.EndpointRevoked", f"endpoint {endpoint_id} was revoked before task {tid} finished")
    )
    h.dispatcher.revoke(endpoint_id)
    log.info("revoked endpoint %s (by user %s; %d unfinished tasks failed)", endpoint_id, user, len(failed), extra={"endpoint_id": endpoint_id})
    h.placement.remove(endpoint_id)
    if failed:
        h.placement.tasks_ended([t for t, _ in failed], time.time())
    await h.refresh_broker_auth()
    if failed:
        h.bus.notify({u for _, u in failed})
    return RevokeOut(endpoint_id=endpoint_id, revoked=True, failed_tasks=len(failed))
