"""The console's routes, under ``/console``: sign-in, pages, the live event stream, static assets.

Every page and the stream need a signed-in session (``sessions.py``); pages redirect to the
sign-in form, the stream and live page refreshes answer 401. Every query is scoped to the
signed-in user, so another user's endpoint or task is a plain 404. POSTs (sign in, sign out)
check the Origin header when the browser sends one, and sign-out checks a per-session form
token, on top of the SameSite=Strict cookie.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import quote, urlparse

from fastapi import APIRouter, Depends, Form, HTTPException, Request
from starlette.responses import RedirectResponse, Response, StreamingResponse

from cloud_hub.console import capacity, charts, queries
from cloud_hub.console.blobs import describe_result
from cloud_hub.console.live import BUCKET_S, Live, TooManyStreams, endpoint_view
from cloud_hub.console.optional import OPTIONAL_PAGES, Helpers, add_routes, optional_extras
from cloud_hub.console.sessions import COOKIE, SESSION_TTL_S, Session, close_session, csrf_token, find_session, open_session
from cloud_hub.console.views import HERE, fmt_duration, render, secure
from cloud_hub.store.availability import events_between
from cloud_hub.store.console import recent_transitions

if TYPE_CHECKING:
    from cloud_hub.service.hub import Hub

__all__ = ["router"]

router = APIRouter(prefix="/console", include_in_schema=False)

LIVE_HEADER = "X-Console-Live"
_MAX_TOKEN_CHARS = 512
_PAGE = 50
_WINDOWS = {"1h": 3600.0, "24h": 86400.0, "7d": 7 * 86400.0}
_MIN_WINDOW_S = 60.0

_STATIC_TYPES = {"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8", "favicon.svg": "image/svg+xml"}
_STATIC = {name: (HERE / "static" / name).read_bytes() for name in _STATIC_TYPES}
_STATIC_V = {name: hashlib.sha256(body).hexdigest()[:10] for name, body in _STATIC.items()}


# ---------------------------------------------------------------------- plumbing
def _hub(request: Request) -> "Hub":
    return request.app.state.hub  # type: ignore[no-any-return]


def _live(request: Request) -> Live:
    live = getattr(request.app.state, "console_live", None)
    if live is None:
        live = request.app.state.console_live = Live(_hub(request), optional_extras())
    return live  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Viewer:
    session: Session
    sid: str

    @property
    def user_id(self) -> str:
        return self.session.user_id

    @property
    def csrf(self) -> str:
        return csrf_token(self.sid)


async def _viewer_or_none(request: Request) -> Viewer | None:
    sid = request.cookies.get(COOKIE)
    sess = await find_session(_hub(request).store, sid)
    return Viewer(sess, sid) if sess and sid else None


async def _page_viewer(request: Request) -> Viewer:
    v = await _viewer_or_none(request)
    if v is not None:
        return v
    if request.headers.get(LIVE_HEADER):
        raise HTTPException(401, "sign in to the console")
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    raise HTTPException(303, "sign in to the console", headers={"Location": f"/console/login?next={quote(target, safe='')}"})


ViewerDep = Annotated[Viewer, Depends(_page_viewer)]


def _same_origin(request: Request) -> bool:
    """A cross-site form post (login CSRF) carries another site's Origin; browsers always send
    Origin on POST, so a mismatch is refused. No Origin at all (curl, old clients) is allowed."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return origin != "null" and urlparse(origin).netloc == request.headers.get("host", "")


def _safe_next(target: str | None) -> str:
    """Only our own pages: no scheme, no host, no protocol-relative ``//evil``."""
    if not target or not target.startswith("/console") or target.startswith("//") or "\\" in target:
        return "/console"
    return target


async def _ctx(request: Request, viewer: Viewer, active: str, title: str, **extra: Any) -> dict[str, Any]:
    snap = await _live(request).snapshot(viewer.user_id)
    nav = [("overview", "/console", "Overview"), ("endpoints", "/console/endpoints", "Endpoints"),
           ("tasks", "/console/tasks", "Tasks"), ("functions", "/console/functions", "Functions")]
    for page in OPTIONAL_PAGES:
        if snap["extra"].get(page.key, {}).get("count"):
            nav.append((page.key, page.href, page.label))
    return {
        "request": request, "viewer": viewer, "user": viewer.session.user_name, "csrf": viewer.csrf, "active": active,
        "title": title, "nav": nav, "snap": snap, "static": _static_url, **extra,
    }


