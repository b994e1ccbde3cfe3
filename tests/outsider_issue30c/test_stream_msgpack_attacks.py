"""Promise 1 of issue 30 (docs/protocol.md, "SDK stream", "msgpack frames"), attacked by a hostile or
buggy client over a raw WebSocket:

- a hello with ``"enc": "msgpack"`` gets msgpack binary frames, byte fields as raw ``bin``;
- every submit is checked with exactly the REST schema's rules: a refusal has REST's status and
  names the field as REST does (``batch.tasks.1.args`` for REST's ``["body", "tasks", 1, "args"]``);
  the oracle here is ``POST /v1/tasks/batch`` with the same batch (bytes as base64);
- a refused submit stores nothing (the hub's SQLite file is read before and after) and keeps the
  connection (a repeat of an earlier submit under its idempotency key still answers);
- a malformed frame closes the stream with 4400 and a reason, after ``{"op": "error", "detail"}``;
- one idempotency key means one request over the JSON stream, the msgpack stream and REST.

Every validation submit names an endpoint whose agent never runs, so accepted tasks stay queued and
the snapshot of the durable tables is stable between submits.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from typing import Any, Callable

import msgpack
import pytest

from mesh_agent.protocol.serialize import deserialize, function_id, serialize, serialize_function

from . import _h

MAX_BATCH = 40
MAX_PAYLOAD = 65536


def triple(x: int) -> int:
    return x * 3


def blob(v: Any) -> bytes:
    """An argument blob as the SDK makes it: serialize((args, kwargs))."""
    return serialize(((v,), {}))


def to_rest(o: Any) -> Any:
    """The JSON (REST) shape of a msgpack-shaped batch: bytes -> base64 text."""
    if isinstance(o, bytes):
        return base64.b64encode(o).decode()
    if isinstance(o, dict):
        return {k: to_rest(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [to_rest(v) for v in o]
    return o


def key() -> str:
    return f"k30c-{uuid.uuid4().hex}"


class World:
    def __init__(self, m, live: str, idle: str, fid: str) -> None:
        self.m, self.live, self.idle, self.fid = m, live, idle, fid
        self.probe_key = key()
        self.probe_batch = {"tasks": [self.task(1)], "idempotency_key": self.probe_key}
        self.probe_ids: list[str] | None = None

    def task(self, v: Any = 1, **kw: Any) -> dict:
        return {"endpoint_id": self.idle, "function_id": self.fid, "args": blob(v), **kw}

    def rows(self, ids: list[str]) -> dict[str, tuple]:
        """What a task is, apart from its id and clock: to compare REST's tasks with the stream's."""
        c = _h.db(self.m)
        try:
            q = ("SELECT id, user_id, endpoint_id, function_id, args, state, timeout, attempts, task_group_id, memo_key, "
                 "env, start_now, expires - created FROM tasks WHERE id IN (%s)" % ",".join("?" * len(ids)))
            return {r[0]: r[1:] for r in c.execute(q, ids).fetchall()}
        finally:
            c.close()


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("p1")
    env = {"MESH_HUB_MAX_BATCH": str(MAX_BATCH), "MESH_HUB_MAX_PAYLOAD_BYTES": str(MAX_PAYLOAD)}
    with _h.mesh(tmp, env=env) as m:
        live = m.add_agent("live", "zmq", workers=2)
        idle = m.add_agent("idle", "zmq", workers=1, start=False)  # enrolled, never started: its tasks stay queued
        m.wait_online(live)
        fid = m.client.register_function(triple)
        world = World(m, live.endpoint_id, idle.endpoint_id, fid)
        st, ans = _h.rest(m, to_rest(world.probe_batch))
        assert st == 201, (st, ans)
        world.probe_ids = ans["task_ids"]
        yield world


def assert_alive(w: World, s: _h.RawWS, before: dict, what: str) -> None:
    """The stream still answers (a repeat of the probe batch: same ids, nothing stored)."""
    try:
        kind, ans = s.submit_mp(w.probe_batch, timeout=20)
    except _h.Closed as c:
        raise AssertionError(f"{what}: the hub closed the stream after a refusal that must keep it: {c}") from None
    assert ans.get("op") == "accepted" and ans.get("task_ids") == w.probe_ids, f"{what}: probe after the refusal got {ans}"
    after = _h.snapshot(w.m)
    assert after == before, f"{what}: the database changed: {_h.diff(before, after)}"


def rest_fields(detail: Any) -> list[str]:
    """REST's 422 locations as the stream is documented to name them: body.tasks.1.args -> batch.tasks.1.args."""
    if not isinstance(detail, list):
        return []
    out = []
    for e in detail:
        loc = [str(x) for x in (e.get("loc") or [])]
        if loc and loc[0] == "body":
            out.append(".".join(["batch", *loc[1:]]))
    return out


def field_named(stream_detail: str, fields: list[str]) -> bool:
    """The stream's detail names one of REST's fields (a union's member tag may follow the field)."""
    for f in fields:
        parts = f.split(".")
        if stream_detail.startswith(f + ":") or stream_detail.startswith(f + " "):
            return True
        for n in range(len(parts), 1, -1):
            prefix = ".".join(parts[:n])
            if prefix in stream_detail and (n >= 3 or parts[1] != "tasks"):
                return True
    return False


