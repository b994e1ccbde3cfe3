"""LAN reconnects without a hello, the pure parts (issue 29 item 2, docs/sites.md "LAN reconnects").

The gateway folds a device's resumed heartbeat (naming a new connection) into its liveness row as
a new connection epoch, and judges wills against that connection; the hub keeps the session of a
device that resumes through a row off the LAN (its offline bound runs from that row), and ends at
once the session of one that says hello anyway. The processes are in
tests/integration/test_site_lan_resume.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cloud_hub.config import HubConfig
from cloud_hub.dispatcher import Dispatcher, _Session
from cloud_hub.store import SqliteStore
from mesh_agent.gateway import Gateway
from mesh_agent.protocol import BadFrame, Envelope, Kind, encode
from mesh_agent.protocol.bodies import validate_body
from mesh_agent.protocol.envelope import _parse_header
from mesh_agent.protocol.site import ROW_FIELDS

KEY = bytes(range(32))
DEV = "ep-0123456789ab"


def _gateway() -> Any:
    """The state Gateway._into_row works on, without a broker, an uplink or a queue."""
    gw = SimpleNamespace(_rows={}, _conns={}, _info={}, _info_dirty={}, _dirty=set(), cfg=SimpleNamespace(site=SimpleNamespace(hold=8)),
                         queued=0)
    gw._queue_up = lambda device, frame, at_once: setattr(gw, "queued", gw.queued + 1)
    return gw


def _fold(gw: Any, kind: Kind, body: dict[str, Any]) -> tuple[bool, bool]:
    frame = encode(Envelope(kind, DEV, body), KEY)
    k, _ep, _mid, _ts, _exp, end, z = _parse_header(frame)
    return asyncio.run(Gateway._into_row(gw, DEV, k, frame, end, z))


def _row(gw: Any) -> dict[str, int]:
    return dict(zip(ROW_FIELDS, gw._rows[DEV]))


def test_a_resumed_heartbeat_is_a_new_connection_epoch_and_takes_over_the_will() -> None:
    gw = _gateway()
    assert _fold(gw, Kind.HELLO, {"nonce": "n1", "capacity": 2, "conn": "c1"}) == (False, False)  # the hello still goes up
    assert _row(gw)["lan"] == 1 and _row(gw)["epoch"] == 1
    assert _fold(gw, Kind.HEARTBEAT, {"running": 1, "want": 0}) == (True, False)  # an ordinary beat: folded
    assert _fold(gw, Kind.GONE, {"conn": "c1"}) == (True, False)  # the LAN link died: off the LAN
    assert _row(gw)["lan"] == 0 and _row(gw)["epoch"] == 1
    # back on a new connection of the same process, without a hello
    assert _fold(gw, Kind.HEARTBEAT, {"running": 1, "want": 0, "conn": "c2"}) == (True, True)
    assert _row(gw)["lan"] == 1 and _row(gw)["epoch"] == 2
    assert "conn" not in gw._info[DEV], "the connection id is the gateway's business, not a heartbeat field for the hub"
    assert _fold(gw, Kind.HEARTBEAT, {"running": 0, "want": 1, "conn": "c2"}) == (True, False)  # the same connection
    assert _row(gw)["epoch"] == 2
    # the will of the old connection, published late (a takeover), is stale; the new one's counts
    assert _fold(gw, Kind.GONE, {"conn": "c1"}) == (True, False) and _row(gw)["lan"] == 1
    assert _fold(gw, Kind.GONE, {"conn": "c2"}) == (True, False) and _row(gw)["lan"] == 0


def test_a_heartbeat_conn_must_be_a_short_ascii_string() -> None:
    validate_body(Kind.HEARTBEAT, {"want": 1, "conn": "0011223344556677"})
    for bad in ("", "x" * 65, 7, "c\u00e9"):
        with pytest.raises(BadFrame, match="heartbeat body: conn"):
            validate_body(Kind.HEARTBEAT, {"want": 1, "conn": bad})


class _Link:
    name = "mqtt"

    async def send(self, endpoint_id: str, frame: bytes) -> None:
        return None


def _row_off(lan: int) -> dict[str, int]:
    return dict(zip(ROW_FIELDS, [lan, 1, 1, 0, 0, 0, 0, 0]))


def test_the_hub_keeps_a_resuming_device_through_a_row_off_the_lan(tmp_path: Path) -> None:
    async def main() -> None:
        store = await SqliteStore(tmp_path / "hub.sqlite3").open()
        try:
            cfg = HubConfig(db_path=tmp_path / "hub.sqlite3", lost_after_s=4.0, mqtt_lost_after_s=60.0, beat_max_s=1800.0)
            d = Dispatcher(cfg, store, None)  # type: ignore[arg-type]
            user = await store.create_user("alice")
            tok = await store.create_enroll_token(user, 3600, 3)
            gw, dev, old = [(await store.enroll_endpoint(tok, n, "mqtt", KEY))["id"] for n in ("gw", "dev", "old")]  # type: ignore[index]
            d._site_of = {dev: gw, old: gw}
            now = time.time()
            g = d._sessions[gw] = _Session(gw, _Link(), now)  # type: ignore[arg-type]
            g.site_frames = g.site_resume = True
            s = d._sessions[dev] = _Session(dev, _Link(), now - 3.0, resume=True)  # type: ignore[arg-type]
            d._sessions[old] = _Session(old, _Link(), now - 3.0)  # type: ignore[arg-type]  # a device that says hello anyway
            await d._site_rows(gw, [(dev, _row_off(0)), (old, _row_off(0))], {dev, old}, _Link())  # type: ignore[arg-type]
            assert d._sessions.get(dev) is s and s.last_seen >= now, "kept: its offline bound runs from the row"
            assert old not in d._sessions, "a device that says hello when back is ended at once, as before"
            assert d._on_lan[dev] is False
            s.last_seen = now - 100.0
            await d._site_rows(gw, [(dev, _row_off(0))], {dev}, _Link())  # type: ignore[arg-type]  # the full summary repeats it
            assert s.last_seen == now - 100.0, "a repeated row off the LAN does not extend the bound"
            await d._site_rows(gw, [(dev, _row_off(1))], {dev}, _Link())  # type: ignore[arg-type]  # back, resumed
            assert d._sessions.get(dev) is s and s.last_seen >= now and d._on_lan[dev] is True
            # the bound: lost_after_s on the lan profile; for a device that beats on change its MQTT
            # offline bound, not beat_max_s on top (its will came already)
            assert d._off_lan_bound(s) == 4.0
            s.bound = d.silence_bound(adaptive=True)
            assert d._off_lan_bound(s) == 60.0
        finally:
            await store.close()

    asyncio.run(main())


def test_a_gateway_back_without_resume_has_its_resuming_devices_asked_for_a_hello(tmp_path: Path) -> None:
    """An older gateway (or site frames turned off) would judge a resumed device's will against the
    connection of its last hello: its devices told to resume are asked for a hello (whose welcome
    no longer says resume), keep their sessions meanwhile, and are asked again at their next row on
    the LAN until they say it; a row off the LAN then ends them at once, as before."""
    from mesh_agent.protocol import decode

    class _Capture(_Link):
        def __init__(self) -> None:
            self.sent: list[tuple[str, bytes]] = []

        async def send(self, endpoint_id: str, frame: bytes) -> None:
            self.sent.append((endpoint_id, frame))

    async def main() -> None:
        store = await SqliteStore(tmp_path / "hub.sqlite3").open()
        try:
            d = Dispatcher(HubConfig(db_path=tmp_path / "hub.sqlite3", lost_after_s=4.0), store, None)  # type: ignore[arg-type]
            user = await store.create_user("alice")
            tok = await store.create_enroll_token(user, 3600, 2)
            gw, dev = [(await store.enroll_endpoint(tok, n, "mqtt", KEY))["id"] for n in ("gw", "dev")]  # type: ignore[index]
            d._keys[dev] = KEY
            d._site_of = {dev: gw}
            link = _Capture()
            now = time.time()
            g = d._sessions[gw] = _Session(gw, link, now)  # type: ignore[arg-type]
            g.site_frames = True  # ... and no resume: an older gateway's hello
            s = d._sessions[dev] = _Session(dev, link, now, resume=True)  # type: ignore[arg-type]
            await d._resume_withdrawn(gw, now)
            assert d._sessions.get(dev) is s and not s.resume and s.resume_withdrawn
            asked = [decode(f, KEY).body for ep, f in link.sent if ep == dev]
            assert asked and asked[-1]["code"] == "hello_required"
            d._hello_asked.clear()  # past the 2 s rate limit
            await d._site_rows(gw, [(dev, _row_off(1))], {dev}, link)  # type: ignore[arg-type]
            assert len([ep for ep, _f in link.sent if ep == dev]) == len(asked) + 1, "asked again at its next row on the LAN"
            await d._site_rows(gw, [(dev, _row_off(0))], {dev}, link)  # type: ignore[arg-type]
            assert dev not in d._sessions, "no longer kept off the LAN"
        finally:
            await store.close()

    asyncio.run(main())
