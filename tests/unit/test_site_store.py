"""The site's LAN blob store (mesh_agent/site_store.py) over a real agent SQLite queue, and the
pure helpers of fl.sites: content addressing holds against a store that answers other bytes,
and bad input gets a clear error and stores nothing."""

from __future__ import annotations

import asyncio
import hashlib
import struct
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from cloud_hub.broker import free_port
from fl.sites import SiteError, lan_update, site_stores, task_weights_blob
from mesh_agent.site_store import SiteStore, SiteStoreError, get_blob, parse_address, put_blob
from mesh_agent.store import AgentStore


class Served:
    """A SiteStore on its own event loop thread, over a real AgentStore file."""

    def __init__(self, path: Path, **kw: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self._t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._t.start()
        self.port = free_port()
        self.agent_store = self.call(AgentStore(path).open())
        self.store = SiteStore(self.agent_store, "127.0.0.1", self.port, **kw)
        self.call(self.store.start())
        self.addr = f"127.0.0.1:{self.port}"

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(20)

    def count(self) -> int:
        async def n() -> int:
            cur = await self.agent_store.db.execute("SELECT COUNT(*) FROM functions")
            return int((await cur.fetchone())[0])

        return self.call(n())

    def close(self) -> None:
        self.call(self.store.stop())
        self.call(self.agent_store.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._t.join(5)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    s = Served(tmp_path / "queue.sqlite3", max_blob=1 << 20, max_bytes=3 << 20)
    yield s
    s.close()


def test_put_get_round_trip_is_content_addressed(served: Served) -> None:
    blob = b"model" * 1000
    key = put_blob(served.addr, blob)
    assert key == hashlib.sha256(blob).hexdigest()
    assert put_blob(served.addr, blob) == key  # idempotent
    assert get_blob(served.addr, key) == blob
    assert served.count() == 1
    # the blob lives in the gateway's content-addressed functions cache (one cache per site)
    assert served.call(served.agent_store.function_bodies([key])) == {key: blob}


def test_bad_requests_get_clear_errors_and_store_nothing(served: Served) -> None:
    with pytest.raises(SiteStoreError, match="no blob"):
        get_blob(served.addr, "0" * 64)
    with pytest.raises(SiteStoreError, match="not a blob key"):
        get_blob(served.addr, "../../etc/passwd")
    with pytest.raises(SiteStoreError, match="over the site store's limit"):
        put_blob(served.addr, b"x" * ((1 << 20) + 1))
    assert served.count() == 0
    import socket

    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:  # an unknown op
        s.sendall(struct.pack(">4sQ", b"DEL ", 0))
        status, n = struct.unpack(">BQ", s.recv(9))
        assert status == 2 and b"unknown request" in s.recv(n)
    assert served.count() == 0 and served.store.stats["refused"] == 2
    for bad in ("nohost", "h:0", "h:x", ":1", "a:b:c"):
        with pytest.raises(SiteStoreError, match="not a site store address"):
            parse_address(bad)


def test_blobs_stored_over_the_lan_are_bounded(served: Served) -> None:
    keys = [put_blob(served.addr, bytes([i]) * (900 * 1024)) for i in range(5)]  # 4.5 MiB against a 3 MiB bound
    assert served.store.stats["evicted"] == 2
    with pytest.raises(SiteStoreError, match="no blob"):
        get_blob(served.addr, keys[0])
    assert get_blob(served.addr, keys[-1]) == bytes([4]) * (900 * 1024)


def test_a_store_answering_other_bytes_is_caught() -> None:
    """Anyone on the LAN could answer at the store's address: the reader checks the hash."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    port = free_port()

    async def liar(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        op, n = struct.unpack(">4sQ", await reader.readexactly(12))
        await reader.readexactly(n)
        body = b"a" * 64 if op == b"PUT " else b"tampered model"
        writer.write(struct.pack(">BQ", 0, len(body)) + body)
        await writer.drain()
        writer.close()

    server = asyncio.run_coroutine_threadsafe(asyncio.start_server(liar, "127.0.0.1", port), loop).result(10)
    try:
        with pytest.raises(SiteStoreError, match="SHA-256 is not"):
            get_blob(f"127.0.0.1:{port}", hashlib.sha256(b"the real model").hexdigest())
        with pytest.raises(SiteStoreError, match="answered key"):
            put_blob(f"127.0.0.1:{port}", b"an update")
        # a child fetching its round's model through fl.sites gets the error, never the bytes
        task = {"weights_ref": hashlib.sha256(b"m").hexdigest(), "site_store": f"127.0.0.1:{port}"}
        with pytest.raises(SiteStoreError):
            task_weights_blob(task)
    finally:
        server.close()
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)


def test_fl_sites_helpers(served: Served) -> None:
    assert task_weights_blob({"weights": b"inline"}) == b"inline"
    with pytest.raises(SiteError, match="needs site_store"):
        task_weights_blob({"weights_ref": "0" * 64})
    with pytest.raises(SiteError, match="not a blob key"):
        task_weights_blob({"weights_ref": "zz", "site_store": served.addr})
    out = lan_update({"site_store": served.addr}, {"weights": b"update", "num_samples": 3})
    assert out == {"weights_ref": hashlib.sha256(b"update").hexdigest(), "bytes_lan": 6, "num_samples": 3}
    with pytest.raises(SiteError, match="needs site_store"):
        lan_update({}, {"weights": b"u"})
    rows = {"g1": {"online": True, "info": {"site": {"store": "10.0.0.1:1885"}}},
            "g2": {"online": False, "info": {"site": {"store": "10.0.0.2:1885"}}},
            "g3": {"online": True, "info": {"site": {"broker": "10.0.0.3:1884"}}},
            "g4": {"online": True, "info": {}}}
    assert site_stores(rows, ["g1", "g2", "g3", "g4", "missing"]) == {"g1": "10.0.0.1:1885"}
