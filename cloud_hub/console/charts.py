"""Inline SVG charts drawn on the server (no chart library, no CDN, nothing to run in the browser).

Charts stretch to their container (``preserveAspectRatio="none"``, strokes with
``vector-effect: non-scaling-stroke``) so they fill a phone or a desktop alike; text is never
inside a stretched SVG (it would distort): axis labels come back as strings for the template to
place in HTML. Colours come from CSS classes, so the stylesheet owns the palette and the
Content-Security-Policy needs no inline styles. Pure functions: data in, markup out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from markupsafe import Markup, escape

__all__ = ["Chart", "throughput_chart", "timeline", "line_chart", "scatter_chart", "hop_bar", "Segment"]

_W, _H = 1000.0, 200.0


@dataclass
class Chart:
    svg: Markup
    y_max: str = ""
    y_min: str = ""
    x_labels: list[str] = field(default_factory=list)
    legend: list[tuple[str, str]] = field(default_factory=list)  # (css class, label)
    empty: bool = False
    cls: str = ""  # extra CSS class on the figure


def _num(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".") if not float(v).is_integer() else str(int(v))


def _fmt(v: float) -> str:
    """Short human number for axis labels: 1234 -> 1.2k, 0.0312 -> 0.031."""
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.1f}M"
    if a >= 1e4:
        return f"{v / 1e3:.0f}k"
    if a >= 1e3:
        return f"{v / 1e3:.1f}k"
    if a == 0 or a >= 10:
        return f"{v:.0f}"
    if a >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.3g}"


def _svg(body: str, cls: str, label: str, w: float = _W, h: float = _H, stretch: bool = True) -> Markup:
    aspect = ' preserveAspectRatio="none"' if stretch else ""
    return Markup(
        f'<svg class="{cls}" viewBox="0 0 {_num(w)} {_num(h)}"{aspect} role="img" aria-label="{escape(label)}" '
        f'xmlns="http://www.w3.org/2000/svg">{body}</svg>'
    )


def _grid(h: float = _H, w: float = _W) -> str:
    return "".join(f'<line class="grid" x1="0" x2="{_num(w)}" y1="{_num(h * f)}" y2="{_num(h * f)}"/>' for f in (0.25, 0.5, 0.75))


def throughput_chart(series: Sequence[tuple[float, int, int]], bucket_s: float, clock: str = "%H:%M") -> Chart:
    """Stacked bars per time bucket: succeeded (bottom) and failed (top)."""
    import time as _time

    top = max((ok + bad for _, ok, bad in series), default=0)
    n = max(1, len(series))
    bw = _W / n
    parts = [_grid()]
    for i, (t0, ok, bad) in enumerate(series):
        total = ok + bad
        if total == 0 or top == 0:
            continue
        x = i * bw + bw * 0.12
        w = bw * 0.76
        h_ok = _H * ok / top
        h_bad = _H * bad / top
        rate = total / bucket_s
        tip = f"{_time.strftime('%H:%M:%S', _time.localtime(t0))}: {ok} ok, {bad} failed ({rate:.1f}/s)"
        parts.append(f'<g><title>{escape(tip)}</title>')
        if ok:
            parts.append(f'<rect class="bar ok" x="{x:.1f}" y="{_H - h_ok:.1f}" width="{w:.1f}" height="{h_ok:.1f}"/>')
        if bad:
            parts.append(f'<rect class="bar bad" x="{x:.1f}" y="{_H - h_ok - h_bad:.1f}" width="{w:.1f}" height="{h_bad:.1f}"/>')
        parts.append("</g>")
    labels = []
    if series:
        mid = series[len(series) // 2][0]
        labels = [_time.strftime(clock, _time.localtime(series[0][0])), _time.strftime(clock, _time.localtime(mid)), "now"]
    return Chart(
        svg=_svg("".join(parts), "chart-svg", "results per time bucket"),
        y_max=f"{_fmt(top / bucket_s)}/s" if top else "",
        y_min="0",
        x_labels=labels,
        legend=[("ok", "succeeded"), ("bad", "failed")],
        empty=top == 0,
    )


@dataclass
class Segment:
    start: float
    end: float
    state: str  # "on", "off" or "unknown"


def segments(events: Sequence[tuple[float, bool]], start: float, end: float, created: float, online_now: bool) -> list[Segment]:
    """Turn transitions (the state before ``start`` first, if known) into spans over
    ``[start, end]``: unknown before enrollment, then on/off as recorded. The live state colours
    the last span (the dispatcher writes a transition just after it changes its live state)."""
    out: list[Segment] = []
    t = start
    state = "off"
    if created > start:
        t = min(created, end)
        out.append(Segment(start, t, "unknown"))
    for at, on in events:
        if at > t:
            until = min(at, end)
            out.append(Segment(t, until, state))
            t = until
        state = "on" if on else "off"
    if t < end:
        out.append(Segment(t, end, "on" if online_now else "off"))
    merged: list[Segment] = []
    for seg in out:
        if seg.end <= seg.start:
            continue
        if merged and merged[-1].state == seg.state:
            merged[-1].end = seg.end
        else:
            merged.append(seg)
    return merged


def uptime(segs: Sequence[Segment]) -> float | None:
    """Fraction of known time spent online, None when nothing is known."""
    on = sum(s.end - s.start for s in segs if s.state == "on")
    known = sum(s.end - s.start for s in segs if s.state != "unknown")
    return on / known if known > 0 else None


def timeline(segs: Sequence[Segment], start: float, end: float, label: str = "availability") -> Markup:
    """One horizontal strip: green online, red offline, grey before enrollment."""
    import time as _time

    span = max(end - start, 1e-9)
    parts = []
    names = {"on": "online", "off": "offline", "unknown": "not enrolled"}
    for s in segs:
        x = _W * (s.start - start) / span
        w = max(_W * (s.end - s.start) / span, 1.0)
        tip = (f"{names[s.state]} {_time.strftime('%H:%M:%S', _time.localtime(s.start))}"
               f" – {_time.strftime('%H:%M:%S', _time.localtime(s.end))}")
        parts.append(f'<rect class="seg {s.state}" x="{x:.1f}" y="0" width="{w:.1f}" height="10"><title>{escape(tip)}</title></rect>')
    return _svg("".join(parts), "timeline-svg", label, h=10)


def line_chart(series: dict[str, Sequence[tuple[float, float | None]]], label: str, classes: dict[str, str] | None = None,
               y_floor: float | None = None, y_ceiling: float | None = None, percent: bool = False) -> Chart:
    """Lines over a shared x axis (FL rounds). ``None`` values break the line. ``y_floor`` and
    ``y_ceiling`` pin the axis (0 and 1 for an accuracy); ``percent`` labels it in %."""
    pts = [(x, y) for s in series.values() for x, y in s if y is not None and math.isfinite(y)]
    if not pts:
        return Chart(svg=_svg("", "chart-svg", label), empty=True)
    xs = [x for x, _ in pts]
    ys = [y for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y_floor is not None:
        y0 = min(y0, y_floor)
    if y1 == y0:
        y1, y0 = y1 + (abs(y1) * 0.1 or 1), y0 - (abs(y0) * 0.1 or 0)
    if y_ceiling is not None:
        y1 = max(y1, y_ceiling)
    pad = (y1 - y0) * 0.08
    if y_ceiling is None or y1 > y_ceiling:
        y1 += pad
    if y_floor is None or y0 - pad >= y_floor:
        y0 -= pad
    inset = 12.0  # keep end points off the frame
    sx = (lambda x: _W / 2) if x1 == x0 else (lambda x: inset + (_W - 2 * inset) * (x - x0) / (x1 - x0))

    def sy(y: float) -> float:
        return _H - _H * (y - y0) / (y1 - y0)

    parts = [_grid()]
    legend = []
    for name, s in series.items():
        cls = (classes or {}).get(name, "s1")
        legend.append((cls, name))
        run: list[str] = []
        runs: list[list[str]] = []
        for x, y in s:
            if y is None or not math.isfinite(y):
                if run:
                    runs.append(run)
                run = []
                continue
            run.append(f"{sx(x):.1f},{sy(y):.1f}")
        if run:
            runs.append(run)
        for r in runs:
            if len(r) == 1:  # a single point: a short tick so it is visible
                x, y = (float(v) for v in r[0].split(","))
                r = [f"{max(0, x - 4):.1f},{y:.1f}", f"{min(_W, x + 4):.1f},{y:.1f}"]
            parts.append(f'<polyline class="line {cls}" points="{" ".join(r)}"/>')
        for x, y in s:
            if y is not None and math.isfinite(y):
                # a zero-length path with a round cap and a non-scaling stroke stays a circle when stretched
                parts.append(f'<path class="dot {cls}" d="M{sx(x):.1f} {sy(y):.1f}h0.01"><title>{escape(name)} round {_num(x)}: {y:.4g}</title></path>')
    return Chart(
        svg=_svg("".join(parts), "chart-svg", label),
        y_max=f"{y1 * 100:.0f}%" if percent else _fmt(y1),
        y_min=f"{y0 * 100:.0f}%" if percent else _fmt(y0),
        x_labels=[f"round {_num(x0)}", f"round {_num(x1)}"] if x1 != x0 else [f"round {_num(x0)}"],
        legend=legend,
    )


def scatter_chart(points: Sequence[tuple[float, float, str]], label: str) -> Chart:
    """Predicted (x) against actual (y) seconds, with the y = x diagonal: points above it took
    longer than the scheduler expected. Square, not stretched, so the diagonal means something."""
    if not points:
        return Chart(svg=_svg("", "scatter-svg", label, w=200, h=200, stretch=False), empty=True, cls="scatter")
    top = max(max(p, a) for p, a, _ in points) or 1.0
    top *= 1.05
    s = 200.0 / top
    parts = [_grid(200, 200), '<line class="diag" x1="0" y1="200" x2="200" y2="0"/>']
    for p, a, tip in points:
        parts.append(f'<circle class="pt" cx="{p * s:.1f}" cy="{200 - a * s:.1f}" r="3"><title>{escape(tip)}</title></circle>')
    return Chart(svg=_svg("".join(parts), "scatter-svg", label, w=200, h=200, stretch=False),
                 y_max=f"{_fmt(top)}s", y_min="0", x_labels=["0", f"predicted {_fmt(top)}s"], cls="scatter")


def hop_bar(t0: float, total: float, start: float | None, end: float | None, cls: str) -> Markup:
    """One row of a task's waterfall: the span ``[start, end]`` within ``[t0, t0 + total]``."""
    if start is None or end is None or total <= 0:
        return _svg("", "hop-svg", "no data", h=10)
    x = _W * max(0.0, start - t0) / total
    w = max(_W * max(0.0, end - start) / total, 3.0)
    return _svg(f'<rect class="hop {cls}" x="{min(x, _W - w):.1f}" y="1" width="{w:.1f}" height="8"/>', "hop-svg", "span", h=10)
