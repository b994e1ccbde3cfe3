"""Cancelling tasks (docs/protocol.md, "Cancellation"; docs/multiprocessing.md, "Cancel"): the
routes of cloud_hub/api/cancel.py call :func:`cancel`. Every task without a result gets its one
``cancelled`` result in the same transaction, so the answer never waits for an agent; the
dispatcher then tells the agents holding them (now, or on their next session).
"""

from __future__ import annotations

import time
from typing import Any

from cloud_hub.service.errors import ServiceError
from cloud_hub.service.hub import Hub

__all__ = ["cancel"]


async def cancel(h: Hub, user: str, ids: list[str] | None = None, group: str | None = None) -> dict[str, Any]:
    """Cancel by ids (all the caller's, else 404 and nothing changes) or a whole group's unfinished tasks."""
    from cloud_hub.store.sqlite import UnknownTask

    now = time.time()
    try:
        out = await h.store.cancel_tasks(user, ids, group=group, now=now)
    except UnknownTask as exc:
        raise ServiceError(404, f"{exc}; nothing was cancelled") from None
    if out["fresh"]:
        h.bus.notify({user})
        h.placement.tasks_ended(out["fresh"], now)
    h.dispatcher.note_cancelled(out["fresh"], out["endpoints"])
    return out
