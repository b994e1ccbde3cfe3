"""The light agent runner: what ``mesh-agent start`` becomes once the settings are validated.

Why a second entry point: the CLI needs typer, rich, httpx and pydantic (enrollment, tables,
validation with clear errors), about 32 MB of resident memory that a running agent never uses
again. So ``mesh-agent start`` validates the config and credentials in the CLI process, writes the
validated values to an inherited file descriptor (a memfd, or a pipe where there is none: never
argv or the environment, the credentials are secret, and never a file on disk) and ``exec``\\ s
``python -m mesh_agent.run --settings-fd N``. Same process id, so systemd, balena and anything
that sent the CLI a SIGTERM reach the agent.

This module and everything the agent imports on its idle path stay free of pydantic, typer, rich
and httpx (tests/integration/test_agent_runner.py checks the running process).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from mesh_agent.settings import ConfigError, build, register_credentials

__all__ = ["main", "hand_over", "read_settings", "HEAVY_MODULES"]

log = logging.getLogger("mesh_agent")

#: What the runner must not load: the CLI's and the validator's packages.
HEAVY_MODULES = ("pydantic", "pydantic_core", "typer", "rich", "httpx", "click", "yaml")


def hand_over(payload: dict[str, Any]) -> int:
    """An inheritable descriptor holding ``payload`` as JSON, positioned at its start."""
    data = json.dumps(payload, separators=(",", ":")).encode()
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("mesh-agent-settings", 0)  # no CLOEXEC: the runner inherits it
        _write_all(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd
    r, w = os.pipe()
    if len(data) >= 2**16:  # more than a pipe holds before its reader (the exec'd runner) exists
        os.close(r)
        os.close(w)
        raise ConfigError(f"settings of {len(data)} bytes are too large to hand to the agent runner on this system")
    _write_all(w, data)
    os.close(w)
    os.set_inheritable(r, True)
    return r


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def read_settings(fd: int) -> dict[str, Any]:
    """Read and close what :func:`hand_over` wrote."""
    chunks = []
    try:
        while chunk := os.read(fd, 2**16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return json.loads(b"".join(chunks))


def _loaded_packages() -> list[str]:
    return sorted({name.partition(".")[0] for name in list(sys.modules)})


def _error(message: str) -> None:
    from mesh_agent.redact import redact

    print(f"error: {redact(message)}", flush=True)  # where `mesh-agent start` printed its errors (stdout)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    opts = dict(zip(args[::2], args[1::2]))
    if "--settings-fd" not in opts:
        _error("mesh_agent.run is started by `mesh-agent start`, which hands it validated settings (--settings-fd)")
        return 2
    from mesh_agent._logs import setup_logging

    level, fmt = opts.get("--log-level", "INFO"), opts.get("--log-format")
    setup_logging(level, stream=sys.stderr, fmt=fmt)
    payload = read_settings(int(opts["--settings-fd"]))
    cfg, creds = build(payload["config"], payload["credentials"], payload["shapes"])
    register_credentials(creds)  # every log line of this process masks the key and passwords (mesh_agent/redact.py)
    setup_logging(level, stream=sys.stderr, fmt=fmt, fields={"endpoint_id": cfg.endpoint_id})  # every line names this endpoint
    from mesh_agent import costs
    from mesh_agent.agent import Agent
    from mesh_agent.store import StoreError

    costs.start("agent")  # the CPU ledger's writer, only with MESH_COST_LEDGER set (mesh_agent/costs.py)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Agent(cfg, creds, worker_env=payload.get("worker_env")).run(stop)  # type: ignore[arg-type]

    try:
        asyncio.run(run())
    except StoreError as exc:
        _error(str(exc))
        return 3
    except ConfigError as exc:  # e.g. engine: parsl without Parsl installed
        _error(str(exc))
        return 2
    except Exception:  # a bug or a broken machine: the traceback goes through the log, secrets masked
        log.critical("agent stopped by an unexpected error", exc_info=True)
        return 1
    finally:
        # For tests and operators: proof that the running agent stayed light (HEAVY_MODULES absent).
        log.debug("runner modules: %s", " ".join(_loaded_packages()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
