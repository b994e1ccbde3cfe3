"""What hub replicas sharing one database record about each other (``cloud_hub/replicas.py``):
each replica's broker login, as ``broker_hub:<user>`` rows of ``hub_secrets``.

Plain SQL that both stores run; the caller runs them in one ``store.tx``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["secret", "replace_secret", "broker_logins"]


def secret(db: Any, name: str) -> str | None:
    """The value of a hub secret (a replica's recorded broker password hash), or None."""
    row = db.execute("SELECT value FROM hub_secrets WHERE name=?", (name,)).fetchone()
    return row[0] if row is not None else None


def replace_secret(db: Any, name: str, value: str, created: float) -> None:
    """Record a hub secret, replacing the one of that name (a replica's new broker password hash)."""
    db.execute("DELETE FROM hub_secrets WHERE name=?", (name,))
    db.execute("INSERT INTO hub_secrets (name, value, created) VALUES (?, ?, ?)", (name, value, created))


def broker_logins(db: Any) -> list[tuple[str, str]]:
    """(name, hash) of every replica's recorded broker login (``broker_hub:<user>``)."""
    return [(n, v) for n, v in db.execute("SELECT name, value FROM hub_secrets WHERE name LIKE 'broker_hub:%'").fetchall()]
