"""``GET /metrics``: the hub in Prometheus's text format. The series are collected by
``cloud_hub/metrics.py`` (``Hub.metrics``); this module is only the route.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response

from cloud_hub.api.deps import HubDep
from cloud_hub.metrics import CONTENT_TYPE_LATEST

__all__ = ["make_router"]


def make_router() -> Any:
    """``GET /metrics``: no user token (Prometheus has none), but ``metrics_token`` can require a
    bearer token of its own, since the series name endpoints."""
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    async def metrics(request: Request, h: HubDep) -> Response:
        if not h.cfg.metrics:
            raise HTTPException(404, "metrics are off on this hub (metrics: false)")
        want = h.cfg.metrics_token
        if want:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {want}".encode()):
                raise HTTPException(401, "metrics need 'Authorization: Bearer <metrics_token>'")
        body = await h.metrics.render()
        if "gzip" in request.headers.get("accept-encoding", ""):  # Prometheus asks for it: 1.8 MB -> 0.25 MB at 10k endpoints
            body = await h.metrics.compress(body)
            return Response(body, media_type=CONTENT_TYPE_LATEST, headers={"Content-Encoding": "gzip"})
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return router
