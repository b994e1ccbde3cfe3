"""What hub replicas sharing one database must know about each other, beyond the store.

The broker runs with ``use_username_as_clientid``: two replicas logging in with one broker user
would throw each other off. So each replica has its own broker user (``MESH_HUB_MQTT_USERNAME``),
records its ``$7$`` hash in ``hub_secrets`` (``broker_hub:<user>``) and every replica writes all of
them into the broker's password and ACL files (full access, like the hub's own user).
"""

from __future__ import annotations

from typing import Any

from cloud_hub.broker_auth import mosquitto_hash, verify_mosquitto_hash
from cloud_hub.store import replicas as sql

__all__ = ["broker_peers"]

_PREFIX = "broker_hub:"


async def broker_peers(store: Any, username: str, password: str) -> list[tuple[str, str]]:
    """Record this replica's broker login; return the other replicas' (username, hash) pairs."""

    def q(db: Any) -> list[tuple[str, str]]:
        import time

        name = _PREFIX + username
        recorded = sql.secret(db, name)
        if recorded is None or not verify_mosquitto_hash(password, recorded):
            sql.replace_secret(db, name, mosquitto_hash(password), time.time())
        rows = sql.broker_logins(db)
        return [(n[len(_PREFIX):], v) for n, v in rows if n != name]

    return list(await store.tx(q))