def _static_url(name: str) -> str:
    return f"/console/static/{name}?v={_STATIC_V[name]}"


def _bad_request(request: Request, viewer: Viewer | None, message: str, status: int = 400) -> Response:
    return render("error.html", status, title="Bad request" if status == 400 else "Not found", message=message,
                  user=viewer.session.user_name if viewer else None, csrf=viewer.csrf if viewer else "",
                  nav=[], active="", static=_static_url, snap=None)


# ---------------------------------------------------------------------- sign in / out
def _login_page(status: int, next: str | None, error: str | None) -> Response:
    return render("login.html", status, title="Sign in", next=_safe_next(next), error=error, static=_static_url, nav=[], snap=None)


@router.get("/login")
async def login_form(request: Request, next: str | None = None) -> Response:
    if await _viewer_or_none(request) is not None:
        return secure(RedirectResponse(_safe_next(next), 303))
    return _login_page(200, next, None)


@router.post("/login")
async def login(request: Request, token: Annotated[str, Form()] = "", next: Annotated[str, Form()] = "/console") -> Response:
    if not _same_origin(request):
        return _login_page(403, "/console", "Sign-in refused: the form was posted from another site.")
    token = token.strip()
    if not token:
        return _login_page(422, _safe_next(next), "Enter an API token.")
    if len(token) > _MAX_TOKEN_CHARS:
        return _login_page(422, _safe_next(next), "That is not an API token (too long).")
    hub = _hub(request)
    uid = await hub.store.user_for_token(token)
    if uid is None:
        return _login_page(401, _safe_next(next), "Unknown or revoked API token.")
    sid = await open_session(hub.store, uid, token)
    resp = RedirectResponse(_safe_next(next), 303)
    resp.set_cookie(COOKIE, sid, max_age=int(SESSION_TTL_S), path="/console", httponly=True, samesite="strict",
                    secure=request.url.scheme == "https")
    return secure(resp)


@router.post("/logout")
async def logout(request: Request, csrf: Annotated[str, Form()] = "") -> Response:
    v = await _viewer_or_none(request)
    if v is not None:
        if not _same_origin(request) or csrf != v.csrf:
            return _bad_request(request, v, "Sign-out refused: stale or foreign form. Reload the page and try again.", 403)
        await close_session(_hub(request).store, v.sid)
    resp = RedirectResponse("/console/login", 303)
    resp.delete_cookie(COOKIE, path="/console", httponly=True, samesite="strict")
    return secure(resp)


# ---------------------------------------------------------------------- live stream
@router.get("/events")
async def events(request: Request) -> Response:
    v = await _viewer_or_none(request)
    if v is None:
        return secure(Response("sign in to the console\n", 401, media_type="text/plain"))
    store = _hub(request).store
    sid = v.sid

    async def still_valid() -> bool:
        return await find_session(store, sid) is not None

    try:
        body = _live(request).open(v.session.hash, v.user_id, still_valid)
    except TooManyStreams as exc:
        return secure(Response(f"{exc}\n", 503, media_type="text/plain", headers={"Retry-After": "30"}))
    resp = StreamingResponse(body, media_type="text/event-stream", headers={"X-Accel-Buffering": "no"})
    return secure(resp)


# ---------------------------------------------------------------------- static assets
@router.get("/static/{name}")
async def static(name: str) -> Response:
    if name not in _STATIC:
        raise HTTPException(404, "no such asset")
    resp = Response(_STATIC[name], media_type=_STATIC_TYPES[name], headers={"Cache-Control": "public, max-age=86400"})
    return secure(resp, cache=True)


# ---------------------------------------------------------------------- pages
@router.get("")
@router.get("/")
async def overview(request: Request, viewer: ViewerDep) -> Response:
    ctx = await _ctx(request, viewer, "overview", "Overview")
    snap = ctx["snap"]
    hub = _hub(request)
    recent = await hub.store.read_parallel(lambda db: queries.list_tasks(db, viewer.user_id, limit=8))
    failures = await hub.store.read_parallel(lambda db: queries.list_tasks(db, viewer.user_id, state="failed", limit=5))
    chart = charts.throughput_chart(snap["throughput"], BUCKET_S)
    return render("overview.html", **ctx, recent=recent, failures=failures, chart=chart)


