"""FL runs in the hub's store: run metadata, one record per round, the latest checkpoint.

Why the hub keeps this rather than the driver's own disk: the driver is often a laptop; a run
must survive the laptop sleeping and the hub restarting, and the console shows runs from the
hub. Rounds are stored strictly in order and each exactly once (a retried write of the last
round replaces it), and a round's record and its checkpoint commit in one transaction, so a
checkpoint never exists without its round and resuming never skips or repeats one.

Only the latest checkpoint is kept (models on a 10 MB-payload mesh are small, but a thousand
rounds of them are not).
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from typing import Any, Sequence

from cloud_hub.store.sqlite import SqliteStore

__all__ = ["FLStore", "FLNotFound", "FLConflict", "RUN_STATUSES"]

RUN_STATUSES = ("running", "finished", "failed", "aborted")
_SUMMARY_COLS = "id, name, status, error, strategy, mode, rounds_planned, rounds_done, clients, client_names, config, created, updated"


class FLNotFound(LookupError):
    """No such run for this user."""


class FLConflict(RuntimeError):
    """The write does not fit the run's state (wrong round number, run already over)."""


def _last_metrics(db: sqlite3.Connection, run_id: str) -> tuple[float | None, float | None]:
    loss = db.execute("SELECT loss FROM fl_rounds WHERE run_id=? AND loss IS NOT NULL ORDER BY round DESC LIMIT 1", (run_id,)).fetchone()
    acc = db.execute("SELECT accuracy FROM fl_rounds WHERE run_id=? AND accuracy IS NOT NULL ORDER BY round DESC LIMIT 1", (run_id,)).fetchone()
    return (loss[0] if loss else None), (acc[0] if acc else None)


def _summary(db: sqlite3.Connection, row: Sequence[Any]) -> dict[str, Any]:
    (rid, name, status, error, strategy, mode, planned, done, clients, names, config, created, updated) = row
    last_loss, last_acc = _last_metrics(db, rid)
    clients_l = json.loads(clients)
    return {
        "id": rid, "name": name, "status": status, "error": error, "strategy": strategy, "mode": mode,
        "rounds_planned": planned, "rounds_done": done, "num_clients": len(clients_l), "clients": clients_l,
        "client_names": json.loads(names), "config": json.loads(config), "last_loss": last_loss,
        "last_accuracy": last_acc, "created": created, "updated": updated,
    }


