"""Thin, typed wrapper over the hub's REST API (httpx, keep-alive, bearer token)."""

from __future__ import annotations

import base64
import ssl
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import httpx

from cloud_hub.client._fl import FLRunsMixin
from mesh_agent.protocol import function_id, serialize, serialize_function

__all__ = ["Client", "EnrollmentToken", "HubError", "HubUnreachable", "NotAHub", "AuthError", "EndpointSelector", "selector",
           "constraints_spec"]

#: Where a task may run: an endpoint id, ``"auto"``, a list of ids, or ``{"tags": [...]}``.
EndpointSelector = str | Sequence[str] | dict[str, Any]


class HubError(RuntimeError):
    """The hub refused a request; ``status`` is the HTTP code and the message its explanation."""

    def __init__(self, status: int, detail: str, retry_after: float | None = None) -> None:
        super().__init__(f"hub answered {status}: {detail}")
        self.status = status
        self.detail = detail
        #: Seconds the hub asked us to wait (``Retry-After`` of a 429 or 503), or None.
        self.retry_after = retry_after


class AuthError(HubError):
    """401: the token is wrong, expired or revoked."""


def refused_token_line(url: str, detail: str, source: str) -> str:
    """The hub's reason (``API token tk_... expired at ...``, ``... was revoked at ...``, ``invalid
    API token``) turned into what the user does next."""
    if " expired at " in detail or " was revoked at " in detail:
        why = "it expired" if " expired at " in detail else "it was revoked"
        return (f"the hub at {url} refused the token: {detail}; {why}, so ask the hub's operator for a new one "
                f"(`mesh-hub token create`) and run `mesh-hub login --url {url}` with it, or set MESH_TOKEN (token from {source})")
    return (f"the hub at {url} refused the token ({detail}); check it, or run `mesh-hub login --url {url}` with a good one, "
            f"or set MESH_TOKEN (token from {source})")


class NotAHub(HubError):
    """The URL answers HTTP, but not like a Continuum Mesh hub (a wrong port or path)."""


class HubUnreachable(ConnectionError):
    """No answer from the hub: a wrong URL, the hub restarting, or a dropped link. The Executor
    retries these within ``submit_timeout_s``; a plain :class:`Client` call raises at once."""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def selector(endpoint: EndpointSelector) -> str | list[str] | dict[str, list[str]]:
    """Check an endpoint selector locally (clear errors before any request) and return its JSON form."""
    if isinstance(endpoint, str):
        if not endpoint:
            raise ValueError("endpoint must not be empty: an endpoint id, 'auto', a list of ids or {'tags': [...]}")
        return endpoint
    if isinstance(endpoint, dict):
        if set(endpoint) != {"tags"}:
            raise ValueError(f"a tag selector is {{'tags': [...]}}, got keys {sorted(endpoint)}")
        tags = endpoint["tags"]
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags) or not tags:
            raise ValueError("{'tags': [...]} needs a non-empty list of tag strings")
        return {"tags": list(tags)}
    if isinstance(endpoint, (list, tuple, set, frozenset)):
        ids = list(endpoint)
        if not ids or not all(isinstance(e, str) and e for e in ids):
            raise ValueError("an endpoint list needs one or more endpoint id strings")
        return ids
    raise TypeError(f"endpoint must be an id, 'auto', a list of ids or {{'tags': [...]}}, not {type(endpoint).__name__}")


def constraints_spec(constraints: dict[str, Any] | None) -> dict[str, Any] | None:
    """Check function-level constraints (``tags``, ``gpu``, ``min_memory_mb``) locally."""
    if constraints is None:
        return None
    unknown = set(constraints) - {"tags", "gpu", "min_memory_mb"}
    if unknown:
        raise ValueError(f"unknown constraint(s) {sorted(unknown)}; use tags, gpu, min_memory_mb")
    out = dict(constraints)
    if "tags" in out:
        if isinstance(out["tags"], str):
            raise ValueError("constraints tags must be a list of strings")
        out["tags"] = list(out["tags"])
    return out


class EnrollmentToken(str):
    """An enrollment token (a ``str``, as before) that also carries what a device needs to trust the hub:
    ``ca_hash`` (``sha256:...`` of the hub's CA, for ``mesh-agent init --ca-hash``) and ``broker_url``."""

    ca_hash: str | None = None
    broker_url: str | None = None

    def __new__(cls, token: str, ca_hash: str | None = None, broker_url: str | None = None) -> "EnrollmentToken":
        self = super().__new__(cls, token)
        self.ca_hash, self.broker_url = ca_hash, broker_url
        return self


