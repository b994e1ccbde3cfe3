"""The result stream's Inbox and the ResultBus that fills it (cloud_hub/dispatcher.py, issue 30).

An Inbox is only a shortcut: ``take`` must answer None (read the store) whenever the rows it holds
might not be every result right after the stream's cursor, and the rows themselves otherwise."""

from __future__ import annotations

import asyncio
from typing import Any

from cloud_hub.dispatcher import Inbox, ResultBus


def _row(seq: int, tid: str | None = None) -> dict[str, Any]:
    return {"seq": seq, "task_id": tid or f"t{seq}", "ok": True, "data": b"x", "started": 1.0, "finished": 2.0,
            "endpoint_id": "ep", "own_endpoint": True, "trusted": True}


def _fresh_box() -> Inbox:
    """An inbox past its first take (the stream has read the store once)."""
    box = Inbox()
    assert box.take(0) is None
    return box


# ---------------------------------------------------------------- Inbox.take
def test_a_new_inbox_is_stale_once_then_empty() -> None:
    box = Inbox()
    assert box.stale
    assert box.take(0) is None, "a new stream reads the store first"
    assert not box.stale
    assert box.take(0) == [], "nothing added since: nothing to send, no store read"
    assert box.take(5) == []


def test_rows_added_while_stale_are_ignored() -> None:
    box = Inbox()
    box.add([_row(1), _row(2)])
    assert box.rows == []
    assert box.take(0) is None
    assert box.take(0) == [], "rows added before the first take were not kept"


def test_contiguous_rows_after_the_cursor_are_returned_once() -> None:
    box = _fresh_box()
    box.add([_row(4), _row(5)])
    box.add([_row(6)])
    assert [r["seq"] for r in box.take(3) or []] == [4, 5, 6]
    assert box.take(6) == [], "taken rows are not given again"


def test_rows_at_or_below_the_cursor_are_dropped() -> None:
    box = _fresh_box()
    box.add([_row(3), _row(4), _row(5), _row(6)])
    assert [r["seq"] for r in box.take(4) or []] == [5, 6]
    box.add([_row(5), _row(6)])  # the store read already sent them: all at or below the cursor
    assert box.take(6) == []


def test_a_gap_after_the_cursor_means_read_the_store() -> None:
    box = _fresh_box()
    box.add([_row(5), _row(6)])
    assert box.take(3) is None, "seq 4 is missing: the store has it"
    assert box.rows == [], "what was held is dropped; the store read covers it"
    assert not box.stale
    box.add([_row(5), _row(7)])
    assert box.take(4) is None, "a hole between held rows"
    box.add([_row(6), _row(5)])
    assert box.take(4) is None, "out of order is a gap too (the store orders them)"


def test_more_than_max_rows_held_turns_stale() -> None:
    box = _fresh_box()
    box.add([_row(i) for i in range(1, Inbox.MAX_ROWS + 1)])
    assert not box.stale and len(box.rows) == Inbox.MAX_ROWS
    box.add([_row(Inbox.MAX_ROWS + 1)])
    assert box.stale and box.rows == [], "a slow client: the store holds them"
    box.add([_row(Inbox.MAX_ROWS + 2)])
    assert box.rows == [], "added while stale: ignored"
    assert box.take(0) is None
    assert box.take(0) == []


def test_one_add_over_max_rows_at_once_turns_stale() -> None:
    box = _fresh_box()
    box.add([_row(i) for i in range(1, Inbox.MAX_ROWS + 2)])
    assert box.stale and box.rows == []
    assert box.take(0) is None


# ---------------------------------------------------------------- ResultBus
async def test_stored_fills_every_inbox_of_that_user_only_and_wakes_that_user() -> None:
    bus = ResultBus()
    a1, a2, b = bus.inbox("alice"), bus.inbox("alice"), bus.inbox("bob")
    for box in (a1, a2, b):
        assert box.take(0) is None
    ev_a, ev_b = bus.event("alice"), bus.event("bob")
    bus.stored({"alice": [_row(1), _row(2)]})
    assert ev_a.is_set() and not ev_b.is_set()
    assert bus.event("alice") is not ev_a, "a set event is handed out once; the next waiter gets a new one"
    assert [r["seq"] for r in a1.take(0) or []] == [1, 2]
    assert [r["seq"] for r in a2.take(0) or []] == [1, 2], "each stream of the user gets its own copy"
    assert b.take(0) == []
    bus.stored({"bob": [_row(1, "tb")]})
    assert ev_b.is_set()
    assert [r["task_id"] for r in b.take(0) or []] == ["tb"]
    assert a1.take(2) == []


async def test_stored_for_a_user_without_a_stream_still_wakes_waiters() -> None:
    bus = ResultBus()
    ev = bus.event("carol")
    bus.stored({"carol": [_row(1)]})
    assert ev.is_set()
    await asyncio.wait_for(ev.wait(), 1.0)


async def test_notify_marks_that_users_inboxes_stale_and_wakes() -> None:
    bus = ResultBus()
    a, b = bus.inbox("alice"), bus.inbox("bob")
    a.take(0), b.take(0)
    bus.stored({"alice": [_row(1)], "bob": [_row(1)]})
    ev_a, ev_b = bus.event("alice"), bus.event("bob")
    bus.notify({"alice"})  # e.g. a memo hit or an expiry: stored without rows at hand
    assert a.stale and not b.stale
    assert ev_a.is_set() and not ev_b.is_set()
    assert a.take(0) is None, "the store holds a result the inbox lacks"
    assert [r["seq"] for r in b.take(0) or []] == [1]
    bus.stored({"alice": [_row(2)]})
    assert [r["seq"] for r in a.take(1) or []] == [2], "fresh again after its store read"


def test_drop_inbox_stops_filling_it_and_forgets_the_user() -> None:
    bus = ResultBus()
    a1, a2 = bus.inbox("alice"), bus.inbox("alice")
    a1.take(0), a2.take(0)
    bus.drop_inbox("alice", a1)
    bus.stored({"alice": [_row(1)]})
    assert a1.take(0) == [], "a dropped inbox is no longer filled"
    assert [r["seq"] for r in a2.take(0) or []] == [1]
    bus.drop_inbox("alice", a2)
    assert "alice" not in bus._inboxes, "no inbox left: the user's entry goes"
    bus.drop_inbox("alice", a2)  # twice, or one never added: harmless
    bus.drop_inbox("nobody", Inbox())
    bus.stored({"alice": [_row(2)]})  # no inbox: nothing to fill, no error
