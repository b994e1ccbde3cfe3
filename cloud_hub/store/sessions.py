"""Sessions: what the hub writes when an endpoint says hello or is lost. They touch the queue
(leases go back) and the registry (online, info, availability history), so they sit on both.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from cloud_hub.store.endpoints import EndpointStore
from cloud_hub.store.tasks import TaskStore, _requeue


class SessionStore(TaskStore, EndpointStore):
    """A hello's and a lost session's writes, each one transaction."""

    async def open_session(self, endpoint_id: str, held: set[str], now: float, info: dict[str, Any], transition: bool) -> tuple[int, int]:
        """A hello's writes, in one transaction: the endpoint's leases go back to the queue, acked
        tasks its agent no longer holds too, the row says online with the hello's info, and (for a
        new session) the availability history gets its transition. Returns (leases re-queued,
        acked tasks lost). Why one: a herd of hellos paid four fsynced transactions each, and they
        queued every other frame behind them (docs/benchmarks.md, swarm)."""
        from cloud_hub.store.availability import record_transition

        if self._group is None:  # a store that runs its own transactions (PostgreSQL): one call each, as before
            requeued = await self.requeue(endpoint_id=endpoint_id)
            lost = await self.requeue(endpoint_id=endpoint_id, not_in=held)
            await self.set_endpoint_state(endpoint_id, True, now, info)
            if transition:
                await self.tx(record_transition, endpoint_id, True, now)
            return requeued, lost

        def q(db: sqlite3.Connection) -> tuple[int, int]:
            requeued = _requeue(db, endpoint_id, None, None)
            lost = _requeue(db, endpoint_id, None, held)
            db.execute("UPDATE endpoints SET online=1, last_seen=?, info=? WHERE id=?", (now, json.dumps(info), endpoint_id))
            if transition:
                record_transition(db, endpoint_id, True, now)
            return requeued, lost

        return await self.tx(q)

    async def close_session(self, endpoint_id: str, last_seen: float, info: dict[str, Any]) -> int:
        """A lost session's writes in one transaction: its leases back to the queue (acked tasks
        stay on the device), the row offline, the transition recorded. Returns leases re-queued."""
        from cloud_hub.store.availability import record_transition

        if self._group is None:
            n = await self.requeue(endpoint_id=endpoint_id)
            await self.set_endpoint_state(endpoint_id, False, last_seen, info)
            await self.tx(record_transition, endpoint_id, False, last_seen)
            return n

        def q(db: sqlite3.Connection) -> int:
            n = _requeue(db, endpoint_id, None, None)
            db.execute("UPDATE endpoints SET online=0, last_seen=?, info=? WHERE id=?", (last_seen, json.dumps(info), endpoint_id))
            record_transition(db, endpoint_id, False, last_seen)
            return n

        return await self.tx(q)
