"""A Flower ``ClientApp`` (Message API, or one built from a ``client_fn``) run on an endpoint,
unchanged.

:class:`ClientAppRunner` is the mesh function. Each task carries one Flower ``Message`` (its
protobuf bytes: ArrayRecord, MetricRecord and ConfigRecord content, metadata) plus which app
(by hash) and the run's ``run_config``. On the endpoint it

* loads the app's ``clientapp`` from the installed package (``flower-apps/<sha256>`` in the
  agent's data dir, put there by :mod:`fl.flower.delivery`), once per warm worker;
* builds a real ``flwr.app.Context``: ``node_id`` from the endpoint id (the same number the
  driver's Grid uses), ``node_config`` from the endpoint's declaration of the run's dataset
  (``index`` -> ``partition-id``, ``num_clients`` -> ``num-partitions`` and the other keyword
  arguments), ``run_config`` from the app, and ``state``: the ``RecordDict`` the app left there
  in earlier rounds of this run, kept on the device's disk (so it survives a worker or device
  restart, as Flower's SuperNode keeps it across messages);
* calls ``app(message, context)`` and returns the reply ``Message``. An exception in the app
  becomes an error reply, as a SuperNode sends it (``CLIENT_APP_RAISED_EXCEPTION``, or
  ``LOAD_CLIENT_APP_EXCEPTION`` when the app cannot be loaded), and the state is not changed.

A ``{"kind": "flower-warmup"}`` task loads the app and its context without calling it, so a
device that cannot load the app says so (the first error) before any round counts on it.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from fl.flower.delivery import AppError, data_dir, installed_dir

__all__ = ["ClientAppRunner", "node_id_of", "encode_message", "decode_message", "PROTOCOL"]

PROTOCOL = 1
_lock = threading.Lock()
_apps: Dict[str, Any] = {}  # sha256 -> the loaded ClientApp, per worker process
_loaded_dir: Dict[str, str] = {}  # top-level module -> the app folder it was imported from


def node_id_of(endpoint_id: str) -> int:
    """The Flower node id of an endpoint: a stable positive 63-bit number from its id."""
    return int.from_bytes(hashlib.sha256(endpoint_id.encode()).digest()[:8], "big") >> 1 or 2


def encode_message(msg: Any) -> bytes:
    from flwr.common.serde import message_to_proto

    return message_to_proto(msg).SerializeToString()


def decode_message(data: bytes) -> Any:
    from flwr.common.serde import message_from_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module

    msg = message_from_proto(ProtoMessage.FromString(bytes(data)))
    return msg


def _set_identity(run_id: int, node_id: int) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id = run_id
    TaskIdentity.node_id = node_id
    TaskIdentity.task_id = 0


def load_clientapp(sha256: str, ref: str, name: str = "app") -> Any:
    """The app's ``ClientApp`` object (cached per worker; an app of another hash whose modules
    share names is imported afresh)."""
    with _lock:
        app = _apps.get(sha256)
        if app is not None:
            return app
        folder = installed_dir(sha256)
        if not (folder / "pyproject.toml").is_file():
            raise AppError(f"Flower app {name!r} ({sha256[:12]}) is not installed on this endpoint; "
                           "`mesh-fl run` delivers it before the first round")
        top = ref.partition(":")[0].split(".")[0]
        if _loaded_dir.get(top) not in (None, str(folder)):
            for mod in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[mod]
            sys.path[:] = [p for p in sys.path if p != _loaded_dir[top]]
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
        importlib.invalidate_caches()
        from flwr.supercore.object_ref import load_app

        try:
            app = load_app(ref, AppError, folder)
        except AppError:
            raise
        except Exception as exc:  # the app's own import error (a missing module, a bug)
            raise AppError(f"cannot load ClientApp {ref!r} of {name!r}: {type(exc).__name__}: {exc}") from exc
        from flwr.clientapp import ClientApp

        if not isinstance(app, ClientApp):
            raise AppError(f"{ref!r} is a {type(app).__name__}, not a flwr.clientapp.ClientApp")
        _loaded_dir[top] = str(folder)
        _apps[sha256] = app
        return app


def _state_path(run_key: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_key)[:120] or "run"
    return data_dir() / "flower-state" / f"{safe}.pb"


def load_state(run_key: str) -> Any:
    from flwr.app import RecordDict
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

    p = _state_path(run_key)
    if not p.is_file():
        return RecordDict()
    return recorddict_from_proto(ProtoRecordDict.FromString(p.read_bytes()))


def save_state(run_key: str, state: Any) -> None:
    """Atomically (temp file, fsync, rename): a device that dies mid-write keeps the old state."""
    from flwr.common.serde import recorddict_to_proto

    p = _state_path(run_key)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(recorddict_to_proto(state).SerializeToString())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, p)


class ClientAppRunner:
    """The mesh function that runs a Flower ClientApp on an endpoint (see the module doc).

    Task: ``{"v": 1, "kind": "flower-message" | "flower-warmup", "app": {"sha256", "clientapp",
    "name"}, "run": str, "run_id": int, "dataset": str, "run_config": {...}, "message": bytes}``.
    Reply: ``{"v": 1, "kind": "flower-reply", "message": bytes, "app_s": float}`` or, for a
    warm-up, ``{"kind": "ready", "node_id", "node_config"}``.
    """

    name = "flower-clientapp"

    def _context(self, task: Dict[str, Any]) -> Tuple[Any, int]:
        from flwr.app import Context

        from fl import datasets as _datasets
        from fl.flower.legacy import node_config_for

        eid = _datasets.endpoint_id() or "local"
        node_id = node_id_of(eid)
        node_config = node_config_for(str(task["dataset"])) if task.get("dataset") else {}
        run_id = int(task.get("run_id") or 0)
        ctx = Context(run_id=run_id, node_id=node_id, node_config=node_config,
                      state=load_state(str(task.get("run") or run_id)), run_config=dict(task.get("run_config") or {}))
        return ctx, node_id

    def __call__(self, task: Dict[str, Any]) -> Dict[str, Any]:
        if not isinstance(task, dict) or task.get("v") != PROTOCOL or task.get("kind") not in ("flower-message", "flower-warmup"):
            raise AppError("expected a Flower message task")
        app_ref = dict(task.get("app") or {})
        if task["kind"] == "flower-warmup":
            t0 = time.perf_counter()
            load_clientapp(str(app_ref.get("sha256")), str(app_ref.get("clientapp")), str(app_ref.get("name", "app")))
            ctx, node_id = self._context(task)
            return {"v": PROTOCOL, "kind": "ready", "node_id": node_id, "node_config": dict(ctx.node_config),
                    "warmup_time_s": time.perf_counter() - t0}
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        msg = decode_message(task["message"])
        t0 = time.perf_counter()
        reply: Optional[Any] = None
        try:
            ctx, node_id = self._context(task)
            _set_identity(ctx.run_id, node_id)
            try:
                app = load_clientapp(str(app_ref.get("sha256")), str(app_ref.get("clientapp")), str(app_ref.get("name", "app")))
            except Exception as exc:
                reply = Message(Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION,
                                      reason=f"An exception was raised when attempting to load `ClientApp`: {exc}"), reply_to=msg)
            else:
                reply = app(msg, ctx)
                if not isinstance(reply, Message):
                    raise TypeError(f"the ClientApp returned {type(reply).__name__}, not a Message")
                save_state(str(task.get("run") or ctx.run_id), ctx.state)  # only after success, as a SuperNode does
        except Exception as ex:  # the app raised: an error reply, as Flower's SuperNode sends it
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(type(ex)) + ":<'" + str(ex) + "'>"),
                            reply_to=msg)
        assert reply is not None
        reply.metadata.__dict__["_message_id"] = f"r-{msg.metadata.message_id}"
        return {"v": PROTOCOL, "kind": "flower-reply", "message": encode_message(reply), "app_s": time.perf_counter() - t0}