class FLStore:
    """FL run storage on top of the hub's :class:`SqliteStore` (same file, same DB thread)."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store

    async def create_run(self, user_id: str, *, name: str, strategy: str, mode: str, rounds_planned: int,
                         clients: list[str], client_names: dict[str, str], config: dict[str, Any]) -> dict[str, Any]:
        rid = "flr-" + uuid.uuid4().hex[:12]
        now = time.time()

        def q(db: sqlite3.Connection) -> dict[str, Any]:
            db.execute(
                "INSERT INTO fl_runs (id, user_id, name, status, strategy, mode, rounds_planned, clients, client_names, config, created, updated)"
                " VALUES (?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?)",
                (rid, user_id, name, strategy, mode, rounds_planned, json.dumps(clients), json.dumps(client_names),
                 json.dumps(config), now, now),
            )
            return self._get(db, user_id, rid)

        return await self.store.tx(q)

    @staticmethod
    def _row(db: sqlite3.Connection, user_id: str, run_id: str) -> Sequence[Any]:
        row = db.execute(f"SELECT {_SUMMARY_COLS} FROM fl_runs WHERE id=? AND user_id=?", (run_id, user_id)).fetchone()
        if row is None:
            raise FLNotFound(f"unknown FL run {run_id}")
        return row  # type: ignore[no-any-return]

    def _get(self, db: sqlite3.Connection, user_id: str, run_id: str) -> dict[str, Any]:
        run = _summary(db, self._row(db, user_id, run_id))
        run["rounds"] = [json.loads(r[0]) for r in db.execute("SELECT record FROM fl_rounds WHERE run_id=? ORDER BY round", (run_id,))]
        ck = db.execute("SELECT round, LENGTH(weights), created FROM fl_checkpoints WHERE run_id=?", (run_id,)).fetchone()
        run["checkpoint"] = {"round": ck[0], "bytes": ck[1], "created": ck[2]} if ck else None
        return run

    async def get_run(self, user_id: str, run_id: str) -> dict[str, Any]:
        return await self.store.tx(lambda db: self._get(db, user_id, run_id))

    async def list_runs(self, user_id: str, limit: int = 100, status: str | None = None) -> list[dict[str, Any]]:
        def q(db: sqlite3.Connection) -> list[dict[str, Any]]:
            sql = f"SELECT {_SUMMARY_COLS} FROM fl_runs WHERE user_id=?"
            args: list[Any] = [user_id]
            if status is not None:
                sql += " AND status=?"
                args.append(status)
            rows = db.execute(sql + " ORDER BY created DESC, id LIMIT ?", (*args, limit)).fetchall()
            out = []
            for row in rows:
                s = _summary(db, row)
                for k in ("clients", "client_names", "config", "error"):
                    s.pop(k)
                out.append(s)
            return out

        return await self.store.tx(q)

    async def put_round(self, user_id: str, run_id: str, round: int, record: dict[str, Any], weights: bytes,
                        state: dict[str, Any], status: str = "running") -> dict[str, Any]:
        now = time.time()

        def q(db: sqlite3.Connection) -> dict[str, Any]:
            row = self._row(db, user_id, run_id)
            cur_status, done = row[2], int(row[7])
            if cur_status in ("finished", "failed"):
                raise FLConflict(f"run {run_id} is {cur_status}; no more rounds can be stored")
            if round not in (done, done + 1) or round < 1:
                raise FLConflict(f"run {run_id} has {done} round(s) stored; the next round is {done + 1}, not {round}")
            db.execute(
                "INSERT INTO fl_rounds (run_id, round, record, loss, accuracy, created) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id, round) DO UPDATE SET record=excluded.record, loss=excluded.loss, accuracy=excluded.accuracy, "
                "created=excluded.created",
                (run_id, round, json.dumps(record), record.get("loss"), record.get("accuracy"), now),
            )
            db.execute(
                "INSERT INTO fl_checkpoints (run_id, round, weights, state, created) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (run_id) DO UPDATE SET round=excluded.round, weights=excluded.weights, state=excluded.state, "
                "created=excluded.created",
                (run_id, round, weights, json.dumps(state), now),
            )
            db.execute("UPDATE fl_runs SET rounds_done=?, status=?, error=NULL, updated=? WHERE id=?", (round, status, now, run_id))
            return {"run_id": run_id, "round": round, "status": status, "checkpoint_bytes": len(weights)}

        return await self.store.tx(q)

    async def get_checkpoint(self, user_id: str, run_id: str) -> dict[str, Any]:
        def q(db: sqlite3.Connection) -> dict[str, Any]:
            self._row(db, user_id, run_id)
            ck = db.execute("SELECT round, weights, state, created FROM fl_checkpoints WHERE run_id=?", (run_id,)).fetchone()
            if ck is None:
                raise FLNotFound(f"FL run {run_id} has no checkpoint yet (no round stored)")
            return {"run_id": run_id, "round": ck[0], "weights": bytes(ck[1]), "state": json.loads(ck[2]), "created": ck[3]}

        return await self.store.tx(q)

    async def set_status(self, user_id: str, run_id: str, status: str, error: str | None = None) -> dict[str, Any]:
        now = time.time()

        def q(db: sqlite3.Connection) -> dict[str, Any]:
            cur = self._row(db, user_id, run_id)[2]
            if cur == "finished" and status != "finished":
                raise FLConflict(f"run {run_id} is finished; it cannot become {status}")
            db.execute("UPDATE fl_runs SET status=?, error=?, updated=? WHERE id=?", (status, error, now, run_id))
            return self._get(db, user_id, run_id)

        return await self.store.tx(q)