# --------------------------------------------------------------------------- 1. encoding itself
def test_msgpack_frames_carry_raw_bytes_and_results_come_back(w):
    s = _h.RawWS(w.m)
    try:
        assert s.welcome.get("enc") == "msgpack", f"the hub does not offer msgpack: {s.welcome}"
        body = serialize_function(triple)
        fid = function_id(body)
        batch = {"tasks": [{"endpoint_id": w.live, "function_id": fid, "args": blob(v)} for v in (1, 2, 3)],
                 "functions": {fid: {"name": "triple", "body": body}}, "idempotency_key": key()}
        kind, ans = s.submit_mp(batch)
        assert kind == "bin", f"the answer to a msgpack submit came as a {kind} frame: {ans}"
        assert ans.get("op") == "accepted", ans
        ids = ans["task_ids"]
        # a JSON text submit after a msgpack hello: text frames stay JSON, and the answer is msgpack
        kind2, ans2 = s.submit_json(to_rest({"tasks": [{"endpoint_id": w.live, "function_id": fid, "args": blob(4)}]}))
        assert kind2 == "bin", f"after a msgpack hello the hub answered a text submit with a {kind2} frame: {ans2}"
        assert ans2.get("op") == "accepted", f"a JSON text submit after a msgpack hello was not accepted: {ans2}"
        ids += ans2["task_ids"]
        deadline = time.monotonic() + 30
        while len({r["task_id"] for r in s.results()} & set(ids)) < len(ids) and time.monotonic() < deadline:
            try:
                s.recv(max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                break
        rows = {r["task_id"]: r for r in s.results() if r["task_id"] in ids}
        assert set(rows) == set(ids), f"results missing on the stream: {set(ids) - set(rows)}{_h.logs(w.m)}"
        for (k, f) in s.seen:
            if isinstance(f, dict) and f.get("op") in ("results", "accepted"):
                assert k == "bin", f"a {f.get('op')} frame came as {k} after the msgpack hello"
        for tid, v in zip(ids, (1, 2, 3, 4)):
            r = rows[tid]
            assert isinstance(r["data"], bytes), f"result data is {type(r['data']).__name__}, not raw bytes: {r!r:.200}"
            assert r["ok"] is True and deserialize(r["data"]) == v * 3, r
        # the body rode along as raw bytes: the hub stored exactly those bytes under that id
        c = _h.db(w.m)
        try:
            stored = c.execute("SELECT body FROM functions WHERE id = ?", (fid,)).fetchone()
        finally:
            c.close()
        assert stored is not None and bytes(stored[0]) == body, "the function body stored is not the bytes sent"
    finally:
        s.close()


# --------------------------------------------------------------------------- 2. same rules as REST
def _cases(w: World) -> list[tuple[str, Callable[[], dict]]]:
    T = w.task
    fbody = serialize_function(triple)
    fid = function_id(fbody)
    nan, inf = float("nan"), float("inf")
    cases: list[tuple[str, Callable[[], dict]]] = []

    def add(name: str, mk: Callable[[], dict]) -> None:
        cases.append((name, mk))

    for name, val in [("bool", True), ("false", False), ("zero", 0), ("negative", -1.5), ("nan", nan), ("inf", inf),
                      ("-inf", -inf), ("huge_uint64", 2**64 - 1), ("min_int64", -(2**63)), ("str", "5"), ("str_junk", "5s"),
                      ("list", [5]), ("map", {"v": 5}), ("tiny", 5e-324), ("int", 7)]:
        add(f"timeout_s={name}", lambda val=val: {"tasks": [T(timeout_s=val)]})
    for name, val in [("bool", True), ("zero", 0), ("nan", nan), ("inf", inf), ("negative", -3), ("str", "60")]:
        add(f"ttl_s={name}", lambda val=val: {"tasks": [T(ttl_s=val)]})
    for name, val in [("int", 123), ("bool", True), ("null", None), ("empty", ""), ("len100", "e" * 100), ("len101", "e" * 101),
                      ("empty_list", []), ("list_len101", ["e" * 101]), ("tags_empty", {"tags": []}), ("tags_str", {"tags": "a"}),
                      ("map_unknown", {"nope": 1}), ("list_1001", ["e"] * 1001)]:
        add(f"endpoint_id={name}", lambda val=val: {"tasks": [T(endpoint_id=val)]})
    for name, val in [("len63", "a" * 63), ("len64_unknown", "a" * 64), ("len65", "a" * 65), ("int", 5), ("null", None),
                      ("nonhex64", "g" * 64)]:
        add(f"function_id={name}", lambda val=val: {"tasks": [T(function_id=val)]})
    for name, val in [("null", None), ("int", 123), ("bool", True), ("list", []), ("map", {}), ("empty", b""), ("junk", b"garbage"),
                      ("at_limit", b"json\n\"" + b"a" * (MAX_PAYLOAD - 7) + b"\""),
                      ("over_limit", b"json\n\"" + b"a" * (MAX_PAYLOAD - 6) + b"\"")]:
        add(f"args={name}", lambda val=val: {"tasks": [T(args=val)]})
    add("args=missing", lambda: {"tasks": [{"endpoint_id": w.idle, "function_id": w.fid}]})
    for name, val in [("upper", "A" * 64), ("len63", "a" * 63), ("len65", "a" * 65), ("int", 5), ("ok", "0" * 64)]:
        add(f"cache_key={name}", lambda val=val: {"tasks": [T(cache_key=val)]})
    for name, val in [("later", "later"), ("NOW", "NOW"), ("bool", True), ("int", 1), ("null", None), ("now", "now")]:
        add(f"start={name}", lambda val=val: {"tasks": [T(start=val)]})
    add("task_unknown_field", lambda: {"tasks": [T(foo=1)]})
    add("task_unknown_field_null", lambda: {"tasks": [T(foo=None)]})
    add("batch_unknown_field", lambda: {"tasks": [T()], "bar": 1})
    add("second_task_bad", lambda: {"tasks": [T(), T(args=b"garbage")]})
    add("third_task_bad_type", lambda: {"tasks": [T(), T(), T(timeout_s="x")]})
    add("task_idem_key_short", lambda: {"tasks": [T(idempotency_key="short")]})
    for name, val in [("len7", "k" * 7), ("len8", "k" * 8 + uuid.uuid4().hex[:0]), ("len128", None), ("len129", "k" * 129),
                      ("space", "bad key!"), ("int", 12345678), ("bool", True)]:
        if name == "len8":
            add(f"idempotency_key={name}", lambda: {"tasks": [T()], "idempotency_key": uuid.uuid4().hex[:8]})
        elif name == "len128":
            add(f"idempotency_key={name}", lambda: {"tasks": [T()], "idempotency_key": (uuid.uuid4().hex * 4)[:128]})
        else:
            add(f"idempotency_key={name}", lambda val=val: {"tasks": [T()], "idempotency_key": val})
    for name, val in [("len64", "g" * 64), ("len65", "g" * 65), ("empty", ""), ("space", "a b"), ("int", 5)]:
        add(f"task_group_id={name}", lambda val=val: {"tasks": [T()], "task_group_id": val})
    for name, val in [("empty", []), ("null", None), ("str", "x"), ("map", {}), ("int", 1)]:
        add(f"tasks={name}", lambda val=val: {"tasks": val})
    add("tasks=missing", lambda: {"idempotency_key": key()})
    add(f"tasks={MAX_BATCH}", lambda: {"tasks": [T(i) for i in range(MAX_BATCH)]})
    add(f"tasks={MAX_BATCH + 1}", lambda: {"tasks": [T(i) for i in range(MAX_BATCH + 1)]})
    # function bodies riding along
    add("functions=good", lambda: {"tasks": [T(function_id=fid)], "functions": {fid: {"name": "triple", "body": fbody}}})
    add("functions=sha_mismatch", lambda: {"tasks": [T(function_id=fid)], "functions": {fid: {"name": "t", "body": fbody + b"\n"}}})
    add("functions=bad_header", lambda: {"tasks": [T()], "functions": {function_id(b"garbage"): {"name": "g", "body": b"garbage"}}})
    add("functions=name_empty", lambda: {"tasks": [T(function_id=fid)], "functions": {fid: {"name": "", "body": fbody}}})
    add("functions=name_200", lambda: {"tasks": [T(function_id=fid)], "functions": {fid: {"name": "n" * 200, "body": fbody}}})
    add("functions=name_201", lambda: {"tasks": [T(function_id=fid)], "functions": {fid: {"name": "n" * 201, "body": fbody}}})
    add("functions=extra_field", lambda: {"tasks": [T(function_id=fid)], "functions": {fid: {"name": "t", "body": fbody, "x": 1}}})
    add("functions=body_int", lambda: {"tasks": [T(function_id=fid)], "functions": {fid: {"name": "t", "body": 5}}})
    add("functions=list", lambda: {"tasks": [T()], "functions": [fid]})

    def many(n: int) -> dict:
        fs = {}
        for i in range(n):
            b = f"source\nf{i}\ndef f{i}():\n    return {i}\n".encode()
            fs[function_id(b)] = {"name": f"f{i}", "body": b}
        return {"tasks": [T()], "functions": fs}
    add("functions=1001", lambda: many(1001))
    # other batches (documented to be checked by the REST schema itself)
    add("constraints=neg_memory", lambda: {"tasks": [T(constraints={"min_memory_mb": -1})]})
    add("constraints=gpu_str", lambda: {"tasks": [T(constraints={"gpu": "yes"})]})
    add("constraints=bad_tag", lambda: {"tasks": [T(endpoint_id="auto", constraints={"tags": ["a b"]})]})
    add("environment=pip_int", lambda: {"tasks": [T(environment={"pip": 5})]})
    add("inputs=bool_bytes", lambda: {"tasks": [T(inputs=[[w.idle, True]])]})
    add("inputs=negative", lambda: {"tasks": [T(inputs=[[w.idle, -1]])]})
    add("inputs=triple", lambda: {"tasks": [T(inputs=[[w.idle, 1, 2]])]})
    return cases


def test_every_submit_is_checked_as_rest_checks_it(w):
    m = w.m
    s = _h.RawWS(m)
    problems: list[str] = []
    table: list[str] = []
    rest_500: list[str] = []
    hint = {"timeout_s=nan": ["tasks", 0, "timeout_s"], "timeout_s=-inf": ["tasks", 0, "timeout_s"],
            "ttl_s=nan": ["tasks", 0, "ttl_s"], "ttl_s=-inf": ["tasks", 0, "ttl_s"]}
    try:
        for name, mk in _cases(w):
            batch = mk()
            before = _h.snapshot(m)
            rbody = json.dumps(to_rest(batch), allow_nan=True).encode()
            rst, rdet = _h.rest(m, rbody)
            if rst == 500:
                # REST itself failed (test_rest_answers_non_finite_floats_with_422 shows why); what it
                # should have said is a 422 naming the field, so the stream is held to that
                rest_500.append(name)
                rst, rdet = 422, {"detail": [{"loc": ["body", *hint[name]]}]} if name in hint else rdet
            mid = _h.snapshot(m)
            if rst != 201 and mid != before:
                problems.append(f"{name}: REST refused ({rst}) but the database changed: {_h.diff(before, mid)}")
            try:
                kind, ans = s.submit_mp(batch)
            except _h.Closed as c:
                problems.append(f"{name}: the stream was closed ({c.code} {c.reason!r}) where REST answered {rst} {rdet!r:.200}")
                s = _h.RawWS(m)
                continue
            op = ans.get("op")
            table.append(f"{name:32} REST {rst} | stream {op} {ans.get('status', '')} {str(ans.get('detail', ''))[:90]!r}")
            if kind != "bin":
                problems.append(f"{name}: answer came as {kind}")
            if rst in (200, 201):
                if op != "accepted":
                    problems.append(f"{name}: REST accepted, the msgpack stream answered {ans}")
                    continue
                a = w.rows(rdet["task_ids"])
                b = w.rows(ans["task_ids"])
                ra = [a.get(t) for t in rdet["task_ids"]]
                rb = [b.get(t) for t in ans["task_ids"]]
                ra = [None if r is None else r[:-1] + (round(r[-1] or 0, 0),) for r in ra]
                rb = [None if r is None else r[:-1] + (round(r[-1] or 0, 0),) for r in rb]
                if ra != rb:
                    problems.append(f"{name}: REST and the stream stored different tasks:\n  REST   {ra!r:.400}\n  stream {rb!r:.400}")
                short = [t for t, r in {**a, **b}.items() if r[-1] is not None and r[-1] < 30]
                if short:  # a task with a short ttl expires at the hub (a result row): let it, before the next snapshot
                    ok = _h.until(lambda: _h.states(m, short).get("done", 0) == len(short), 20)
                    assert ok, f"{name}: short-lived tasks did not expire: {_h.states(m, short)}"
                continue
            after = _h.snapshot(m)
            if op != "refused":
                problems.append(f"{name}: REST refused with {rst} {rdet!r:.200}; the stream answered {ans!r:.300}")
                continue
            if ans.get("status") != rst:
                problems.append(f"{name}: status {ans.get('status')} on the stream, {rst} over REST ({ans.get('detail')!r:.150} / {rdet!r:.150})")
            det = str(ans.get("detail", ""))
            if isinstance(rdet, dict) and isinstance(rdet.get("detail"), list):
                fields = rest_fields(rdet["detail"])
                if not field_named(det, fields):
                    problems.append(f"{name}: the stream's detail {det!r:.200} names none of REST's fields {fields}")
            elif isinstance(rdet, dict) and isinstance(rdet.get("detail"), str):
                if det != rdet["detail"]:
                    problems.append(f"{name}: detail differs: stream {det!r:.200} REST {rdet['detail']!r:.200}")
            if after != mid:
                problems.append(f"{name}: refused on the stream, but the database changed: {_h.diff(mid, after)}")
        assert_alive(w, s, _h.snapshot(m), "after all the refusals")
    finally:
        s.close()
        print("\n" + "\n".join(table))
    assert not problems, f"{len(problems)} differences from REST:\n" + "\n".join(problems)


# --------------------------------------------------------------------------- 3. types JSON does not have
def test_msgpack_only_types_are_refused_or_mean_the_same(w):
    """bytes where a string goes, a string where bytes go, ext types, float32: REST has no such JSON
    value, so the oracle is the meaning: either 422 naming the field (nothing stored, stream open),
    or 4400 for a frame that is not valid, or accepted with exactly the task the str/bytes form makes."""
    m = w.m
    T = w.task
    ref_task = T(7)
    cases: list[tuple[str, dict, str]] = [
        ("endpoint_id=bytes", {"tasks": [T(7, endpoint_id=w.idle.encode())]}, "batch.tasks.0.endpoint_id"),
        ("function_id=bytes", {"tasks": [T(7, function_id=w.fid.encode())]}, "batch.tasks.0.function_id"),
        ("start=bytes", {"tasks": [T(7, start=b"now")]}, "batch.tasks.0.start"),
        ("cache_key=bytes", {"tasks": [T(7, cache_key=b"0" * 64)]}, "batch.tasks.0.cache_key"),
        ("idempotency_key=bytes", {"tasks": [T(7)], "idempotency_key": key().encode()}, "batch.idempotency_key"),
        ("task_group_id=bytes", {"tasks": [T(7)], "task_group_id": b"grp"}, "batch.task_group_id"),
        ("args=str_base64", {"tasks": [T(7, args=base64.b64encode(blob(7)).decode())]}, "batch.tasks.0.args"),
        ("args=str_raw", {"tasks": [T(7, args="json\n[[7],{}]")]}, "batch.tasks.0.args"),
        ("args=bytearray_ext", {"tasks": [T(7, args=msgpack.ExtType(5, blob(7)))]}, "batch.tasks.0.args"),
        ("timeout_s=timestamp_ext", {"tasks": [T(7, timeout_s=msgpack.Timestamp(5, 0))]}, "batch.tasks.0.timeout_s"),
        ("timeout_s=ext", {"tasks": [T(7, timeout_s=msgpack.ExtType(1, b"\x05"))]}, "batch.tasks.0.timeout_s"),
        ("function body=str", {"tasks": [T(7)], "functions": {w.fid: {"name": "t", "body": "abc"}}}, "batch.functions"),
    ]
    problems: list[str] = []
    for name, batch, field in cases:
        s = _h.RawWS(m)
        try:
            before = _h.snapshot(m)
            try:
                kind, ans = s.submit_mp(batch)
            except _h.Closed as c:
                after = _h.snapshot(m)
                if c.code != 4400 or not c.reason:
                    problems.append(f"{name}: closed with {c.code} {c.reason!r} (a malformed frame closes with 4400 and a reason)")
                if after != before:
                    problems.append(f"{name}: closed, but the database changed: {_h.diff(before, after)}")
                print(f"\n{name}: closed {c.code} {c.reason!r}")
                continue
            print(f"\n{name}: {ans!r:.200}")
            if ans.get("op") == "refused":
                after = _h.snapshot(m)
                if ans.get("status") != 422 or field not in str(ans.get("detail")):
                    problems.append(f"{name}: refused with {ans.get('status')} {ans.get('detail')!r:.200}, expected 422 naming {field}")
                if after != before:
                    problems.append(f"{name}: refused, but the database changed: {_h.diff(before, after)}")
                assert_alive(w, s, after, name)
            elif ans.get("op") == "accepted":
                # accepted: it must be the very task that the plain form makes (a bytes id stored as
                # "b'ep-...'" or the base64 text stored as the blob would be wrong)
                got = w.rows(ans["task_ids"])[ans["task_ids"][0]]
                _, ref = s.submit_mp({"tasks": [dict(ref_task, **{k: v for k, v in batch["tasks"][0].items()
                                                                   if not isinstance(v, (bytes, str, msgpack.ExtType, msgpack.Timestamp))})]})
                want = w.rows(ref["task_ids"])[ref["task_ids"][0]]
                if got[:-1] != want[:-1] and name.startswith(("endpoint_id", "function_id", "args")):
                    problems.append(f"{name}: accepted, but the task stored differs from the plain one:\n  {got!r:.300}\n  {want!r:.300}")
                if name.startswith(("timeout_s", "function body", "args=bytearray")):
                    problems.append(f"{name}: accepted a value no REST body can carry: {ans}")
            else:
                problems.append(f"{name}: unexpected answer {ans}")
        finally:
            s.close()
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- 4. malformed frames
def _bomb_submit(depth: int) -> bytes:
    head = (b"\x83" + msgpack.packb("op") + msgpack.packb("submit") + msgpack.packb("ref") + msgpack.packb(1)
            + msgpack.packb("batch") + b"\x81" + msgpack.packb("tasks"))
    return head + b"\x91" * depth + b"\xc0"


def _malformed_cases(w: World) -> dict[str, list[tuple[str, dict, Any]]]:
    good = {"tasks": [w.task(9)], "idempotency_key": key()}
    fbody = serialize_function(triple)
    fid = function_id(fbody)
    P = lambda o: msgpack.packb(o, use_bin_type=True)  # noqa: E731
    bomb_json = '{"op": "submit", "ref": 1, "batch": ' + "[" * 100_000 + "]" * 100_000 + "}"
    # (name, how to open: RawWS kwargs, the frame to send)
    return {"plain": [
        ("msgpack: not msgpack", {}, b"\xc1\x00\x01"),
        ("msgpack: truncated", {}, P({"op": "submit", "ref": 1, "batch": good})[:-3]),
        ("msgpack: trailing bytes", {}, P({"op": "submit", "ref": 1, "batch": good}) + b"\x00"),
        ("msgpack: two objects", {}, P({"op": "submit", "ref": 1, "batch": good}) * 2),
        ("msgpack: depth bomb 100000", {}, _bomb_submit(100_000)),
        ("msgpack: depth bomb 5000", {}, _bomb_submit(5_000)),
        ("msgpack: int key at top", {}, P({"op": "submit", "ref": 1, "batch": good, 7: "x"})),
        ("msgpack: bin key op", {}, P({b"op": "submit", "ref": 1, "batch": good})),
        ("msgpack: int key in a task", {}, P({"op": "submit", "ref": 1, "batch": {"tasks": [{**w.task(9), 1: 2}]}})),
        ("msgpack: nil key", {}, P({"op": "submit", "ref": 1, "batch": {"tasks": [w.task(9)], None: 1}})),
        ("msgpack: float key in functions", {}, P({"op": "submit", "ref": 1, "batch": {"tasks": [w.task(9)], "functions": {1.5: {}}}})),
        ("msgpack: array frame", {}, P(["submit", 1, good])),
        ("msgpack: string frame", {}, P("submit")),
        ("msgpack: no op", {}, P({"ref": 1, "batch": good})),
        ("msgpack: op bin", {}, P({"op": b"submit", "ref": 1, "batch": good})),
        ("msgpack: op int", {}, P({"op": 1, "ref": 1, "batch": good})),
        ("msgpack: unknown op", {}, P({"op": "subm1t", "ref": 1, "batch": good})),
        ("msgpack: ref missing", {}, P({"op": "submit", "batch": good})),
        ("msgpack: ref str", {}, P({"op": "submit", "ref": "1", "batch": good})),
        ("msgpack: ref float", {}, P({"op": "submit", "ref": 1.0, "batch": good})),
        ("msgpack: ref nil", {}, P({"op": "submit", "ref": None, "batch": good})),
        ("msgpack: ref bool", {}, P({"op": "submit", "ref": True, "batch": good})),
        ("msgpack: ref ext", {}, P({"op": "submit", "ref": msgpack.ExtType(3, b"\x01"), "batch": good})),
        ("msgpack: text not JSON", {}, "{op: submit"),
        ("msgpack: text array", {}, "[1, 2]"),
        ("json: binary frame before hello asked", {"enc": None}, P({"op": "submit", "ref": 1, "batch": good})),
        ("json: binary frame after unknown enc", {"hello": {"op": "hello", "after": None, "enc": "MSGPACK"}},
         P({"op": "submit", "ref": 1, "batch": good})),
        ("json: ref bool", {"enc": None}, json.dumps({"op": "submit", "ref": True, "batch": to_rest(good)})),
        ("first frame binary hello", {"raw_hello": P({"op": "hello", "after": None, "enc": "msgpack"})}, None),
        ("first frame not hello", {"raw_hello": json.dumps({"op": "submit", "ref": 1, "batch": to_rest(good)})}, None),
    ], "bin_keys": [
        # msgpack has two string-like families; a bin is not a str, so a bin map key is a non-string key
        ("msgpack: bin key in functions, bad body", {}, P({"op": "submit", "ref": 1,
                                                           "batch": {"tasks": [w.task(9)], "functions": {w.fid.encode(): {"name": "t", "body": b"x"}}}})),
        ("msgpack: bin key in functions, good body", {}, P({"op": "submit", "ref": 1, "batch": {
            "tasks": [w.task(9, function_id=fid)], "functions": {fid.encode(): {"name": "t", "body": fbody}}}})),
        ("msgpack: bin key in environment", {}, P({"op": "submit", "ref": 1, "batch": {
            "tasks": [w.task(9, environment={b"env_vars": {"A": "1"}})]}})),
        ("msgpack: bin key in a task", {}, P({"op": "submit", "ref": 1, "batch": {"tasks": [{**w.task(9), b"timeout_s": 5}]}})),
        ("msgpack: bin key in the batch", {}, P({"op": "submit", "ref": 1, "batch": {"tasks": [w.task(9)], b"task_group_id": "g1"}})),
    ], "json_bombs": [
        ("first frame JSON depth bomb", {"raw_hello": "[" * 100_000 + "]" * 100_000}, None),
        ("json: JSON depth bomb in a submit", {"enc": None}, bomb_json),
        ("msgpack: JSON depth bomb in a text frame", {}, bomb_json),
    ]}


def _run_malformed(w: World, cases: list[tuple[str, dict, Any]]) -> list[str]:
    m = w.m
    problems: list[str] = []
    lines = []
    for name, how, frame in cases:
        before = _h.snapshot(m)
        s = _h.RawWS(m, **how)
        try:
            if frame is not None:
                s.send_raw(frame)
            try:
                code, reason, frames = s.expect_close(15)
            except AssertionError as exc:
                problems.append(f"{name}: {exc}")
                lines.append(f"{name:42} not closed: {s.seen[-1:]!r:.150}")
                code, reason, frames = None, "", None
            if frames is not None:
                errs = [f for f in frames if isinstance(f, dict) and f.get("op") == "error"]
                lines.append(f"{name:42} {code} {reason!r:.100} error-frame={bool(errs)}")
                if code != 4400:
                    problems.append(f"{name}: closed with {code} {reason!r}, expected 4400")
                if not reason:
                    problems.append(f"{name}: closed without a reason")
                if not errs:
                    problems.append(f"{name}: no {{'op': 'error', 'detail'}} frame before the close (got {frames!r:.200})")
                elif reason and not str(errs[0].get("detail", "")).startswith(reason[:100].rstrip(".…")):
                    problems.append(f"{name}: error detail {errs[0].get('detail')!r:.150} is not the close reason {reason!r:.150}")
                if any(isinstance(f, dict) and f.get("op") == "accepted" for f in frames):
                    problems.append(f"{name}: the hub accepted something from a malformed frame: {frames!r:.300}")
        finally:
            s.close()
        after = _h.snapshot(m)
        if after != before:
            problems.append(f"{name}: the database changed: {_h.diff(before, after)[:300]}")
    print("\n" + "\n".join(lines))
    s = _h.RawWS(m)  # the hub still serves streams afterwards
    try:
        assert_alive(w, s, _h.snapshot(m), "after the malformed frames")
    finally:
        s.close()
    return problems


def test_malformed_frames_close_with_4400_and_store_nothing(w):
    problems = _run_malformed(w, _malformed_cases(w)["plain"])
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_bin_map_keys_are_non_string_keys(w):
    """docs/protocol.md: after "enc": "msgpack", a frame that is not msgpack, "non-string map keys
    included", is malformed: error frame, close 4400, nothing stored."""
    problems = _run_malformed(w, _malformed_cases(w)["bin_keys"])
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_json_depth_bombs_close_with_4400(w):
    """docs/protocol.md: a text frame that is not JSON (depth bombs included for msgpack; a JSON text the
    hub cannot parse is "not JSON" to it) gets {"op": "error"} and close 4400 with a reason."""
    problems = _run_malformed(w, _malformed_cases(w)["json_bombs"])
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems) + \
        "\nhub.log: " + " | ".join(l for l in (w.m.workdir / "hub.log").read_text().splitlines() if "RecursionError" in l)[-400:]


