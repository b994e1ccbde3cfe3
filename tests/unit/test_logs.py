"""Structured logs (mesh_agent/_logs.py): one set-up for hub, agent and simulator, text or JSON,
with task, endpoint, function and FL run ids as fields. Real processes: ``mesh-hub serve`` and
``mesh-agent start`` (tests/integration/test_structured_logs.py)."""

from __future__ import annotations

import io
import json
import logging
from typing import Iterator

import pytest

from mesh_agent._logs import JsonFormatter, log_context, resolve_format, setup_logging


@pytest.fixture
def root_saved() -> Iterator[None]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def _lines(buf: io.StringIO) -> list[str]:
    return [line for line in buf.getvalue().splitlines() if line]


def test_json_lines_carry_ids_from_extra_context_and_process(root_saved: None) -> None:
    buf = io.StringIO()
    setup_logging("INFO", stream=buf, fmt="json", fields={"endpoint_id": "ep-1"})
    log = logging.getLogger("mesh_agent.engine.local")
    log.info("plain")
    log.warning("task %s timed out", "t1", extra={"task_id": "t1", "function_id": "f" * 64})
    with log_context(fl_run_id="run-7"):
        logging.getLogger("fl.drivers").info("round %d done", 3)
        with log_context(task_id="t2"):
            logging.getLogger("x").info("nested")
    logging.getLogger("x").info("after")  # the context is gone again
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    rows = [json.loads(line) for line in _lines(buf)]
    assert [r["msg"] for r in rows] == ["plain", "task t1 timed out", "round 3 done", "nested", "after", "failed"]
    assert all(r["endpoint_id"] == "ep-1" and r["ts"].endswith("Z") and r["level"] and r["logger"] for r in rows)
    assert rows[1]["task_id"] == "t1" and rows[1]["function_id"] == "f" * 64 and rows[1]["level"] == "WARNING"
    assert rows[2]["fl_run_id"] == "run-7" and "task_id" not in rows[2]
    assert rows[3]["fl_run_id"] == "run-7" and rows[3]["task_id"] == "t2"
    assert "fl_run_id" not in rows[4] and "task_id" not in rows[0]
    assert "RuntimeError: boom" in rows[5]["exc"] and "\n" not in _lines(buf)[5]


def test_text_format_keeps_its_shape_and_appends_ids(root_saved: None) -> None:
    buf = io.StringIO()
    setup_logging("INFO", stream=buf, fmt="text")
    logging.getLogger("cloud_hub.dispatcher").info("endpoint %s online", "ep-9", extra={"endpoint_id": "ep-9"})
    logging.getLogger("cloud_hub.dispatcher").info("no ids")
    first, second = _lines(buf)
    assert first.endswith("INFO cloud_hub.dispatcher: endpoint ep-9 online endpoint_id=ep-9")
    assert second.endswith("INFO cloud_hub.dispatcher: no ids")


def test_json_rate_limit_still_counts_suppressed(root_saved: None) -> None:
    buf = io.StringIO()
    setup_logging("INFO", stream=buf, fmt="json")
    for _ in range(12):
        logging.getLogger("mesh_agent.transport.mqtt").warning("cannot reach %s", "mqtt://x")
    assert len(_lines(buf)) == 5, "the rate limit applies to JSON lines as to text"


def test_format_comes_from_flag_then_env_then_text(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_LOG_FORMAT", raising=False)
    assert resolve_format(None) == "text"
    monkeypatch.setenv("MESH_LOG_FORMAT", "JSON")
    assert resolve_format(None) == "json"
    assert resolve_format("text") == "text", "a flag or config value wins over the environment"
    monkeypatch.setenv("MESH_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="MESH_LOG_FORMAT must be one of text, json, not 'xml'"):
        resolve_format(None)
    with pytest.raises(ValueError, match="log format must be one of text, json, not 'yaml'"):
        resolve_format("yaml")


def test_bad_format_leaves_logging_as_it_was(root_saved: None) -> None:
    root = logging.getLogger()
    before = list(root.handlers)
    with pytest.raises(ValueError):
        setup_logging("INFO", fmt="xml")
    assert root.handlers == before


def test_json_formatter_never_raises_on_odd_values() -> None:
    rec = logging.LogRecord("x", logging.INFO, __file__, 1, "value %s", (object(),), None)
    rec.task_id = b"\xff"  # not a str: still one valid JSON line
    out = json.loads(JsonFormatter().format(rec))
    assert out["msg"].startswith("value <object") and out["task_id"] == "b'\\xff'"


def test_setting_up_again_replaces_ours_and_keeps_foreign_handlers(root_saved: None) -> None:
    foreign = logging.StreamHandler(io.StringIO())
    logging.getLogger().addHandler(foreign)
    first, second = io.StringIO(), io.StringIO()
    setup_logging("INFO", stream=first, fmt="text")
    setup_logging("INFO", stream=second, fmt="json", fields={"endpoint_id": "ep-2"})  # the agent, once it knows its id
    logging.getLogger("x").warning("once")
    assert first.getvalue() == "" and [json.loads(line)["msg"] for line in _lines(second)] == ["once"]
    assert foreign in logging.getLogger().handlers and "once" in foreign.stream.getvalue()  # type: ignore[attr-defined]
