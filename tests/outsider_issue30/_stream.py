"""A bare client of the SDK stream (GET /v1/stream, docs/protocol.md "SDK stream"), to see exactly
what the hub answers and pushes, without the SDK's de-duplication in between."""

from __future__ import annotations

import json
import time
from typing import Any

from websockets.sync.client import connect


class RawStream:
    def __init__(self, url: str, token: str, after: int | None = None, early: bool = False) -> None:
        ws_url = url.replace("http://", "ws://").replace("https://", "wss://") + "/v1/stream"
        self.ws = connect(ws_url, additional_headers={"Authorization": f"Bearer {token}"},
                          open_timeout=10, max_size=None, proxy=None)
        hello: dict[str, Any] = {"op": "hello", "after": after}
        if early:
            hello["early"] = True
        self.ws.send(json.dumps(hello))
        self.welcome = json.loads(self.ws.recv(timeout=10))
        assert self.welcome.get("op") == "welcome", self.welcome
        self.cursor = self.welcome.get("cursor")
        self.rows: list[dict[str, Any]] = []
        self.frames: list[dict[str, Any]] = []
        self._ref = 0

    def _take(self, msg: dict[str, Any]) -> None:
        if msg.get("op") == "results":
            self.frames.append(msg)
            self.rows.extend(msg.get("results") or [])
            if msg.get("cursor") is not None:
                self.cursor = msg["cursor"]

    def submit(self, batch: dict[str, Any], timeout: float = 20.0) -> dict[str, Any]:
        self._ref += 1
        ref = self._ref
        self.ws.send(json.dumps({"op": "submit", "ref": ref, "batch": batch}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("op") in ("accepted", "refused") and msg.get("ref") == ref:
                return msg
            if msg.get("op") == "error":
                return msg
            self._take(msg)
        raise TimeoutError("no answer to the submit")

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                msg = json.loads(self.ws.recv(timeout=max(0.05, deadline - time.monotonic())))
            except TimeoutError:
                return
            self._take(msg)

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass
