"""Function bodies that ride with a batch, and task groups (``/v1/task-groups/{id}/tasks``).

A batch may carry ``{"functions": {id: {"name", "body"}}}`` for bodies the hub has not seen, so the
SDK never makes a registration round trip inside ``submit()``. Each id must be the SHA-256 of its
body and each body serialized code within the payload limit; a bad one refuses the whole batch
(4xx, one line) before anything is stored. Good ones are stored in the transaction that inserts
the tasks (``function_writer``, cloud_hub/service/submit.py).

A batch may also carry a ``task_group_id``; the caller lists that group's tasks later (a new
process re-attaching futures to tasks an earlier one submitted: ``Executor.reload_tasks``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path

from cloud_hub.api.deps import HubDep, UserDep
from cloud_hub.api.schemas import BatchFunction, GroupTask, GroupTasksOut
from cloud_hub.store.task_groups import group_tasks as group_tasks_of
from mesh_agent.protocol import SerializationError, function_id, method_of

__all__ = ["router", "CODE_METHODS", "checked_functions"]

router = APIRouter(prefix="/v1/task-groups", tags=["tasks"])

#: Serialization methods a function body may use (data-only methods are refused).
CODE_METHODS = ("cloudpickle", "dill", "source", "pickle")


def checked_functions(h: Any, functions: dict[str, BatchFunction] | None) -> dict[str, tuple[str, bytes]]:
    """``{id: (name, body)}`` after checking every body; the first bad one is a clear 4xx."""
    out: dict[str, tuple[str, bytes]] = {}
    for fid, f in (functions or {}).items():
        short = fid[:16] + ("..." if len(fid) > 16 else "")
        if len(f.body) > h.cfg.max_payload_bytes:
            raise HTTPException(413, f"function {short} body is {len(f.body)} bytes, over the {h.cfg.max_payload_bytes}-byte limit")
        try:
            method = method_of(f.body)
        except SerializationError as exc:
            raise HTTPException(422, f"function {short}: {exc}") from None
        if method not in CODE_METHODS:
            raise HTTPException(422, f"function {short}: body must be serialized code ({', '.join(CODE_METHODS)}), not {method}")
        if function_id(f.body) != fid:
            raise HTTPException(422, f"function {short}: the id is not the SHA-256 of its body (the id is computed, never chosen)")
        out[fid] = (f.name, f.body)
    return out


GroupId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


@router.get("/{task_group_id}/tasks", response_model=GroupTasksOut)
async def group_tasks(task_group_id: GroupId, h: HubDep, user: UserDep) -> GroupTasksOut:
    """The caller's tasks filed under this group in submission order (an unknown group is empty)."""

    def q(db: Any) -> list[Any]:
        return group_tasks_of(db, user, task_group_id)

    rows = await h.store.read(q)
    return GroupTasksOut(task_group_id=task_group_id, tasks=[
        GroupTask(task_id=r[0], endpoint_id=r[1], function_id=r[2], state=r[3], created=r[4], ok=None if r[5] is None else bool(r[5]))
        for r in rows
    ])
