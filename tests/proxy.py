"""The emulator's fault proxy (sim/emulate/proxy.py) on its own event loop, for synchronous tests.

Why: tests that cut a link (a gateway's uplink, a metered device's LTE) drive processes from
plain threads, while the proxy is asyncio. One helper owns that bridge, so every test cuts,
restores and counts the same way and stops the loop it started.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, Literal, TypeVar

from sim.emulate.proxy import FaultProxy

T = TypeVar("T")

__all__ = ["ProxyThread"]


class ProxyThread:
    """A started :class:`FaultProxy` in front of ``upstream``; every call is run on its loop."""

    def __init__(self, upstream: tuple[str, int], name: str = "uplink") -> None:
        self.loop = asyncio.new_event_loop()
        self._t = threading.Thread(target=self.loop.run_forever, daemon=True, name=f"proxy-{name}")
        self._t.start()
        self.proxy = FaultProxy(name, upstream)
        self.run(self.proxy.start())

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the proxy's loop and return its result (bounded)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def port(self) -> int:
        """Where clients connect instead of ``upstream``."""
        return int(self.proxy.port)

    @property
    def stats(self) -> dict[str, int]:
        """A copy of the proxy's counters (connections, resets, bytes up and down, ...)."""

        async def snap() -> dict[str, int]:
            return dict(self.proxy.stats)

        return self.run(snap(), 5)

    def bytes(self) -> int:
        """Bytes that crossed the link, both ways."""
        s = self.stats
        return int(s["bytes_up"] + s["bytes_down"])

    def cut(self, mode: Literal["reset", "blackhole"] = "reset", cause: str = "test") -> None:
        """Take the link down (``reset``: connections refused and reset; ``blackhole``: bytes vanish)."""
        self._call(self.proxy.cut, cause, mode)

    def restore(self, cause: str = "test") -> None:
        self._call(self.proxy.restore, cause)

    def stop(self) -> None:
        self.run(self.proxy.stop(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._t.join(5)

    def _call(self, fn: Any, *args: Any) -> None:
        """A plain call made on the loop and waited for (cutting aborts connections there)."""

        async def go() -> None:
            fn(*args)

        self.run(go(), 10)
