"""Hub storage: the interface (``Store``, interface.py), one module per concern (sqlite.py lists them)
and one per backend (SQLite, PostgreSQL); the dispatcher and API use only the interface's methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloud_hub.store.interface import Store
from cloud_hub.store.sqlite import SqliteStore, StoreError, StoreFull, hash_token, token_id

if TYPE_CHECKING:
    from cloud_hub.config import HubConfig

__all__ = ["SqliteStore", "Store", "StoreError", "StoreFull", "hash_token", "make_store", "token_id"]


def make_store(cfg: "HubConfig") -> SqliteStore:
    """PostgreSQL when ``database_url`` is set (replicas possible), else the SQLite file."""
    if cfg.database_url:
        from cloud_hub.store.postgres import PostgresStore

        return PostgresStore(cfg.database_url)
    return SqliteStore(cfg.db_path)
