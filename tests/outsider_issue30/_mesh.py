"""Helpers for the outsider checks of issue 30 (the hub's hot path): a LocalMesh with the hub as
its own process, extra users made with ``mesh-hub token create``, and task functions that record
each execution in a file so a test can count how often each task really ran."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from cloud_hub.broker import find_mosquitto
from cloud_hub.client import Client
from cloud_hub.localmesh import LocalMesh

REPO = Path(__file__).resolve().parents[2]
MESH_HUB = str(Path(sys.executable).parent / "mesh-hub")


def need_mosquitto() -> None:
    import pytest

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")


@contextlib.contextmanager
def mesh(tmp: Path, *, lease_s: float = 10.0, env: dict[str, str] | None = None, **kw: Any) -> Iterator[LocalMesh]:
    """A LocalMesh with the hub as its own ``mesh-hub serve`` process (``env`` is set in this process
    while the hub starts, so the hub inherits it: MESH_HUB_LIMITS and the like)."""
    need_mosquitto()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    m = LocalMesh(tmp / "mesh", hub_process=True, lease_s=lease_s, **kw)
    try:
        m.start()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield m
    finally:
        m.stop()


def make_user(m: LocalMesh, name: str) -> Client:
    out = subprocess.run([MESH_HUB, "token", "create", "--user", name, "--db", str(m.hub_cfg.db_path)],
                         capture_output=True, text=True, timeout=30, check=True)
    token = out.stdout.strip().splitlines()[-1].strip()
    assert token.startswith("cm_"), out
    c = Client(m.url, token)
    c.outsider_token = token  # type: ignore[attr-defined]
    return c


def logs(m: LocalMesh, tail: int = 4000) -> str:
    parts = []
    for p in [m.workdir / "hub.log", *sorted((m.workdir / "agents").glob("*.log"))]:
        if p.exists():
            parts.append(f"--- {p}\n{p.read_text(errors='replace')[-tail:]}")
    return "\n".join(parts)


def record(path: str, key: str, payload: bytes = b"", sleep: float = 0.0) -> tuple[str, int, str]:
    """The task: append ``key`` to ``path`` (one line per execution), then answer who it was."""
    import hashlib
    import os as _os
    import time as _time

    fd = _os.open(path, _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT, 0o644)
    try:
        _os.write(fd, f"{key} {_os.getpid()} {_time.time():.4f}\n".encode())
    finally:
        _os.close(fd)
    if sleep:
        _time.sleep(sleep)
    return (key, len(payload), hashlib.sha256(payload).hexdigest())


def expected(key: str, payload: bytes = b"") -> tuple[str, int, str]:
    import hashlib

    return (key, len(payload), hashlib.sha256(payload).hexdigest())


def runs(path: str | Path) -> Counter[str]:
    p = Path(path)
    if not p.exists():
        return Counter()
    return Counter(line.split()[0] for line in p.read_text().splitlines() if line)


def run_lines(path: str | Path) -> list[tuple[str, int, float]]:
    """(key, worker pid, time) per execution."""
    p = Path(path)
    out = []
    for line in (p.read_text().splitlines() if p.exists() else []):
        k, pid, t = line.split()
        out.append((k, int(pid), float(t)))
    return out


def wait_all(futs: list[Any], timeout: float) -> tuple[list[Any], list[Any]]:
    """Wait for every future within ``timeout``; returns (done, not done)."""
    from concurrent.futures import wait

    done, pending = wait(futs, timeout=timeout)
    return list(done), list(pending)


def result_tuple(v: Any) -> tuple[Any, ...]:
    return tuple(v) if isinstance(v, (list, tuple)) else v


def scratch(prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    return d


def rm(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True)


def until(pred: Any, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())
