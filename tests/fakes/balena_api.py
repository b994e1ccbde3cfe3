"""A fake balena API (the pine/OData v7 endpoints balena-sdk calls) on 127.0.0.1, for fleet tests.

Only the HTTP boundary is imitated: the SDK, our fleet code and the hub are the real ones. It
answers the requests balena-sdk 17 makes for listing a fleet's devices and their environment
variables and for setting one (POST, then PATCH on a unique-constraint 409, as the SDK's upsert
does), checks the bearer token, and records every request so tests can assert what was changed.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["FakeBalena"]


@dataclass
class FakeBalena:
    token: str = "balena-test-token"
    fleets: dict[str, int] = field(default_factory=dict)  # slug -> application id
    devices: list[dict[str, Any]] = field(default_factory=list)  # id, uuid, device_name, is_online, app
    env: list[dict[str, Any]] = field(default_factory=list)  # id, device id, name, value
    requests: list[tuple[str, str, Any]] = field(default_factory=list)

    def add_device(self, fleet: str, name: str, online: bool, last_seen: str | None = "2026-11-23T10:00:00.000Z") -> str:
        app = self.fleets.setdefault(fleet, len(self.fleets) + 1)
        uuid = f"{len(self.devices) + 1:032x}"
        self.devices.append({"id": 100 + len(self.devices), "uuid": uuid, "device_name": name, "is_online": online,
                             "last_connectivity_event": last_seen, "app": app})
        return uuid

    def env_of(self, name: str) -> dict[str, str]:
        dev = next(d for d in self.devices if d["device_name"] == name)
        return {e["name"]: e["value"] for e in self.env if e["device"] == dev["id"]}

    @property
    def writes(self) -> list[tuple[str, str, Any]]:
        return [r for r in self.requests if r[0] != "GET"]

    # ------------------------------------------------------------------ server
    def start(self) -> "FakeBalena":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, payload: Any) -> None:
                out = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def _handle(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.requests.append((self.command, unquote(self.path), body))
                if self.headers.get("Authorization") != f"Bearer {fake.token}":
                    return self._reply(401, b"Unauthorized")
                status, payload = fake._route(self.command, urlsplit(self.path), body)
                self._reply(status, payload)

            do_GET = do_POST = do_PATCH = _handle

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _route(self, method: str, url: Any, body: Any) -> tuple[int, Any]:
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        flt = q.get("$filter", "")
        if method == "GET" and url.path == "/v7/application":
            slug = re.search(r"slug eq '([^']*)'", flt)
            app = self.fleets.get(slug.group(1)) if slug else None
            return 200, {"d": [{"id": app}] if app else []}
        if method == "GET" and url.path == "/v7/device":
            app = int(re.search(r"belongs_to__application eq (\d+)", flt).group(1))  # type: ignore[union-attr]
            devs = sorted((d for d in self.devices if d["app"] == app), key=lambda d: d["device_name"])
            return 200, {"d": [{k: v for k, v in d.items() if k != "app"} for d in devs]}
        m = re.fullmatch(r"/v7/device\(uuid='([0-9a-f]+)'\)", unquote(url.path))
        if method == "GET" and m:
            return 200, {"d": [{"id": d["id"]} for d in self.devices if d["uuid"] == m.group(1)]}
        if method == "GET" and url.path == "/v7/device_environment_variable":
            app = int(re.search(r"belongs_to__application eq (\d+)", flt).group(1))  # type: ignore[union-attr]
            ids = {d["id"] for d in self.devices if d["app"] == app}
            return 200, {"d": [{"id": e["id"], "device": {"__id": e["device"]}, "name": e["name"], "value": e["value"]}
                               for e in self.env if e["device"] in ids]}
        if method == "POST" and url.path == "/v7/device_environment_variable":
            if any(e["device"] == body["device"] and e["name"] == body["name"] for e in self.env):
                return 409, b'"unique" constraint violated'
            self.env.append({"id": len(self.env) + 1, **body})
            return 201, {"id": len(self.env), **body}
        if method == "PATCH" and url.path == "/v7/device_environment_variable":
            dev = int(re.search(r"device eq (\d+)", flt).group(1))  # type: ignore[union-attr]
            name = re.search(r"name eq '([^']*)'", flt).group(1)  # type: ignore[union-attr]
            for e in self.env:
                if e["device"] == dev and e["name"] == name:
                    e["value"] = body["value"]
            return 200, b"OK"
        return 404, {"error": f"fake balena: no route for {method} {url.path}"}
