"""Rendering: the Jinja2 environment (autoescaped), template filters and security headers.

Times are rendered as ``<time data-ts=...>`` with a server-side fallback text; the console's JS
rewrites them in the browser's own time zone and keeps "12 s ago" texts ticking.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape
from starlette.responses import HTMLResponse, Response

__all__ = ["render", "secure", "HERE", "fmt_duration"]

HERE = Path(__file__).parent

#: Strict CSP: everything from the hub itself, no inline script or style, no framing.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)


def secure(resp: Response, cache: bool = False) -> Response:
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "same-origin"  # "no-referrer" would make form posts say Origin: null
    resp.headers["X-Frame-Options"] = "DENY"
    if not cache:
        resp.headers["Cache-Control"] = "no-store"
    return resp


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "–"
    a = abs(s)
    sign = "-" if s < 0 else ""
    if a < 1e-3:
        return f"{sign}{a * 1e6:.0f} µs"
    if a < 1:
        return f"{sign}{a * 1e3:.1f} ms" if a < 0.1 else f"{sign}{a * 1e3:.0f} ms"
    if a < 60:
        return f"{sign}{a:.2f} s" if a < 10 else f"{sign}{a:.1f} s"
    if a < 3600:
        return f"{sign}{int(a // 60)} min {int(a % 60)} s"
    if a < 86400:
        return f"{sign}{int(a // 3600)} h {int(a % 3600 // 60)} min"
    return f"{sign}{int(a // 86400)} d {int(a % 86400 // 3600)} h"


def _time_tag(ts: float | None, fmt: str) -> Markup:
    if ts is None:
        return Markup('<span class="muted">–</span>')
    fallback = {
        "clock": time.strftime("%H:%M:%S", time.gmtime(ts)) + " UTC",
        "datetime": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + " UTC",
        "ago": fmt_duration(max(0.0, time.time() - ts)) + " ago",
    }[fmt]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    return Markup(f'<time datetime="{iso}" data-ts="{ts:.3f}" data-fmt="{fmt}">{escape(fallback)}</time>')


def _short(s: str | None, n: int = 12) -> str:
    return "" if s is None else (s if len(s) <= n else s[:n] + "…")


def _size(n: int | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v * 100:.1f}%"


def _percent(v: Any, digits: int = 0) -> str:
    """A 0-100 figure from a heartbeat ("–" when the agent did not report it)."""
    return f"{v:.{digits}f}%" if isinstance(v, (int, float)) and not isinstance(v, bool) else "–"


def _num(v: Any) -> str:
    if not isinstance(v, (int, float)):
        return "–"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return f"{v:,}"


_env = Environment(
    loader=FileSystemLoader(str(HERE / "templates")),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters.update(
    clock=lambda ts: _time_tag(ts, "clock"),
    datetime=lambda ts: _time_tag(ts, "datetime"),
    ago=lambda ts: _time_tag(ts, "ago"),
    dur=fmt_duration,
    delta=lambda s: ("+" + fmt_duration(s)) if s >= 0 else ("−" + fmt_duration(-s)),
    short=_short,
    size=_size,
    pct=_pct,
    num=_num,
    percent=_percent,
)
_env.globals["STATE_LABELS"] = {
    "queued": "queued at hub", "dispatched": "dispatched", "on_device": "on device", "succeeded": "succeeded", "failed": "failed",
}


def render(name: str, status: int = 200, **ctx: Any) -> Response:
    return secure(HTMLResponse(_env.get_template(name).render(**ctx), status_code=status))
