"""One logging set-up for the hub and the agent, with repeated warnings rate-limited.

Why: a hub whose broker is unreachable, or an agent whose uplink is down, retries every few
seconds and used to log the same WARNING each time: hours of identical lines that bury the one
line that matters, and on a Pi they wear the SD card. :class:`RateLimitFilter` lets the first
records of a kind through (a burst of five by default), then none until ``interval_s`` has passed,
and the next one says how many like it were suppressed in between, so nothing is silently hidden. Records are "of a kind" when they come
from the same logger at the same level with the same format string (``record.msg``): "link down
(%s); retrying in %.1fs" is one kind whatever the reason and delay.

Stdlib only: the agent stays light.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable, TextIO

__all__ = ["RateLimitFilter", "setup_logging", "LOG_FORMAT"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def setup_logging(level: str | int = "INFO", *, stream: TextIO | None = None, interval_s: float = 60.0, burst: int = 5) -> RateLimitFilter:
    """Configure the root logger for a command-line process (``mesh-hub serve``, ``mesh-agent start``).

    The filter sits on the handler, so it sees records from every logger (filters on a logger miss
    records propagated from its children)."""
    if isinstance(level, str):
        level = level.upper()
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    limiter = RateLimitFilter(interval_s, burst=burst)
    handler.addFilter(limiter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return limiter
