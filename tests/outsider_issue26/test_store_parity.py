"""Promise 2: one storage interface. The same scenario, with awkward inputs, on a SqliteStore and a
PostgresStore (own schema per test, tests/pg.py); the normalized outcomes must be equal."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.pg import pg_url  # noqa: F401

WEIRD_NAME = "Zoë 😀 100% ?x :name 'q' \"dq\" -- /*c*/"
BIG = bytes(range(256)) * 4096  # 1 MiB, every byte value


async def _scenario(store: Any) -> dict[str, Any]:
    from cloud_hub.store.sqlite import UnknownTask

    out: dict[str, Any] = {}
    uid = await store.create_user(WEIRD_NAME)
    out["same_user_again"] = (await store.create_user(WEIRD_NAME)) == uid
    other = await store.create_user("other ? %s")
    tok = await store.create_api_token(uid, name="tok :a ?1 %%")
    out["token_user"] = (await store.user_for_token(tok)) == uid
    out["bad_token"] = await store.user_for_token(tok + "x")
    et = await store.create_enroll_token(uid, 60, 2)
    e1 = await store.enroll_endpoint(et, "ep ü ?", "mqtt", b"\x00k" * 16)
    e2 = await store.enroll_endpoint(et, "ep :two %", "zmq", b"\xffk" * 16)
    out["third_enroll"] = await store.enroll_endpoint(et, "ep3", "mqtt", b"k" * 32)
    assert e1 and e2
    ep = e1["id"]
    out["key_roundtrip"] = bytes(await store.endpoint_key(ep)) == b"\x00k" * 16
    eps = await store.list_endpoints(uid)
    out["endpoint_names"] = sorted(e["name"] for e in eps)

    await store.put_function(uid, "f_big", BIG, WEIRD_NAME)
    await store.put_function(uid, "f_big", BIG, WEIRD_NAME)  # duplicate put: idempotent
    await store.put_function(uid, "f_small", b"%s ? :x", "small")
    fns = await store.list_functions(uid)
    out["functions"] = sorted((f["id"], f["name"]) for f in fns)
    out["functions_other"] = await store.list_functions(other)

    now = time.time()

    def row(i: int, fid: str, args: bytes) -> dict[str, Any]:
        return {"id": f"t{i:03d}", "user_id": uid, "endpoint_id": ep, "function_id": fid, "args": args,
                "created": now + i * 0.001, "expires": now + 3600, "timeout": 30.0}

    await store.insert_tasks([row(i, "f_small" if i % 2 else "f_big", f"a{i} % ? :n ".encode() * 3) for i in range(6)])
    # duplicate id in a later batch: the whole batch must fail and nothing of it be written
    dup_exc = None
    try:
        await store.insert_tasks([row(50, "f_small", b"x"), row(0, "f_small", b"dup")])
    except Exception as exc:  # noqa: BLE001
        dup_exc = type(exc).__name__
    out["dup_insert_raised"] = dup_exc is not None
    out["dup_batch_partial"] = await store.get_task("t050", uid)
    out["counts_after_insert"] = await store.task_counts(uid)

    tasks, bodies = await store.lease(ep, 4, 30.0, 8 << 20)
    out["leased"] = [(t["id"], t["fn"], bytes(t["args"])) for t in tasks]
    out["bodies"] = {k: (len(v), bytes(v)[:16]) for k, v in bodies.items()}
    out["big_body_intact"] = bytes(bodies.get("f_big", b"")) == BIG
    tasks2, _ = await store.lease(ep, 10, 30.0, 8 << 20)
    out["leased2"] = [t["id"] for t in tasks2]
    out["lease_other_ep"] = (await store.lease(e2["id"], 10, 30.0, 8 << 20))[0]
    await store.ack(ep, [t["id"] for t in tasks])

    res = [{"id": "t000", "ok": True, "data": BIG, "started": now, "finished": now + 1},
           {"id": "t001", "ok": False, "data": b"err % ? :x", "started": now},
           {"id": "t001", "ok": True, "data": b"repeat in batch"},
           {"id": "nope", "ok": True, "data": b""}]
    fresh = await store.store_results(ep, res)
    out["fresh"] = sorted(fresh)
    out["fresh_again"] = await store.store_results(ep, res[:2])
    out["fresh_wrong_ep"] = await store.store_results(e2["id"], [{"id": "t002", "ok": True, "data": b"x"}])
    with pytest.raises(ValueError):
        await store.store_results(ep, [{"id": "t002", "ok": True, "data": "not bytes"}])
    got = await store.results(uid, ["t000", "t001", "t002", "nope"])
    out["results"] = sorted((r["task_id"], r["ok"], len(r["data"]), bytes(r["data"])[:12], r["endpoint_id"] == ep) for r in got)
    out["results_big_intact"] = any(bytes(r["data"]) == BIG for r in got)
    out["results_other_user"] = await store.results(other, ["t000"])
    after = await store.results_after(uid, 0, 100)
    out["results_after"] = [(r["seq"], r["task_id"]) for r in after]
    out["last_seq"] = await store.last_result_seq(uid)
    out["last_seq_other"] = await store.last_result_seq(other)

    c = await store.cancel_tasks(uid, ["t005", "t000"])
    out["cancel"] = {k: sorted(v) if isinstance(v, (list, set, tuple)) else v for k, v in c.items()}
    try:
        await store.cancel_tasks(uid, ["t004", "no-such"])
        out["cancel_unknown"] = "no error"
    except UnknownTask as exc:
        out["cancel_unknown"] = str(exc)
    out["t004_after_refused_cancel"] = (await store.get_task("t004", uid))["state"]
    out["cancel_other_user"] = None
    try:
        await store.cancel_tasks(other, ["t003"])
    except UnknownTask:
        out["cancel_other_user"] = "refused"
    t = await store.get_task("t000", uid)
    out["t000"] = {k: t[k] for k in ("id", "endpoint_id", "function_id", "state", "attempts", "ok")}
    out["counts_end"] = await store.task_counts(uid)
    out["pending_cancels"] = sorted(await store.pending_cancels(ep))
    ids = {uid: "<U>", other: "<O>", ep: "<EP1>", e2["id"]: "<EP2>"}
    return _norm(out, ids)


def _norm(v: Any, ids: dict[str, str]) -> Any:
    if isinstance(v, str):
        return ids.get(v, v)
    if isinstance(v, dict):
        return {k: _norm(x, ids) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_norm(x, ids) for x in v]
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, bool):
        return v
    return v


async def _run_store(store: Any) -> dict[str, Any]:
    await store.open()
    try:
        return await asyncio.wait_for(_scenario(store), 120)
    finally:
        await store.close()


def test_sqlite_and_postgres_agree(tmp_path, pg_url: str) -> None:  # noqa: F811
    from cloud_hub.store.postgres import PostgresStore
    from cloud_hub.store.sqlite import SqliteStore

    a = asyncio.run(_run_store(SqliteStore(tmp_path / "hub.db")))
    b = asyncio.run(_run_store(PostgresStore(pg_url)))
    diffs = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    assert diffs == {}, "\n".join(f"{k}: sqlite={str(x)[:300]} | pg={str(y)[:300]}" for k, (x, y) in diffs.items())
    # sanity on the behaviour itself (same on both)
    assert a["same_user_again"] and a["token_user"] and a["bad_token"] is None
    assert a["third_enroll"] is None
    assert a["dup_insert_raised"] and a["dup_batch_partial"] is None
    assert a["big_body_intact"] and a["results_big_intact"]
    assert a["fresh_again"] == [] and a["fresh_wrong_ep"] == []
    assert a["results_other_user"] == [] and a["cancel_other_user"] == "refused"
    assert a["t004_after_refused_cancel"] == "leased" or a["t004_after_refused_cancel"] == "queued"
