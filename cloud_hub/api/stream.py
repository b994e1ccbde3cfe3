"""``/v1/stream``: one WebSocket between the SDK and the hub that carries submits and results.

Why: over REST every batch is a request (headers, auth, a new response) and results need a long
poll that is re-issued after each answer; on a 2-core box those hops were most of the SDK's share
of the warm round trip. The stream keeps one authenticated connection open and pushes each result
as soon as it is stored.

Durability is the REST path's, unchanged: a submit frame goes through the same ``accept`` (cloud_hub/service/submit.py) (same
validation, placement, idempotency key, one transaction) and is answered ``accepted`` only after
that transaction committed. Results are read from the store after the cursor the client names in
its ``hello``, so a reconnecting client gets everything it may have missed again (at least once);
the client drops repeats by task id. The frames are JSON text, the REST bodies in an envelope
(docs/protocol.md, "SDK stream"). A client that asks for early results (``hello.early``) gets a
result as soon as the agent's verified frame reaches the hub, before the hub's commit: the agent
keeps it until the hub acknowledges it after that commit, so nothing is lost if the hub dies.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from typing import Any

from fastapi import APIRouter, HTTPException, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from cloud_hub.api import _stream_wire as wire
from cloud_hub.api.errors import http_error
from cloud_hub.api.schemas import BatchIn
from cloud_hub.globus_auth import GlobusUnavailable
from cloud_hub.service.errors import ServiceError
from cloud_hub.service.hub import Hub
from cloud_hub.service.submit import accept
from cloud_hub.store import StoreFull
from mesh_agent import costs

__all__ = ["router", "STREAM_VERSION", "MAX_FRAME", "CLOSE_AUTH", "CLOSE_BAD_FRAME", "CLOSE_TRY_LATER"]

log = logging.getLogger("cloud_hub")

router = APIRouter()

STREAM_VERSION = 1
#: Largest frame the hub reads (uvicorn's default ``ws_max_size`` is 16 MiB); the client sends a
#: bigger batch over REST instead.
MAX_FRAME = 8 * 2**20
#: Close codes (4000-4999 are the application's): the reason says what to do.
CLOSE_AUTH = 4401
CLOSE_BAD_FRAME = 4400
#: An idle stream re-reads the store this often even without a wake-up (one indexed query).
_IDLE_REQUERY_S = 2.0
CLOSE_TRY_LATER = 1013  # RFC 6455 "try again later": Globus Auth unreachable, hub stopping
_RESULTS_PER_FRAME = 2000
#: How long an early-results stream goes on using what it read about an endpoint (owned by this user,
#: marked trusted) before reading it again: an owner who unmarks an endpoint is obeyed on every
#: open stream within this long (stored results read the flag at every fetch).
_TRUST_RECHECK_S = 5.0
_MAX_PLACED = 100_000  # tasks remembered per early-results stream (about 150 B each, 15 MB at most); past it, stored copies only


class _BadFrame(ValueError):
    """A frame that is not the protocol: the connection is closed with the reason."""


def _reason(text: str) -> str:
    """A close reason fits in 123 bytes of UTF-8."""
    b = text.encode()[:123]
    return b.decode("utf-8", "ignore")


def _token(ws: WebSocket) -> str | None:
    auth = ws.headers.get("authorization", "")
    scheme, _, cred = auth.partition(" ")
    return cred.strip() if scheme.lower() == "bearer" and cred.strip() else None


def _payload(msg: dict[str, Any], binary_ok: bool) -> tuple[str | bytes, str]:
    """A received frame's payload and its encoding: a text frame is JSON, a binary one msgpack
    (only after a hello that asked for it)."""
    text, data = msg.get("text"), msg.get("bytes")
    if text is None and (data is None or not binary_ok):
        raise _BadFrame('binary frames are not part of this protocol unless the hello asked for "enc": "msgpack": send JSON text frames')
    payload: str | bytes = text if text is not None else data  # type: ignore[assignment]
    if len(payload) > MAX_FRAME:
        raise _BadFrame(f"frame of {len(payload)} bytes is over the {MAX_FRAME}-byte limit: send big batches over REST")
    return payload, "json" if text is not None else "msgpack"


def _parse(payload: str | bytes, enc: str = "json") -> dict[str, Any]:
    try:
        msg = json.loads(payload) if enc == "json" else wire.parse_msgpack(payload)  # type: ignore[arg-type]
    except (ValueError, RecursionError) as exc:  # msgpack's errors are ValueErrors too; RecursionError: a JSON depth bomb
        raise _BadFrame(f"frame is not {'JSON' if enc == 'json' else 'msgpack'} ({str(exc)[:100]})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise _BadFrame('frame must be a JSON object with an "op"' if enc == "json" else 'frame must be a msgpack map with an "op"')
    return msg


@router.websocket("/v1/stream")
async def stream(ws: WebSocket) -> None:
    """Accept, authenticate with the REST API token (``Authorization: Bearer``), read ``hello``,
    then serve submits and push results until either side closes."""
    hub: Hub = ws.app.state.hub
    if not hub.cfg.stream:
        await ws.close(code=1008)  # a 403 to the handshake: the SDK falls back to REST
        return
    await ws.accept()
    token = _token(ws)
    if token is None:
        await ws.close(CLOSE_AUTH, "missing API token (Authorization: Bearer ...)")
        return
    try:
        user, why = await hub.auth(token)
    except GlobusUnavailable as exc:
        await ws.close(CLOSE_TRY_LATER, _reason(str(exc)))
        return
    if user is None:
        await ws.close(CLOSE_AUTH, _reason(f"the hub refused the token: {why}"))
        return
    conn = _Conn(hub, ws, user, token)
    try:
        await conn.run()
    except _BadFrame as exc:
        log.warning("stream of user %s closed: %s", user, exc)
        with contextlib.suppress(Exception):
            await conn.send({"op": "error", "detail": str(exc)})
            await ws.close(CLOSE_BAD_FRAME, _reason(str(exc)))
    except WebSocketDisconnect:
        pass


class _Conn:
    """One client's stream: a reader (submits, in order) and a pusher (results after the cursor)."""

    def __init__(self, hub: Hub, ws: WebSocket, user: str, token: str) -> None:
        self.hub, self.ws, self.user, self._token = hub, ws, user, token
        self._send_lock = asyncio.Lock()
        # Early results (see _early): where each task accepted here was placed, whether the user
        # owns each such endpoint and whether it is trusted for them (read again after
        # _TRUST_RECHECK_S), and the tasks whose result went out before it was stored.
        self._placed: dict[str, str] = {}
        self._own: dict[str, tuple[bool, bool]] = {}
        self._own_read = 0.0  # monotonic time _own was last read
        self._refreshing: asyncio.Task[None] | None = None
        self._early_done: set[str] = set()  # written to the socket; the stored copy is then not sent again
        self._sending: set[asyncio.Task[None]] = set()
        self._early_on = False
        self.enc = "json"  # what this hub sends: "msgpack" once the hello asked for it

    async def send(self, msg: dict[str, Any]) -> None:
        with costs.stage("hub.answer"):
            out = wire.encode(msg, self.enc)
        async with self._send_lock:
            await self._write(out)

    def _data(self, data: bytes) -> str | bytes:
        """A result's bytes as this stream carries them: raw in msgpack, base64 in JSON."""
        return bytes(data) if self.enc == "msgpack" else base64.b64encode(data).decode()

    async def _write(self, out: str | bytes) -> None:
        if isinstance(out, bytes):
            await self.ws.send_bytes(out)
        else:
            await self.ws.send_text(out)

    async def run(self) -> None:
        first = await self.ws.receive()
        if first["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(first.get("code", 1000))
        hello = _parse(*_payload(first, False))  # the hello is JSON text
        if hello["op"] != "hello":
            raise _BadFrame(f'the first frame must be "hello", not {hello["op"]!r}')
        after = hello.get("after")
        if after is None:
            after = await self.hub.store.last_result_seq(self.user)
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise _BadFrame('"after" must be a result cursor (an integer >= 0) or null')
        enc = hello.get("enc")  # an encoding this hub does not speak gets JSON text, as from a hub that predates "enc"
        enc = enc if enc in wire.ENCODINGS else "json"
        await self.send({"op": "welcome", "v": STREAM_VERSION, "cursor": after, "max_frame": MAX_FRAME,
                         "max_batch": self.hub.cfg.max_batch, "enc": enc})  # the welcome itself is JSON text
        self.enc = enc
        pusher = asyncio.create_task(self._push(after))
        if hello.get("early") is True:  # the client takes results before the hub stored them (see _early)
            self._early_on = True
            self.hub.bus.listen_early(self._early)
        try:
            await self._read()
        finally:
            self.hub.bus.unlisten_early(self._early)
            pusher.cancel()
            for t in [pusher, *self._sending, *([self._refreshing] if self._refreshing else [])]:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t

    async def _read(self) -> None:
        while True:
            msg = await self.ws.receive()
            if msg["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(msg.get("code", 1000))
            with costs.stage("hub.decode"):
                payload, enc = _payload(msg, self.enc == "msgpack")
                fast = wire.fast_submit(payload, enc)  # a plain batch, checked in one pass
                if fast is not None:
                    ref, batch = fast
                else:  # anything else is checked the pydantic way, which answers with REST's words
                    frame = _parse(payload, enc)
                    if frame["op"] != "submit":
                        raise _BadFrame(f'unknown op {frame["op"]!r} (expected "submit")')
                    ref = frame.get("ref")
                    if not isinstance(ref, int) or isinstance(ref, bool):
                        raise _BadFrame('a submit needs an integer "ref" to answer it by')
                    batch = frame.get("batch") if enc == "json" else wire.b64_batch(frame.get("batch"))
            # Each submit is authorized as a REST request would be (the token may have been
            # revoked since the handshake); cached, so this is a dictionary lookup.
            try:
                with costs.stage("hub.auth"):
                    uid, why = await self.hub.auth(self._token)
            except GlobusUnavailable as exc:  # neither good nor bad yet: REST answers 503, retried with the same key
                await self.send({"op": "refused", "ref": ref, "status": 503, "detail": str(exc), "retry_after": 5.0})
                continue
            if uid != self.user:
                await self.ws.close(CLOSE_AUTH, _reason(f"the hub refused the token: {why}"))
                return
            answer = await self._submit(ref, batch)
            await self.send(answer)
            if answer["op"] == "accepted":
                await self._placed_on(answer["task_ids"], answer["endpoint_ids"])

    async def _submit(self, ref: int, batch: Any) -> dict[str, Any]:
        """The REST batch submit, answered as a frame; a refusal names the HTTP status it would have had.
        ``batch`` is a :class:`BatchIn` already checked (``wire.fast_submit``) or the frame's value."""
        from cloud_hub.api.task_groups import checked_functions

        h, cfg = self.hub, self.hub.cfg
        try:
            with costs.stage("hub.decode"):
                body = batch if isinstance(batch, BatchIn) else BatchIn.model_validate(batch)
                if len(body.tasks) > cfg.max_batch:
                    raise HTTPException(413, f"batch of {len(body.tasks)} tasks exceeds the limit of {cfg.max_batch}")
                if any(t.idempotency_key is not None for t in body.tasks):
                    raise HTTPException(422, "idempotency_key belongs on the batch, not on its tasks")
                functions = checked_functions(h, body.functions)
            ids, eps = await accept(h, self.user, body.tasks, body.idempotency_key, functions=functions, group=body.task_group_id)
        except ValidationError as exc:
            return {"op": "refused", "ref": ref, "status": 422, "detail": _validation_detail(exc)}
        except (HTTPException, ServiceError) as exc:
            http = http_error(exc) if isinstance(exc, ServiceError) else exc  # the answer REST would give
            out = {"op": "refused", "ref": ref, "status": http.status_code, "detail": str(http.detail)}
            retry = (http.headers or {}).get("Retry-After")
            if retry is not None:  # 429 at a queue bound: when to send the same batch (same key) again
                out["retry_after"] = float(retry)
            return out
        except StoreFull as exc:
            log.error("refused a streamed submit: %s", exc)
            return {"op": "refused", "ref": ref, "status": 507, "detail": str(exc)}
        return {"op": "accepted", "ref": ref, "task_ids": ids, "endpoint_ids": eps}

    async def _placed_on(self, ids: list[str], eps: list[str | None]) -> None:
        """Remember where these tasks run, so their results can go out as they arrive (``_early``)."""
        if not self._early_on:
            return
        if len(self._placed) < _MAX_PLACED:
            self._placed.update((t, e) for t, e in zip(ids, eps) if e)
        stale = time.monotonic() - self._own_read > _TRUST_RECHECK_S
        new = {e for e in eps if e and (stale or e not in self._own)}
        if new:
            await self._read_trust(new)

    async def _read_trust(self, eps: set[str]) -> None:
        """Read (again) whether this user owns these endpoints and marked them trusted; when what
        was read before is stale, every endpoint known so far is read again with them."""
        trusted_for = getattr(self.hub.store, "trusted_for", None)
        if trusted_for is None:
            return
        now = time.monotonic()
        if now - self._own_read > _TRUST_RECHECK_S:
            eps = eps | set(self._own)
            self._own.clear()  # unknown until read again: their results wait for the stored copy
        self._own.update(await trusted_for(self.user, eps))
        self._own_read = now

    def _refresh_trust(self) -> None:
        """From ``_early`` (not a coroutine): read the flags again in the background, once."""
        if self._refreshing is None or self._refreshing.done():
            t = self._refreshing = asyncio.get_running_loop().create_task(self._read_trust(set(self._own)))
            t.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failed read: tried again next time

    def _early(self, endpoint_id: str, results: list[dict[str, Any]]) -> None:
        """Results an agent just sent (frame verified), before the hub stores them: those of tasks
        accepted on this stream and placed on that endpoint go out now, which takes the hub's
        result commit and a read off the round trip. The stored copy follows as usual and is not
        sent again (only the cursor moves). If the hub dies first, the agent, which keeps every
        result until the hub acknowledges it after the commit, sends it again; the SDK drops the
        repeat. A task re-placed elsewhere since, or an endpoint whose owner is not known yet,
        waits for the stored copy."""
        known = self._own.get(endpoint_id)
        if known is None:
            return
        if time.monotonic() - self._own_read > _TRUST_RECHECK_S:
            self._refresh_trust()  # these go out once stored; later ones early again
            return
        own, trusted = known
        rows = []
        for r in results:
            tid, data = r.get("id"), r.get("data")
            if self._placed.get(tid) != endpoint_id or not isinstance(data, (bytes, bytearray)):  # type: ignore[arg-type]
                continue
            del self._placed[tid]  # type: ignore[arg-type]
            rows.append({"task_id": tid, "ok": bool(r.get("ok")), "data": self._data(data), "started": r.get("started"),
                         "finished": r.get("finished"), "endpoint_id": endpoint_id, "own_endpoint": own, "trusted": trusted})
        if rows:
            self.hub.dispatcher.stats["stream_results_early"] = self.hub.dispatcher.stats.get("stream_results_early", 0) + len(rows)
            t = asyncio.get_running_loop().create_task(self._send_early(rows))
            self._sending.add(t)
            t.add_done_callback(self._sending.discard)

    async def _send_early(self, rows: list[dict[str, Any]]) -> None:
        out = wire.encode({"op": "results", "results": rows}, self.enc)
        async with self._send_lock:
            try:
                await self._write(out)
            except Exception:  # a closed stream: the SDK gets them from the store after it reconnects
                return
            if len(self._early_done) > _MAX_PLACED:  # stored copies that never came (the hub refused them): forget
                self._early_done.clear()
            self._early_done.update(r["task_id"] for r in rows)

    async def _send_stored(self, cursor: int, rows: list[dict[str, Any]]) -> None:
        """Stored results up to ``cursor``, but not those already written early on this socket:
        decided under the send lock, so the cursor never passes a result the SDK may lack (a
        frame written before this one arrives before it, or neither arrives)."""
        async with self._send_lock:
            with costs.stage("hub.push"):
                out = [_row(r, self._data(r["data"] or b"")) for r in rows if r["task_id"] not in self._early_done]
                if self._early_on:
                    for r in rows:  # stored: never early any more (a task re-placed elsewhere, a result via another replica)
                        self._early_done.discard(r["task_id"])
                        self._placed.pop(r["task_id"], None)
                frame = wire.encode({"op": "results", "cursor": cursor, "results": out}, self.enc)
            await self._write(frame)

    async def _push(self, cursor: int) -> None:
        """Every result of the user after ``cursor``, as soon as it is stored (woken by the result bus)."""
        h = self.hub
        box = h.bus.inbox(self.user)
        try:
            while True:
                ev = h.bus.event(self.user)  # before the query: a result stored in between sets it
                rows = box.take(cursor)  # sent from memory when the dispatcher handed them over whole
                if rows is None:
                    rows = await h.store.results_after(self.user, cursor, _RESULTS_PER_FRAME)
                if rows:
                    fitted = _fit(rows)
                    cursor = fitted[-1]["seq"]
                    await self._send_stored(cursor, fitted)
                    if len(rows) >= _RESULTS_PER_FRAME or len(fitted) < len(rows):
                        box.stale = True  # the rest is read from the store
                        continue  # more are stored already
                    # That was all: no second read to find nothing (one DB hop per round trip less);
                    # a result stored since has set ``ev``.
                # Bounded: a wake-up that comes before the stored rows are visible to this read (or a
                # store path that never notifies) costs at most this long, never a stuck stream.
                try:
                    await asyncio.wait_for(ev.wait(), _IDLE_REQUERY_S)
                except asyncio.TimeoutError:
                    box.stale = True  # the store is read again: a path that stored without telling
        except (asyncio.CancelledError, WebSocketDisconnect):
            raise
        except Exception as exc:  # the store failed: close, the client reconnects and resumes from its cursor
            log.error("result stream of user %s stopped: %s", self.user, exc)
            with contextlib.suppress(Exception):
                await self.ws.close(1011, _reason(f"hub error while reading results: {exc}"))
        finally:
            h.bus.drop_inbox(self.user, box)


def _row(r: dict[str, Any], data: str | bytes | None = None) -> dict[str, Any]:
    """A result row as REST's ``ResultOut`` has it, built directly (a model per row costs more than
    the rest of the frame on a busy stream); ``data``: raw bytes on a msgpack stream, else base64 text."""
    if data is None:
        data = base64.b64encode(r["data"] or b"").decode()
    return {"task_id": r["task_id"], "ok": bool(r["ok"]), "data": data, "started": r["started"],
            "finished": r["finished"], "endpoint_id": r.get("endpoint_id"), "own_endpoint": bool(r.get("own_endpoint", False)),
            "trusted": bool(r.get("trusted", False))}


def _fit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first rows whose data fits in a quarter of ``MAX_FRAME`` (base64 adds a third), at least one."""
    total = 0
    for i, r in enumerate(rows):
        total += len(r["data"] or b"") + 200
        if total > MAX_FRAME // 4 and i:
            return rows[:i]
    return rows


def _validation_detail(exc: ValidationError) -> str:
    errs = exc.errors(include_url=False)
    first = errs[0] if errs else {}
    where = ".".join(str(x) for x in first.get("loc", ()))
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"batch.{where}: {first.get('msg', 'invalid')}{more}" if where else f"batch: {first.get('msg', 'invalid')}{more}"
