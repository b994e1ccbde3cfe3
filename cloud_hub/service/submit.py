"""Task acceptance, the submit path every way in shares: REST (``POST /v1/tasks``,
``/v1/tasks/batch``, cloud_hub/api/app.py) and the SDK's WebSocket stream (cloud_hub/api/stream.py)
both call :func:`accept`, so a task gets the same checks, placement, admission, environment rule
and idempotency wherever it arrives. A refusal is a :class:`~cloud_hub.service.errors.ServiceError`
(the API answers it with its status), raised before anything is stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

from pydantic import TypeAdapter

from cloud_hub.placement import PlacementError
from cloud_hub.service.environments import apply_environments, task_environments
from cloud_hub.service.errors import ServiceError
from cloud_hub.service.hub import Hub
from cloud_hub.service.schemas import TaskIn
from cloud_hub.store.endpoints import owned_refs_in, put_functions
from mesh_agent import costs
from mesh_agent.protocol import SerializationError, method_of

__all__ = ["accept", "check_size", "function_writer", "task_ids"]


def check_size(h: Hub, what: str, blob: bytes) -> None:
    if len(blob) > h.cfg.max_payload_bytes:
        raise ServiceError(
            413,
            f"{what} is {len(blob)} bytes, over the {h.cfg.max_payload_bytes}-byte limit; "
            "stage large data separately and pass a reference",
        )


_TASKS = TypeAdapter(list[TaskIn])


def _request_hash(tasks: list[TaskIn]) -> str:
    """What an idempotency key is checked against: the tasks, serialized in one call in pydantic's
    core (a third of the CPU of a dict per task sorted by ``json``, issue 30)."""
    return hashlib.sha256(_TASKS.dump_json(tasks, exclude={"__all__": {"idempotency_key"}})).hexdigest()


def _legacy_request_hash(tasks: list[TaskIn]) -> str:
    """The hash hubs before issue 30 stored: a replay of a submit they accepted still matches."""
    body = json.dumps([t.model_dump(mode="json", exclude={"idempotency_key"}) for t in tasks], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


async def _replayed(h: Hub, user: str, key: str, request_hash: str, tasks: list[TaskIn]) -> tuple[list[str], list[str]] | None:
    """The tasks an earlier submit with this key made, or None; 409 if the key came with another request."""
    seen = await h.store.submit_key(user, key)
    if seen is None:
        return None
    if seen[0] != request_hash and seen[0] != _legacy_request_hash(tasks):
        raise ServiceError(409, f"idempotency key {key} was used for a different request; use a new key per submit")
    return seen[1], seen[2]  # type: ignore[return-value]


async def accept(h: Hub, user: str, tasks: list[TaskIn], key: str | None = None, *, functions: dict[str, tuple[str, bytes]] | None = None,
                  group: str | None = None) -> tuple[list[str], list[str]]:
    """Validate every task, place those with a selector ("auto", a list, tags), then insert all
    (with the placement decisions and the idempotency key) in one transaction, then wake the
    dispatcher. With a key seen before, answer what that submit made and insert nothing.

    The key is not looked up first (a database read on every submit, issue 30): the insert of a
    key seen before fails inside the tasks' transaction, which then stores nothing, and so does any
    refusal on the way there (a queue bound the first attempt's own tasks now fill): either way
    the key is looked up then, and a replay gets what the first attempt made."""
    with costs.stage("hub.idempotency"):
        request_hash = _request_hash(tasks) if key is not None else ""
    try:
        return await _accept(h, user, tasks, key, request_hash, functions, group)
    except BaseException:
        # A retry (the client did not hear the first answer), possibly racing the first attempt.
        if key is not None and (done := await _replayed(h, user, key, request_hash, tasks)) is not None:
            return done
        raise


async def _accept(h: Hub, user: str, tasks: list[TaskIn], key: str | None, request_hash: str,
                  functions: dict[str, tuple[str, bytes]] | None, group: str | None) -> tuple[list[str], list[str]]:
    with costs.stage("hub.validate"):
        for i, t in enumerate(tasks):
            check_size(h, f"task {i} arguments", t.args)
            try:
                method_of(t.args)
            except SerializationError as exc:
                raise ServiceError(422, f"task {i} arguments: {exc}") from None
        env_specs = task_environments(tasks)  # 422 naming the task and key, before anything is stored
        eps: set[str] = set()
        for t in tasks:
            if isinstance(t.endpoint_id, list):
                eps.update(t.endpoint_id)
            elif isinstance(t.endpoint_id, str) and t.endpoint_id != "auto":
                eps.add(t.endpoint_id)
        fids = {t.function_id for t in tasks}
    # Which endpoints and functions the user may use is checked inside the insert's transaction
    # (``_refs_check``). It is also checked here, before placement and the allow-lists could
    # answer anything about another user's endpoint, but from memory when this user's accepted
    # submits named all of them before (one database hop per submit less, issue 30). An entry
    # may be stale (a share withdrawn since): any other refusal on the way (an allow-list, the
    # constraints) is then answered only after the names were read again, so it never tells a
    # former user anything about an endpoint that is no longer theirs (404 first, as always).
    if _seen(h, user, eps, fids):
        try:
            return await _accept_named(h, user, tasks, key, request_hash, functions, group, eps, fids, env_specs)
        except ServiceError as exc:
            if exc.status != 404:
                h.refs_seen.pop(user, None)
                await _check_refs(h, user, eps, fids, functions)
            raise
    await _check_refs(h, user, eps, fids, functions)
    return await _accept_named(h, user, tasks, key, request_hash, functions, group, eps, fids, env_specs)


async def _check_refs(h: Hub, user: str, eps: set[str], fids: set[str], functions: dict[str, tuple[str, bytes]] | None) -> None:
    """404 unless every named endpoint and function is the user's (or shared with them)."""
    found_eps, found_fids = await h.store.owned_refs(user, eps, fids)
    if eps - found_eps:
        raise ServiceError(404, f"unknown endpoint {sorted(eps - found_eps)[0]}")
    if fids - found_fids - set(functions or ()):
        raise ServiceError(404, f"unknown function {sorted(fids - found_fids - set(functions or ()))[0]} (register it first)")


async def _accept_named(h: Hub, user: str, tasks: list[TaskIn], key: str | None, request_hash: str,
                        functions: dict[str, tuple[str, bytes]] | None, group: str | None, eps: set[str],
                        fids: set[str], env_specs: Any) -> tuple[list[str], list[str]]:
    now = time.time()
    with costs.stage("hub.rows"):
        rows = _rows(h, user, tasks, now, group)
    # Memoization and admission (cloud_hub/service/admit.py): cached results answer their tasks with no
    # dispatch; the rest must fit under the queue bounds (else 429 + Retry-After, nothing stored).
    with costs.stage("hub.memo"):  # a stage only where it does not suspend (no cache keys): else counted as misnested
        hits = await h.admission.memo_split(user, tasks, now)
    run = [i for i in range(len(tasks)) if i not in hits]
    run_tasks, run_rows = [tasks[i] for i in run], [rows[i] for i in run]
    with costs.stage("hub.admission"):
        await h.admission.check(user, run_tasks)
    for i, hit in hits.items():
        rows[i]["endpoint_id"] = hit.endpoint_id
        if hit.joined:  # the same call is still queued or running: this submit gets that task
            rows[i]["id"] = hit.task_id
    try:
        with costs.stage("hub.placement"):
            decisions = await h.placement.place(user, run_tasks, run_rows, now) if run_rows else []
    except PlacementError as exc:
        raise ServiceError(exc.status, str(exc)) from None
    with costs.stage("hub.allow"):
        for i, r in zip(run, run_rows):  # on the endpoint each task will run on, named or placed
            allowed = h.dispatcher.allow_list(r["endpoint_id"])
            if allowed is not None and r["function_id"] not in allowed:
                h.placement.retract(r["id"] for r in run_rows)
                raise ServiceError(403, f"task {i}: function {r['function_id']} is not on endpoint {r['endpoint_id']}'s allow-list")
    with costs.stage("hub.environment"):
        await apply_environments(h, user, rows, env_specs)  # after placement: others' endpoints sandbox by default
    with costs.stage("hub.rows"):
        write_decisions = h.placement.writer(decisions)
        misses: dict[str, int] = {}
        for r in run_rows:
            if r["memo_key"]:
                misses[r["function_id"]] = misses.get(r["function_id"], 0) + 1
        write_memo = h.admission.memo_writer(user, [(rows[i], hit) for i, hit in hits.items()], misses, now)

    def also(db: Any) -> None:
        if write_decisions is not None:
            write_decisions(db)
        if write_memo is not None:
            write_memo(db)
        if key is not None:
            h.store.put_submit_key(db, user, key, request_hash, [r["id"] for r in rows], [r["endpoint_id"] for r in rows], now)
        if leases is not None:  # last: whatever above refuses the batch does so before a lease
            leases.query(db)

    # Endpoints with credit lease in this same transaction (Dispatcher.claim_insert_leases).
    leases = h.dispatcher.claim_insert_leases({r["endpoint_id"] for r in run_rows})
    try:
        await h.store.insert_tasks(run_rows, also=also, before=_refs_check(user, eps, fids, functions))
    except BaseException:
        if leases is not None:
            leases.failed()
        h.placement.retract(r["id"] for r in run_rows)
        raise
    with costs.stage("hub.accepted"):
        now_eps = {r["endpoint_id"] for r in run_rows if r["start_now"]}
        if leases is not None:
            leases.committed(now_eps)
        _remember(h, user, eps, fids)
        h.metrics.tasks_submitted(rows)
        if hits:
            h.bus.notify({user})  # their results are stored already
        for ep in {r["endpoint_id"] for r in run_rows} - (leases.endpoints if leases is not None else set()):
            h.dispatcher.kick(ep, start_now=ep in now_eps)
    return [r["id"] for r in rows], [r["endpoint_id"] for r in rows]


def task_ids(n: int) -> list[str]:
    """``n`` random version-4 UUIDs as 32 hex characters, what ``uuid.uuid4().hex`` gives, from one
    ``os.urandom`` call: one call per id (a system call and a ``UUID`` object each) cost 3-6 us a
    task, more than building the task's row (issue 30)."""
    raw = bytearray(os.urandom(16 * n))
    raw[6::16] = bytes((b & 0x0F) | 0x40 for b in raw[6::16])  # version 4
    raw[8::16] = bytes((b & 0x3F) | 0x80 for b in raw[8::16])  # RFC 4122 variant
    text = raw.hex()
    return [text[i:i + 32] for i in range(0, 32 * n, 32)]


def _rows(h: Hub, user: str, tasks: list[TaskIn], now: float, group: str | None) -> list[dict[str, Any]]:
    """The task rows to insert, one per task (ids made here)."""
    ids = task_ids(len(tasks))
    return [
        {
            "id": tid,
            "user_id": user,
            "endpoint_id": t.endpoint_id if isinstance(t.endpoint_id, str) and t.endpoint_id != "auto" else None,
            "function_id": t.function_id,
            "args": t.args,
            "created": now,
            "expires": now + (t.ttl_s or h.cfg.task_ttl_s),
            "timeout": t.timeout_s,
            "task_group_id": group,
            "memo_key": t.cache_key,
            "start_now": 1 if t.start == "now" else None,
        }
        for t, tid in zip(tasks, ids)
    ]


_REFS_SEEN_MAX = 10_000  # users, and names per user, remembered (then forgotten and read again)


def _seen(h: Hub, user: str, eps: set[str], fids: set[str]) -> bool:
    known = h.refs_seen.get(user)
    return known is not None and eps <= known[0] and fids <= known[1]


def _remember(h: Hub, user: str, eps: set[str], fids: set[str]) -> None:
    """After an accepted submit (its transaction checked every name): its names are the user's."""
    known = h.refs_seen.get(user)
    if known is None or len(known[0]) + len(known[1]) > _REFS_SEEN_MAX:
        if len(h.refs_seen) >= _REFS_SEEN_MAX:
            h.refs_seen.clear()
        known = h.refs_seen[user] = (set(), set())
    known[0].update(eps)
    known[1].update(fids)


def _refs_check(user: str, eps: set[str], fids: set[str], functions: dict[str, tuple[str, bytes]] | None) -> Any:
    """First in the submit's transaction: the batch's function bodies are stored, then every named
    endpoint and function must be the user's (or shared with them), else 404 and the transaction
    stores nothing. (Placement and admission ran on the batch before, in memory only: a refusal
    here takes their bookkeeping back, as any failed insert does.)"""

    def q(db: Any) -> None:
        if functions:
            put_functions(db, user, functions, time.time())
        found_eps, found_fids = owned_refs_in(db, user, eps, fids - set(functions or ()))
        if eps - found_eps:
            raise ServiceError(404, f"unknown endpoint {sorted(eps - found_eps)[0]}")
        if fids - found_fids - set(functions or ()):
            raise ServiceError(404, f"unknown function {sorted(fids - found_fids - set(functions or ()))[0]} (register it first)")

    return q


def function_writer(user: str, functions: dict[str, tuple[str, bytes]]) -> Any:
    """Stores the batch's bodies inside the transaction that inserts its tasks."""

    def q(db: Any) -> None:
        put_functions(db, user, functions, time.time())

    return q
