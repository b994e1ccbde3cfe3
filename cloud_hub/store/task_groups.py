"""Task groups (``GET /v1/task_groups/{id}/tasks``, ``cloud_hub/api/task_groups.py``): the tasks a
user filed under one group, with their outcome.

Plain SQL that both stores run; the caller passes it to ``store.read``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["group_tasks"]


def group_tasks(db: Any, user_id: str, task_group_id: str) -> list[tuple[Any, ...]]:
    """(id, endpoint, function, state, created, result ok or None) of the user's tasks in the group, in submission order (100,000 at most)."""
    return db.execute(
        "SELECT t.id, t.endpoint_id, t.function_id, t.state, t.created, r.ok FROM tasks t LEFT JOIN results r ON r.task_id=t.id "
        "WHERE t.user_id=? AND t.task_group_id=? ORDER BY t.created, t.rowid LIMIT 100000",
        (user_id, task_group_id),
    ).fetchall()
