"""What admission control (``cloud_hub/service/admit.py``) reads: how many tasks a user has queued
(in all, and per function), counted no further than the bound needs, and a user's name (limits
and shares may name users by name).

Plain SQL that both stores run; the caller passes these to ``store.read``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["queued", "queued_of_function", "user_name"]


def queued(db: Any, user_id: str, upto: int) -> int:
    """The user's queued tasks, counted up to ``upto`` at most (an index range no longer than that)."""
    return int(db.execute("SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE user_id=? AND state='queued' LIMIT ?) q",
                          (user_id, upto)).fetchone()[0])


def queued_of_function(db: Any, user_id: str, function_id: str, upto: int) -> int:
    """The user's queued tasks of one function, counted up to ``upto`` at most."""
    return int(db.execute("SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE user_id=? AND state='queued' AND function_id=? LIMIT ?) q",
                          (user_id, function_id, upto)).fetchone()[0])


def user_name(db: Any, user_id: str) -> str | None:
    """The user's name, or None for an unknown id (users are never renamed: callers cache it)."""
    row = db.execute("SELECT name FROM users WHERE id=?", (user_id,)).fetchone()
    return row[0] if row is not None else None
