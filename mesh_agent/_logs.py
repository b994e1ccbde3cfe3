"""One logging set-up for the hub and the agent, with repeated warnings rate-limited.

Why: a hub whose broker is unreachable, or an agent whose uplink is down, retries every few
seconds and used to log the same WARNING each time: hours of identical lines that bury the one
line that matters, and on a Pi they wear the SD card. :class:`RateLimitFilter` lets the first
records of a kind through (a burst of five by default), then none until ``interval_s`` has passed,
and the next one says how many like it were suppressed in between, so nothing is silently hidden. Records are "of a kind" when they come
from the same logger at the same level with the same format string (``record.msg``): "link down
(%s); retrying in %.1fs" is one kind whatever the reason and delay.

Structured logs: ``setup_logging(fmt="json")`` (``--log-format json``, or ``MESH_LOG_FORMAT=json``
for every process of the mesh) writes one JSON object per line, for Loki, journald's JSON export
or any log shipper, with the ids an operator filters by as fields of their own: ``task_id``,
``endpoint_id``, ``function_id`` and ``fl_run_id``. They come from ``extra=`` on a call, from
:func:`log_context` (every line logged inside a block, e.g. one FL run, gets them), or from the
process itself (an agent's own endpoint id). The text format keeps its one-line shape and appends
the same ids as ``key=value``. One module for the hub, the agent and the simulator, so that their
lines look alike and a single parser reads all three.

Secrets: both formatters pass the whole line, traceback included, through
:func:`mesh_agent.redact.redact` (URL passwords, ``password=...``, tokens, and every secret value
the process registered: the agent's key and broker password, the hub's). A secret reaches no log.

Stdlib only: the agent stays light.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, Mapping, TextIO

from mesh_agent.redact import redact

__all__ = ["RateLimitFilter", "setup_logging", "LOG_FORMAT", "LOG_FORMATS", "FORMAT_ENV", "ID_FIELDS", "JsonFormatter", "TextFormatter",
           "log_context", "resolve_format"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")
FORMAT_ENV = "MESH_LOG_FORMAT"  # one variable for hub, agent and simulator
ID_FIELDS = ("task_id", "endpoint_id", "function_id", "fl_run_id")  # the ids lines are searched by
_context: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("mesh_log_context", default={})


@contextlib.contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Every record logged inside the block (this task or thread, and tasks it starts) carries
    these ids, e.g. ``with log_context(fl_run_id=run.id):`` around an FL run. ``None`` is ignored."""
    token = _context.set({**_context.get(), **{k: str(v) for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class _IdsFilter(logging.Filter):
    """Copy the ids in effect (process fields, then :func:`log_context`) onto each record, unless
    the call already set them with ``extra=``. On the handler, so records of every logger get them."""

    def __init__(self, fields: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def filter(self, record: logging.LogRecord) -> bool:
        for source in (_context.get(), self.fields):
            for key, value in source.items():
                if getattr(record, key, None) is None:
                    setattr(record, key, value)
        return True


def _ids(record: logging.LogRecord) -> dict[str, str]:
    return {k: str(v) for k in ID_FIELDS if (v := getattr(record, k, None)) is not None}


class TextFormatter(logging.Formatter):
    """The classic one-line format, with the ids appended as ``key=value`` when a record has any."""

    def __init__(self) -> None:
        super().__init__(LOG_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = redact(super().format(record))
        ids = _ids(record)
        if not ids:
            return line
        head, sep, tail = line.partition("\n")  # a traceback stays below the line it belongs to
        return head + " " + " ".join(f"{k}={v}" for k, v in ids.items()) + sep + tail


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``msg``, the ids
    a record has, and ``exc`` (the traceback) when there is one. Never raises on odd values."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": redact(record.getMessage()),
            **_ids(record),
        }
        if record.exc_info:
            out["exc"] = redact(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = redact(record.exc_text)
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(out, ensure_ascii=False, default=str)


def resolve_format(fmt: str | None) -> str:
    """The format asked for (a flag or config value), else ``MESH_LOG_FORMAT``, else text.
    A wrong value is a clear ValueError, not a silent fall-back to text."""
    chosen = fmt if fmt else os.environ.get(FORMAT_ENV) or "text"
    chosen = chosen.strip().lower()
    if chosen not in LOG_FORMATS:
        source = "log format" if fmt else FORMAT_ENV
        raise ValueError(f"{source} must be one of {', '.join(LOG_FORMATS)}, not {chosen!r}")
    return chosen


class RateLimitFilter(logging.Filter):
    """Pass the first ``burst`` records of each kind in a window of ``interval_s``, drop the rest,
    and say how many were dropped on the first record of the next window.

    ``burst`` > 1 lets a short run of distinct events through whole (five forged frames in a row
    are five lines), while a warning repeated every few seconds still costs one line a minute.
    Only records at ``min_level`` or above are limited (INFO lines such as "online" always pass).
    ``clock`` is injectable so that a test can step time instead of sleeping."""

    def __init__(self, interval_s: float = 60.0, *, burst: int = 1, min_level: int = logging.WARNING, max_kinds: int = 1000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.burst = max(1, burst)
        self.min_level = min_level
        self.max_kinds = max_kinds
        self._clock = clock
        self._lock = threading.Lock()
        # kind -> [start of its window, records passed in it, records suppressed in it]
        self._seen: OrderedDict[tuple[str, int, str], list[float]] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.min_level:
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        with self._lock:
            state = self._seen.get(key)
            if state is not None and now - state[0] < self.interval_s:
                if state[1] < self.burst:
                    state[1] += 1
                    return True
                state[2] += 1
                return False
            suppressed = int(state[2]) if state is not None else 0
            self._seen[key] = [now, 1, 0]
            self._seen.move_to_end(key)
            while len(self._seen) > self.max_kinds:  # bounded memory whatever the messages
                self._seen.popitem(last=False)
        if suppressed:
            # Appended to the format string so that %-arguments still format; the note has no '%'.
            record.msg = f"{record.msg} [{suppressed} similar messages suppressed in the last {self.interval_s:.0f}s]"
        return True


def setup_logging(level: str | int = "INFO", *, stream: TextIO | None = None, interval_s: float = 60.0, burst: int = 5,
                  fmt: str | None = None, fields: Mapping[str, str] | None = None) -> RateLimitFilter:
    """Configure the root logger for a command-line process (``mesh-hub serve``, ``mesh-agent start``,
    ``mesh-sim``): ``fmt`` "text" or "json" (None: ``MESH_LOG_FORMAT``, else text); ``fields``: ids
    every line of this process carries (an agent's endpoint id). Raises ValueError on a wrong format.

    The filters sit on the handler, so they see records from every logger (filters on a logger miss
    records propagated from its children)."""
    chosen = resolve_format(fmt)
    if isinstance(level, str):
        level = level.upper()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    limiter = RateLimitFilter(interval_s, burst=burst)
    handler.addFilter(limiter)
    handler.addFilter(_IdsFilter(fields))
    handler._mesh_handler = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in list(root.handlers):
        # Ours from an earlier call (the agent sets up again once it knows its endpoint id); a
        # handler someone else installed (pytest's capture, an embedding application) stays.
        if getattr(old, "_mesh_handler", False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return limiter
