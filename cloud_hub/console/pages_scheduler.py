"""Scheduler page: recent placements, what the scheduler predicted and what happened.

Reads through ``PlacementService.decisions`` (the same call behind ``GET /v1/scheduler/decisions``,
docs/scheduler.md), so the page and the API always agree.
"""

from __future__ import annotations

import re
import sqlite3
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from cloud_hub.console import charts, queries
from cloud_hub.console.optional import Helpers, OptionalPage
from cloud_hub.console.views import fmt_duration, render
from cloud_hub.store.scheduling import last_decision_seq

if TYPE_CHECKING:
    from cloud_hub.service.hub import Hub

__all__ = ["PAGE"]

_PAGE_SIZE = 50


async def summary(hub: "Hub", user_id: str) -> dict[str, Any]:
    """Whether the user has decisions (nav), and the newest one's seq (so open pages refresh)."""

    def q(db: sqlite3.Connection) -> dict[str, Any]:
        try:
            last = last_decision_seq(db, user_id)
        except sqlite3.OperationalError:  # a hub without the scheduler's tables
            return {"count": 0}
        return {"count": 1 if last else 0, "last": last}

    return await hub.store.read_parallel(q)


def _register(router: APIRouter, h: Helpers) -> None:
    @router.get("/scheduler")
    async def scheduler_page(request: Request, before: str | None = None, viewer: Any = Depends(h.page_viewer)) -> Response:
        cursor = None
        if before:
            if not before.isdigit() or len(before) > 18:
                return h.bad_request(request, viewer, f"bad page cursor {before!r}")
            cursor = int(before)
        hub = h.hub(request)
        placement = getattr(hub, "placement", None)
        data: dict[str, Any] = {"decisions": [], "next_before": None, "summary": {"decisions": 0, "completed": 0}}
        calibration: list[dict[str, Any]] = []
        if placement is not None:
            data = await placement.decisions(viewer.user_id, _PAGE_SIZE, cursor)
            calibration = [e for e in placement.state(viewer.user_id)["endpoints"] if len(e["calibration"]) > 2]  # more than the two corrections in force
        eps, fns = await hub.store.read_parallel(queries.names, viewer.user_id)
        ep_names, fn_names = dict(eps), dict(fns)
        points = [
            (d["predicted_s"], d["actual_s"], f"{fn_names.get(d['function_id'], d['function_id'][:8])} on "
             f"{ep_names.get(d['endpoint_id'], d['endpoint_id'])}: predicted {fmt_duration(d['predicted_s'])}, "
             f"took {fmt_duration(d['actual_s'])}")
            for d in data["decisions"] if d["state"] == "done" and d["ok"] and d["predicted_s"] is not None and d["actual_s"] is not None
        ]
        chart = charts.scatter_chart(points, "predicted against actual completion time")
        for d in data["decisions"]:
            d["reason_text"] = _named(d.get("reason") or d["policy"], ep_names, fn_names)
        ctx = await h.ctx(request, viewer, "scheduler", "Scheduler")
        return render("scheduler.html", **ctx, data=data, chart=chart, ep_names=ep_names, fn_names=fn_names,
                      paged=cursor is not None, by_endpoint=_by_endpoint(data["decisions"]), calibration=calibration)


_IDS = re.compile(r"\b(?:endpoint:)?(ep-[0-9a-f]{12})\b|\b([0-9a-f]{64})\b")


def _named(text: str, ep_names: dict[str, str], fn_names: dict[str, str]) -> str:
    """Reasons name endpoints and functions by id; show the names people gave them."""
    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return ep_names.get(m.group(1), m.group(1))
        return fn_names.get(m.group(2), m.group(2)[:10] + "…")

    return _IDS.sub(sub, text)


def _by_endpoint(decisions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per chosen endpoint, over this page's completed placements: how far off the predictions were."""
    acc: dict[str, list[tuple[float, float]]] = defaultdict(list)
    placed: dict[str, int] = defaultdict(int)
    for d in decisions:
        placed[d["endpoint_id"]] += 1
        if d["state"] == "done" and d["ok"] and d["predicted_s"] is not None and d["actual_s"] is not None:
            acc[d["endpoint_id"]].append((d["predicted_s"], d["actual_s"]))
    rows = []
    for ep, n in sorted(placed.items(), key=lambda kv: -kv[1]):
        pa = acc.get(ep, [])
        rows.append({
            "endpoint_id": ep, "placed": n, "completed": len(pa),
            "predicted": sum(p for p, _ in pa) / len(pa) if pa else None,
            "actual": sum(a for _, a in pa) / len(pa) if pa else None,
            "error": sum(a - p for p, a in pa) / len(pa) if pa else None,
        })
    return rows


PAGE = OptionalPage(key="scheduler", href="/console/scheduler", label="Scheduler", summary=summary, register=_register)
