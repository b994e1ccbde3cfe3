"""Server-side SVG charts: pure functions from data to markup."""

from __future__ import annotations

import re

from cloud_hub.console import charts
from cloud_hub.console.charts import Segment


def test_segments_from_transitions() -> None:
    # enrolled at 10, online 12..20, offline 20..25, online since 25 (live)
    segs = charts.segments([(12.0, True), (20.0, False), (25.0, True)], start=0.0, end=30.0, created=10.0, online_now=True)
    assert [(s.start, s.end, s.state) for s in segs] == [
        (0.0, 10.0, "unknown"), (10.0, 12.0, "off"), (12.0, 20.0, "on"), (20.0, 25.0, "off"), (25.0, 30.0, "on")]
    assert charts.uptime(segs) == (8 + 5) / 20


def test_segments_use_state_before_window_and_live_state_last() -> None:
    # last transition before the window said online; the live state says offline now
    segs = charts.segments([(-50.0, True)], start=0.0, end=10.0, created=-100.0, online_now=False)
    assert [(s.start, s.end, s.state) for s in segs] == [(0.0, 10.0, "off")]
    segs = charts.segments([(-50.0, True), (4.0, False)], start=0.0, end=10.0, created=-100.0, online_now=False)
    assert [(s.state) for s in segs] == ["on", "off"]
    assert charts.uptime([Segment(0, 5, "unknown")]) is None


def test_timeline_svg_has_one_rect_per_segment_and_escapes_nothing_unsafe() -> None:
    segs = [Segment(0, 5, "on"), Segment(5, 10, "off")]
    svg = str(charts.timeline(segs, 0, 10, label='<script>x</script>'))
    assert svg.count("<rect") == 2 and 'class="seg on"' in svg and 'class="seg off"' in svg
    assert "<script>" not in svg


def test_throughput_chart_scales_to_peak() -> None:
    series = [(0.0, 0, 0), (10.0, 30, 10), (20.0, 5, 0)]
    c = charts.throughput_chart(series, 10.0)
    heights = [float(h) for h in re.findall(r'height="([0-9.]+)"', str(c.svg))]
    assert max(heights) == 150.0 and c.y_max == "4/s" and not c.empty
    assert charts.throughput_chart([(0.0, 0, 0)], 10.0).empty


def test_line_chart_handles_gaps_single_points_and_empty() -> None:
    c = charts.line_chart({"loss": [(1, 2.0), (2, None), (3, 1.0)], "acc": [(1, 0.5)]}, "fl")
    svg = str(c.svg)
    assert svg.count("<polyline") == 3  # loss splits at the gap; the lone accuracy point is a tick
    assert c.x_labels == ["round 1", "round 3"]
    assert charts.line_chart({"loss": [(1, None)]}, "fl").empty
    assert charts.line_chart({"loss": [(1, float("nan"))]}, "fl").empty


def test_scatter_and_hop_bar() -> None:
    c = charts.scatter_chart([(1.0, 2.0, "a"), (2.0, 1.0, "b<")], "pred")
    assert str(c.svg).count("<circle") == 2 and "b&lt;" in str(c.svg)
    assert charts.scatter_chart([], "pred").empty
    bar = str(charts.hop_bar(0.0, 10.0, 2.0, 4.0, "acked"))
    assert 'x="200.0"' in bar and 'width="200.0"' in bar
    assert "<rect" not in str(charts.hop_bar(0.0, 10.0, None, None, "x"))


def test_fl_participation_chart_stacks_used_late_and_dropped() -> None:
    from cloud_hub.console.pages_fl import participation_chart

    rounds = [
        {"round": 1, "participants": ["a", "b"], "stragglers": [], "dropped": {}},
        {"round": 2, "participants": ["a"], "stragglers": ["b"], "dropped": {"c": "nan"}},
    ]
    c = participation_chart(rounds)
    svg = str(c.svg)
    assert svg.count('class="bar used"') == 2 and svg.count('class="bar late"') == 1 and svg.count('class="bar drop"') == 1
    assert c.y_max == "3" and c.x_labels == ["round 1", "round 2"]
    assert participation_chart([]).empty


def test_scheduler_reasons_name_endpoints_and_functions() -> None:
    from cloud_hub.console.pages_scheduler import _by_endpoint, _named

    fid = "ab" * 32
    text = f"probe: first run of {fid} on endpoint:ep-0123456789ab (exploring)"
    assert _named(text, {"ep-0123456789ab": "pi-1"}, {fid: "fit"}) == "probe: first run of fit on pi-1 (exploring)"
    assert _named(text, {}, {}).startswith("probe: first run of abababab")
    rows = _by_endpoint([
        {"endpoint_id": "e1", "state": "done", "ok": True, "predicted_s": 1.0, "actual_s": 1.5},
        {"endpoint_id": "e1", "state": "placed", "ok": None, "predicted_s": 1.0, "actual_s": None},
        {"endpoint_id": "e2", "state": "done", "ok": False, "predicted_s": 1.0, "actual_s": 9.0},
    ])
    assert rows[0] == {"endpoint_id": "e1", "placed": 2, "completed": 1, "predicted": 1.0, "actual": 1.5, "error": 0.5}
    assert rows[1]["completed"] == 0 and rows[1]["error"] is None
