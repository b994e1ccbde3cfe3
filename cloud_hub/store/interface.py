"""The hub store's interface: what the rest of the hub may call, in one place.

Why a Protocol: the hub has one store class per backend (SQLite, and PostgreSQL on top of it),
and code outside ``cloud_hub/store/`` should depend on these methods, not on a backend. The
methods are grouped by the module that holds them (``sqlite.py`` lists the modules). Whoever
adds a method that the hub calls from outside the store adds it here too;
``tests/unit/test_store_interface.py`` checks that both backends provide each one with this
signature. SQL the hub runs through ``tx``/``read`` lives in ``cloud_hub/store/`` modules as
plain functions of the connection.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    from cloud_hub.admission import AdmissionPolicy

__all__ = ["Store"]

T = TypeVar("T")
_P = TypeVar("_P", bound="Store")


class Store(Protocol):
    """The hub's storage, whatever the backend."""

    # the engine (_engine.py): transactions, reads, lifecycle
    async def close(self) -> None:
        """Stop the DB threads and close the connections (pending work is finished first)."""
        ...

    async def open(self: _P) -> _P:
        """Open (creating and migrating the schema as needed); returns the store, ready."""
        ...

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(db)`` on the DB thread without opening a write transaction."""
        ...

    async def read_parallel(self, fn: Callable[..., T], *args: Any) -> T:
        """Run read-only ``fn(db, *args)`` on a second, read-only connection with its own thread."""
        ...

    async def tx(self, fn: Callable[..., T], *args: Any, durable: bool = True) -> T:
        """Run ``fn(db, *args)`` as one transaction (or one savepoint of a group commit) on the DB thread; return once it is committed. ..."""
        ...

    # tokens.py
    async def api_token_state(self, token: str) -> tuple[str, float | None, float | None] | None:
        """``(user id, expires, revoked)`` of a token, whether or not it is still good; None when unknown."""
        ...

    async def create_api_token(self, user_id: str, name: str = "default", expires: float | None = None) -> str:
        """A new API token (shown once; only its SHA-256 is stored). ``expires``: a Unix time after which the hub refuses it, or None for a token that ..."""
        ...

    async def create_enroll_token(self, user_id: str, ttl_s: float, uses: int) -> str:
        """create enroll token"""
        ...

    async def create_user(self, name: str) -> str:
        """create user"""
        ...

    async def enroll_endpoint(self, token: str, name: str, transport: str, key: bytes,
                              mqtt_hash: str | None = None, curve_key: str | None = None,
                              gateway_id: str | None = None) -> dict[str, Any] | None:
        """Consume one use of an enrollment token and create the endpoint, atomically."""
        ...

    async def enroll_endpoints(self, token: str, items: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
        """Consume ``len(items)`` uses of one enrollment token and create all those endpoints in one transaction, or none (a fleet enrolled in bulk ..."""
        ...

    async def list_api_tokens(self, user: str | None = None) -> list[dict[str, Any]]:
        """Every API token (or one user's, by name): its id (:func:`token_id`), user, name, times."""
        ...

    async def revoke_api_token(self, which: str) -> dict[str, Any]:
        """Revoke one API token, named by its id (``tk_`` and at least 6 hex digits of it, a unique prefix) or by the token itself. Returns its row ..."""
        ...

    async def user_for_token(self, token: str) -> str | None:
        """The token's user while it is good (known, not expired, not revoked), else None."""
        ...

    # endpoints.py
    async def claim_endpoint(self, endpoint_id: str, replica: str, until: float, now: float) -> bool:
        """Hold (or renew) an endpoint's session for this hub replica unless another holds it."""
        ...

    async def endpoint_info(self, endpoint_id: str) -> dict[str, Any] | None:
        """The info JSON kept in an endpoint's row (one indexed read, no task counts)."""
        ...

    async def endpoint_key(self, endpoint_id: str) -> bytes | None:
        """One endpoint's key: for an endpoint enrolled through another hub replica."""
        ...

    async def endpoint_keys(self) -> dict[str, bytes]:
        """endpoint keys"""
        ...

    async def endpoint_owners_of(self, endpoint_ids: Iterable[str]) -> dict[str, str]:
        """endpoint id -> the user who enrolled it (sandbox by default for anyone else's tasks, docs/environments.md)."""
        ...

    async def endpoint_transport(self, endpoint_id: str) -> str | None:
        """The link an endpoint enrolled for: a replica takes over only endpoints it can reach."""
        ...

    async def list_endpoints(self, user_id: str | None = None, endpoint_id: str | None = None) -> list[dict[str, Any]]:
        """list endpoints"""
        ...

    async def list_functions(self, user_id: str) -> list[dict[str, Any]]:
        """list functions"""
        ...

    async def owned_refs(self, user_id: str, endpoint_ids: Iterable[str], fids: Iterable[str]) -> tuple[set[str], set[str]]:
        """Which of these endpoints and functions the user may use: one hop on the submit path."""
        ...

    async def put_function(self, user_id: str, fid: str, body: bytes, name: str) -> None:
        """put function"""
        ...

    async def release_endpoint(self, endpoint_id: str, replica: str) -> None:
        """release endpoint"""
        ...

    async def touch_endpoints(self, rows: Sequence[tuple[float, dict[str, Any], str]]) -> None:
        """Many endpoints' ``last_seen`` and live info, ``(last_seen, info, endpoint_id)`` each, in one transaction without an fsync. Why: heartbeats ..."""
        ...

    # sessions.py
    async def close_session(self, endpoint_id: str, last_seen: float, info: dict[str, Any]) -> int:
        """A lost session's writes in one transaction: its leases back to the queue (acked tasks stay on the device), the row offline, the transition ..."""
        ...

    async def open_session(self, endpoint_id: str, held: set[str], now: float, info: dict[str, Any], transition: bool) -> tuple[int, int]:
        """A hello's writes, in one transaction: the endpoint's leases go back to the queue, acked tasks its agent no longer holds too, the row says ..."""
        ...

    # tasks.py
    async def ack(self, endpoint_id: str, ids: Sequence[str]) -> None:
        """ack"""
        ...

    async def cancel_endpoints(self) -> set[str]:
        """Endpoints with cancels their agents have yet to confirm."""
        ...

    async def cancel_tasks(self, user_id: str, ids: Sequence[str] | None = None, *, group: str | None = None,
                           why: str = "cancelled by its submitter", now: float | None = None) -> dict[str, Any]:
        """Cancel the user's tasks, by id or every unfinished one of a task group, in one transaction. Each task without a result gets its one ..."""
        ...

    async def cancels_applied(self, endpoint_id: str, ids: Sequence[str]) -> int:
        """The agent stored these cancels (its ``ack.c``): stop sending them. Without an fsync: one lost in a crash is sent again, and the agent acks it again."""
        ...

    async def count_leased(self, endpoint_id: str) -> int:
        """Tasks of an endpoint sent but not yet acked: on their way, or lost on the way."""
        ...

    async def endpoints_with_queued(self, endpoint_ids: Sequence[str]) -> set[str]:
        """Which of these endpoints have a task waiting in the queue (the watchdog's recheck of drained sessions, one hop for all)."""
        ...

    async def expire_group_leases(self, now: float, limit: int = 100) -> list[dict[str, Any]]:
        """Leases past their expiry (a driver that died or stopped renewing): every unfinished task of the group is cancelled as by its submitter, and ..."""
        ...

    async def expire_tasks(self, now: float, error_blob: Callable[[str], bytes]) -> list[tuple[str, str]]:
        """Tasks still queued past their expiry get an error result, so the caller learns of it."""
        ...

    async def get_task(self, task_id: str, user_id: str) -> dict[str, Any] | None:
        """get task"""
        ...

    async def insert_tasks(self, rows: Sequence[dict[str, Any]], also: Callable[[sqlite3.Connection], None] | None = None,
                           before: Callable[[sqlite3.Connection], None] | None = None) -> None:
        """All or nothing: the caller has validated every row before this transaction. ``also`` runs in the same transaction (the scheduler stores its ..."""
        ...

    async def lease(self, endpoint_id: str, n: int, lease_s: float, max_bytes: int,
                    policy: "AdmissionPolicy | None" = None, *, only_now: bool = False,
                    placed_max: int | None = None) -> tuple[list[dict[str, Any]], dict[str, bytes]]:
        """Take up to ``n`` queued tasks of an endpoint and the function bodies they need: oldest first, or with a ``policy`` fair between users under ..."""
        ...

    def lease_query(self, endpoint_id: str, n: int, lease_s: float, max_bytes: int,
                    policy: "AdmissionPolicy | None" = None, *, only_now: bool = False,
                    placed_max: int | None = None) -> Callable[[Any], tuple[list[dict[str, Any]], dict[str, bytes]]]:
        """``lease`` as a function of a connection, to run inside another transaction (a submit's insert)."""
        ...

    async def pending_cancels(self, endpoint_id: str, limit: int = 5000) -> list[str]:
        """Cancelled tasks whose agent has not confirmed the cancel yet (oldest first)."""
        ...

    @staticmethod
    def put_submit_key(db: Any, user_id: str, key: str, request_hash: str, task_ids: list[str],
                       endpoint_ids: list[str | None], now: float) -> None:
        """Record a submit's key in the transaction that inserts its tasks: both or neither. A concurrent submit with the same key makes this insert ..."""
        ...

    async def release_group_lease(self, user_id: str, group: str) -> bool:
        """Drop a lease (the driver ended cleanly); its tasks are left as they are."""
        ...

    async def renew_group_lease(self, user_id: str, group: str, ttl_s: float, now: float | None = None) -> float:
        """A driver's lease on its task group (docs/multiprocessing.md, "Lease"): made or renewed until ``now + ttl_s``. Returns that time."""
        ...

    async def requeue(self, endpoint_id: str | None = None, expired_before: float | None = None, not_in: set[str] | None = None) -> int:
        """Put tasks back in the queue: leases that expired, or an endpoint's leases when it is lost."""
        ...

    async def submit_key(self, user_id: str, key: str) -> tuple[str, list[str], list[str | None]] | None:
        """What a submit with this idempotency key made: (request hash, task ids, endpoint ids)."""
        ...

    async def unlease(self, endpoint_id: str, ids: Sequence[str]) -> int:
        """Put these leased tasks back in the queue at once: the frame carrying them failed to send."""
        ...

    # sites.py
    async def unlease_site(self, gateway_id: str, ids: Sequence[str]) -> int:
        """Tasks of a site_down the hub gave up on: back in the queue at once, no longer the gateway's to re-claim."""
        ...

    async def count_site_leased(self, gateway_id: str) -> int:
        """Tasks leased ahead to this gateway that no device has acknowledged yet."""
        ...

    async def hold_site(self, gateway_id: str, ids: Sequence[str], until: float, frame_ttl_s: float | None = None) -> int:
        """The gateway confirmed it stored these tasks (its own signed ack): their lease at the site now lasts until ``until`` (``site_hold_s``) ..."""
        ...

    async def lease_site(self, gateway_id: str, devices: Sequence[str], n: int, hold_s: float, max_bytes: int,
                         *, skip_returned: bool = False) -> tuple[dict[str, list[dict[str, Any]]], dict[str, bytes]]:
        """Lease up to ``n`` queued tasks of a site's devices ahead of time to its gateway: each is leased for ``hold_s`` and marked with the gateway, ..."""
        ...

    async def set_gateway(self, device_id: str, gateway_id: str | None) -> tuple[str | None, int]:
        """Re-home a device to another site gateway (or to none: it dials the hub's broker). The new gateway must be a live MQTT endpoint of the ..."""
        ...

    async def site_devices(self) -> dict[str, str]:
        """device endpoint id -> the gateway endpoint that serves it (docs/sites.md)."""
        ...

    # results.py
    async def last_result_seq(self, user_id: str | None = None) -> int:
        """The newest result's cursor: a user's own (what a stream reader starts from, counted per user so it tells nothing of other users' results), ..."""
        ...

    async def prune_results(self, older_than: float) -> int:
        """prune results"""
        ...

    async def results(self, user_id: str, task_ids: Sequence[str]) -> list[dict[str, Any]]:
        """results"""
        ...

    async def results_after(self, user_id: str, seq: int, limit: int) -> list[dict[str, Any]]:
        """The user's results after their cursor ``seq`` (a per-user number, see number_results)."""
        ...

    async def store_results(self, endpoint_id: str, results: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
        """Store results exactly once per task; return (task id, user id) of those that were new. A malformed batch raises ValueError naming what is ..."""
        ...
