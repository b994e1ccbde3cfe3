"""Helpers of the issue-30c outsider checks (written from docs/protocol.md "SDK stream" and
docs/architecture.md "The transactions on a task's path" only):

- ``mesh``: a LocalMesh whose hub is its own ``mesh-hub serve`` process (so it can be SIGKILLed and
  restarted), with hub settings passed through ``MESH_HUB_*`` variables;
- ``RawWS``: a bare WebSocket client of ``GET /v1/stream`` that sends exactly the bytes a test
  gives it (JSON text or msgpack binary), so hostile and broken frames can be sent;
- ``snapshot``: the hub's durable tables (tasks, results, functions, idempotency keys, ...), read
  read-only from its SQLite file, to prove that a refusal stored nothing;
- ``rest``: ``POST /v1/tasks/batch`` with a raw body, the oracle for "REST's rules";
- ``record``: a task that appends one line per run to a marker file, so runs can be counted.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgpack
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from cloud_hub.localmesh import LocalMesh
from tests.outsider_issue30._mesh import mesh as _mesh30
from tests.outsider_issue30._mesh import runs as runs

# tables whose rows a submit writes (docs/architecture.md: "insert: function bodies riding with the
# batch, ownership check, tasks, placement decisions, memo rows, idempotency key")
DURABLE = ("tasks", "results", "functions", "function_owners", "submit_keys", "memo", "memo_counts",
           "scheduler_decisions", "task_group_leases")


#: A LocalMesh with the hub as its own process (it can be SIGKILLed and restarted), as the first
#: outsider folder of issue 30 starts one: lease 10 s, ``env`` inherited by the hub.
mesh = _mesh30

def logs(m: LocalMesh, tail: int = 3000) -> str:
    parts = []
    for p in [m.workdir / "hub.log", *sorted((m.workdir / "agents").glob("*.log"))]:
        if p.exists():
            parts.append(f"\n--- {p.name}\n{p.read_text(errors='replace')[-tail:]}")
    return "".join(parts)


# ------------------------------------------------------------------ database
def db(m: LocalMesh) -> sqlite3.Connection:
    c = sqlite3.connect(f"file:{m.hub_cfg.db_path}?mode=ro", uri=True, timeout=10)
    c.execute("PRAGMA busy_timeout = 10000")
    return c


def snapshot(m: LocalMesh) -> dict[str, list[tuple]]:
    """Every row of the durable tables, sorted (volatile columns included: nothing may change)."""
    c = db(m)
    try:
        have = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        out = {}
        for t in DURABLE:
            if t in have:
                out[t] = sorted(c.execute(f"SELECT * FROM {t}").fetchall(), key=repr)
        return out
    finally:
        c.close()


def diff(a: dict[str, list[tuple]], b: dict[str, list[tuple]]) -> str:
    out = []
    for t in sorted(set(a) | set(b)):
        ra, rb = set(map(repr, a.get(t, []))), set(map(repr, b.get(t, [])))
        if ra != rb:
            out.append(f"{t}: +{len(rb - ra)} -{len(ra - rb)} e.g. {sorted(rb - ra)[:2]} {sorted(ra - rb)[:1]}")
    return "; ".join(out)


def states(m: LocalMesh, task_ids: list[str] | None = None) -> Counter[str]:
    c = db(m)
    try:
        rows = c.execute("SELECT id, state FROM tasks").fetchall()
    finally:
        c.close()
    want = None if task_ids is None else set(task_ids)
    return Counter(s for i, s in rows if want is None or i in want)


def stuck(m: LocalMesh, task_ids: list[str] | None = None) -> list[tuple]:
    c = db(m)
    try:
        rows = c.execute("SELECT id, state, endpoint_id, attempts, leased_until, start_now FROM tasks "
                         "WHERE state IN ('queued', 'leased', 'acked')").fetchall()
    finally:
        c.close()
    want = None if task_ids is None else set(task_ids)
    return [r for r in rows if want is None or r[0] in want]


def result_counts(m: LocalMesh, task_ids: list[str]) -> Counter[str]:
    c = db(m)
    try:
        rows = c.execute("SELECT task_id FROM results").fetchall()
    finally:
        c.close()
    want = set(task_ids)
    return Counter(r[0] for r in rows if r[0] in want)


# ------------------------------------------------------------------ REST oracle
def rest(m: LocalMesh, body: bytes | dict, token: str | None = None) -> tuple[int, Any]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{m.url}/v1/tasks/batch", content=content, timeout=60,
                   headers={"Authorization": f"Bearer {token or m.token}", "Content-Type": "application/json"})
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, r.text


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


# ------------------------------------------------------------------ raw stream
class Closed(Exception):
    def __init__(self, code: int | None, reason: str, frames: list[Any]) -> None:
        super().__init__(f"closed {code} {reason!r}; frames before: {frames!r:.400}")
        self.code, self.reason, self.frames = code, reason, frames


class RawWS:
    """One /v1/stream connection; ``recv`` returns ("bin"|"text", decoded frame)."""

    def __init__(self, m: LocalMesh, *, hello: Any = None, enc: str | None = "msgpack", token: str | None = None,
                 raw_hello: bytes | str | None = None, max_size: int | None = None) -> None:
        url = m.url.replace("http://", "ws://") + "/v1/stream"
        self.ws = connect(url, additional_headers={"Authorization": f"Bearer {token or m.token}"},
                          open_timeout=15, max_size=max_size, proxy=None, close_timeout=5)
        self.seen: list[tuple[str, Any]] = []
        self.welcome = None
        if raw_hello is not None:
            self.ws.send(raw_hello)
            return
        h = dict(hello) if hello is not None else {"op": "hello", "after": None}
        if enc is not None and "enc" not in h:
            h["enc"] = enc
        self.ws.send(json.dumps(h))
        kind, w = self.recv(15)
        assert kind == "text", f"the welcome must be JSON text, got a {kind} frame: {w!r}"
        assert w.get("op") == "welcome", w
        self.welcome = w
        self.ref = 0

    # -- sending
    def send_mp(self, obj: Any) -> None:
        self.ws.send(msgpack.packb(obj, use_bin_type=True))

    def send_raw(self, data: bytes | str) -> None:
        self.ws.send(data)

    def send_json(self, obj: Any) -> None:
        self.ws.send(json.dumps(obj))

    # -- receiving
    def recv(self, timeout: float = 20.0) -> tuple[str, Any]:
        try:
            msg = self.ws.recv(timeout=timeout)
        except ConnectionClosed as exc:
            rcvd = exc.rcvd
            raise Closed(rcvd.code if rcvd else None, rcvd.reason if rcvd else "", self.seen) from None
        if isinstance(msg, bytes):
            item = ("bin", msgpack.unpackb(msg, raw=False, strict_map_key=False))
        else:
            item = ("text", json.loads(msg))
        self.seen.append(item)
        return item

    def answer(self, ref: Any, timeout: float = 30.0) -> tuple[str, dict]:
        """The accepted/refused/error frame for ``ref`` (results frames in between are kept)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer to ref {ref!r} within {timeout} s; seen {self.seen[-5:]!r:.600}")
            kind, f = self.recv(left)
            if isinstance(f, dict) and f.get("op") == "error":
                return kind, f
            if isinstance(f, dict) and f.get("op") in ("accepted", "refused") and f.get("ref") == ref:
                return kind, f

    def submit_mp(self, batch: Any, timeout: float = 30.0) -> tuple[str, dict]:
        self.ref += 1
        self.send_mp({"op": "submit", "ref": self.ref, "batch": batch})
        return self.answer(self.ref, timeout)

    def submit_json(self, batch: Any, timeout: float = 30.0) -> tuple[str, dict]:
        self.ref += 1
        self.send_json({"op": "submit", "ref": self.ref, "batch": batch})
        return self.answer(self.ref, timeout)

    def expect_close(self, timeout: float = 15.0) -> tuple[int | None, str, list[Any]]:
        """Read until the hub closes; returns (code, reason, frames read before the close)."""
        before = len(self.seen)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _, f = self.recv(max(0.1, deadline - time.monotonic()))
            except Closed as c:
                return c.code, c.reason, [f for _, f in self.seen[before:]]
            except TimeoutError:
                break
            if isinstance(f, dict) and f.get("op") in ("accepted", "refused"):
                deadline = min(deadline, time.monotonic() + 1.5)  # answered as a submit: a close would follow at once
        raise AssertionError(f"the hub did not close the stream; it sent {self.seen[before:]!r:.600}")

    def results(self) -> list[dict]:
        return [r for _, f in self.seen if isinstance(f, dict) and f.get("op") == "results" for r in f.get("results") or []]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()


# ------------------------------------------------------------------ tasks that count their runs
def record(path: str, key: str, sleep: float = 0.0) -> str:
    """Append ``key`` to ``path`` once per run (O_APPEND: atomic lines), then answer the key."""
    import os as _os
    import time as _time

    fd = _os.open(path, _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT, 0o644)
    try:
        _os.write(fd, f"{key} {_os.getpid()} {_time.time():.4f}\n".encode())
    finally:
        _os.close(fd)
    if sleep:
        _time.sleep(sleep)
    return key




def run_times(path: str | Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    p = Path(path)
    for line in (p.read_text().splitlines() if p.exists() else []):
        k, _pid, t = line.split()
        out.setdefault(k, []).append(float(t))
    return out


def until(pred: Any, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
