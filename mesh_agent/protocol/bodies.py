"""Shape checks for message bodies, one rule set per kind (docs/protocol.md, section 3).

Why: a body passed the MAC, so it came from a holder of the endpoint's key, but a buggy or
compromised peer can still send a ``tasks`` entry without an id or a result whose ``data`` is a
string. Checking the shape here, before any handler touches a store, turns such a frame into one
clear ``BadFrame`` ("results[3].data must be bytes, got str") instead of a KeyError deep in a
transaction. Only the keys a receiver reads are checked; unknown keys are ignored so optional
fields can be added without a version bump. Pure and fast: plain loops, no I/O, no pickle.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from mesh_agent.protocol.envelope import BadFrame, Kind

__all__ = ["validate_body", "MAX_IDS", "TASK_CANCELLED", "cancelled_error"]

#: The error type of a cancelled task's one result (docs/protocol.md, "Cancellation"): written by
#: the hub when the submitter cancels (``POST /v1/tasks/{id}/cancel``), by the engine for a task it
#: dropped or whose worker it ended; the SDK turns it into a cancelled future.
TASK_CANCELLED = "mesh_agent.TaskCancelled"


def cancelled_error(task_id: str, why: str = "cancelled by its submitter") -> dict[str, Any]:
    """The error dict (section 3, "error blob") of a cancelled task."""
    return {"type": TASK_CANCELLED, "message": f"task {task_id} was {why}", "traceback": "", "exception": None}

#: Upper bound for any id list (``have`` in a hello is capped at 100,000 by the agent).
MAX_IDS = 200_000
_MAX_ID_LEN = 256
_MAX_ENV = 32_768  # canonical JSON of an environment spec (mesh_agent/protocol/environment.py): 100 requirements, 64 variables


def _type(v: Any) -> str:
    return type(v).__name__


def _fail(kind: Kind, where: str, what: str, v: Any) -> BadFrame:
    return BadFrame(f"{kind.value} body: {where} must be {what}, got {_type(v)}")


def _num(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _str_id(v: Any) -> bool:
    return type(v) is str and 0 < len(v) <= _MAX_ID_LEN


def _need(kind: Kind, body: dict[str, Any], key: str, ok: Callable[[Any], bool], what: str, optional: bool = False) -> Any:
    if key not in body:
        if optional:
            return None
        raise BadFrame(f"{kind.value} body: missing {key!r}")
    v = body[key]
    if not ok(v):
        raise _fail(kind, key, what, v)
    return v


def _id_list(kind: Kind, body: dict[str, Any], key: str) -> None:
    ids = _need(kind, body, key, lambda v: type(v) is list and len(v) <= MAX_IDS, f"a list of at most {MAX_IDS} ids")
    for i, x in enumerate(ids):
        if not _str_id(x):
            raise _fail(kind, f"{key}[{i}]", "a non-empty string id", x)


def _opt_num(v: Any) -> bool:
    return v is None or _num(v)


def _hello(k: Kind, b: dict[str, Any]) -> None:
    _need(k, b, "nonce", lambda v: type(v) is str and 0 < len(v) <= 64 and v.isascii(), "a short ascii string")
    _need(k, b, "capacity", lambda v: type(v) is int and 0 <= v <= 1_000_000, "an int >= 0")
    _need(k, b, "prefetch", lambda v: type(v) is int and v >= 0, "an int >= 0", optional=True)
    if "have" in b:
        _id_list(k, b, "have")


def _welcome(k: Kind, b: dict[str, Any]) -> None:
    _need(k, b, "reply_to", lambda v: type(v) is str and 0 < len(v) <= 64 and v.isascii(), "a short ascii string")
    _need(k, b, "hub_time", _num, "a finite number")
    _need(k, b, "heartbeat_s", lambda v: _num(v) and v > 0, "a number > 0", optional=True)
    if b.get("allow") is not None:
        _id_list(k, b, "allow")


def _fetch(k: Kind, b: dict[str, Any]) -> None:
    _need(k, b, "want", lambda v: type(v) is int and v >= 0, "an int >= 0")


def _tasks(k: Kind, b: dict[str, Any]) -> None:
    tasks = _need(k, b, "tasks", lambda v: type(v) is list, "a list")
    functions = _need(k, b, "functions", lambda v: type(v) is dict, "a map", optional=True) or {}
    for fid, body in functions.items():
        if not _str_id(fid) or type(body) is not bytes:
            raise _fail(k, f"functions[{fid[:70]!r}]", "bytes under a string id", body)
    for i, t in enumerate(tasks):
        if type(t) is not dict:
            raise _fail(k, f"tasks[{i}]", "a map", t)
        for key, ok, what in (
            ("id", _str_id, "a non-empty string id"),
            ("fn", _str_id, "a function id string"),
            ("args", lambda v: type(v) is bytes, "bytes"),
        ):
            if key not in t:
                raise BadFrame(f"{k.value} body: tasks[{i}] has no {key!r}")
            if not ok(t[key]):
                raise _fail(k, f"tasks[{i}].{key}", what, t[key])
        if not (t.get("timeout") is None or (_num(t["timeout"]) and t["timeout"] > 0)):
            raise _fail(k, f"tasks[{i}].timeout", "null or a number > 0", t["timeout"])
        if not _opt_num(t.get("exp")):
            raise _fail(k, f"tasks[{i}].exp", "null or a finite number", t["exp"])
        if not (t.get("env") is None or (type(t["env"]) is str and len(t["env"]) <= _MAX_ENV)):
            raise _fail(k, f"tasks[{i}].env", f"null or an environment spec of at most {_MAX_ENV} characters", t["env"])
    if b.get("allow") is not None:
        _id_list(k, b, "allow")
    if "cancel" in b:  # task ids the submitter cancelled (optional; an agent that predates it ignores it)
        _id_list(k, b, "cancel")


def _ids(k: Kind, b: dict[str, Any]) -> None:
    _id_list(k, b, "ids")


def _ack(k: Kind, b: dict[str, Any]) -> None:
    _id_list(k, b, "ids")
    if "c" in b:  # cancels the agent applied (stored): the hub stops re-sending them
        _id_list(k, b, "c")


def _results(k: Kind, b: dict[str, Any]) -> None:
    results = _need(k, b, "results", lambda v: type(v) is list, "a list")
    for i, r in enumerate(results):
        if type(r) is not dict:
            raise _fail(k, f"results[{i}]", "a map", r)
        for key, ok, what in (
            ("id", _str_id, "a non-empty string id"),
            ("ok", lambda v: type(v) is bool, "a bool"),
            ("data", lambda v: type(v) is bytes, "bytes"),
        ):
            if key not in r:
                raise BadFrame(f"{k.value} body: results[{i}] has no {key!r}")
            if not ok(r[key]):
                raise _fail(k, f"results[{i}].{key}", what, r[key])
        for key in ("started", "finished"):
            if not _opt_num(r.get(key)):
                raise _fail(k, f"results[{i}].{key}", "null or a finite number", r[key])
        if not (r.get("pid") is None or type(r["pid"]) is int):
            raise _fail(k, f"results[{i}].pid", "null or an int", r["pid"])


def _heartbeat(k: Kind, b: dict[str, Any]) -> None:
    for key in ("capacity", "running", "queued", "stored", "outbox", "want", "cpu", "mem_used", "mem_avail_mb"):
        if not _opt_num(b.get(key)):
            raise _fail(k, key, "null or a finite number", b[key])
    # optional: a device behind a gateway resuming on a new LAN connection names it (docs/sites.md)
    _need(k, b, "conn", lambda v: type(v) is str and 0 < len(v) <= 64 and v.isascii(), "a short ascii string", optional=True)
    if "warm" in b:
        warm = _need(k, b, "warm", lambda v: type(v) is list and len(v) <= 1000, "a list of at most 1000 ids")
        if not all(_str_id(x) for x in warm):
            raise BadFrame(f"{k.value} body: warm must hold string ids")
    if "envs" in b:
        envs = _need(k, b, "envs", lambda v: type(v) is list and len(v) <= 64, "a list of at most 64 environment ids")
        if not all(_str_id(x) for x in envs):
            raise BadFrame(f"{k.value} body: envs must hold string ids")
    if "eb" in b:
        eb = _need(k, b, "eb", lambda v: type(v) is dict and len(v) <= 16, "a map of at most 16 environment builds")
        for sid, v in eb.items():
            if not _str_id(sid) or type(v) is not list or len(v) != 2 or not all(_num(x) and x >= 0 for x in v):
                raise BadFrame(f"{k.value} body: eb[{str(sid)[:40]!r}] must be [seconds, bytes], both >= 0")


def _error(k: Kind, b: dict[str, Any]) -> None:
    _need(k, b, "code", lambda v: type(v) is str and len(v) <= 64, "a short string")
    _need(k, b, "message", lambda v: type(v) is str, "a string", optional=True)


def _gone(k: Kind, b: dict[str, Any]) -> None:
    _need(k, b, "conn", lambda v: type(v) is str and 0 < len(v) <= 64 and v.isascii(), "a short ascii string")


def _site(k: Kind, b: dict[str, Any]) -> None:
    from mesh_agent.protocol.site import check_site_body

    check_site_body(k, b)


_RULES: dict[Kind, Callable[[Kind, dict[str, Any]], None]] = {
    Kind.HELLO: _hello,
    Kind.WELCOME: _welcome,
    Kind.FETCH: _fetch,
    Kind.TASKS: _tasks,
    Kind.ACK: _ack,
    Kind.RESULTS: _results,
    Kind.RESULT_ACK: _ids,
    Kind.HEARTBEAT: _heartbeat,
    Kind.ERROR: _error,
    Kind.GONE: _gone,
    Kind.SITE_UP: _site,
    Kind.SITE_DOWN: _site,
}


def validate_body(kind: Kind, body: dict[str, Any]) -> None:
    """Raise :class:`BadFrame` naming the first field that has the wrong shape for ``kind``."""
    if type(body) is not dict:
        raise BadFrame(f"{kind.value} body must be a map, got {_type(body)}")
    _RULES[kind](kind, body)
