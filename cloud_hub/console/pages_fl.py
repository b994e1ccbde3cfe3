"""FL runs pages: the caller's runs, and one run's loss and accuracy per round with who took part.

Reads through ``cloud_hub.store.fl.FLStore`` (the same calls behind ``GET /v1/fl/runs[/{id}]``,
docs/fl.md), so the pages and the API always agree.
"""

from __future__ import annotations

import json
import sqlite3
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, Request
from markupsafe import Markup
from starlette.responses import Response

from cloud_hub.console import charts
from cloud_hub.console.optional import Helpers, OptionalPage
from cloud_hub.console.views import render
from cloud_hub.store.console import fl_run_summary

if TYPE_CHECKING:
    from cloud_hub.service.hub import Hub

__all__ = ["PAGE", "participation_chart"]


async def summary(hub: "Hub", user_id: str) -> dict[str, Any]:
    """How many runs the user has (nav) and when one last changed (so open pages refresh)."""

    def q(db: sqlite3.Connection) -> dict[str, Any]:
        try:
            n, updated, running = fl_run_summary(db, user_id)
        except sqlite3.OperationalError:  # a hub without the FL tables
            return {"count": 0}
        return {"count": n, "updated": updated, "running": running or 0}

    return await hub.store.read_parallel(q)


def participation_chart(rounds: list[dict[str, Any]]) -> charts.Chart:
    """Per round, stacked: clients whose update was used, stragglers (asked, not back by the
    deadline), dropped (back but rejected)."""
    if not rounds:
        return charts.Chart(svg=Markup(""), empty=True)
    top = max(len(r["participants"]) + len(r["stragglers"]) + len(r["dropped"]) for r in rounds) or 1
    n = len(rounds)
    bw = 1000.0 / n
    parts = []
    for i, r in enumerate(rounds):
        x = i * bw + bw * 0.15
        w = bw * 0.7
        y = 200.0
        tip = (f"round {r['round']}: {len(r['participants'])} used, {len(r['stragglers'])} stragglers, "
               f"{len(r['dropped'])} dropped")
        parts.append(f"<g><title>{Markup.escape(tip)}</title>")
        for cls, k in (("used", len(r["participants"])), ("late", len(r["stragglers"])), ("drop", len(r["dropped"]))):
            if k:
                h = 200.0 * k / top
                y -= h
                parts.append(f'<rect class="bar {cls}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}"/>')
        parts.append("</g>")
    svg = Markup('<svg class="chart-svg" viewBox="0 0 1000 200" preserveAspectRatio="none" role="img" '
                 'aria-label="clients per round" xmlns="http://www.w3.org/2000/svg">' + "".join(parts) + "</svg>")
    labels = [f"round {rounds[0]['round']}", f"round {rounds[-1]['round']}"] if n > 1 else [f"round {rounds[0]['round']}"]
    return charts.Chart(svg=svg, y_max=str(top), y_min="0", x_labels=labels,
                        legend=[("used", "used"), ("late", "stragglers"), ("drop", "dropped")])


def client_traffic(rounds: list[dict[str, Any]]) -> dict[int, list[tuple[str, Any, Any]]]:
    """Per round: ``(client, bytes up, bytes down)`` for every client with a figure, sorted by
    client id (None where one direction has none, e.g. a client whose update never came back).
    Secure rounds count the masked vector up and the global model down, as plain rounds do."""
    out: dict[int, list[tuple[str, Any, Any]]] = {}
    for r in rounds:
        extra = r.get("extra") or {}
        up, dn = extra.get("bytes_up"), extra.get("bytes_down")
        up = up if isinstance(up, dict) else {}
        dn = dn if isinstance(dn, dict) else {}
        rows = []
        for c in sorted(set(up) | set(dn)):
            u, d = up.get(c), dn.get(c)
            rows.append((str(c), u if isinstance(u, (int, float)) else None, d if isinstance(d, (int, float)) else None))
        if rows:
            out[int(r["round"])] = rows
    return out


def _register(router: APIRouter, h: Helpers) -> None:
    from cloud_hub.store.fl import FLNotFound, FLStore

    @router.get("/fl")
    async def fl_runs(request: Request, viewer: Any = Depends(h.page_viewer)) -> Response:
        runs = await FLStore(h.hub(request).store).list_runs(viewer.user_id, 200)
        ctx = await h.ctx(request, viewer, "fl", "FL runs")
        return render("fl_runs.html", **ctx, runs=runs)

    @router.get("/fl/{run_id}")
    async def fl_run(request: Request, run_id: str, viewer: Any = Depends(h.page_viewer)) -> Response:
        try:
            run = await FLStore(h.hub(request).store).get_run(viewer.user_id, run_id)
        except FLNotFound:
            return h.bad_request(request, viewer, f"no FL run {run_id} among yours", 404)
        rounds = run.get("rounds", [])
        names = run.get("client_names") or {}
        loss = charts.line_chart({"loss": [(r["round"], r.get("loss")) for r in rounds]}, "global loss per round",
                                 classes={"loss": "s2"})
        acc = charts.line_chart({"accuracy": [(r["round"], r.get("accuracy")) for r in rounds]}, "global accuracy per round",
                                classes={"accuracy": "s3"}, y_floor=0.0, y_ceiling=1.0, percent=True)
        ctx = await h.ctx(request, viewer, "fl", run["name"])
        return render("fl_run.html", **ctx, run=run, rounds=list(reversed(rounds)), names=names, loss=loss, acc=acc,
                      participation=participation_chart(rounds), traffic=client_traffic(rounds), config=json.dumps(run.get("config") or {}, indent=2))


PAGE = OptionalPage(key="fl", href="/console/fl", label="FL runs", summary=summary, register=_register)
