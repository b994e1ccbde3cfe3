"""Hub storage. One module per backend (SQLite now); the dispatcher and API use only these methods."""

from cloud_hub.store.sqlite import SqliteStore, StoreError, hash_token

__all__ = ["SqliteStore", "StoreError", "hash_token"]
