"""``/v1/scheduler``: the scheduler's placement decisions, predicted against actual.

Read-only and per user: a caller sees the decisions for their own tasks only (every endpoint
a decision names is theirs too, since selectors only ever choose among the caller's
endpoints). The JSON shape is documented in docs/scheduler.md; the console builds on it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import time

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field

from cloud_hub.api.deps import HubDep, UserDep

__all__ = ["router"]

router = APIRouter(prefix="/v1/scheduler", tags=["scheduler"])


class PredictionOut(BaseModel):
    endpoint_id: str
    total: float | None
    transfer_in: float | None
    queue: float | None
    cold: float | None
    run: float | None
    transfer_out: float | None
    outage: float | None
    source: str
    exploration: bool


class SelectorOut(BaseModel):
    kind: Literal["auto", "list", "tags"]
    endpoints: list[str] | None
    tags: list[str] | None


class ConstraintsOut(BaseModel):
    tags: list[str]
    gpu: bool
    min_memory_mb: int


class DecisionOut(BaseModel):
    seq: int
    task_id: str
    function_id: str
    endpoint_id: str
    policy: str
    selector: SelectorOut
    constraints: ConstraintsOut
    reason: str
    exploration: bool
    placed_at: float
    predicted_s: float | None
    predicted: PredictionOut | None
    compared: list[PredictionOut]
    pruned: int
    state: Literal["placed", "done", "moved"]
    completed_at: float | None
    actual_s: float | None
    runtime_s: float | None
    error_s: float | None
    ok: bool | None


class DecisionSummary(BaseModel):
    decisions: int
    completed: int
    moved: int = Field(0, description="decisions superseded: the task was placed again while it waited in the hub (its "
                                      "endpoint lost, or another ran out of work: late binding)")
    mean_abs_error_s: float | None
    mean_rel_error: float | None


class DecisionsOut(BaseModel):
    decisions: list[DecisionOut]
    next_before: int | None
    summary: DecisionSummary


@router.get("/decisions", response_model=DecisionsOut)
async def decisions(
    h: HubDep,
    user: UserDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    before: Annotated[int | None, Query(ge=1, description="seq cursor from next_before: older decisions")] = None,
    task_id: Annotated[str | None, Query(min_length=1, max_length=100)] = None,
    endpoint_id: Annotated[str | None, Query(min_length=1, max_length=100)] = None,
    function_id: Annotated[str | None, Query(min_length=1, max_length=64)] = None,
) -> Any:
    """Recent placement decisions for the caller's tasks, newest first, with predicted vs actual."""
    return await h.placement.decisions(user, limit, before, task_id, endpoint_id, function_id)


@router.get("/state")
async def state(h: HubDep, user: UserDep) -> Any:
    """What the scheduler believes about each of the caller's endpoints: link latency and clock
    offset (from echoed round trips), throughput, learned cold starts, and per term (total, run,
    overhead, transfer, queue, transfer out) how far its predictions were from what happened,
    with the bounded correction in force (docs/scheduler.md, "Calibration")."""
    return h.placement.state(user)


class PredictIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    function_id: str = Field(min_length=1, max_length=64)
    endpoint_ids: list[str] = Field(min_length=1, max_length=1000)
    payload_bytes: int = Field(0, ge=0, le=1 << 30)
    horizon_s: float | None = Field(None, gt=0, le=7 * 86400, description="P(online) over this window (default: the predicted time)")


class EndpointPrediction(BaseModel):
    endpoint_id: str
    known: bool
    online: bool
    predicted_s: float | None
    run_s: float | None
    source: str
    exploration: bool
    p_online: float | None
    share_online: float | None


class PredictOut(BaseModel):
    function_id: str
    predictions: list[EndpointPrediction]


@router.post("/predict", response_model=PredictOut)
async def predict(body: PredictIn, h: HubDep, user: UserDep) -> Any:
    """Predicted seconds to run ``function_id`` on each endpoint and P(it stays online that long),
    placing nothing (FL client selection asks this). Only the caller's own (or shared) endpoints
    and functions: another user's is a 404, as everywhere in the API."""
    mine = {e["id"] for e in await h.store.list_endpoints(user_id=user)}
    unknown = [e for e in dict.fromkeys(body.endpoint_ids) if e not in mine]
    if unknown:
        raise HTTPException(404, f"endpoint(s) not found: {', '.join(unknown[:5])}")
    if body.function_id not in {f["id"] for f in await h.store.list_functions(user)}:
        raise HTTPException(404, f"function {body.function_id} not found")
    preds = h.placement.predict(body.function_id, list(dict.fromkeys(body.endpoint_ids)), body.payload_bytes,
                                body.horizon_s, time.time())
    return {"function_id": body.function_id, "predictions": preds}
