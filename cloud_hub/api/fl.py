"""REST routes for federated-learning runs: ``/v1/fl/runs`` (JSON shapes in docs/fl.md).

The driver (``fl.Federation``) creates a run, stores each round's record with the global-weights
checkpoint, and reads the checkpoint back to resume after a restart; the console reads runs and
rounds. Every request is validated completely before the store is touched, so a bad request
changes nothing.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import Base64Bytes, BaseModel, ConfigDict, Field

from cloud_hub.api.deps import HubDep, UserDep
from cloud_hub.store.fl import FLConflict, FLNotFound, FLStore

__all__ = ["router"]

router = APIRouter(prefix="/v1/fl", tags=["fl"])

_strict = ConfigDict(extra="forbid", allow_inf_nan=False)
_MAX_CONFIG_BYTES = 64 * 1024
_MAX_EXTRA_BYTES = 1024 * 1024  # a round's per-client detail (timings, metrics) for large federations
_Id = Annotated[str, Field(min_length=1, max_length=100)]


class RunIn(BaseModel):
    model_config = _strict
    name: str = Field(min_length=1, max_length=200)
    strategy: str = Field(min_length=1, max_length=100)
    # the built-in modes are sync, async and hierarchical; a driver registered with
    # fl.drivers.register_driver brings its own mode name (docs/fl.md, "Writing a round driver")
    mode: str = Field("sync", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    rounds_planned: int = Field(ge=1, le=1_000_000)
    clients: list[_Id] = Field(default_factory=list, max_length=10_000)
    client_names: dict[str, Annotated[str, Field(max_length=200)]] = Field(default_factory=dict)
    config: dict[str, Any] = Field(default_factory=dict)


class RoundRecordIn(BaseModel):
    model_config = _strict
    round: int = Field(ge=1)
    loss: float | None = None
    accuracy: float | None = None
    participants: list[_Id] = Field(default_factory=list, max_length=10_000)
    stragglers: list[_Id] = Field(default_factory=list, max_length=10_000)
    dropped: dict[str, Annotated[str, Field(max_length=4000)]] = Field(default_factory=dict)
    round_time_s: float | None = Field(None, ge=0)
    extra: dict[str, Any] = Field(default_factory=dict)


class RoundIn(BaseModel):
    model_config = _strict
    record: RoundRecordIn
    weights: Base64Bytes = Field(description="fl.wire blob of the global weights after this round, base64")
    state: dict[str, Any] = Field(default_factory=dict, description="driver state needed to resume (JSON)")
    status: Literal["running", "finished"] = "running"


class StatusIn(BaseModel):
    model_config = _strict
    status: Literal["running", "finished", "failed", "aborted"]
    error: str | None = Field(None, max_length=10_000)


def _fl(h: Any) -> FLStore:
    return FLStore(h.store)


def _json_size(what: str, value: Any, limit: int = _MAX_CONFIG_BYTES) -> None:
    try:
        n = len(json.dumps(value, allow_nan=False))
    except ValueError as exc:
        raise HTTPException(422, f"{what} is not valid JSON: {exc}") from None
    if n > limit:
        raise HTTPException(413, f"{what} is {n} bytes of JSON, over the {limit}-byte limit")


@router.post("/runs", status_code=201)
async def create_run(body: RunIn, h: HubDep, user: UserDep) -> dict[str, Any]:
    _json_size("config", body.config)
    _json_size("client_names", body.client_names)
    return await _fl(h).create_run(
        user, name=body.name, strategy=body.strategy, mode=body.mode, rounds_planned=body.rounds_planned,
        clients=list(dict.fromkeys(body.clients)), client_names=body.client_names, config=body.config,
    )


@router.get("/runs")
async def list_runs(
    h: HubDep,
    user: UserDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    status: Annotated[Literal["running", "finished", "failed", "aborted"] | None, Query()] = None,
) -> dict[str, Any]:
    return {"runs": await _fl(h).list_runs(user, limit, status)}


@router.get("/runs/{run_id}")
async def get_run(run_id: str, h: HubDep, user: UserDep) -> dict[str, Any]:
    try:
        return await _fl(h).get_run(user, run_id)
    except FLNotFound as exc:
        raise HTTPException(404, str(exc)) from None


@router.put("/runs/{run_id}/rounds/{round}")
async def put_round(run_id: str, round: int, body: RoundIn, h: HubDep, user: UserDep) -> dict[str, Any]:
    from mesh_agent.protocol.weights import WireError, decode_weights  # numpy: loaded with the first checkpoint

    if body.record.round != round:
        raise HTTPException(422, f"record.round is {body.record.round} but the path says round {round}")
    if len(body.weights) > h.cfg.max_payload_bytes:
        raise HTTPException(413, f"weights are {len(body.weights)} bytes, over the {h.cfg.max_payload_bytes}-byte limit")
    try:
        decode_weights(body.weights)
    except WireError as exc:
        raise HTTPException(422, f"weights: {exc}") from None
    _json_size("record.extra", body.record.extra, _MAX_EXTRA_BYTES)
    _json_size("state", body.state)
    try:
        return await _fl(h).put_round(user, run_id, round, body.record.model_dump(), body.weights, body.state, body.status)
    except FLNotFound as exc:
        raise HTTPException(404, str(exc)) from None
    except FLConflict as exc:
        raise HTTPException(409, str(exc)) from None


@router.get("/runs/{run_id}/checkpoint")
async def get_checkpoint(run_id: str, h: HubDep, user: UserDep) -> dict[str, Any]:
    try:
        ck = await _fl(h).get_checkpoint(user, run_id)
    except FLNotFound as exc:
        raise HTTPException(404, str(exc)) from None
    ck["weights"] = base64.b64encode(ck["weights"]).decode()
    return ck


@router.patch("/runs/{run_id}")
async def set_status(run_id: str, body: StatusIn, h: HubDep, user: UserDep) -> dict[str, Any]:
    try:
        return await _fl(h).set_status(user, run_id, body.status, body.error)
    except FLNotFound as exc:
        raise HTTPException(404, str(exc)) from None
    except FLConflict as exc:
        raise HTTPException(409, str(exc)) from None
