"""The shapes the service layer takes and gives: a task as submitted (:class:`TaskIn`) and an
endpoint as listed (:class:`EndpointOut`). Pydantic, so the REST API uses them as its request and
response bodies unchanged (``cloud_hub/api/schemas.py`` holds the bodies only HTTP needs); here
because task acceptance (``cloud_hub/service/submit.py``) and placement (``cloud_hub/placement.py``)
work on them, and neither may import ``cloud_hub.api``.

Binary fields travel base64-encoded and are produced by ``mesh_agent.protocol.serialize``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Base64Bytes, BaseModel, ConfigDict, Field, StringConstraints

__all__ = ["Tag", "EndpointRef", "TagSelector", "TaskConstraints", "IdempotencyKey", "TaskIn", "EndpointOut"]

_strict = ConfigDict(extra="forbid")


Tag = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
EndpointRef = Annotated[str, StringConstraints(min_length=1, max_length=100)]


class TagSelector(BaseModel):
    """Any of the caller's endpoints that has all these tags."""

    model_config = _strict
    tags: list[Tag] = Field(min_length=1, max_length=32)


class TaskConstraints(BaseModel):
    """What the function needs from an endpoint (the scheduler never places it elsewhere)."""

    model_config = _strict
    tags: list[Tag] = Field(default_factory=list, max_length=32)
    gpu: bool = False
    min_memory_mb: int = Field(0, ge=0, le=2**31)


#: Client-generated (a uuid4 is ideal): a retry with the same key returns the tasks the first attempt
#: made instead of making new ones; the same key with a different request is refused (409).
IdempotencyKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{8,128}$"),
                           Field(description="client-generated key that makes a retried submit return the original tasks")]


class TaskIn(BaseModel):
    model_config = _strict
    endpoint_id: Union[EndpointRef, Annotated[list[EndpointRef], Field(min_length=1, max_length=1000)], TagSelector] = Field(
        description='an endpoint id; "auto" (the scheduler picks among yours); a list of ids; or {"tags": [...]}')
    constraints: TaskConstraints | None = None
    function_id: str = Field(min_length=64, max_length=64)
    args: Base64Bytes = Field(description="serialize((args, kwargs)), base64")
    timeout_s: float | None = Field(None, gt=0, description="per-run limit on the endpoint")
    ttl_s: float | None = Field(None, gt=0, description="give up if not run within this time")
    idempotency_key: IdempotencyKey | None = None
    cache_key: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = Field(
        None, description="memoization (docs/sdk.md): the SDK's hash of function, arguments and environment; a live cached "
                          "result of yours with this key answers the task with no dispatch, and a success is cached under it")
    environment: dict[str, Any] | None = Field(
        None, description='where it runs on the endpoint (docs/environments.md): {"pip": [...], "env_vars": {...}, "container": '
                          '"...", "sandbox": true, "network": true}; checked and stored canonical, signed into the task frame')
    start: Literal["now"] | None = Field(
        None, description='"now": start at once, on a free worker or on one more up to the agent\'s cap, never behind other '
                          "tasks in the agent's queue (a multiprocessing Process: docs/multiprocessing.md, \"Start\")")
    inputs: Annotated[list[tuple[Annotated[str, StringConstraints(min_length=1, max_length=200)], Annotated[int, Field(ge=0)]]],
                      Field(max_length=1024)] | None = Field(
        None, description="where the task's input refs already lie, [endpoint_id, bytes] pairs (docs/data.md, \"Locality\"): "
                          "the scheduler adds the bytes an endpoint lacks to its predicted transfer time")


class EndpointOut(BaseModel):
    id: str
    name: str
    transport: str
    online: bool
    last_seen: float | None
    created: float
    queued: int
    in_flight: int
    info: dict[str, Any]
    trusted: bool = Field(False, description="its owner marked it trusted: the owner's SDK unpickles its results "
                          "(PUT /v1/endpoints/{id}/trusted); otherwise they are decoded as data only")
