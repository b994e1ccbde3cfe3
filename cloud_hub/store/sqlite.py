"""The hub's embedded store: one SQLite file, WAL, ``synchronous=FULL`` (a 2xx means on disk).

Every public method is one transaction run on a single dedicated DB thread: the event loop
never blocks on fsync, there is exactly one writer (no SQLITE_BUSY games), and a multi-statement
operation (lease a batch, store a batch of results) costs one thread hop. Transactions that
arrive while the thread is busy are committed together (group commit, cloud_hub/store/group.py):
each in its own savepoint, each caller answered only after the COMMIT, one fsync for the group.

:class:`SqliteStore` is composed of one mixin per concern, each in a module of its own:

- ``_engine.py``: the connection, the writer and reader threads, transactions, migrations;
- ``tokens.py``: users, API tokens, enrollment tokens and enrolling endpoints;
- ``endpoints.py``: the endpoint registry, replica claims, functions and ownership;
- ``sessions.py``: a hello's and a lost session's writes (on both the queue and the registry);
- ``tasks.py``: the queue: insert, lease, ack, requeue, expiry, cancellation, group leases;
- ``sites.py``: site gateways and the work leased ahead to a site;
- ``results.py``: results, once per task, and each user's result cursor.

The PostgreSQL store (``postgres.py``) is the same class on another connection. The names other
modules import from here are re-exported, so callers need not know the split.
"""

from __future__ import annotations

from cloud_hub.store._engine import (
    StoreEngine,
    StoreError,
    StoreFull,
    _chunks,
    _statements,
    migrate,
    number_results,
    pending_migrations,
)
from cloud_hub.store.results import ResultStore, check_results
from cloud_hub.store.sessions import SessionStore
from cloud_hub.store.sites import SiteStore
from cloud_hub.store.tasks import UnknownTask, _fair_rows, attach_envs, cancel_in, fail_tasks
from cloud_hub.store.tokens import TokenStore, hash_token, token_id, token_id_of_hash

__all__ = [
    "SqliteStore", "StoreEngine", "StoreError", "StoreFull", "UnknownTask", "attach_envs", "cancel_in", "check_results", "fail_tasks",
    "hash_token", "migrate", "number_results", "pending_migrations", "token_id", "token_id_of_hash", "_chunks", "_fair_rows", "_statements",
]


class SqliteStore(TokenStore, SessionStore, SiteStore, ResultStore):
    """The hub store: every concern's methods on one SQLite file (the module docstring lists them)."""
