"""The hub's embedded store (cloud_hub.kv.server.KVServer), the real server, run on its own event
loop thread on a free loopback port, for tests that need it without a whole hub."""

from __future__ import annotations

import asyncio
import secrets
import threading
from typing import Any

from cloud_hub.kv.server import KVServer


class KVThread:
    def __init__(self, **kw: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.server = KVServer("127.0.0.1", 0, secret=secrets.token_bytes(32), **kw)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="kv-store")
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def url(self, user: str = "alice") -> str:
        return self.server.url(user)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
