"""Data staging with Globus Transfer: file references as task arguments and results.

The hub caps payloads (10 MiB); big inputs and outputs move between Globus collections instead.
A caller passes a :class:`GlobusFile` as an argument::

    ex.submit(train, GlobusFile("<collection uuid>", "/project/shard-07.npz"))

and the endpoint, before running ``train``, transfers that file into its own collection (the
``globus:`` section of ``agent.yaml``) and calls ``train`` with the local :class:`~pathlib.Path`.
A function pushes an output back by returning ``GlobusFile.push(local_file, collection, path)``
(write it under :func:`output_path`); the endpoint transfers it after the run and the caller
receives the plain reference ``GlobusFile(collection, path)``. A transfer that fails or does not
finish within ``timeout_s`` fails the task with :class:`StagingError` saying which file and why
(a timed-out transfer is cancelled).

Where it runs, and why: in the worker process, around the user function (hooked into
``_worker.run_task``), because only the worker deserializes arguments; the agent process never
unpickles user data. Workers learn the settings from ``MESH_STAGING`` (set by the agent; JSON with
the credentials file path, not the secret). This module is imported by a worker only when an
argument holds a ``GlobusFile`` (unpickling imports it) or a function imports it, so tasks that
do not stage pay nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = ["GlobusFile", "StagingError", "output_path", "stage_in", "stage_out", "cleanup"]

_ENV = "MESH_STAGING"
_TERMINAL = {"SUCCEEDED", "FAILED"}
_clients: dict[str, Any] = {}
_current_task: str | None = None


class StagingError(Exception):
    """A Globus transfer for a task failed, timed out, or staging is not set up on this endpoint."""


@dataclass(frozen=True)
class GlobusFile:
    """A file on a Globus collection. ``local`` is set only on outputs still to be pushed."""

    collection: str
    path: str
    local: str | None = None

    @classmethod
    def push(cls, local: str | os.PathLike[str], collection: str, path: str) -> "GlobusFile":
        """An output: after the run, transfer ``local`` to ``collection:path``."""
        return cls(collection, path, os.fspath(local))

    def __post_init__(self) -> None:
        if not self.collection or not self.path.startswith("/"):
            raise ValueError(f"GlobusFile needs a collection id and an absolute path, got {self.collection!r}, {self.path!r}")


# ---------------------------------------------------------------------- settings


@dataclass(frozen=True)
class _Settings:
    local_collection: str
    local_root: Path
    staging_dir: Path
    timeout_s: float
    poll_s: float
    client_id: str
    client_secret: str = field(repr=False)


def _settings() -> _Settings:
    raw = os.environ.get(_ENV)
    if not raw:
        raise StagingError("this endpoint has no Globus staging configured (add a `globus:` section to agent.yaml)")
    cfg = json.loads(raw)
    try:
        creds = json.loads(Path(cfg["credentials_file"]).read_text())
        client_id, secret = creds["globus_client_id"], creds["globus_client_secret"]
    except (OSError, KeyError, ValueError) as exc:
        raise StagingError(f"Globus client credentials missing from {cfg.get('credentials_file')}: {exc}") from None
    root = Path(cfg["local_root"])
    return _Settings(cfg["local_collection"], root, Path(cfg.get("staging_dir") or root / ".mesh-staging"),
                     float(cfg.get("timeout_s", 3600)), float(cfg.get("poll_s", 2.0)), client_id, secret)


def _transfer_client(s: _Settings) -> Any:
    """One TransferClient per worker process (client-credentials grant, refreshed by the SDK)."""
    tc = _clients.get(s.client_id)
    if tc is None:
        import globus_sdk

        auth = globus_sdk.ConfidentialAppAuthClient(s.client_id, s.client_secret)
        authorizer = globus_sdk.ClientCredentialsAuthorizer(auth, globus_sdk.TransferClient.scopes.all)
        tc = _clients[s.client_id] = globus_sdk.TransferClient(authorizer=authorizer)
    return tc


def _collection_path(s: _Settings, local: Path) -> str:
    try:
        rel = local.resolve().relative_to(s.local_root.resolve())
    except ValueError:
        raise StagingError(f"{local} is outside the local collection root {s.local_root}; write outputs under output_path()") from None
    return str(PurePosixPath("/") / PurePosixPath(*rel.parts))


def _task_dir(s: _Settings, task_id: str) -> Path:
    return s.staging_dir / task_id


def output_path(name: str) -> Path:
    """A path for an output file of the running task, inside the endpoint's collection."""
    s = _settings()
    d = _task_dir(s, _current_task or "no-task") / "out"
    d.mkdir(parents=True, exist_ok=True)
    return d / name


