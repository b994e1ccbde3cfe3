"""Shared helpers of the issue-30b outsider check: a tracker of submit -> done times, the hub's
stored results (exactly once), and diagnostics for tasks that never came back."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterable

STRAND_S = 15.0  # a task slower than this on an idle mesh with free workers is stranded


def val(x: int) -> int:
    return x * 3 + 1


def work(x, delay=0.0, mark=None):  # module level: shipped by value (a test module is the user's own)
    import time as _t
    if delay:
        _t.sleep(delay)
    if mark:
        with open(mark, "a") as fh:
            fh.write(f"{x}\n")
    return x * 3 + 1


def hub_log(workdir: Path) -> Path:
    """The in-process hub logs through Python logging: keep WARNING and up in a file."""
    path = Path(workdir) / "hub-inproc.log"
    h = logging.FileHandler(path)
    h.setLevel(logging.WARNING)
    h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger().addHandler(h)
    return path


def drop_log(path: Path) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == Path(path).resolve():
            root.removeHandler(h)
            h.close()


class Tracker:
    """Submit time and done time per key; a future completing twice would show as a second callback."""

    def __init__(self) -> None:
        self.sub: dict[Any, float] = {}
        self.done: dict[Any, float] = {}
        self.calls: dict[Any, int] = {}
        self.futs: dict[Any, cf.Future] = {}
        self.expect: dict[Any, int] = {}
        self.floor: dict[Any, float] = {}  # when a task became deliverable again (agent restarted)
        self._lock = threading.Lock()

    def submit(self, ex, key, x: int, *, delay: float = 0.0, mark: str | None = None, now: bool = False) -> cf.Future:
        assert key not in self.sub, key
        t = time.monotonic()
        fut = (ex.submit_now if now else ex.submit)(work, x, delay, mark)
        self.sub[key] = t
        self.futs[key] = fut
        self.expect[key] = val(x)

        def cb(f, key=key):
            with self._lock:
                self.calls[key] = self.calls.get(key, 0) + 1
                self.done.setdefault(key, time.monotonic())
        fut.add_done_callback(cb)
        return fut

    def reset_floor(self, keys: Iterable[Any], t: float) -> None:
        for k in keys:
            if k not in self.done:
                self.floor[k] = t

    def pending(self) -> list[Any]:
        return [k for k, f in self.futs.items() if not f.done()]

    def wait(self, keys: Iterable[Any], timeout: float, client=None, logs: Iterable[Path] = ()) -> None:
        keys = list(keys)
        _, not_done = cf.wait([self.futs[k] for k in keys], timeout=timeout)
        if not_done:
            stuck = [k for k in keys if not self.futs[k].done()]
            raise AssertionError(f"{len(stuck)} of {len(keys)} tasks not done {timeout:g} s after waiting began: "
                                 f"{describe(stuck[:5], self, client)}{tails(logs)}")

    def check(self, keys: Iterable[Any], *, what: str, bound: float = STRAND_S, client=None, logs: Iterable[Path] = ()) -> dict:
        keys = list(keys)
        bad_val, late = [], []
        lat = {}
        for k in keys:
            f = self.futs[k]
            assert f.done(), k
            exc = f.exception()
            if exc is not None:
                bad_val.append((k, repr(exc)[:300]))
                continue
            if f.result() != self.expect[k]:
                bad_val.append((k, f.result()))
            start = max(self.sub[k], self.floor.get(k, 0.0))
            lat[k] = self.done[k] - start
            if lat[k] > bound:
                late.append((k, round(lat[k], 2)))
        twice = {k: n for k, n in self.calls.items() if n != 1 and k in set(keys)}
        worst = max(lat.values(), default=0.0)
        over1 = sum(1 for v in lat.values() if v > 1.0)
        raw = max((self.done[k] - self.sub[k] for k in keys if k in self.done), default=0.0)
        print(f"\n[{what}] tasks={len(keys)} slowest(since deliverable)={worst:.2f}s slowest(since submit)={raw:.2f}s "
              f"over 1 s={over1}")
        assert not bad_val, f"{what}: wrong values or errors: {bad_val[:5]}"
        assert not twice, f"{what}: futures completed more than once: {twice}"
        assert not late, (f"{what}: {len(late)} tasks took longer than {bound} s (stranded until a watchdog or never): "
                          f"{sorted(late, key=lambda t: -t[1])[:8]}{tails(logs)}")
        return {"worst": worst, "raw": raw, "over1": over1}


def describe(keys, tr: Tracker, client) -> str:
    out = []
    for k in keys:
        f = tr.futs[k]
        tid = getattr(f, "task_id", None)
        st: Any = None
        if client is not None and tid:
            try:
                st = client.task_status(tid)
            except Exception as exc:  # noqa: BLE001
                st = repr(exc)
        out.append(f"\n  key={k} task={tid} placed_on={getattr(f, 'endpoint_id', None)} age={time.monotonic() - tr.sub[k]:.1f}s status={st}")
    return "".join(out)


def tails(logs: Iterable[Path], n: int = 2500) -> str:
    out = []
    for p in logs:
        p = Path(getattr(p, "log_path", p))
        if p.exists():
            out.append(f"\n--- {p.name}\n{p.read_text(errors='replace')[-n:]}")
    return "".join(out)


def hub_results_once(client, after: int, task_ids: Iterable[str], timeout: float = 30.0) -> dict[str, int]:
    """Read the hub's result stream from ``after`` until every id is there; fail on a duplicate."""
    want = set(task_ids)
    seen: dict[str, int] = {}
    cursor = after
    deadline = time.monotonic() + timeout
    for _ in range(1000):
        rows, cursor = client.result_stream(cursor, timeout_s=2.0, limit=5000)
        for r in rows:
            tid = r.get("task_id")
            if tid in want:
                seen[tid] = seen.get(tid, 0) + 1
        if want <= set(seen) or time.monotonic() > deadline:
            break
    missing = want - set(seen)
    dup = {t: n for t, n in seen.items() if n > 1}
    assert not missing, f"hub's result stream lacks {len(missing)} of {len(want)} results, e.g. {sorted(missing)[:3]}"
    assert not dup, f"hub stored/streamed results more than once: {list(dup.items())[:5]}"
    return seen


def marks(path: Path) -> dict[int, int]:
    c: dict[int, int] = {}
    if Path(path).exists():
        for line in Path(path).read_text().split():
            c[int(line)] = c.get(int(line), 0) + 1
    return c


def freeze(agent, on: bool) -> None:
    os.killpg(agent.proc.pid, signal.SIGSTOP if on else signal.SIGCONT)
