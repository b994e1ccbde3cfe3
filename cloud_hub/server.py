"""Running the hub: in the foreground (``mesh-hub serve``) or on a background thread (tests, demo).

The background form runs a real uvicorn server on a real port in its own event loop, so tests
talk HTTP to it exactly as users do, and can stop and restart it against the same database.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from cloud_hub.api.app import Hub, create_app
from cloud_hub.config import HubConfig

__all__ = ["serve", "HubThread"]


def _server(cfg: HubConfig) -> uvicorn.Server:
    app = create_app(cfg)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=3)
    return uvicorn.Server(config)


def serve(cfg: HubConfig) -> None:
    _server(cfg).run()


class HubThread:
    """A hub on a free port in a background thread; ``url``, ``token`` (bootstrap user), ``stop()``."""

    def __init__(self, cfg: HubConfig) -> None:
        if cfg.port == 0:
            with socket.socket() as s:
                s.bind((cfg.host, 0))
                cfg = cfg.model_copy(update={"port": s.getsockname()[1]})
        self.cfg = cfg
        self.server = _server(cfg)
        self._thread = threading.Thread(target=self._run, name="hub", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    @property
    def hub(self) -> Hub:
        return self.server.config.app.state.hub  # type: ignore[no-any-return]

    @property
    def token(self) -> str:
        tok = self.hub.bootstrap_token
        assert tok, "configure bootstrap_user to get a token"
        return tok

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc

    def start(self, timeout: float = 20.0) -> "HubThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"hub failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("hub did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop and wait until the lifespan shutdown has run (links closed, ports released):
        a restart on the same ports right after must not find them still taken. On a loaded
        machine that shutdown (graceful HTTP close, profile save, store close) can take seconds."""
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"hub thread did not stop within {timeout:.0f}s")

    def __enter__(self) -> "HubThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
