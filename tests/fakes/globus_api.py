"""A fake Globus Auth + Transfer service on 127.0.0.1 (the HTTP boundary only).

globus-sdk is pointed at it with ``GLOBUS_SDK_SERVICE_URL_AUTH`` / ``GLOBUS_SDK_SERVICE_URL_TRANSFER``
(the SDK's own override variables). It implements the calls the hub and the agent make: token
introspection, the client-credentials grant, transfer submission (with a submission id), task
status and cancel. Collections are local directories; a transfer copies the file between them,
fails like Globus does when the source is missing (``FILE_NOT_FOUND``), or, for collections
marked slow, stays ACTIVE until cancelled.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

__all__ = ["FakeGlobus"]


@dataclass
class FakeGlobus:
    clients: dict[str, str] = field(default_factory=dict)  # client id -> secret
    tokens: dict[str, dict[str, Any]] = field(default_factory=dict)  # access token -> introspection answer
    collections: dict[str, Path] = field(default_factory=dict)  # collection id -> directory
    slow: set[str] = field(default_factory=set)  # collections whose transfers never finish
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    fail_auth: bool = False  # answer 500 on introspection (Globus having a bad day)
    issued: set[str] = field(default_factory=set)  # transfer tokens from the client-credentials grant

    def start(self) -> "FakeGlobus":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, payload: Any) -> None:
                out = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def _handle(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                fake.requests.append((self.command, self.path))
                status, payload = fake._route(self.command, urlsplit(self.path).path, raw, self.headers)
                self._reply(status, payload)

            do_GET = do_POST = _handle

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def env(self) -> dict[str, str]:
        """What points globus-sdk here."""
        return {"GLOBUS_SDK_SERVICE_URL_AUTH": self.url, "GLOBUS_SDK_SERVICE_URL_TRANSFER": self.url}

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def count(self, path: str) -> int:
        return sum(1 for _, p in self.requests if p.startswith(path))

    # ------------------------------------------------------------------ routes
    def _client(self, headers: Any) -> str | None:
        auth = headers.get("Authorization", "")
        if not auth.startswith("Basic "):
            return None
        cid, _, secret = base64.b64decode(auth[6:]).decode().partition(":")
        return cid if self.clients.get(cid) == secret else None

    def _route(self, method: str, path: str, raw: bytes, headers: Any) -> tuple[int, Any]:
        if path == "/v2/oauth2/token/introspect" and method == "POST":
            if self.fail_auth:
                return 500, {"errors": [{"code": "InternalError"}]}
            if self._client(headers) is None:
                return 401, {"errors": [{"code": "UNAUTHORIZED", "detail": "bad client credentials"}]}
            token = parse_qs(raw.decode()).get("token", [""])[0]
            return 200, self.tokens.get(token, {"active": False})
        if path == "/v2/oauth2/token" and method == "POST":
            if self._client(headers) is None:
                return 401, {"error": "invalid_client"}
            token = "transfer-" + uuid.uuid4().hex
            self.issued.add(token)
            return 200, {"access_token": token, "expires_in": 172800, "token_type": "Bearer", "other_tokens": [],
                         "resource_server": "transfer.api.globus.org", "scope": "urn:globus:auth:scope:transfer.api.globus.org:all"}
        if path.startswith("/v0.10/"):
            if headers.get("Authorization", "").removeprefix("Bearer ") not in self.issued:
                return 401, {"code": "AuthenticationFailed", "message": "no valid token"}
            return self._transfer(method, path[len("/v0.10"):], raw)
        return 404, {"code": "NotFound", "message": f"fake globus: {method} {path}"}

    def _transfer(self, method: str, path: str, raw: bytes) -> tuple[int, Any]:
        if path == "/submission_id":
            return 200, {"value": str(uuid.uuid4())}
        if path == "/transfer" and method == "POST":
            doc = json.loads(raw)
            tid = str(uuid.uuid4())
            src, dst = doc["source_endpoint"], doc["destination_endpoint"]
            task: dict[str, Any] = {"task_id": tid, "status": "ACTIVE", "nice_status": "Queued", "fatal_error": None, "label": doc.get("label")}
            self.tasks[tid] = task
            if src not in self.slow and dst not in self.slow:
                for item in doc["DATA"]:
                    s = self.collections[src] / item["source_path"].lstrip("/")
                    d = self.collections[dst] / item["destination_path"].lstrip("/")
                    if not s.is_file():
                        task.update(status="FAILED", nice_status="FILE_NOT_FOUND",
                                    fatal_error={"code": "FILE_NOT_FOUND", "description": f"No such file: {item['source_path']}"})
                        break
                    d.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(s, d)
                else:
                    task.update(status="SUCCEEDED", nice_status=None)
            return 202, {"DATA_TYPE": "transfer_result", "code": "Accepted", "task_id": tid, "submission_id": doc.get("submission_id")}
        if path.startswith("/task/") and path.endswith("/cancel") and method == "POST":
            task = self.tasks[path.split("/")[2]]
            task.update(status="FAILED", nice_status="CANCELED")
            return 200, {"code": "Canceled", "message": "The task has been cancelled."}
        if path.startswith("/task/") and method == "GET":
            task = self.tasks.get(path.split("/")[2])
            return (200, task) if task else (404, {"code": "TaskNotFound"})
        return 404, {"code": "NotFound", "message": f"fake transfer: {method} {path}"}
