"""Fair leasing: which queued tasks of a shared endpoint go out next (docs/operations.md, "Limits,
shares and 429").

The store counts; :func:`cloud_hub.admission.plan_lease` decides. Why the counting is shaped like
this: a flood of 50,000 tasks by one user must not make every lease scan 50,000 rows. The queue is
read per (user, function) *flow* through the ``tasks_flow`` index (migration 10): one index probe
finds each flow (a skip scan written out as two plain index ranges), and its count is capped at what one
lease may take, so a lease costs O(flows x batch), not O(queue).

The same SQL runs on SQLite and, through the PostgreSQL store's translation, on PostgreSQL (which
adds ``FOR UPDATE SKIP LOCKED`` to the final per-flow selects; cloud_hub/store/postgres.py).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from cloud_hub.admission import AdmissionPolicy, Flow, plan_lease

__all__ = ["MAX_FLOWS", "MAX_FLOWS_PER_USER", "flows", "plan", "frame_order", "select_sql"]

#: Distinct (user, function) flows one lease looks at, and per user: a user with many functions
#: queued must not hide the users whose ids sort after theirs (its further functions, by id, wait until
#: one of its first 16 has nothing queued here).
MAX_FLOWS = 256
MAX_FLOWS_PER_USER = 16


def flows(db: Any, endpoint_id: str, cap: int) -> list[Flow]:
    """The endpoint's queued work per (user, function), each count capped at ``cap``."""
    out: list[Flow] = []
    last: tuple[str, str] | None = None
    of_user = 0
    for _ in range(MAX_FLOWS):
        # Two plain ranges, not one row-value range: SQLite walks ``(user_id, function_id) > (u, f)``
        # from the first entry of user u, i.e. through all of u's queue (7 ms at 50,000 queued).
        row = None
        if last is not None and of_user < MAX_FLOWS_PER_USER:  # the same user's next function
            row = db.execute(
                "SELECT user_id, function_id, created FROM tasks WHERE endpoint_id=? AND state='queued' AND user_id=? AND function_id > ? "
                "ORDER BY function_id, created LIMIT 1", (endpoint_id, *last)).fetchone()
        if row is None:  # the next user
            row = db.execute(
                "SELECT user_id, function_id, created FROM tasks WHERE endpoint_id=? AND state='queued' AND user_id > ? "
                "ORDER BY user_id, function_id, created LIMIT 1", (endpoint_id, last[0] if last else "")).fetchone()
        if row is None:
            break
        user, fid, oldest = row
        n = db.execute("SELECT COUNT(*) FROM (SELECT 1 FROM tasks WHERE endpoint_id=? AND state='queued' AND user_id=? AND function_id=? LIMIT ?) q",
                       (endpoint_id, user, fid, cap)).fetchone()[0]
        out.append(Flow(user, fid, int(n), float(oldest)))
        of_user = of_user + 1 if last is not None and last[0] == user else 1
        last = (user, fid)
    return out


def _marks(n: int) -> str:
    return ",".join("?" * n)


def plan(db: Any, endpoint_id: str, n: int, policy: AdmissionPolicy) -> list[tuple[str, str, int]]:
    """``[(user, function, count)]`` to lease from this endpoint now, under the policy."""
    fl = flows(db, endpoint_id, n)
    if not fl:
        return []
    users = sorted({f.user_id for f in fl})
    if len(fl) == 1 and not policy.caps_running:  # one flow: nothing to share (the common case)
        return [(fl[0].user_id, fl[0].function_id, min(n, fl[0].queued))]
    running = dict(db.execute("SELECT user_id, COUNT(*) FROM tasks WHERE endpoint_id=? AND state IN ('leased','acked') GROUP BY user_id",
                              (endpoint_id,)).fetchall())
    names = dict(db.execute(f"SELECT id, name FROM users WHERE id IN ({_marks(len(users))})", users).fetchall())
    weights = {u: policy.share(u, names.get(u)) for u in users}
    user_room: dict[str, int | None] = {}
    function_room: dict[str, int | None] = {}
    if policy.caps_running:
        capped = [u for u in users if policy.user_limits(u, names.get(u)).max_running is not None]
        if capped:
            busy = dict(db.execute(f"SELECT user_id, COUNT(*) FROM tasks WHERE state IN ('leased','acked') AND user_id IN ({_marks(len(capped))}) "
                                   "GROUP BY user_id", capped).fetchall())
            for u in capped:
                user_room[u] = max(0, int(policy.user_limits(u, names.get(u)).max_running or 0) - int(busy.get(u, 0)))
        fids = sorted({f.function_id for f in fl if policy.function_limits(f.function_id).max_running is not None})
        if fids:
            busy = dict(db.execute(f"SELECT function_id, COUNT(*) FROM tasks WHERE state IN ('leased','acked') AND function_id IN ({_marks(len(fids))}) "
                                   "GROUP BY function_id", fids).fetchall())
            for fid in fids:
                function_room[fid] = max(0, int(policy.function_limits(fid).max_running or 0) - int(busy.get(fid, 0)))
    return plan_lease(n, fl, {u: int(c) for u, c in running.items()}, weights=weights, user_room=user_room,
                      function_room=function_room, fair=policy.fair)


def frame_order(picked: Mapping[str, list[Any]], fair: bool, created: Callable[[Any], float]) -> list[Any]:
    """One frame's tasks in the order the agent should run them.

    Fair: each user's tasks together, users in the order :func:`plan` first served them (the
    least served first). Not alternating task by task: two users' tasks often run in different
    environments (a shared endpoint sandboxes other users' functions, issue 16 item 1), and an
    agent with a few warm workers would restart a worker for almost every task (measured: a
    100-task run under a flood did not finish in 80 s). Fairness is kept across leases, which are
    small (an agent's credit is its capacity plus prefetch). Without fairness: arrival order."""
    if not fair:
        return sorted((t for ts in picked.values() for t in ts), key=created)
    return [t for ts in picked.values() for t in ts]


def select_sql(extra: str = "") -> str:
    """One flow's oldest tasks (``extra``: PostgreSQL's row locks)."""
    return ("SELECT id, function_id, args, timeout, expires, created, user_id, placed FROM tasks WHERE endpoint_id=? AND state='queued' "
            f"AND user_id=? AND function_id=? ORDER BY created, rowid LIMIT ?{extra}")
