"""A Flower ``Grid`` whose nodes are mesh endpoints and whose messages are mesh tasks.

An unchanged ``ServerApp`` (``@app.main()`` calling ``strategy.start(grid=...)`` with Flower's
own strategies) drives the rounds through :class:`MeshGrid`:

* ``get_node_ids()``: the run's endpoints that passed the warm-up (app loaded) and that the hub
  reports online now, as Flower node ids (:func:`fl.flower.clientapp.node_id_of`).
* ``push_messages``: one task per message to the destination endpoint (the message travels as
  its protobuf bytes). Tasks are the mesh's: durable in the hub and in the agent's queue, so an
  outage of the link, the hub or the device delays a message, never loses it; they expire with
  the message's TTL.
* ``pull_messages``: the replies that are back (never waits). A message whose destination the
  hub reports offline gets an error reply with ``NODE_UNAVAILABLE`` at once, as Flower's
  SuperLink answers for a node that missed its heartbeats; a task that failed outside the app
  (its worker died, it expired) gets ``CLIENT_APP_CRASHED`` / ``MESSAGE_UNAVAILABLE``. As in
  Flower, each message is answered once: a real reply that arrives after its error reply is
  kept in :attr:`MeshGrid.late_replies` (and counted), not handed to the strategy.
* ``send_and_receive``: push, then pull by long poll until every message is answered or
  ``timeout`` passes (Flower polls every 3 s; here the hub wakes the driver when a reply lands).

Runs fail loudly: a training round in which every message came back with the same error
counts; after ``max_failed_rounds`` such rounds in a row :class:`RunFailed` stops the run
(a missing ``run_config`` key or module fails every round the same way; waiting for more does
not help). Bytes of the messages are counted both ways (:attr:`MeshGrid.bytes_out`, ``bytes_in``).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from cloud_hub.client import Client
from cloud_hub.client._results import decode_row
from fl.drivers._base import hub_down, wait_out_hub
from fl.flower.clientapp import PROTOCOL, decode_message, encode_message, node_id_of

__all__ = ["MeshGrid", "RunFailed", "RoundLog"]

log = logging.getLogger("fl.flower.grid")

NODE_UNAVAILABLE_REASON = ("Error: Node Unavailable - the destination endpoint is offline (the hub missed its "
                           "heartbeats); a reply that still comes is kept in MeshGrid.late_replies")


class RunFailed(RuntimeError):
    """The run cannot produce a model (every client fails the same way, nothing trained)."""


@dataclass
class _Pending:
    task_id: str
    endpoint: str
    msg: Message
    sent: float
    size: int


@dataclass
class RoundLog:
    """What the grid saw of one round (``group_id``), for the run record and the console."""

    round: int
    started: float
    train_ok: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # endpoint -> metrics
    train_failed: Dict[str, str] = field(default_factory=dict)
    eval_ok: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    eval_failed: Dict[str, str] = field(default_factory=dict)
    asked: List[str] = field(default_factory=list)
    train_app_s: Dict[str, float] = field(default_factory=dict)  # endpoint -> seconds inside the ClientApp (its own clock)
    eval_app_s: Dict[str, float] = field(default_factory=dict)
    bytes_out: int = 0
    bytes_in: int = 0
    ended: Optional[float] = None


def _short(exc: BaseException) -> str:
    remote = getattr(exc, "remote_type", None)
    text = f"{remote or type(exc).__name__}: {getattr(exc, 'remote_message', None) or exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def _metrics(content: RecordDict) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for rec in content.metric_records.values():
        for k, v in rec.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = v
    return out


class MeshGrid(Grid):
    """See the module doc. ``endpoints``: the run's endpoints (ready ones: warm-up passed);
    ``task``: the fields every task carries besides the message (app, run, run_config, dataset);
    ``environments``: endpoint -> the execution environment its messages run in (the app's
    dependencies built there, :mod:`fl.flower.delivery`)."""

    def __init__(self, client: Client, endpoints: Sequence[str], *, fid: str, task: Mapping[str, Any], run_id: int,
                 hub_wait_s: float = 300.0, poll_s: float = 5.0, max_failed_rounds: int = 2,
                 on_round: Optional[Callable[["RoundLog"], None]] = None,
                 environments: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
        if max_failed_rounds < 1:
            raise ValueError("max_failed_rounds must be >= 1")
        self.client = client
        self.endpoints = list(dict.fromkeys(endpoints))
        self._by_node = {node_id_of(e): e for e in self.endpoints}
        self.fid = fid
        self.task = dict(task)
        self.hub_wait_s = float(hub_wait_s)
        self.poll_s = float(poll_s)
        self.max_failed_rounds = int(max_failed_rounds)
        self.on_round = on_round
        self.environments = {e: dict(env) for e, env in (environments or {}).items() if env}  # endpoint -> where its ClientApp runs
        self._run = Run.create_empty(run_id)
        self._pending: Dict[str, _Pending] = {}
        self._answered_early: Dict[str, _Pending] = {}  # task id -> answered with an error; a reply may still come
        self.late_replies: List[Message] = []
        self.bytes_out = 0
        self.bytes_in = 0
        self.messages_out = 0
        self.rounds: Dict[int, RoundLog] = {}
        self.arrays_after: Dict[int, Any] = {}  # round -> the global ArrayRecord after it, as seen in later messages
        self.trained_rounds = 0
        self.failed_streak = 0
        self.last_errors: Dict[str, str] = {}
        self._online: Dict[str, bool] = {}
        self._online_at = 0.0

    # ------------------------------------------------------------------ Grid API
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: Optional[float] = None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        online = self._online_now(max_age_s=1.0)
        return [node_id_of(e) for e in self.endpoints if online.get(e)]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        msgs = list(messages)
        items = []
        ids: List[str] = []
        for msg in msgs:
            md = msg.metadata
            if md.reply_to_message_id or md.ttl <= 0:
                raise ValueError(f"Invalid message: {msg}")
            mid = uuid.uuid4().hex
            md.__dict__["_message_id"] = mid
            ids.append(mid)
            endpoint = self._by_node.get(int(md.dst_node_id))
            if msg.has_content() and msg.content.array_records:
                r = self.round_of(msg)
                after = r - 1 if md.message_type.startswith("train") else r
                self.arrays_after.setdefault(after, next(iter(msg.content.array_records.values())))
            data = encode_message(msg)
            items.append((mid, endpoint, msg, data))
        specs, meta = [], []
        for mid, endpoint, msg, data in items:
            if endpoint is None:  # not a node of this run: answered on the next pull
                self._answered_early[mid] = _Pending("", "", msg, time.time(), 0)
                continue
            payload = {**self.task, "v": PROTOCOL, "kind": "flower-message", "message": data}
            ttl = max(1.0, float(msg.metadata.ttl))
            spec = Client.task_spec(endpoint, self.fid, (payload,), None, ttl_s=ttl)
            if endpoint in self.environments:
                spec["environment"] = self.environments[endpoint]
            specs.append(spec)
            meta.append((mid, endpoint, msg, len(data)))
        if specs:
            tids = self._hub(self.client.submit_batch, specs)
            now = time.time()
            for tid, (mid, endpoint, msg, size) in zip(tids, meta):
                self._pending[mid] = _Pending(tid, endpoint, msg, now, size)
                self.bytes_out += size
                self.messages_out += 1
                rl = self._round(msg)
                rl.bytes_out += size
                if msg.metadata.message_type.startswith("train"):
                    rl.asked.append(endpoint)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._pull(list(message_ids), 0.0)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: Optional[float] = None) -> Iterable[Message]:
        msgs = list(messages)
        ids = set(self.push_messages(msgs))
        end = None if timeout is None else time.monotonic() + float(timeout)
        out: List[Message] = []
        while ids:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                break
            got = self._pull(sorted(ids), min(self.poll_s, left) if left is not None else self.poll_s)
            out.extend(got)
            ids -= {m.metadata.reply_to_message_id for m in got}
        self._after_round(msgs, out)
        return out

    # ------------------------------------------------------------------ internals
    def _hub(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Call the hub; while it is unreachable (or answers 5xx) wait and retry up to ``hub_wait_s``,
        as the FL driver does (``fl.drivers._base.wait_out_hub``)."""
        try:
            return wait_out_hub(lambda: fn(*args, **kw), self.hub_wait_s)
        except BaseException as err:
            if not hub_down(err):
                raise
            raise RunFailed(f"hub unreachable for {self.hub_wait_s:.0f}s (last error: {err})") from err

    def _online_now(self, max_age_s: float) -> Dict[str, bool]:
        """Which endpoints the hub reports online; cached for ``max_age_s`` only while all are
        (a node that is away is looked up again at every call, so it rejoins the next sampling)."""
        if not all(self._online.get(e) for e in self.endpoints) or time.monotonic() - self._online_at > max_age_s:
            rows = {e["id"]: e for e in self._hub(self.client.list_endpoints)}
            self._online = {e: bool(rows.get(e, {}).get("online")) for e in self.endpoints}
            self._online_at = time.monotonic()
        return self._online

    @staticmethod
    def round_of(msg: Message) -> int:
        """The FL round of a message: its ``group_id`` when numeric, else the ``server-round``
        Flower's strategies put in the message's ConfigRecord, else 0."""
        try:
            return int(msg.metadata.group_id)
        except (TypeError, ValueError):
            pass
        if msg.has_content():
            for rec in msg.content.config_records.values():
                v = rec.get("server-round")
                if isinstance(v, int):
                    return v
        return 0

    def _round(self, msg: Message) -> RoundLog:
        r = self.round_of(msg)
        if r not in self.rounds:
            self.rounds[r] = RoundLog(r, time.time())
        return self.rounds[r]

    def _error_reply(self, msg: Message, code: int, reason: str) -> Message:
        reply = Message(Error(code=code, reason=reason), reply_to=msg)
        reply.metadata.__dict__["_message_id"] = f"e-{msg.metadata.message_id}"
        return reply

    def _pull(self, message_ids: List[str], wait_s: float) -> List[Message]:
        out: List[Message] = []
        for mid in [m for m in message_ids if m in self._answered_early and not self._answered_early[m].task_id]:
            p = self._answered_early.pop(mid)
            out.append(self._error_reply(p.msg, ErrorCode.NODE_UNAVAILABLE, f"node {p.msg.metadata.dst_node_id} is not part of this run"))
        wanted = {self._pending[m].task_id: m for m in message_ids if m in self._pending}
        watch = list(wanted) + [t for t, p in self._answered_early.items() if p.task_id and t not in wanted][:1000]
        if watch:
            rows = self._hub(self.client.wait_results, watch, max(0.0, wait_s))
        else:
            rows = []
        for row in rows:
            tid = row["task_id"]
            try:
                ok, value = decode_row(row, self.client.trusted_endpoints)  # untrusted endpoints: data only (numpy arrays included)
            except Exception as exc:
                ok, value = False, exc
            if tid in self._answered_early:  # a late reply: kept, never used (Flower's semantics)
                p = self._answered_early.pop(tid)
                if ok and isinstance(value, dict) and value.get("kind") == "flower-reply":
                    self.late_replies.append(decode_message(value["message"]))
                continue
            mid = wanted.get(tid)
            if mid is None:
                continue
            p = self._pending.pop(mid)
            if ok and isinstance(value, dict) and value.get("kind") == "flower-reply":
                data = value["message"]
                reply = decode_message(data)
                reply.metadata.__dict__["_message_id"] = reply.metadata.message_id or f"r-{mid}"
                self.bytes_in += len(data)
                rl = self._round(p.msg)
                rl.bytes_in += len(data)
                if isinstance(value.get("app_s"), (int, float)):
                    train = p.msg.metadata.message_type.startswith("train")
                    (rl.train_app_s if train else rl.eval_app_s)[p.endpoint] = float(value["app_s"])
            else:
                err = _short(value) if not ok else f"unexpected reply {type(value).__name__}"
                code = ErrorCode.MESSAGE_UNAVAILABLE if "expired" in err.lower() else ErrorCode.CLIENT_APP_CRASHED
                reply = self._error_reply(p.msg, code, err)
            self._note(p, reply)
            out.append(reply)
        # destinations the hub reports offline: an error reply now, as Flower's SuperLink gives
        left = [m for m in message_ids if m in self._pending]
        if left:
            online = self._online_now(max_age_s=self.poll_s)
            for mid in left:
                p = self._pending[mid]
                if not online.get(p.endpoint):
                    del self._pending[mid]
                    self._answered_early[p.task_id] = p
                    reply = self._error_reply(p.msg, ErrorCode.NODE_UNAVAILABLE, NODE_UNAVAILABLE_REASON)
                    self._note(p, reply)
                    out.append(reply)
        return out

    def _note(self, p: _Pending, reply: Message) -> None:
        rl = self._round(p.msg)
        train = p.msg.metadata.message_type.startswith("train")
        if reply.has_error():
            (rl.train_failed if train else rl.eval_failed)[p.endpoint] = str(reply.error.reason)[:500]
            self.last_errors[p.endpoint] = str(reply.error.reason)[:500]
        else:
            (rl.train_ok if train else rl.eval_ok)[p.endpoint] = _metrics(reply.content)
        rl.ended = time.time()

    def _after_round(self, sent: List[Message], replies: List[Message]) -> None:
        """Fail loudly: count training rounds in which every message failed with one error."""
        train = [m for m in sent if m.metadata.message_type.startswith("train")]
        if not train:
            return
        rl = self._round(train[0])
        if self.on_round is not None:
            self.on_round(rl)
        if any(not r.has_error() for r in replies):
            self.trained_rounds += 1
            self.failed_streak = 0
            return
        reasons = {str(r.error.reason) for r in replies if r.has_error()}
        if len(replies) == len(train) and len(reasons) == 1:
            self.failed_streak += 1
            if self.failed_streak >= self.max_failed_rounds:
                raise RunFailed(f"every client failed {self.failed_streak} training round(s) in a row with: {reasons.pop()}")
        else:
            self.failed_streak = 0