async def _endpoint_rows(request: Request, viewer: Viewer, endpoint_id: str | None, window: float) -> tuple[list[dict[str, Any]], float, float]:
    """Endpoints with live state and an availability timeline. The window starts no earlier
    than the oldest endpoint's enrollment (at least a minute back), so a young fleet's timeline
    is not a grey bar with a sliver of colour at the end."""
    hub = _hub(request)
    now = time.time()
    rows = await hub.store.list_endpoints(user_id=viewer.user_id, endpoint_id=endpoint_id)
    start = min(max(now - window, min((e["created"] for e in rows), default=now)), now - _MIN_WINDOW_S)
    ids = [e["id"] for e in rows]
    evs = await hub.store.read_parallel(events_between, ids, start, now)
    for e in rows:
        e["online"], e["info"], e["last_seen"] = endpoint_view(hub, e)
        segs = charts.segments(evs.get(e["id"], []), start, now, e["created"], e["online"])
        e["timeline"] = charts.timeline(segs, start, now, f"availability of {e['name']}")
        e["uptime"] = charts.uptime(segs)
        e["segments"] = segs
    return rows, start, now


@router.get("/endpoints")
async def endpoints(request: Request, viewer: ViewerDep) -> Response:
    ctx = await _ctx(request, viewer, "endpoints", "Endpoints")
    rows, start, end = await _endpoint_rows(request, viewer, None, 3600.0)
    label = "last hour" if end - start >= 3599 else f"last {fmt_duration(end - start)}"
    return render("endpoints.html", **ctx, endpoints=rows, window_label=label)


@router.get("/endpoints/{endpoint_id}")
async def endpoint_detail(request: Request, viewer: ViewerDep, endpoint_id: str, window: str = "1h") -> Response:
    if window not in _WINDOWS:
        return _bad_request(request, viewer, f"unknown window {window!r}: use one of {', '.join(_WINDOWS)}")
    rows, start, end = await _endpoint_rows(request, viewer, endpoint_id, _WINDOWS[window])
    if not rows:
        return _bad_request(request, viewer, f"no endpoint {endpoint_id} among yours", 404)
    e = rows[0]
    hub = _hub(request)
    transitions = await hub.store.read_parallel(recent_transitions, endpoint_id)
    recent = await hub.store.read_parallel(lambda db: queries.list_tasks(db, viewer.user_id, endpoint_id=endpoint_id, limit=15))
    _, fns = await hub.store.read_parallel(queries.names, viewer.user_id)
    fn_names = dict(fns)
    warm = [(f, fn_names.get(f, f)) for f in (e["info"].get("warm") or [])]
    site = await _site_view(request, viewer, e)
    # Predicted capacity per function: workers x measured rate (cloud_hub/console/capacity.py)
    rates = await hub.store.read_parallel(capacity.function_rates, viewer.user_id, endpoint_id, time.time() - capacity.WINDOW_S)
    workers = e["info"].get("capacity")
    cap = capacity.predicted_capacity(rates, workers if isinstance(workers, int) else None, e["info"].get("warm"))
    ctx = await _ctx(request, viewer, "endpoints", e["name"])
    return render("endpoint.html", **ctx, e=e, transitions=transitions, recent=recent, warm=warm, window=window,
                  windows=list(_WINDOWS), windows_s=_WINDOWS, start=start, end=end, site=site, capacity=cap)


async def _site_view(request: Request, viewer: Viewer, e: dict[str, Any]) -> dict[str, Any] | None:
    """A site gateway's page (docs/sites.md): its devices and their state, the uplink's state (the
    gateway's own session) and the frame bytes per day that cross it (the gateway's and all its
    devices'); a device's page: the gateway that serves it."""
    hub = _hub(request)
    disp = hub.dispatcher
    gw = disp.gateway_of(e["id"])
    if gw is not None:
        return {"gateway": gw}
    devices = set(disp.site_devices(e["id"]))
    if not devices and not (e.get("info") or {}).get("site"):
        return None
    rows = [r for r in await hub.store.list_endpoints(user_id=viewer.user_id) if r["id"] in devices]
    nodes = hub.placement.sched.fleet.nodes if getattr(hub, "placement", None) is not None else {}
    for r in rows:
        r["online"], r["info"], r["last_seen"] = endpoint_view(hub, r)
        # the scheduler's view (scheduler/availability.py): with the uplink down, a device the hub
        # cannot hear may still be working on what its gateway holds
        avail = getattr(nodes.get(r["id"]), "avail", None)
        r["site_state"] = avail.state() if hasattr(avail, "state") else None
    up = down = 0.0
    for ep in [e["id"], *devices]:
        b = disp.bytes_per_day(ep)
        if b is not None:
            up, down = up + b["in"], down + b["out"]
    return {"devices": rows, "uplink_online": e["online"], "bytes_per_day": {"up": round(up), "down": round(down)},
            "hold": ((e.get("info") or {}).get("site") or {}).get("hold")}


