"""fl.data partitions and fl.history export."""

import json

import numpy as np
import pytest

pytest.importorskip("sklearn")

from fl.data import (  # noqa: E402
    label_distribution,
    load_client_data,
    load_federated_digits,
    load_test_data,
    partition_indices,
)
from fl.history import History  # noqa: E402


def _check_partition(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    assert np.array_equal(np.sort(allidx), np.arange(n))  # disjoint and complete


@pytest.mark.parametrize("scheme,alpha", [("iid", 0.5), ("dirichlet", 0.1), ("dirichlet", 100.0)])
def test_partitions_disjoint_complete_deterministic(scheme, alpha):
    y = np.repeat(np.arange(10), 50)
    parts = partition_indices(y, 7, scheme, alpha, seed=3)
    _check_partition(parts, len(y))
    assert all(len(p) >= 1 for p in parts)
    again = partition_indices(y, 7, scheme, alpha, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_indices(y, 7, scheme, alpha, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def _mean_skew(fd):
    glob = label_distribution(np.concatenate([c.y for c in fd.clients]))
    return float(np.mean([0.5 * np.abs(label_distribution(c.y) - glob).sum() for c in fd.clients]))


def test_digits_federated_shapes_and_coverage():
    fd = load_federated_digits(5, "iid", seed=0)
    n_train = sum(c.num_samples for c in fd.clients)
    assert n_train + len(fd.y_test) == 1797
    assert abs(len(fd.y_test) - 0.2 * 1797) < 10
    for c in fd.clients:
        assert c.X.dtype == np.float32 and c.y.dtype == np.int64 and c.X.shape[1] == 64
        assert c.X.min() >= 0.0 and c.X.max() <= 1.0
    assert max(c.num_samples for c in fd.clients) - min(c.num_samples for c in fd.clients) <= 1
    # the test split holds every class (stratified) and does not overlap the training data
    assert set(fd.y_test.tolist()) == set(range(10))
    rows_train = {r.tobytes() + bytes([int(l)]) for c in fd.clients for r, l in zip(c.X, c.y)}
    # digits has a few duplicate images; overlap must be tiny, not a leak of the split
    overlap = sum((r.tobytes() + bytes([int(l)])) in rows_train for r, l in zip(fd.X_test, fd.y_test))
    assert overlap < 10


def test_dirichlet_low_alpha_is_skewed_vs_iid():
    iid = load_federated_digits(10, "iid", seed=1)
    skew = load_federated_digits(10, "dirichlet", alpha=0.1, seed=1)
    assert _mean_skew(skew) > 0.4 > 0.1 > _mean_skew(iid)


def test_client_loader_matches_full_split_and_is_deterministic():
    fd = load_federated_digits(4, "dirichlet", alpha=0.5, seed=9)
    for i in range(4):
        X, y = load_client_data(i, 4, "dirichlet", alpha=0.5, seed=9)
        assert np.array_equal(X, fd.client(i).X) and np.array_equal(y, fd.client(i).y)
    Xt, yt = load_test_data(seed=9)
    assert np.array_equal(yt, fd.y_test)
    with pytest.raises(IndexError):
        load_client_data(4, 4)


def test_bad_partition_args():
    y = np.arange(5) % 2
    with pytest.raises(ValueError):
        partition_indices(y, 6)
    with pytest.raises(ValueError):
        partition_indices(y, 2, "zipf")
    with pytest.raises(ValueError):
        partition_indices(y, 2, "dirichlet", alpha=0)


# ---------------------------------------------------------------------------- history
def _hist():
    h = History(metadata={"strategy": "fedavg", "seed": 1})
    h.add_round(1, 2.1, 0.3, participants=["a", "b"], stragglers=["c"],
                dropped={"d": "tensor 0 contains non-finite values (NaN/inf)"}, round_time_s=1.5, lr=0.1)
    h.add_round(2, 1.2, 0.7, participants=["a", "b", "c"], round_time_s=1.25)
    return h


def test_history_json_roundtrip(tmp_path):
    h = _hist()
    text = h.to_json(tmp_path / "h.json")
    assert History.from_json(text) == h
    assert History.from_json(tmp_path / "h.json") == h
    assert json.loads(text)["rounds"][0]["dropped"]["d"].startswith("tensor 0")
    assert h.last.accuracy == 0.7 and len(h) == 2


def test_history_csv(tmp_path):
    text = _hist().to_csv(tmp_path / "h.csv")
    lines = text.strip().split("\n")
    assert lines[0].startswith("round,loss,accuracy,num_participants")
    assert lines[0].endswith(",lr")
    assert lines[1].startswith("1,2.1,0.3,2,a;b,1,c,1,")
    assert (tmp_path / "h.csv").read_text() == text


def test_history_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    p = _hist().plot_png(tmp_path / "h.png")
    assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_history_plot_without_matplotlib_clear_error(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        _hist().plot_png(tmp_path / "x.png")
