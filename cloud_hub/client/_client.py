"""Thin, typed wrapper over the hub's REST API (httpx, keep-alive, bearer token)."""

from __future__ import annotations

import base64
import threading
import weakref
from typing import Any, Callable, Iterable, Sequence

import httpx

from cloud_hub.client._fl import FLRunsMixin
from mesh_agent.protocol import function_id, serialize, serialize_function

__all__ = ["Client", "HubError", "EndpointSelector", "selector", "constraints_spec"]

#: Where a task may run: an endpoint id, ``"auto"``, a list of ids, or ``{"tags": [...]}``.
EndpointSelector = str | Sequence[str] | dict[str, Any]


class HubError(RuntimeError):
    """The hub refused a request; ``status`` is the HTTP code and the message its explanation."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"hub answered {status}: {detail}")
        self.status = status
        self.detail = detail


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


class Client(FLRunsMixin):
    def __init__(self, url: str, token: str, *, timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_keepalive_connections=8),
        )
        self._fids: "weakref.WeakKeyDictionary[Callable[..., Any], str]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, path: str, **kw: Any) -> Any:
        r = self._http.request(method, path, **kw)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise HubError(r.status_code, detail if isinstance(detail, str) else str(detail))
        return r.json() if r.content else None

    # ---------------------------------------------------------------- functions
    def register_function(self, fn: Callable[..., Any], name: str | None = None) -> str:
        """Register (idempotently) and return the function id, the hash of its serialized body."""
        try:
            cached = self._fids.get(fn)
        except TypeError:  # not weak-referenceable (builtins): no cache
            cached = None
        if cached:
            return cached
        body = serialize_function(fn)
        fid = self.request("POST", "/v1/functions", json={"name": name or getattr(fn, "__name__", "function"), "body": _b64(body)})["function_id"]
        assert fid == function_id(body)
        try:
            self._fids[fn] = fid
        except TypeError:
            pass
        return str(fid)

    def list_functions(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/functions"))

    # ---------------------------------------------------------------- endpoints
    def list_endpoints(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/endpoints"))

    def get_endpoint(self, endpoint_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/endpoints/{endpoint_id}"))

    def create_enrollment_token(self, ttl_s: float = 86400, uses: int = 1) -> str:
        return str(self.request("POST", "/v1/enrollment-tokens", json={"ttl_s": ttl_s, "uses": uses})["token"])

    def share_endpoint(self, endpoint_id: str, user: str) -> None:
        """Let another user (by name) list the endpoint and run their own functions on it (owner only)."""
        self.request("PUT", f"/v1/endpoints/{endpoint_id}/shares/{user}")

    def unshare_endpoint(self, endpoint_id: str, user: str) -> None:
        self.request("DELETE", f"/v1/endpoints/{endpoint_id}/shares/{user}")

    def set_allowed_functions(self, endpoint_id: str, function_ids: Iterable[str] | None) -> dict[str, Any]:
        """Restrict the endpoint to these function ids (None: no list). Owner only."""
        ids = None if function_ids is None else list(function_ids)
        return dict(self.request("PUT", f"/v1/endpoints/{endpoint_id}/allowed-functions", json={"function_ids": ids}))

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
        spec: dict[str, Any] = {"endpoint_id": selector(endpoint_id), "function_id": function_id,
                                "args": _b64(serialize((tuple(args), kwargs or {})))}
        if timeout_s is not None:
            spec["timeout_s"] = timeout_s
        if ttl_s is not None:
            spec["ttl_s"] = ttl_s
        cons = constraints_spec(constraints)
        if cons is not None:
            spec["constraints"] = cons
        return spec

    def submit(self, endpoint_id: str, function_id: str, *args: Any, **kwargs: Any) -> str:
        return str(self.request("POST", "/v1/tasks", json=self.task_spec(endpoint_id, function_id, args, kwargs))["task_id"])

    def submit_batch(self, specs: Iterable[dict[str, Any]]) -> list[str]:
        return self.submit_batch_placed(specs)[0]

    def submit_batch_placed(self, specs: Iterable[dict[str, Any]]) -> tuple[list[str], list[str]]:
        """Like ``submit_batch``, also returning the endpoint each task was placed on."""
        out = self.request("POST", "/v1/tasks/batch", json={"tasks": list(specs)})
        ids = list(out["task_ids"])
        return ids, list(out.get("endpoint_ids") or [None] * len(ids))

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
        from cloud_hub.client._results import decode_result

        import time

        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            rows = self.wait_results([task_id], timeout_s=max(0.0, min(left, 30.0)))
            if rows:
                ok, value = decode_result(rows[0]["ok"], base64.b64decode(rows[0]["data"]))
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
