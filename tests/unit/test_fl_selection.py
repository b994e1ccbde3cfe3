"""Scheduler-driven client selection (fl.selection): deadline-aware, with a fairness floor."""

from __future__ import annotations

import pytest

from fl.selection import Candidate, report_probability, select_predicted, select_random


def _fleet(last=None, default=1):
    last = last or {}
    fast = [Candidate(f"fast{i}", 2.0, 0.98, 300, last.get(f"fast{i}", default)) for i in range(4)]
    slow = [Candidate(f"slow{i}", 40.0, 0.95, 300, last.get(f"slow{i}", default)) for i in range(2)]
    flaky = [Candidate(f"flaky{i}", 2.0, 0.3, 300, last.get(f"flaky{i}", default)) for i in range(2)]
    return fast + slow + flaky


def test_picks_clients_likely_to_report_before_the_deadline():
    sel = select_predicted(_fleet(), k=4, round=2, deadline_s=10.0)
    assert sorted(sel.chosen) == ["fast0", "fast1", "fast2", "fast3"]
    assert sel.scores["fast0"] > 0.9 > sel.scores["flaky0"] and sel.scores["slow0"] < 0.01
    assert report_probability(Candidate("x", 10.0, 1.0), 10.0) == pytest.approx(0.5)


def test_fairness_floor_brings_slow_clients_back():
    asked = {}
    for r in range(1, 13):
        sel = select_predicted(_fleet(asked), k=4, round=r, deadline_s=10.0, fairness_rounds=4)
        for c in sel.chosen:
            asked[c] = r
        assert len(sel.chosen) == 4
    # every client, slow or flaky, was asked within the last 4 rounds
    assert all(12 - asked[c.client_id] < 4 for c in _fleet())
    sel = select_predicted(_fleet({"slow0": 1}, default=4), k=4, round=5, deadline_s=10.0, fairness_rounds=4)
    assert "slow0" in sel.forced and "slow0" in sel.chosen


def test_unknown_clients_are_explored_and_offline_ones_skipped():
    cands = [Candidate("new", None, 0.9, 100, None), Candidate("known", 1.0, 1.0, 100, 3),
             Candidate("dead", 1.0, 0.0, 100, 3)]
    sel = select_predicted(cands, k=2, round=4, deadline_s=5.0)
    assert sel.chosen == ["new", "known"] and sel.explored == ["new"]


def test_random_baseline_is_seeded_and_bad_input_refused():
    ids = [f"c{i}" for i in range(10)]
    assert select_random(ids, 3, 1, seed=5) == select_random(list(reversed(ids)), 3, 1, seed=5)
    assert select_random(ids, 3, 1) != select_random(ids, 3, 2)
    with pytest.raises(ValueError, match="k must"):
        select_predicted(_fleet(), k=0, round=1, deadline_s=1)
    with pytest.raises(ValueError, match="deadline"):
        select_predicted(_fleet(), k=1, round=1, deadline_s=0)