def _verify(verify: "str | Path | bool | ssl.SSLContext | None") -> "bool | ssl.SSLContext":
    """A CA file path becomes a context trusting only that CA (hostname checked); None/True: system CAs."""
    if verify is None or isinstance(verify, (bool, ssl.SSLContext)):
        return True if verify is None else verify
    from mesh_agent.tls import client_context

    return client_context(verify)


class Client(FLRunsMixin):
    """The hub's REST API. ``Client()`` alone reads ``MESH_HUB_URL`` / ``MESH_TOKEN`` or the
    profile ``mesh-hub login`` saved (``profile=`` or ``MESH_PROFILE`` picks one); no request is
    made until the first call."""

    def __init__(self, url: str | None = None, token: str | None = None, *, profile: str | None = None, timeout: float = 60.0,
                 verify: "str | Path | bool | ssl.SSLContext | None" = None, trusted_endpoints: Iterable[str] = ()) -> None:
        """``verify``: for an https:// hub with a private CA, the CA file (``mesh-hub tls init``'s ca.pem).

        ``trusted_endpoints``: endpoints whose results may be unpickled here (another user's
        endpoint shared with you, or one of yours). Results from your own endpoints are unpickled
        when you marked them trusted (:meth:`set_endpoint_trusted`); from any other endpoint only
        data is decoded (JSON; pickles of plain containers, numbers, strings, complex and numpy
        arrays), since unpickling anything else runs the sender's code here."""
        from cloud_hub.client._config import resolve

        self.trusted_endpoints: set[str] = set(trusted_endpoints)

        settings = resolve(url, token, profile)
        self.url = settings.url
        self.config_source = settings.source
        self._token = settings.token  # also for the WebSocket stream (cloud_hub/client/_stream.py)
        self._tls = _verify(verify if verify is not None else settings.ca_file)
        self.timeout = timeout
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {settings.token}"},
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_keepalive_connections=8),
            verify=self._tls,
        )
        self._fids: "weakref.WeakKeyDictionary[Callable[..., Any], tuple[str, bytes]]" = weakref.WeakKeyDictionary()
        self._bodies = _BodyCache()
        self._known: set[str] = set()  # function ids the hub has (registered, or accepted with a batch)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.ConnectError as exc:
            from mesh_agent.tls import TlsHandshakeError, describe_tls_error

            line = describe_tls_error(exc, self.url)
            if line:
                raise TlsHandshakeError(line) from None
            raise HubUnreachable(f"cannot reach the hub at {self.url} ({_reason(exc)}): is `mesh-hub serve` running there? "
                                 f"(URL from {self.config_source})") from None
        except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise HubUnreachable(f"lost the link to the hub at {self.url} during {method} {path} ({_reason(exc)})") from None
        is_json = r.headers.get("content-type", "").startswith("application/json")
        if r.status_code >= 400:
            if not is_json and r.status_code not in (502, 503, 504):
                raise NotAHub(r.status_code, f"{self.url} does not answer like a Continuum Mesh hub ({method} {path}: "
                                             f"{r.status_code} {r.headers.get('content-type') or 'no content type'}); check the URL "
                                             f"(from {self.config_source})")
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            detail = detail if isinstance(detail, str) else str(detail)
            if r.status_code == 404 and detail == "Not Found":  # the framework's own 404: no such route here
                raise NotAHub(404, f"{self.url} does not answer like a Continuum Mesh hub ({method} {path}: no such route); "
                                   f"check the URL (from {self.config_source})")
            if r.status_code == 401:
                raise self.auth_error(detail)
            raise HubError(r.status_code, detail, _retry_after(r.headers.get("retry-after")))
        if r.content and not is_json:
            raise NotAHub(r.status_code, f"{self.url} does not answer like a Continuum Mesh hub ({method} {path} answered "
                                         f"{r.headers.get('content-type') or 'no content type'}); check the URL (from {self.config_source})")
        return r.json() if r.content else None

    def auth_error(self, detail: str) -> "AuthError":
        """One line for a refused token: which way it is bad (unknown, expired, revoked) and what to do."""
        return AuthError(401, refused_token_line(self.url, detail, self.config_source))

    # ---------------------------------------------------------------- functions
    def function_body(self, fn: Callable[..., Any]) -> tuple[str, bytes]:
        """``(function id, serialized body)`` without any request. Cached per function object and,
        for a fresh lambda or closure over plain values (the closure-in-a-loop pattern), per code
        and captured values, so the same body is not serialized again."""
        try:
            cached = self._fids.get(fn)
        except TypeError:  # not weak-referenceable (builtins): no per-object cache
            cached = None
        if cached:
            return cached
        key = _reuse_key(fn)
        out = self._bodies.get(key) if key is not None else None
        if out is None:
            body = serialize_function(fn)
            out = (function_id(body), body)
            if key is not None:
                self._bodies.put(key, out)
        try:
            self._fids[fn] = out
        except TypeError:
            pass
        return out

    def knows(self, fid: str) -> bool:
        """Whether the hub has this body already (registered or sent with an accepted batch)."""
        return fid in self._known

    def forget(self, fids: Iterable[str]) -> None:
        """The hub said it does not know these (a new database): send their bodies again."""
        with self._lock:
            self._known.difference_update(fids)

    def register_function(self, fn: Callable[..., Any], name: str | None = None) -> str:
        """Register (idempotently) and return the function id, the hash of its serialized body.
        One request per distinct body in this client's life; later calls answer from the cache."""
        fid, body = self.function_body(fn)
        if fid in self._known:
            return fid
        got = self.request("POST", "/v1/functions", json={"name": name or getattr(fn, "__name__", "function"), "body": _b64(body)})["function_id"]
        if got != fid:
            raise HubError(500, f"the hub computed function id {got} for a body whose SHA-256 is {fid}")
        with self._lock:
            self._known.add(fid)
        return fid

    def list_functions(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/functions"))

    # ---------------------------------------------------------------- endpoints
    def list_endpoints(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/endpoints"))

    def get_endpoint(self, endpoint_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/endpoints/{endpoint_id}"))

    def create_enrollment_token(self, ttl_s: float = 86400, uses: int = 1) -> EnrollmentToken:
        """The token (a str) with ``.ca_hash`` and ``.broker_url``: `mesh-agent init --token T --ca-hash H`."""
        out = self.request("POST", "/v1/enrollment-tokens", json={"ttl_s": ttl_s, "uses": uses})
        return EnrollmentToken(out["token"], out.get("ca_hash"), out.get("broker_url"))

    def share_endpoint(self, endpoint_id: str, user: str) -> None:
        """Let another user (by name) list the endpoint and run their own functions on it (owner only)."""
        self.request("PUT", f"/v1/endpoints/{endpoint_id}/shares/{user}")

    def unshare_endpoint(self, endpoint_id: str, user: str) -> None:
        self.request("DELETE", f"/v1/endpoints/{endpoint_id}/shares/{user}")

    def set_allowed_functions(self, endpoint_id: str, function_ids: Iterable[str] | None) -> dict[str, Any]:
        """Restrict the endpoint to these function ids (None: no list). Owner only."""
        ids = None if function_ids is None else list(function_ids)
        return dict(self.request("PUT", f"/v1/endpoints/{endpoint_id}/allowed-functions", json={"function_ids": ids}))

    def set_endpoint_trusted(self, endpoint_id: str, trusted: bool = True) -> bool:
        """Mark your endpoint trusted (owner only): your SDK then unpickles its results, as it does
        for any Python object. Unmarked (the default for a new endpoint), its results are decoded
        as data only, so a stolen device cannot send one that runs code here (docs/security.md).
        Returns the flag as the hub stored it."""
        return bool(self.request("PUT", f"/v1/endpoints/{endpoint_id}/trusted", json={"trusted": bool(trusted)})["trusted"])

    def revoke_endpoint(self, endpoint_id: str) -> dict[str, Any]:
        """Lock a lost or retired device out for good (owner only); its unfinished tasks fail."""
        return dict(self.request("DELETE", f"/v1/endpoints/{endpoint_id}"))

    # ---------------------------------------------------------------- tasks
    @staticmethod
    def task_spec(endpoint_id: EndpointSelector, function_id: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                  timeout_s: float | None = None, ttl_s: float | None = None,
                  constraints: dict[str, Any] | None = None) -> dict[str, Any]:
        """One task for ``submit_batch``. ``endpoint_id``: an id, ``"auto"``, a list of ids or
        ``{"tags": [...]}``; ``constraints``: ``{"tags": [...], "gpu": True, "min_memory_mb": N}``."""
        # user_modules: arguments naming the program's own modules (not installed on endpoints) go by value
        spec: dict[str, Any] = {"endpoint_id": selector(endpoint_id), "function_id": function_id,
                                "args": _b64(serialize((tuple(args), kwargs or {}), user_modules=True))}
        if timeout_s is not None:
            spec["timeout_s"] = timeout_s
        if ttl_s is not None:
            spec["ttl_s"] = ttl_s
        cons = constraints_spec(constraints)
        if cons is not None:
            spec["constraints"] = cons
        refs = sys.modules.get("cloud_hub.client.refs")  # no refs module loaded: no ref among the arguments
        if refs is not None:
            where = refs.locations(args, kwargs or {})
            if where:
                spec["inputs"] = where  # the scheduler prefers endpoints holding them (docs/data.md, "Locality")
        return spec

    def submit(self, endpoint_id: str, function_id: str, *args: Any, **kwargs: Any) -> str:
        return str(self.request("POST", "/v1/tasks", json=self.task_spec(endpoint_id, function_id, args, kwargs))["task_id"])

    def submit_batch(self, specs: Iterable[dict[str, Any]]) -> list[str]:
        return self.submit_batch_placed(specs)[0]

    def submit_batch_placed(self, specs: Iterable[dict[str, Any]], idempotency_key: str | None = None, *,
                            functions: dict[str, tuple[str, bytes]] | None = None,
                            task_group_id: str | None = None) -> tuple[list[str], list[str]]:
        """Like ``submit_batch``, also returning the endpoint each task was placed on.

        ``idempotency_key`` (8-128 of ``A-Za-z0-9_.:-``, e.g. a uuid4 per batch): sending the same
        batch again with the same key, after a timeout or a hub crash, returns the tasks the first
        attempt made instead of making new ones. ``functions``: ``{id: (name, body)}`` for bodies
        the hub may not have; they are stored with the tasks, in one transaction.
        ``task_group_id``: list these tasks later with :meth:`task_group`."""
        out = self.request("POST", "/v1/tasks/batch", json=self.batch_body(specs, idempotency_key, functions, task_group_id))
        return self.batch_accepted(out, functions)

    @staticmethod
    def batch_body(specs: Iterable[dict[str, Any]], idempotency_key: str | None = None,
                   functions: dict[str, tuple[str, bytes]] | None = None, task_group_id: str | None = None) -> dict[str, Any]:
        """The batch submit's body, the same over REST and the stream (so an idempotency key means
        the same request on both)."""
        body: dict[str, Any] = {"tasks": list(specs)}
        if functions:
            body["functions"] = {fid: {"name": name[:200] or "function", "body": _b64(b)} for fid, (name, b) in functions.items()}
        if task_group_id is not None:
            body["task_group_id"] = task_group_id
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        return body

    def batch_accepted(self, out: dict[str, Any], functions: dict[str, tuple[str, bytes]] | None) -> tuple[list[str], list[str]]:
        """``(task ids, endpoint ids)`` from the hub's answer; the bodies it stored are known from now on."""
        if functions:
            with self._lock:
                self._known.update(functions)
        ids = list(out["task_ids"])
        return ids, list(out.get("endpoint_ids") or [None] * len(ids))

    def task_group(self, task_group_id: str) -> list[dict[str, Any]]:
        """The caller's tasks submitted with this group id, oldest first (id, endpoint, state, ok)."""
        return list(self.request("GET", f"/v1/task-groups/{task_group_id}/tasks")["tasks"])

    def cancel_tasks(self, task_ids: Sequence[str]) -> dict[str, list[str]]:
        """Cancel tasks of yours (docs/protocol.md, "Cancellation"): ``{"cancelled": [...], "done":
        [...]}`` (``done``: they had finished; their result stands). All or nothing: an id that is
        not a task of yours raises ``HubError`` 404 and nothing is cancelled."""
        out = self.request("POST", "/v1/tasks/cancel", json={"task_ids": list(task_ids)})
        return {"cancelled": list(out["cancelled"]), "done": list(out["done"])}

    def cancel_task_group(self, task_group_id: str) -> list[str]:
        """Cancel every unfinished task of yours filed under this group; returns their ids."""
        return list(self.request("POST", f"/v1/task-groups/{task_group_id}/cancel")["cancelled"])

    def renew_task_group_lease(self, task_group_id: str, ttl_s: float) -> None:
        """Keep the group's tasks alive for ``ttl_s`` more: not renewed in time, the hub cancels them."""
        self.request("PUT", f"/v1/task-groups/{task_group_id}/lease", json={"ttl_s": ttl_s})

    def release_task_group_lease(self, task_group_id: str) -> None:
        self.request("DELETE", f"/v1/task-groups/{task_group_id}/lease")

    # ---------------------------------------------------------------- scheduler
    def scheduler_decisions(self, limit: int = 50, before: int | None = None, *, task_id: str | None = None,
                            endpoint_id: str | None = None, function_id: str | None = None) -> dict[str, Any]:
        """Placement decisions for your tasks, newest first, with predicted vs actual times
        (``{"decisions": [...], "next_before": seq | None, "summary": {...}}``; see docs/scheduler.md)."""
        params: dict[str, Any] = {"limit": limit}
        for k, v in (("before", before), ("task_id", task_id), ("endpoint_id", endpoint_id), ("function_id", function_id)):
            if v is not None:
                params[k] = v
        return dict(self.request("GET", "/v1/scheduler/decisions", params=params))

    def task_status(self, task_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/tasks/{task_id}"))

    # ---------------------------------------------------------------- results
    def wait_results(self, task_ids: Sequence[str], timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """Raw results (base64 data) among ``task_ids``, waiting up to ``timeout_s`` for the first."""
        out = self.request("POST", "/v1/results/wait", json={"task_ids": list(task_ids), "timeout_s": timeout_s},
                           timeout=timeout_s + 30)
        return list(out["results"])

    def get_result(self, task_id: str, timeout_s: float = 60.0) -> Any:
        """Block until the task is done; return its value or raise its (remote) exception."""
        from cloud_hub.client._results import decode_row

        import time

        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            rows = self.wait_results([task_id], timeout_s=max(0.0, min(left, 30.0)))
            if rows:
                ok, value = decode_row(rows[0], self.trusted_endpoints)
                if ok:
                    return value
                raise value
            if left <= 0:
                raise TimeoutError(f"task {task_id} not done within {timeout_s}s")

    def result_cursor(self) -> int:
        return int(self.request("GET", "/v1/results/cursor")["cursor"])

    def result_stream(self, after: int, timeout_s: float = 20.0, limit: int = 5000) -> tuple[list[dict[str, Any]], int]:
        out = self.request("GET", "/v1/results/stream", params={"after": after, "timeout_s": timeout_s, "limit": limit},
                           timeout=timeout_s + 30)
        return list(out["results"]), int(out["cursor"])


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (the hub sends whole seconds; an HTTP date is not used here)."""
    try:
        return max(0.0, min(3600.0, float(value))) if value else None
    except ValueError:
        return None


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    if "Name or service not known" in text or "nodename nor servname" in text or "Errno -2" in text:
        return "unknown host name"
    return text.split("] ")[-1][:120]


_ATOMS = (int, float, complex, str, bytes, bool, type(None))


def _atom(v: Any) -> bool:
    return type(v) in _ATOMS or (type(v) is tuple and len(v) <= 16 and all(type(x) in _ATOMS for x in v))


def _names(code: Any, out: set[str], depth: int = 0) -> None:
    out.update(code.co_names)
    if depth < 8:
        for c in code.co_consts:
            if hasattr(c, "co_names"):
                _names(c, out, depth + 1)


def _reuse_key(fn: Any) -> tuple[Any, ...] | None:
    """A key under which a fresh function object may reuse an earlier one's serialized body:
    same code, same captured values, same globals it names. Only when every captured value and
    default is a plain immutable value, and every global it names is a module, a builtin or a
    plain value; otherwise None (serialize it again: it may capture state that changed)."""
    import types

    if type(fn) is not types.FunctionType:
        return None
    parts: list[Any] = [fn.__code__, fn.__module__, fn.__qualname__, id(fn.__globals__)]
    for v in (fn.__defaults__ or ()):
        if not _atom(v):
            return None
        parts.append((type(v), repr(v)))  # repr: 0.0 and -0.0 are equal, their bodies are not
    for k, v in sorted((fn.__kwdefaults__ or {}).items()):
        if not _atom(v):
            return None
        parts.append((k, type(v), repr(v)))
    for cell in fn.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            return None
        if not _atom(v):
            return None
        parts.append((type(v), repr(v)))
    names: set[str] = set()
    _names(fn.__code__, names)
    g = fn.__globals__
    for name in sorted(names):
        if name not in g:
            parts.append((name, None))
            continue
        v = g[name]
        if isinstance(v, (types.ModuleType, types.BuiltinFunctionType)):
            parts.append((name, id(v), v))  # v held so its id is not reused while cached
        elif _atom(v):
            parts.append((name, type(v), repr(v)))
        else:
            return None
    return tuple(parts)


class _BodyCache:
    """Bounded: a long-running program making endless distinct closures must not grow forever."""

    def __init__(self, size: int = 4096) -> None:
        from collections import OrderedDict

        self._d: "OrderedDict[tuple[Any, ...], tuple[str, bytes]]" = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> tuple[str, bytes] | None:
        with self._lock:
            out = self._d.get(key)
            if out is not None:
                self._d.move_to_end(key)
            return out

    def put(self, key: tuple[Any, ...], value: tuple[str, bytes]) -> None:
        with self._lock:
            self._d[key] = value
            if len(self._d) > self._size:
                self._d.popitem(last=False)
