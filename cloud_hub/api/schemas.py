"""Request and response bodies of the REST API (pydantic; they make the OpenAPI spec).

Binary fields (function bodies, argument and result blobs) travel base64-encoded; they are
produced and read by ``mesh_agent.protocol.serialize``, so the header inside names the method.
The task and endpoint shapes the service layer works on (``TaskIn``, ``EndpointOut``) are in
``cloud_hub/service/schemas.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Base64Bytes, BaseModel, ConfigDict, Field, StringConstraints

from cloud_hub.service.schemas import IdempotencyKey, TaskIn

_strict = ConfigDict(extra="forbid")


class FunctionIn(BaseModel):
    model_config = _strict
    name: str = Field(min_length=1, max_length=200)
    body: Base64Bytes = Field(description="serialize_function(fn), base64")


class FunctionOut(BaseModel):
    function_id: str
    name: str | None = None
    created: float | None = None
    size: int | None = None


class TaskOut(BaseModel):
    task_id: str
    endpoint_id: str | None = None  # where it was placed


class BatchFunction(BaseModel):
    """A function body that rides with the batch that first uses it (no separate registration)."""

    model_config = _strict
    name: str = Field(min_length=1, max_length=200)
    body: Base64Bytes = Field(description="serialize_function(fn), base64; its SHA-256 must be the key")


TaskGroupId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class BatchIn(BaseModel):
    model_config = _strict
    tasks: list[TaskIn] = Field(min_length=1)
    functions: dict[str, BatchFunction] | None = Field(
        None, max_length=1000, description="function id -> body, for bodies the hub may not have yet (registered with the tasks)")
    task_group_id: TaskGroupId | None = Field(None, description="a group to list these tasks by later (GET /v1/task-groups/{id}/tasks)")
    idempotency_key: IdempotencyKey | None = None


class BatchOut(BaseModel):
    task_ids: list[str]
    endpoint_ids: list[str] | None = None  # where each was placed, same order


class GroupTask(BaseModel):
    task_id: str
    endpoint_id: str
    function_id: str
    state: Literal["queued", "leased", "acked", "done"]
    created: float
    ok: bool | None


class GroupTasksOut(BaseModel):
    task_group_id: str
    tasks: list[GroupTask]


class TaskStatus(BaseModel):
    id: str
    endpoint_id: str
    function_id: str
    state: Literal["queued", "leased", "acked", "done"]
    created: float
    dispatched: float | None
    acked: float | None
    done: float | None
    attempts: int
    ok: bool | None
    started: float | None
    finished: float | None


class ResultOut(BaseModel):
    task_id: str
    ok: bool
    data: str = Field(description="serialize(value) or serialize(error dict), base64")
    started: float | None
    finished: float | None
    endpoint_id: str | None = Field(None, description="where it ran (none: the hub made it, e.g. the task expired)")
    own_endpoint: bool = Field(False, description="it ran on the caller's own endpoint (or the hub made it)")
    trusted: bool = Field(False, description="the caller may unpickle it: it ran on the caller's own endpoint and its owner "
                          "marked that endpoint trusted (or the hub made it). The SDK decodes every other result as data only, "
                          "unless the caller lists the endpoint in trusted_endpoints")


class WaitIn(BaseModel):
    model_config = _strict
    task_ids: list[str] = Field(min_length=1, max_length=10_000)
    timeout_s: float = Field(20.0, ge=0, le=60)


class ResultsOut(BaseModel):
    results: list[ResultOut]
    cursor: int = Field(description="pass as ?after= to continue the stream")


class EnrollTokenIn(BaseModel):
    model_config = _strict
    ttl_s: float = Field(86400.0, gt=0, le=365 * 86400)
    uses: int = Field(1, ge=1, le=100_000)


class EnrollTokenOut(BaseModel):
    token: str = Field(repr=False)  # secrets stay out of repr() and so out of logs (docs/security.md)
    expires_in_s: float
    uses: int
    ca_hash: str | None = Field(None, description="sha256:<hex> of the hub's CA; give it to `mesh-agent init --ca-hash`")
    broker_url: str | None = Field(None, description="the broker agents will be told to use (mqtts://..., wss://...)")


class CaOut(BaseModel):
    ca_pem: str
    ca_hash: str


class EnrollIn(BaseModel):
    model_config = _strict
    token: str = Field(min_length=8, repr=False)
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.\-]+$")
    transport: Literal["mqtt", "zmq"] = "mqtt"
    curve_public: str | None = Field(None, min_length=40, max_length=40, description="the agent's ZeroMQ CURVE public key (z85); required for zmq")
    gateway_id: str | None = Field(None, min_length=4, max_length=40, pattern=r"^ep-[0-9a-f]+$",
                                   description="the site gateway that serves this device on its LAN (docs/sites.md); mqtt only")


class MqttInfo(BaseModel):
    host: str
    port: int
    topic_prefix: str
    username: str | None = None
    password: str | None = Field(None, repr=False)
    url: str | None = Field(None, description="mqtt://, mqtts:// (TLS) or wss://host:port/path (MQTT over secure WebSockets)")


class EnrollOut(BaseModel):
    endpoint_id: str
    key: str = Field(description="hex HMAC key for signing; shown once", repr=False)
    transport: str
    heartbeat_s: float
    mqtt: MqttInfo | None
    zmq_address: str | None
    zmq_server_key: str | None = Field(None, description="the hub's CURVE public key (z85), for zmq endpoints")
    ca_pem: str | None = Field(None, description="the hub's CA (PEM), which the agent checks against its --ca-hash")


class EnrollBatchItem(BaseModel):
    model_config = _strict
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.\-]+$")
    curve_public: str | None = Field(None, min_length=40, max_length=40, description="the endpoint's ZeroMQ CURVE public key (z85); required for zmq")


#: Endpoints per bulk enrollment: one transaction and one broker reload each; 10,000 keeps a request
#: (its Mosquitto hashes, 1 ms each) to seconds.
MAX_ENROLL_BATCH = 10_000


class EnrollBatchIn(BaseModel):
    """Many endpoints under one multi-use enrollment token (a fleet, a load harness), all or none."""

    model_config = _strict
    token: str = Field(min_length=8, repr=False)
    transport: Literal["mqtt", "zmq"] = "mqtt"
    endpoints: list[EnrollBatchItem] = Field(min_length=1, max_length=MAX_ENROLL_BATCH)


class EnrollBatchOut(BaseModel):
    endpoints: list[EnrollOut]


class ErrorOut(BaseModel):
    detail: str
