"""Cancelling tasks, and the driver leases that cancel a dead program's work (docs/protocol.md,
"Cancellation"; docs/multiprocessing.md, "Cancel" and "Lease").

- ``POST /v1/tasks/{task_id}/cancel``, ``POST /v1/tasks/cancel`` (``{"task_ids": [...]}``) and
  ``POST /v1/task-groups/{id}/cancel``: only the task's submitter may cancel (another user's task
  is an unknown task, 404, as everywhere). Every task without a result gets its one ``cancelled``
  result in the same transaction, so the answer never waits for an agent; the dispatcher then
  tells the agents holding them (now, or on their next session). A batch with one bad or unknown
  id changes nothing.
- ``PUT /v1/task-groups/{id}/lease`` (``{"ttl_s": 60}``) makes or renews a lease on the group;
  ``DELETE`` drops it. A lease not renewed within its ``ttl_s`` cancels the group's unfinished
  tasks (the hub's watchdog, cloud_hub/dispatcher.py).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field

from cloud_hub.api.deps import ERRORS, HubDep, UserDep
from cloud_hub.service.cancel import cancel

__all__ = ["router"]

router = APIRouter(tags=["tasks"])

_TASK_ID = re.compile(r"^[0-9a-f]{32}$")
GroupId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
#: Ids one batch cancel may name (as many as a batch submit may make).
MAX_CANCEL = 50_000


class CancelIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_ids: list[Any] = Field(description=f"task ids (32 hex digits), 1 to {MAX_CANCEL}")


class CancelOut(BaseModel):
    cancelled: list[str] = Field(description="tasks that end with their one cancelled result (by this call or an earlier cancel)")
    done: list[str] = Field(description="tasks that had finished already: their result stands")


class TaskCancelOut(BaseModel):
    task_id: str
    cancelled: bool
    state: str = Field(description='"cancelled", or "done" when it had finished before the cancel')


class GroupCancelOut(BaseModel):
    task_group_id: str
    cancelled: list[str]


class LeaseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttl_s: float = Field(gt=0, le=86_400, description="the lease lasts this long unless renewed")


class LeaseOut(BaseModel):
    task_group_id: str
    expires_in_s: float


def _check_ids(ids: list[Any]) -> list[str]:
    if not ids:
        raise HTTPException(422, "task_ids is empty: name at least one task")
    if len(ids) > MAX_CANCEL:
        raise HTTPException(413, f"{len(ids)} task ids exceed the limit of {MAX_CANCEL} per cancel")
    for i, t in enumerate(ids):
        if not isinstance(t, str) or not _TASK_ID.match(t):
            raise HTTPException(422, f"task_ids[{i}]: {str(t)[:80]!r} is not a task id (32 hex digits)")
    return ids


@router.post("/v1/tasks/cancel", response_model=CancelOut, responses=ERRORS)
async def cancel_batch(body: CancelIn, h: HubDep, user: UserDep) -> CancelOut:
    """Cancel these tasks of yours: queued ones never run, running ones are ended (their worker is
    killed and replaced), and each ends with one cancelled result. All or nothing: an id that is
    not a task of yours is 404 and nothing is cancelled."""
    out = await cancel(h, user, _check_ids(body.task_ids))
    return CancelOut(cancelled=out["cancelled"], done=out["done"])


@router.post("/v1/tasks/{task_id}/cancel", response_model=TaskCancelOut, responses=ERRORS)
async def cancel_one(task_id: str, h: HubDep, user: UserDep) -> TaskCancelOut:
    """Cancel one task of yours (``cancelled: false`` when it had finished already)."""
    if not _TASK_ID.match(task_id):
        raise HTTPException(422, f"{task_id[:80]!r} is not a task id (32 hex digits)")
    out = await cancel(h, user, [task_id])
    ok = task_id in out["cancelled"]
    return TaskCancelOut(task_id=task_id, cancelled=ok, state="cancelled" if ok else "done")


@router.post("/v1/task-groups/{task_group_id}/cancel", response_model=GroupCancelOut, responses=ERRORS)
async def cancel_group(task_group_id: GroupId, h: HubDep, user: UserDep) -> GroupCancelOut:
    """Cancel every unfinished task of yours filed under this group (an unknown group has none)."""
    out = await cancel(h, user, group=task_group_id)
    return GroupCancelOut(task_group_id=task_group_id, cancelled=out["cancelled"])


@router.put("/v1/task-groups/{task_group_id}/lease", response_model=LeaseOut, responses=ERRORS)
async def renew_lease(task_group_id: GroupId, body: LeaseIn, h: HubDep, user: UserDep) -> LeaseOut:
    """Make or renew the lease that keeps this group's tasks alive: not renewed within ``ttl_s``,
    the hub cancels the group's unfinished tasks (a driver that died)."""
    await h.store.renew_group_lease(user, task_group_id, body.ttl_s)
    return LeaseOut(task_group_id=task_group_id, expires_in_s=body.ttl_s)


@router.delete("/v1/task-groups/{task_group_id}/lease", status_code=204, responses=ERRORS)
async def release_lease(task_group_id: GroupId, h: HubDep, user: UserDep) -> None:
    """Drop the lease (a program that ended cleanly); the group's tasks are left as they are."""
    await h.store.release_group_lease(user, task_group_id)