def test_frame_size_limit_and_ordering(w):
    """A frame of exactly max_frame is read (here: refused 413, its args over the payload limit); one
    byte more is never stored; answers to pipelined submits come in order, refusals in between."""
    m = w.m
    s = _h.RawWS(m, max_size=None)
    try:
        max_frame = s.welcome["max_frame"]

        def frame_of(n: int) -> bytes:
            pad = 1000
            while True:
                t = w.task(0, args=b"json\n\"" + b"a" * pad + b"\"")
                f = msgpack.packb({"op": "submit", "ref": 77, "batch": {"tasks": [t]}}, use_bin_type=True)
                if len(f) == n:
                    return f
                pad += n - len(f)

        exact = frame_of(max_frame)
        assert len(exact) == max_frame
        before = _h.snapshot(m)
        s.send_raw(exact)
        try:
            kind, ans = s.answer(77, timeout=60)
        except _h.Closed as c:
            raise AssertionError(f"a frame of exactly max_frame ({max_frame}) bytes closed the stream: {c.code} {c.reason!r}") from None
        assert ans.get("op") == "refused" and ans.get("status") == 413, f"frame of max_frame bytes: {ans!r:.300}"
        assert _h.snapshot(m) == before
        assert_alive(w, s, before, "after the 413")

        # pipelined: good, bad, good, bad, good; answers in ref order
        s.ref = 100
        frames = []
        for i in range(6):
            b = w.probe_batch if i % 2 == 0 else {"tasks": [w.task(0, timeout_s=-1)]}
            frames.append(msgpack.packb({"op": "submit", "ref": 100 + i, "batch": b}, use_bin_type=True))
        for f in frames:
            s.send_raw(f)
        order = []
        deadline = time.monotonic() + 30
        while len(order) < 6 and time.monotonic() < deadline:
            _, f = s.recv(30)
            if isinstance(f, dict) and f.get("op") in ("accepted", "refused", "error"):
                order.append((f.get("ref"), f.get("op")))
        want = [(100 + i, "accepted" if i % 2 == 0 else "refused") for i in range(6)]
        assert order == want, f"pipelined submits answered {order}, expected {want}"
        assert _h.snapshot(m) == before

        over = frame_of(max_frame + 1)
        s.send_raw(over)
        try:
            kind, ans = s.answer(77, timeout=30)
            assert ans.get("op") != "accepted", f"a frame over max_frame was accepted: {ans!r:.200}"
            print(f"\nover max_frame: answered {ans!r:.200}")
        except _h.Closed as c:
            print(f"\nover max_frame: closed {c.code} {c.reason!r}")
        assert _h.snapshot(m) == before, "a frame over max_frame changed the database"
    finally:
        s.close()
    s2 = _h.RawWS(m)
    try:
        assert_alive(w, s2, _h.snapshot(m), "a new stream after the oversized frame")
    finally:
        s2.close()


