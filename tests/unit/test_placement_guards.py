"""What the hub's scheduler refuses to learn from a result (issue 25): timings no run could have
(a forged frame from a sandboxed task or a stolen device), and another user's sandboxed failure,
which must never block a function for the endpoint's owner."""

from __future__ import annotations

import json
import math

import pytest

from cloud_hub.placement import _MAX_RUNTIME_S, _runtime, _tenant_of


@pytest.mark.parametrize("started, finished", [
    (-1e308, 1e308), (math.nan, 1.0), (1.0, math.inf), (5.0, 4.0), (0.0, _MAX_RUNTIME_S + 1), (True, 2.0), ("1", 2.0), (None, 1.0),
])
def test_timings_no_run_could_have_teach_nothing(started: object, finished: object) -> None:
    assert _runtime(started, finished) is None


def test_a_real_span_is_its_runtime() -> None:
    assert _runtime(100.0, 100.25) == pytest.approx(0.25)
    assert _runtime(7, 7) == 0.0


def test_only_another_users_sandboxed_spec_is_a_tenants() -> None:
    assert _tenant_of(json.dumps({"sandbox": True, "tenant": "u-bob"}))
    assert not _tenant_of(json.dumps({"sandbox": True}))
    assert not _tenant_of(None) and not _tenant_of("") and not _tenant_of("not json")