# ---------------------------------------------------------------------- transfers


def _transfer(s: _Settings, src: str, src_path: str, dst: str, dst_path: str, what: str) -> None:
    """Submit one transfer and wait for it; StagingError on failure or after ``timeout_s``."""
    import globus_sdk

    tc = _transfer_client(s)
    data = globus_sdk.TransferData(src, dst, label=what[:128], verify_checksum=True)
    data.add_item(src_path, dst_path)
    try:
        tid = tc.submit_transfer(data)["task_id"]
    except globus_sdk.GlobusError as exc:
        raise StagingError(f"Globus refused the transfer for {what}: {exc}") from None
    deadline = time.monotonic() + s.timeout_s
    delay = min(0.2, s.poll_s)
    while True:
        try:
            task = tc.get_task(tid)
        except globus_sdk.GlobusError as exc:
            raise StagingError(f"Globus transfer {tid} for {what}: cannot read its status: {exc}") from None
        status = task["status"]
        if status == "SUCCEEDED":
            return
        if status == "FAILED":
            fatal = task.get("fatal_error") or {}
            why = task.get("nice_status") or fatal.get("code") or "failed"
            detail = fatal.get("description") or task.get("nice_status_details") or ""
            raise StagingError(f"Globus transfer {tid} for {what} failed: {why}{': ' + detail if detail else ''}")
        left = deadline - time.monotonic()
        if left <= 0:
            try:
                tc.cancel_task(tid)
            except globus_sdk.GlobusError:
                pass
            raise StagingError(f"Globus transfer {tid} for {what} did not finish within {s.timeout_s:g} s (status {status}); cancelled")
        time.sleep(min(delay, left))
        delay = min(delay * 1.5, s.poll_s)


def _fetch(s: _Settings, task_id: str, ref: GlobusFile) -> Path:
    local = _task_dir(s, task_id) / "in" / PurePosixPath(ref.path).name
    local.parent.mkdir(parents=True, exist_ok=True)
    _transfer(s, ref.collection, ref.path, s.local_collection, _collection_path(s, local), f"input {ref.collection}:{ref.path}")
    if not local.exists():
        raise StagingError(f"Globus reported input {ref.collection}:{ref.path} transferred, but {local} is missing (local_root wrong?)")
    return local


def _has_ref(value: Any) -> bool:
    if isinstance(value, GlobusFile):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, GlobusFile) for v in value)
    return isinstance(value, dict) and any(isinstance(v, GlobusFile) for v in value.values())


def _map(value: Any, fn: Any) -> Any:
    """Apply ``fn`` to GlobusFile values at the top level and one level inside lists/tuples/dicts."""
    if isinstance(value, GlobusFile):
        return fn(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, GlobusFile) for v in value):
        return type(value)(fn(v) if isinstance(v, GlobusFile) else v for v in value)
    if isinstance(value, dict) and any(isinstance(v, GlobusFile) for v in value.values()):
        return {k: fn(v) if isinstance(v, GlobusFile) else v for k, v in value.items()}
    return value


def stage_in(task_id: str, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Replace GlobusFile arguments with local paths, transferring each file first."""
    global _current_task
    _current_task = task_id
    if not any(_has_ref(a) for a in (*args, *kwargs.values())):
        return args, kwargs
    s = _settings()
    fetch = lambda ref: _fetch(s, task_id, ref)  # noqa: E731
    return [_map(a, fetch) for a in args], {k: _map(v, fetch) for k, v in kwargs.items()}


def stage_out(task_id: str, value: Any) -> Any:
    """Push outputs (GlobusFile with ``local``) to their collections; return plain references."""

    def push(ref: GlobusFile) -> GlobusFile:
        if ref.local is None:
            return ref
        s = _settings()
        local = Path(ref.local)
        if not local.is_file():
            raise StagingError(f"output {local} does not exist; nothing to push to {ref.collection}:{ref.path}")
        _transfer(s, s.local_collection, _collection_path(s, local), ref.collection, ref.path, f"output {ref.collection}:{ref.path}")
        return replace(ref, local=None)

    return _map(value, push)


def cleanup(task_id: str) -> None:
    """Remove the task's staged files (inputs and pushed outputs)."""
    global _current_task
    _current_task = None
    raw = os.environ.get(_ENV)
    if raw:
        cfg = json.loads(raw)
        base = Path(cfg.get("staging_dir") or Path(cfg["local_root"]) / ".mesh-staging")
        shutil.rmtree(base / task_id, ignore_errors=True)
