"""Federated partitions of scikit-learn's bundled ``load_digits`` (8x8 digits, 1797 samples,
10 classes; shipped inside scikit-learn, so nothing is downloaded).

* ``partition_indices(y, num_clients, scheme, alpha, seed)`` — pure numpy partitioner:
  ``"iid"`` (shuffled, near-equal sizes) or ``"dirichlet"`` (for each class, its samples are
  split across clients by proportions drawn from Dirichlet(alpha); small alpha = label skew).
  Every index lands in exactly one partition; deterministic for ``seed``.
* ``load_federated_digits(num_clients, ...)`` — all partitions plus a held-out, stratified
  test split (``FederatedData``).
* ``load_client_data(client_index, num_clients, ...)`` — one client's ``(X, y)``; what a
  client's training function calls on its own device (same seed -> same partition).

``X`` is float32 scaled to [0, 1] (pixel / 16), ``y`` is int64.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

import numpy as np

__all__ = [
    "ClientData",
    "FederatedData",
    "partition_indices",
    "load_digits_arrays",
    "train_test_split_indices",
    "load_federated_digits",
    "load_client_data",
    "label_distribution",
]

NUM_CLASSES = 10
NUM_FEATURES = 64


@dataclass
class ClientData:
    client_index: int
    X: np.ndarray
    y: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(len(self.y))


@dataclass
class FederatedData:
    clients: List[ClientData]
    X_test: np.ndarray
    y_test: np.ndarray
    num_classes: int = NUM_CLASSES
    num_features: int = NUM_FEATURES

    def client(self, index: int) -> ClientData:
        return self.clients[index]

    @property
    def num_clients(self) -> int:
        return len(self.clients)


def _digits_file() -> "str | None":
    """Path of the digits CSV scikit-learn ships, found without importing scikit-learn (whose
    import, with scipy, costs seconds on a Raspberry Pi; every FL worker loads this once)."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            return path
    return None


@lru_cache(maxsize=1)
def _digits() -> Tuple[np.ndarray, np.ndarray]:
    path = _digits_file()
    if path is not None:  # the same file load_digits() reads, in the same way
        raw = np.loadtxt(path, delimiter=",")
        data, target = raw[:, :-1], raw[:, -1].astype(np.int64)
    else:
        try:
            from sklearn.datasets import load_digits
        except ImportError as exc:  # pragma: no cover - depends on environment
            raise ImportError(
                "fl.data needs scikit-learn for its bundled digits dataset: pip install scikit-learn"
            ) from exc
        d = load_digits()
        data, target = d.data, d.target
    X = (np.asarray(data, dtype=np.float32) / 16.0).astype(np.float32)
    y = np.asarray(target, dtype=np.int64)
    X.setflags(write=False)
    y.setflags(write=False)
    return X, y


def load_digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """All 1797 samples: X float32 in [0, 1] with shape (n, 64), y int64 (copies)."""
    X, y = _digits()
    return X.copy(), y.copy()


def train_test_split_indices(y: np.ndarray, test_fraction: float = 0.2, seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """Stratified split of ``range(len(y))``; deterministic for ``seed``. Returns sorted arrays."""
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError("test_fraction must be in [0, 1)")
    y = np.asarray(y)
    rng = np.random.default_rng([int(seed), 7919])
    test: List[np.ndarray] = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test.append(idx[: int(round(test_fraction * len(idx)))])
    test_idx = np.sort(np.concatenate(test)) if test else np.empty(0, dtype=np.int64)
    mask = np.ones(len(y), dtype=bool)
    mask[test_idx] = False
    return np.flatnonzero(mask), test_idx


def partition_indices(
    y: np.ndarray,
    num_clients: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 1,
    max_tries: int = 1000,
) -> List[np.ndarray]:
    """Split ``range(len(y))`` into ``num_clients`` disjoint, complete, sorted index arrays.

    ``dirichlet``: for each class, proportions ~ Dirichlet(alpha * 1_N) decide how its samples
    are divided; draws are repeated (deterministically) until every client holds at least
    ``min_size`` samples.
    """
    y = np.asarray(y)
    n = len(y)
    if num_clients < 1:
        raise ValueError("num_clients must be >= 1")
    if num_clients * max(min_size, 1) > n:
        raise ValueError(f"cannot give {num_clients} clients >= {max(min_size, 1)} samples from {n}")
    rng = np.random.default_rng([int(seed), int(num_clients)])
    if scheme == "iid":
        perm = rng.permutation(n)
        return [np.sort(p) for p in np.array_split(perm, num_clients)]
    if scheme != "dirichlet":
        raise ValueError(f"unknown partition scheme {scheme!r} (use 'iid' or 'dirichlet')")
    if alpha <= 0:
        raise ValueError("alpha must be > 0")
    classes = np.unique(y)
    for _ in range(max_tries):
        parts: List[List[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = np.flatnonzero(y == c)
            rng.shuffle(idx)
            p = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(int)
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
        out = [np.sort(np.concatenate(ch)).astype(np.int64) for ch in parts]
        if min(len(o) for o in out) >= min_size:
            return out
    raise RuntimeError(
        f"no Dirichlet(alpha={alpha}) draw gave every one of {num_clients} clients >= {min_size} "
        f"samples in {max_tries} tries; raise alpha or lower num_clients/min_size"
    )


def label_distribution(y: np.ndarray, num_classes: int = NUM_CLASSES) -> np.ndarray:
    """Normalised label histogram (sums to 1; zeros if ``y`` is empty)."""
    counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=num_classes).astype(np.float64)
    s = counts.sum()
    return counts / s if s > 0 else counts


def load_federated_digits(
    num_clients: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    test_fraction: float = 0.2,
    min_size: int = 1,
) -> FederatedData:
    """Digits split into a stratified test set and ``num_clients`` training partitions."""
    X, y = _digits()
    train_idx, test_idx = train_test_split_indices(y, test_fraction, seed)
    parts = partition_indices(y[train_idx], num_clients, scheme, alpha, seed, min_size)
    clients = [ClientData(k, X[train_idx[p]].copy(), y[train_idx[p]].copy()) for k, p in enumerate(parts)]
    return FederatedData(clients=clients, X_test=X[test_idx].copy(), y_test=y[test_idx].copy())


def load_client_data(
    client_index: int,
    num_clients: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    test_fraction: float = 0.2,
    min_size: int = 1,
) -> Tuple[np.ndarray, np.ndarray]:
    """One client's training ``(X, y)``; identical to ``load_federated_digits(...).client(i)``."""
    if not 0 <= client_index < num_clients:
        raise IndexError(f"client_index {client_index} out of range for {num_clients} clients")
    X, y = _digits()
    train_idx, _ = train_test_split_indices(y, test_fraction, seed)
    parts = partition_indices(y[train_idx], num_clients, scheme, alpha, seed, min_size)
    sel = train_idx[parts[client_index]]
    return X[sel].copy(), y[sel].copy()


def load_test_data(seed: int = 0, test_fraction: float = 0.2) -> Tuple[np.ndarray, np.ndarray]:
    """The held-out test split (server-side evaluation)."""
    X, y = _digits()
    _, test_idx = train_test_split_indices(y, test_fraction, seed)
    return X[test_idx].copy(), y[test_idx].copy()


__all__.append("load_test_data")