# --------------------------------------------------------------------------- 5. one key, one request
def test_one_idempotency_key_is_one_request_on_all_three_paths(w):
    m = w.m
    body = serialize_function(triple)
    fid = function_id(body)

    def mp_batch(k: str, vals=(1, 2, 3), **extra) -> dict:
        return {"tasks": [w.task(v, function_id=fid, timeout_s=5.0) for v in vals], "idempotency_key": k,
                "functions": {fid: {"name": "triple", "body": body}}, "task_group_id": "grp-" + k[-8:], **extra}

    problems = []
    sj = _h.RawWS(m, enc=None)
    sm = _h.RawWS(m)
    try:
        assert sj.welcome.get("enc") in (None, "json"), sj.welcome
        orders = [("msgpack", "rest", "json"), ("rest", "msgpack", "json"), ("json", "msgpack", "rest")]
        for order in orders:
            k = key()
            b = mp_batch(k)
            before = _h.snapshot(m)
            ids = {}
            for path in order:
                if path == "msgpack":
                    kind, a = sm.submit_mp(b)
                    assert kind == "bin"
                    ids[path] = a.get("task_ids") if a.get("op") == "accepted" else a
                elif path == "json":
                    kind, a = sj.submit_json(to_rest(b))
                    assert kind == "text", f"a JSON stream got a {kind} frame"
                    ids[path] = a.get("task_ids") if a.get("op") == "accepted" else a
                else:
                    st, a = _h.rest(m, to_rest(b))
                    ids[path] = a.get("task_ids") if st == 201 else (st, a)
            vals = list(ids.values())
            if not all(isinstance(v, list) for v in vals) or any(v != vals[0] for v in vals):
                problems.append(f"order {order}: one key gave {ids}")
            added = _h.states(m, vals[0] if isinstance(vals[0], list) else [])
            if sum(added.values()) != 3:
                problems.append(f"order {order}: {sum(added.values())} tasks stored for 3")
            after = _h.snapshot(m)
            if len(after["tasks"]) - len(before["tasks"]) != 3:
                problems.append(f"order {order}: {len(after['tasks']) - len(before['tasks'])} task rows added, expected 3")
            # the same key with another request: 409 on every path, nothing stored
            b2 = mp_batch(k, vals=(1, 2, 4))
            st, a = _h.rest(m, to_rest(b2))
            _, a_m = sm.submit_mp(b2)
            _, a_j = sj.submit_json(to_rest(b2))
            got = (st, a_m.get("op"), a_m.get("status"), a_j.get("op"), a_j.get("status"))
            if got != (409, "refused", 409, "refused", 409):
                problems.append(f"order {order}: another request under a used key answered {got} ({a!r:.100} {a_m!r:.150})")
            if _h.snapshot(m) != after:
                problems.append(f"order {order}: a 409 changed the database: {_h.diff(after, _h.snapshot(m))}")

        # the same request spelled differently on the wire: map order, float32 vs float64
        k = key()
        b = mp_batch(k)
        st, a = _h.rest(m, to_rest(b))
        assert st == 201, (st, a)
        reordered = {kk: b[kk] for kk in reversed(list(b))}
        reordered["tasks"] = [{kk: t[kk] for kk in reversed(list(t))} for t in b["tasks"]]
        _, ar = sm.submit_mp(reordered)
        if ar.get("task_ids") != a["task_ids"]:
            problems.append(f"the same batch with its map keys in another order under the same key answered {ar}")
        sm.ref += 1
        sm.send_raw(msgpack.packb({"op": "submit", "ref": sm.ref, "batch": b}, use_bin_type=True, use_single_float=True))
        _, af = sm.answer(sm.ref)
        if af.get("task_ids") != a["task_ids"]:
            problems.append(f"the same batch with timeout 5.0 as a msgpack float32 under the same key answered {af}")
    finally:
        sj.close()
        sm.close()
    assert not problems, "\n".join(problems)


