"""The shared wait helper (tests/waiting.py): returns what the predicate returned, and a timeout
names what was awaited with the logs that explain it."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.waiting import wait_for


def test_returns_the_first_truthy_value() -> None:
    calls = itertools.count()
    assert wait_for(lambda: next(calls) >= 3 and "ready", "a counter", 5, step=0.001) == "ready"


def test_timeout_names_what_and_shows_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_text("x" * 3000 + "the reason it never came")
    with pytest.raises(AssertionError, match=r"(?s)timed out after 0\.05 s waiting for the impossible.*the reason it never came"):
        wait_for(lambda: None, "the impossible", 0.05, step=0.01, logs=[log])
