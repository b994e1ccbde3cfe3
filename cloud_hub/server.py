"""Running the hub: in the foreground (``mesh-hub serve``) or on a background thread (tests, demo).

The background form runs a real uvicorn server on a real port in its own event loop, so tests
talk HTTP to it exactly as users do, and can stop and restart it against the same database.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from typing import Any

import uvicorn

from cloud_hub.api.app import create_app
from cloud_hub.service.hub import Hub
from cloud_hub.config import HubConfig
from mesh_agent import costs

__all__ = ["serve", "HubThread", "HubStartError", "listen_summary"]

log = logging.getLogger("cloud_hub")


def _server(cfg: HubConfig) -> uvicorn.Server:
    from mesh_agent.redact import register_secret

    register_secret(*cfg.secrets())  # masked in every log line of this process (mesh_agent/_logs.py)
    app = create_app(cfg)
    tls = {}
    if cfg.tls_cert_file or cfg.tls_key_file:  # HTTPS (mesh-hub serve --tls-cert/--tls-key); checked before binding
        from cloud_hub.tls import load_server_pair

        if not (cfg.tls_cert_file and cfg.tls_key_file):
            raise ValueError("HTTPS needs both a certificate and its key (--tls-cert and --tls-key)")
        load_server_pair(cfg.tls_cert_file, cfg.tls_key_file)
        tls = {"ssl_certfile": str(cfg.tls_cert_file), "ssl_keyfile": str(cfg.tls_key_file)}
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=3,
                            log_config=None,  # uvicorn's lines go through the hub's handler: one format (text or json)
                            **tls)  # type: ignore[arg-type]
    return uvicorn.Server(config)


def listen_summary(cfg: HubConfig) -> str:
    """One line naming every address the hub serves or dials, for the log at start-up."""
    parts = [f"REST {'https' if cfg.tls_cert_file else 'http'}://{cfg.host}:{cfg.port}"]
    if cfg.mqtt_host:
        login = f" as {cfg.mqtt_username}" if cfg.mqtt_username else " (anonymous)"
        parts.append(f"MQTT broker mqtt://{cfg.mqtt_host}:{cfg.mqtt_port}{login}")
    else:
        parts.append("no MQTT")
    parts.append(f"ZeroMQ {cfg.zmq_bind}" if cfg.zmq_bind else "no ZeroMQ")
    parts.append(f"database {_safe_url(cfg.database_url)}" if cfg.database_url else f"database {cfg.db_path}")
    return ", ".join(parts)


def _safe_url(url: str) -> str:
    """A database URL without its password (it ends up in logs)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        u = urlsplit(url)
        if u.password:
            u = u._replace(netloc=u.netloc.replace(f":{u.password}@", ":***@"))
        return urlunsplit(u)
    except ValueError:
        return "(unparsable URL)"


class HubStartError(RuntimeError):
    """The hub could not start; the message is one line naming what and why (for the CLI)."""


class _StartupFailureInOneLine(logging.Filter):
    """uvicorn logs a failed start-up as a traceback plus "Application startup failed"; when the
    hub recorded why, ``serve`` raises that as one line instead, so drop uvicorn's copy."""

    def __init__(self, hub: Hub) -> None:
        super().__init__()
        self.hub = hub

    def filter(self, record: logging.LogRecord) -> bool:
        return self.hub.startup_error is None or record.levelno < logging.ERROR


def _freeze_startup_objects() -> None:
    """Move everything alive once the hub has started (modules, the app, schemas, the store: a few
    hundred thousand objects that live as long as the process) out of the garbage collector's
    sight. Why: a full collection walks every tracked object, and the hub's hot path allocates
    enough to trigger one every few batches; the CPU ledger charged 50-90 us per batched task to
    ``gc.gen2``, a fifth of the hub's CPU, and none after this (issue 30, docs/benchmarks.md).
    Garbage is collected first, so nothing collectable is frozen; what the hub allocates later is
    collected as before."""
    gc.collect()
    gc.freeze()