@router.get("/tasks")
async def tasks(request: Request, viewer: ViewerDep, state: str | None = None, endpoint: str | None = None,
                function: str | None = None, before: str | None = None) -> Response:
    state, endpoint, function = state or None, endpoint or None, function or None
    if state is not None and state not in queries.STATES:
        return _bad_request(request, viewer, f"unknown task state {state!r}: use one of {', '.join(queries.STATES)}")
    cursor: int | None = None
    if before:
        if not before.isdigit() or len(before) > 18:
            return _bad_request(request, viewer, f"bad page cursor {before!r}")
        cursor = int(before)
    hub = _hub(request)
    rows = await hub.store.read_parallel(lambda db: queries.list_tasks(db, viewer.user_id, state=state, endpoint_id=endpoint,
                                                               function_id=function, before=cursor, limit=_PAGE + 1))
    more = len(rows) > _PAGE
    rows = rows[:_PAGE]
    eps, fns = await hub.store.read_parallel(queries.names, viewer.user_id)
    ctx = await _ctx(request, viewer, "tasks", "Tasks")
    filters = {"state": state or "", "endpoint": endpoint or "", "function": function or ""}
    next_cursor = rows[-1]["rowid"] if more and rows else None
    return render("tasks.html", **ctx, tasks=rows, filters=filters, eps=eps, fns=fns, next_cursor=next_cursor,
                  paged=cursor is not None, states=list(queries.STATES), qs=_qs)


def _qs(filters: dict[str, str], **change: Any) -> str:
    merged = {**filters, **{k: ("" if v is None else str(v)) for k, v in change.items()}}
    parts = [f"{k}={quote(v, safe='')}" for k, v in merged.items() if v]
    return "?" + "&".join(parts) if parts else ""


@router.get("/tasks/{task_id}")
async def task_detail(request: Request, viewer: ViewerDep, task_id: str) -> Response:
    hub = _hub(request)
    t = await hub.store.read_parallel(queries.task_detail, viewer.user_id, task_id)
    if t is None:
        return _bad_request(request, viewer, f"no task {task_id} among yours (results are kept for {hub.cfg.result_ttl_s / 86400:g} days)", 404)
    res = describe_result(None if t["ok"] is None else bool(t["ok"]), t.pop("data"))
    hops = _hops(t)
    ctx = await _ctx(request, viewer, "tasks", f"Task {task_id[:12]}")
    return render("task.html", **ctx, t=t, res=res, hops=hops)


def _hops(t: dict[str, Any]) -> list[dict[str, Any]]:
    """Each hop of a task with its time, the gap since the previous hop, and a waterfall bar."""
    names = [
        ("created", "accepted by the hub", "hub"), ("dispatched", "sent to the endpoint", "hub"),
        ("acked", "stored on the device (ack)", "hub"), ("started", "started running", "device"),
        ("finished", "finished running", "device"), ("received", "result stored at the hub", "hub"),
    ]
    t0 = t["created"]
    last = max((t[k] for k, _, _ in names if t.get(k) is not None), default=t0)
    total = max(last - t0, 1e-6)
    out = []
    prev = None
    for key, label, where in names:
        at = t.get(key)
        out.append({
            "key": key, "label": label, "where": where, "at": at,
            "delta": (at - prev) if at is not None and prev is not None else None,
            "bar": charts.hop_bar(t0, total, prev if prev is not None else t0, at, key) if at is not None else charts.hop_bar(t0, total, None, None, key),
        })
        if at is not None:
            prev = at
    return out


@router.get("/functions")
async def functions(request: Request, viewer: ViewerDep) -> Response:
    hub = _hub(request)
    rows = await hub.store.read_parallel(queries.function_stats, viewer.user_id)
    memo = await hub.store.read_parallel(capacity.memo_counts, viewer.user_id)  # cache hits and misses (cache=True)
    for f in rows:
        f["cache_hits"], f["cache_misses"] = memo.get(f["id"], (0, 0))
    ctx = await _ctx(request, viewer, "functions", "Functions")
    return render("functions.html", **ctx, functions=rows, memo=bool(memo))


# Optional pages (scheduler, FL) add their routes to this router; see cloud_hub.console.optional.
add_routes(router, Helpers(ctx=_ctx, page_viewer=_page_viewer, bad_request=_bad_request, hub=_hub))
