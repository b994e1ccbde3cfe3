"""The invariant check at the end of a run (DESIGN invariants 1 and 2), from three independent
witnesses that must agree:

* the SDK: what ``submit_batch`` accepted (HTTP 2xx, with task ids) and every row the result
  stream delivered, duplicates included (the stream is read raw, never de-duplicated);
* the hub's database: task states, lease attempts, stored results;
* the run logs the workload functions write on the agents: the true number of executions.

Findings: a task accepted but with no delivered result is **lost**; delivered more than once is
**duplicated**; a result whose value is not the one its own arguments produce is **wrong**; an
error result from a function that does not raise is an **unexpected error**. Re-executions
(at-least-once at work) are counted, not failures.
"""

from __future__ import annotations

import base64
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cloud_hub.client._results import decode_result

from .functions import expected
from .workload import TaskPlan, payload_of

__all__ = ["Records", "check", "percentiles", "reconnect_delays"]


@dataclass
class Records:
    seed: int
    plan: list[TaskPlan]
    accepted: dict[int, tuple[str, str, float]] = field(default_factory=dict)  # seq -> (task id, key, accepted at)
    deliveries: dict[str, list[tuple[float, bool, str]]] = field(default_factory=dict)  # task id -> [(t, ok, b64 data)]
    hub_tasks: dict[str, tuple[str, str, int]] = field(default_factory=dict)  # task id -> (endpoint, state, attempts)
    hub_results: dict[str, tuple[int, bool, bytes]] = field(default_factory=dict)  # task id -> (rows, ok, data)
    runs: Counter[str] = field(default_factory=Counter)  # key -> executions seen in the run logs
    submit_attempts: int = 0
    submit_failures: int = 0
    ambiguous_submits: int = 0  # failed after the request may have reached the hub


def percentiles(xs: list[float]) -> dict[str, float | int | None]:
    if not xs:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    s = sorted(xs)

    def q(p: float) -> float:
        k = (len(s) - 1) * p
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"count": len(s), "p50": round(q(0.5), 4), "p99": round(q(0.99), 4), "max": round(s[-1], 4)}


def _outcome(row: tuple[float, bool, str]) -> tuple[bool, Any]:
    _, ok, data = row
    return decode_result(ok, base64.b64decode(data))


def check(r: Records) -> dict[str, Any]:
    by_seq = {p.seq: p for p in r.plan}
    lost_sdk: list[str] = []
    lost_hub: list[str] = []
    dup_sdk: list[str] = []
    dup_hub: list[str] = []
    wrong: list[str] = []
    unexpected: Counter[str] = Counter()
    expected_errors = 0
    accepted_ids = set()
    for seq, (tid, key, _) in r.accepted.items():
        accepted_ids.add(tid)
        p = by_seq[seq]
        rows = r.deliveries.get(tid, [])
        if not rows:
            lost_sdk.append(tid)
        elif len(rows) > 1:
            dup_sdk.append(tid)
        hub = r.hub_results.get(tid)
        if hub is None:
            lost_hub.append(tid)
        elif hub[0] > 1:
            dup_hub.append(tid)
        if not rows:
            continue
        if hub is not None and (hub[1] != rows[0][1] or base64.b64encode(hub[2] or b"").decode() != rows[0][2]):
            wrong.append(tid)  # the SDK got something other than what the hub stored
            continue
        try:
            ok, value = _outcome(rows[0])
        except Exception as exc:  # a result the SDK cannot decode is a wrong result
            wrong.append(tid)
            unexpected[f"undecodable: {type(exc).__name__}"] += 1
            continue
        want = expected(p.fn, key, payload_of(r.seed, seq, p.size), p.param)
        if p.fn == "fail":
            if ok or not isinstance(value, ValueError) or str(value) != want:
                wrong.append(tid)
            else:
                expected_errors += 1
        elif not ok:
            unexpected[getattr(value, "remote_type", type(value).__qualname__)] += 1
        elif value != want:
            wrong.append(tid)
    unknown = [t for t in r.deliveries if t not in accepted_ids]
    hub_only = [t for t in r.hub_tasks if t not in accepted_ids]
    # Executions: run-log lines per key; the accepted key of each task should appear at least once.
    accepted_keys = {key for _, key, _ in r.accepted.values()}
    runs_accepted = {k: n for k, n in r.runs.items() if k in accepted_keys}
    never_ran = [k for k in accepted_keys if k not in r.runs]
    reexec = sum(n - 1 for n in runs_accepted.values() if n > 1)
    attempts_extra = sum(max(0, a - 1) for t, (_, _, a) in r.hub_tasks.items() if t in accepted_ids)
    not_done = sum(1 for t, (_, st, _) in r.hub_tasks.items() if t in accepted_ids and st != "done")
    invariants = {
        "planned": len(r.plan),
        "accepted": len(r.accepted),
        "not_accepted": len(r.plan) - len(r.accepted),
        "delivered": sum(1 for t in accepted_ids if r.deliveries.get(t)),
        "lost": len(set(lost_sdk) | set(lost_hub)),
        "lost_sdk": len(lost_sdk),
        "lost_hub": len(lost_hub),
        "duplicated": len(set(dup_sdk) | set(dup_hub)),
        "duplicated_sdk": len(dup_sdk),
        "duplicated_hub": len(dup_hub),
        "wrong_results": len(wrong),
        "unexpected_errors": dict(unexpected),
        "expected_errors": expected_errors,
        "hub_tasks_not_done": not_done,
        "delivered_unknown_to_sdk": len(unknown),
        "hub_only_tasks": len(hub_only),
        "examples": {"lost": (lost_sdk + lost_hub)[:5], "duplicated": (dup_sdk + dup_hub)[:5], "wrong": wrong[:5]},
    }
    invariants["ok"] = (
        invariants["lost"] == 0 and invariants["duplicated"] == 0 and not wrong and not unexpected
        and invariants["not_accepted"] == 0 and not_done == 0
    )
    executions = {
        "runs": sum(r.runs.values()),
        "tasks_run": len(runs_accepted),
        "re_executions": reexec,
        "tasks_re_executed": sum(1 for n in runs_accepted.values() if n > 1),
        "delivered_without_a_logged_run": len(never_ran),
        "hub_extra_attempts": attempts_extra,
        "runs_of_hub_only_tasks": sum(n for k, n in r.runs.items() if k not in accepted_keys),
    }
    return {"invariants": invariants, "executions": executions,
            "submits": {"attempts": r.submit_attempts, "failed": r.submit_failures, "ambiguous": r.ambiguous_submits}}


def reconnect_delays(tasks: list[tuple[float, float, str]], disruptions: dict[str, list[tuple[float, float]]],
                     shared: dict[str, list[tuple[float, float]]] | None = None) -> list[float]:
    """Delivery delay after reconnect: for every task whose life ``[accepted, delivered]`` was
    touched by a disruption of its agent (link down, process dead, hub or broker down) that ended
    before delivery, ``delivered - end of the last such disruption``.

    ``tasks``: (accepted at, delivered at, agent); ``disruptions``: agent -> intervals;
    ``shared``: agent -> intervals that hit it through a shared part (hub, broker)."""
    out: list[float] = []
    for acc, done, agent in tasks:
        last_end = None
        for a, b in (disruptions.get(agent, []) + (shared or {}).get(agent, [])):
            if a <= done and b >= acc and b <= done and (last_end is None or b > last_end):
                last_end = b
        if last_end is not None:
            out.append(done - last_end)
    return out