def serve(cfg: HubConfig) -> None:
    """Run until SIGTERM/SIGINT; logs the listen addresses once the port is bound, and the stop.
    Raises :class:`HubStartError` (one line) when start-up fails: a hub that did not start must
    never look like one that stopped cleanly (exit status 0) to systemd or a script."""
    from cloud_hub.broker import port_holder, port_taken

    if cfg.port and port_taken(cfg.host, cfg.port):  # before anything starts (uvicorn would exit mid-start-up)
        raise HubStartError(f"{cfg.host}:{cfg.port} is already in use by {port_holder(cfg.host, cfg.port) or 'another process'} (choose another --port)")
    server = _server(cfg)
    hub: Hub = server.config.app.state.hub
    quiet = _StartupFailureInOneLine(hub)
    uv_log = logging.getLogger("uvicorn.error")
    uv_log.addFilter(quiet)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            log.info("hub listening: %s", listen_summary(cfg))
            costs.start("hub")  # only with MESH_COST_LEDGER set (bench/hotpath.py)
            _freeze_startup_objects()
        await task

    try:
        asyncio.run(main())
    finally:
        uv_log.removeFilter(quiet)
    if not server.started:
        err = hub.startup_error
        from mesh_agent.redact import redact

        raise HubStartError(redact(_one_line(err)) if err is not None else "the hub did not start (see the log above)")


def _one_line(exc: BaseException) -> str:
    from cloud_hub.store import StoreError

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if isinstance(exc, StoreError) else f"{type(exc).__name__}: {text}"


class HubThread:
    """A hub on a free port in a background thread; ``url``, ``token`` (bootstrap user), ``stop()``."""

    def __init__(self, cfg: HubConfig) -> None:
        if cfg.port == 0:
            from cloud_hub.broker import free_port

            cfg = cfg.model_copy(update={"port": free_port(cfg.host)})
        self.cfg = cfg
        self.server = _server(cfg)
        self._thread = threading.Thread(target=self._run, name="hub", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.cfg.tls_cert_file else 'http'}://{self.cfg.host}:{self.cfg.port}"

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
            asyncio.run(self._serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.server.serve()

    def start(self, timeout: float = 20.0, *, wait_broker: bool = True) -> "HubThread":
        """Start and wait until REST serves. ``wait_broker``: then also wait (at most 10 s more)
        for the MQTT link's first connect attempt to end, either way, so that agents started right
        after are heard at their first hello (``mesh-hub serve`` does not wait: REST never waits
        on the broker)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"hub failed to start: {self._error or self.hub.startup_error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError("hub did not start")
            time.sleep(0.02)
        if wait_broker:
            deadline = time.monotonic() + 10.0
            while not all(getattr(link, "attempted", True) for link in list(self.hub.dispatcher.links)) and time.monotonic() < deadline:
                time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Stop and wait until the lifespan shutdown has run (links closed, ports released):
        a restart on the same ports right after must not find them still taken. On a loaded
        machine that shutdown (graceful HTTP close, profile save, store close) can take seconds."""
        self.server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"hub thread did not stop within {timeout:.0f}s; where it waits:\n{self._where()}")

    def _where(self) -> str:
        """The hub thread's stack and its event loop's pending tasks: what a stop is waiting on."""
        import sys
        import traceback

        frame = sys._current_frames().get(self._thread.ident or -1)
        out = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
        loop = getattr(self, "_loop", None)
        if loop is not None:
            for t in asyncio.all_tasks(loop):
                out += f"task {t.get_name()}:\n"
                coro: Any = t.get_coro()
                for _ in range(30):  # the await chain, outermost first
                    frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                    if frame is not None:
                        out += f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n"
                    nxt = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
                    if nxt is None:
                        if coro is not None and frame is None:
                            out += f"    awaiting {coro!r}\n"
                        break
                    coro = nxt
            import gc
            import types

            for gen in gc.get_objects():  # an async generator (a lifespan) hides its await chain from its task
                if isinstance(gen, types.AsyncGeneratorType) and gen.ag_frame is not None and gen.ag_await is not None:
                    out += f"async generator {gen.ag_code.co_name} at {gen.ag_frame.f_code.co_filename}:{gen.ag_frame.f_lineno}:\n"
                    coro = gen.ag_await
                    for _ in range(30):
                        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                        if frame is not None:
                            out += f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n"
                        nxt = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
                        if nxt is None:
                            out += f"    awaiting {coro!r}\n"
                            break
                        coro = nxt
        return out

    def __enter__(self) -> "HubThread":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
