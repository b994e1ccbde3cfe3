"""Datasets on the endpoint, by name: what a round function calls to get its local data.

The endpoint's owner declares datasets in the agent config (see ``mesh_agent.datasets``); the
agent hands the declarations to its workers through the environment. A training task then asks
``fl.datasets.load("digits")`` and gets whatever the device's loader returns (for the loaders
shipped here: ``(X, y)`` numpy arrays). Loaded datasets are cached per worker process, so a warm
worker loads its data once for the whole run, not once per round.

Shipped loader: :func:`digits`, scikit-learn's bundled 8x8 digits partitioned IID or non-IID
(Dirichlet alpha) by endpoint index; nothing is downloaded. Declare it per device, e.g.::

    datasets:
      digits: {loader: "fl.datasets:digits", kwargs: {index: 2, num_clients: 5, scheme: dirichlet, alpha: 0.5}}

Importing this module is cheap (no torch, no scikit-learn until a loader runs).
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import numpy as np

from mesh_agent.datasets import ENV_DATASETS, ENV_ENDPOINT_ID, ENV_ENDPOINT_NAME, DatasetSpec, check_name

__all__ = ["DatasetNotFound", "declared", "endpoint_id", "endpoint_name", "load", "load_file", "digits", "clear_cache"]

_cache: Dict[Tuple[str, str, str], Any] = {}
_lock = threading.Lock()


class DatasetNotFound(LookupError):
    """The task asked for a dataset this endpoint did not declare."""


def endpoint_id() -> str | None:
    """Id of the endpoint this code runs on (None outside an agent's worker)."""
    return os.environ.get(ENV_ENDPOINT_ID)


def endpoint_name() -> str | None:
    return os.environ.get(ENV_ENDPOINT_NAME)


def declared() -> Dict[str, DatasetSpec]:
    """The datasets this endpoint declared (empty outside an agent's worker)."""
    raw = os.environ.get(ENV_DATASETS)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
        return {check_name(k): DatasetSpec.model_validate(v) for k, v in data.items()}
    except Exception as exc:  # the agent wrote it, so this is a bug or a tampered environment
        raise RuntimeError(f"${ENV_DATASETS} is not a valid dataset declaration: {exc}") from None


def _resolve_loader(spec: str) -> Callable[..., Any]:
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise DatasetNotFound(f"dataset loader {spec!r} cannot be loaded on this endpoint: {exc}") from None
    if not callable(fn):
        raise DatasetNotFound(f"dataset loader {spec!r} is not callable")
    return fn


def load_file(path: str | os.PathLike[str]) -> Tuple[np.ndarray, np.ndarray]:
    """``(X, y)`` from an ``.npz`` (arrays ``x`` or ``X``, and ``y``) or a ``.csv`` (label last)."""
    p = Path(path)
    if not p.is_file():
        raise DatasetNotFound(f"dataset file {p} does not exist on this endpoint")
    if p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as z:
            xk = "X" if "X" in z.files else "x"
            if xk not in z.files or "y" not in z.files:
                raise ValueError(f"{p}: an .npz dataset needs arrays 'x' (or 'X') and 'y', has {z.files}")
            return np.asarray(z[xk]), np.asarray(z["y"])
    if p.suffix == ".csv":
        a = np.loadtxt(p, delimiter=",", dtype=np.float64, ndmin=2)
        if a.shape[1] < 2:
            raise ValueError(f"{p}: a .csv dataset needs feature columns and a label column")
        return a[:, :-1].astype(np.float32), a[:, -1].astype(np.int64)
    raise ValueError(f"{p}: unsupported dataset file type {p.suffix!r} (use .npz or .csv)")


def load(name: str, **kwargs: Any) -> Any:
    """Load the endpoint's dataset ``name``; ``kwargs`` go to its loader.

    A keyword the device fixed in its declaration cannot be changed by a task (the device owner
    decides which data it shares): a different value is an error, never silently used.
    """
    specs = declared()
    if name not in specs:
        where = endpoint_name() or endpoint_id() or "this process (not an agent worker)"
        have = ", ".join(sorted(specs)) or "none"
        raise DatasetNotFound(f"dataset {name!r} is not declared on {where} (declared: {have})")
    spec = specs[name]
    for k, v in kwargs.items():
        if k in spec.kwargs and spec.kwargs[k] != v:
            raise ValueError(f"dataset {name!r}: the endpoint fixes {k}={spec.kwargs[k]!r}; the task asked for {v!r}")
    args = {**kwargs, **spec.kwargs}
    key = (name, spec.model_dump_json(), json.dumps(args, sort_keys=True, default=repr))
    with _lock:
        if key in _cache:
            return _cache[key]
    if spec.loader is not None:
        value = _resolve_loader(spec.loader)(**args)
    else:
        assert spec.path is not None
        if args:
            raise ValueError(f"dataset {name!r} is a file; it takes no arguments (got {sorted(args)})")
        value = load_file(spec.path)
    with _lock:
        _cache[key] = value
    return value


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def digits(index: int, num_clients: int, scheme: str = "iid", alpha: float = 0.5, seed: int = 0,
           test_fraction: float = 0.2) -> Tuple[np.ndarray, np.ndarray]:
    """This endpoint's share of scikit-learn's digits: partition ``index`` of ``num_clients``.

    Every device computes the same deterministic split (same ``seed``), so partitions are
    disjoint without any coordination; the held-out test split (``fl.data.load_test_data``)
    is never in any partition.
    """
    from fl.data import load_client_data

    return load_client_data(int(index), int(num_clients), scheme=scheme, alpha=float(alpha), seed=int(seed),
                            test_fraction=float(test_fraction))