def test_one_key_racing_on_three_paths_makes_one_set_of_tasks(w):
    m = w.m
    k = key()
    b = {"tasks": [w.task(v) for v in range(5)], "idempotency_key": k}
    before = _h.snapshot(m)
    answers: list[Any] = []
    go = threading.Event()
    conns = [_h.RawWS(m) for _ in range(3)] + [_h.RawWS(m, enc=None) for _ in range(3)]

    def via_mp(s):
        go.wait(10)
        try:
            answers.append(("mp", s.submit_mp(b)[1].get("task_ids")))
        except Exception as e:  # noqa: BLE001
            answers.append(("mp", repr(e)))

    def via_json(s):
        go.wait(10)
        try:
            answers.append(("json", s.submit_json(to_rest(b))[1].get("task_ids")))
        except Exception as e:  # noqa: BLE001
            answers.append(("json", repr(e)))

    def via_rest():
        go.wait(10)
        st, a = _h.rest(m, to_rest(b))
        answers.append(("rest", a.get("task_ids") if st == 201 else (st, a)))

    ts = [threading.Thread(target=via_mp, args=(s,)) for s in conns[:3]]
    ts += [threading.Thread(target=via_json, args=(s,)) for s in conns[3:]]
    ts += [threading.Thread(target=via_rest) for _ in range(3)]
    try:
        [t.start() for t in ts]
        go.set()
        [t.join(60) for t in ts]
    finally:
        [s.close() for s in conns]
    ids = {tuple(v) if isinstance(v, list) else repr(v) for _, v in answers}
    assert len(answers) == 9 and len(ids) == 1, f"9 racing submits of one key answered: {answers}"
    after = _h.snapshot(m)
    assert len(after["tasks"]) - len(before["tasks"]) == 5, f"racing copies stored {_h.diff(before, after)}"


# --------------------------------------------------------------------------- 6. the oracle itself
def test_rest_answers_non_finite_floats_with_422(w):
    """docs/protocol.md section 10: validation errors are 422. A JSON body with NaN or -Infinity (Python's
    json, and so many clients, write them) where a positive number goes must be a 422 naming the field,
    as the msgpack stream answers, not a 500 from encoding the error that echoes the value."""
    m = w.m
    bad = []
    for field, lit in [("timeout_s", "NaN"), ("timeout_s", "-Infinity"), ("ttl_s", "NaN")]:
        before = _h.snapshot(m)
        body = json.dumps({"tasks": [to_rest(w.task(1))]})[:-3] + f', "{field}": {lit}}}]}}'
        assert body.count("{") == body.count("}"), body
        st, det = _h.rest(m, body.encode())
        assert _h.snapshot(m) == before
        if st != 422:
            bad.append(f"{field}={lit}: REST answered {st} {det!r:.120}")
    assert not bad, "REST does not refuse non-finite floats as a validation error:\n" + "\n".join(bad) + \
        "\nhub.log:" + "\n".join(l for l in (m.workdir / "hub.log").read_text().splitlines() if "ValueError" in l)[-600:]
