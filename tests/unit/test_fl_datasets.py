"""Datasets declared by an endpoint: agent config validation, the worker environment, loading
by name on the endpoint (loaders, files, fixed arguments, caching) and the digits loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest
import yaml

from fl import datasets
from fl.data import _digits, load_client_data
from mesh_agent.config import AgentConfig, ConfigError, Credentials, load_config
from mesh_agent.datasets import ENV_DATASETS, ENV_ENDPOINT_ID, ENV_ENDPOINT_NAME, export_worker_env

CALLS: Dict[str, int] = {"n": 0}


def counting_loader(scale: float = 1.0, rows: int = 3) -> Any:
    CALLS["n"] += 1
    return np.full((rows, 2), scale), np.arange(rows)


@pytest.fixture
def endpoint_env(monkeypatch: pytest.MonkeyPatch):
    for k in (ENV_DATASETS, ENV_ENDPOINT_ID, ENV_ENDPOINT_NAME):
        monkeypatch.setenv(k, "")  # restored after the test
    datasets.clear_cache()
    yield
    datasets.clear_cache()


def test_outside_an_agent_nothing_is_declared(endpoint_env) -> None:
    assert datasets.declared() == {}
    with pytest.raises(datasets.DatasetNotFound, match="not declared .*declared: none"):
        datasets.load("digits")


def test_loader_with_fixed_kwargs_cached_per_process(endpoint_env, tmp_path: Path) -> None:
    export_worker_env("ep-7", "pi-7", {
        "counted": {"loader": "tests.unit.test_fl_datasets:counting_loader", "kwargs": {"rows": 4}},
        "plain": "tests.unit.test_fl_datasets:counting_loader",
    }, tmp_path)
    assert datasets.endpoint_id() == "ep-7" and datasets.endpoint_name() == "pi-7"
    assert sorted(datasets.declared()) == ["counted", "plain"]
    before = CALLS["n"]
    X, y = datasets.load("counted", scale=2.0)
    assert X.shape == (4, 2) and float(X[0, 0]) == 2.0
    datasets.load("counted", scale=2.0)
    assert CALLS["n"] == before + 1  # second load came from the worker's cache
    assert datasets.load("plain")[0].shape == (3, 2)
    with pytest.raises(ValueError, match="the endpoint fixes rows=4; the task asked for 9"):
        datasets.load("counted", rows=9)
    with pytest.raises(datasets.DatasetNotFound, match="'other' is not declared on pi-7 .declared: counted, plain"):
        datasets.load("other")


def test_files_npz_and_csv_relative_to_data_dir(endpoint_env, tmp_path: Path) -> None:
    np.savez(tmp_path / "scans.npz", x=np.ones((5, 3), np.float32), y=np.arange(5))
    (tmp_path / "t.csv").write_text("0.5,1.5,1\n2.5,3.5,0\n")
    export_worker_env("ep-1", "pi", {"scans": "scans.npz", "table": str(tmp_path / "t.csv"), "gone": "nope.npz",
                                     "weird": "data.parquet"}, tmp_path)
    X, y = datasets.load("scans")
    assert X.shape == (5, 3) and list(y) == [0, 1, 2, 3, 4]
    Xc, yc = datasets.load("table")
    assert Xc.tolist() == [[0.5, 1.5], [2.5, 3.5]] and yc.tolist() == [1, 0] and yc.dtype == np.int64
    with pytest.raises(datasets.DatasetNotFound, match="does not exist"):
        datasets.load("gone")
    (tmp_path / "data.parquet").write_text("x")
    with pytest.raises(ValueError, match="unsupported dataset file type"):
        datasets.load("weird")
    with pytest.raises(ValueError, match="takes no arguments"):
        datasets.load("scans", index=1)


def test_missing_loader_module_is_a_clear_error(endpoint_env, tmp_path: Path) -> None:
    export_worker_env("ep-1", "pi", {"x": "no_such_pkg.sub:load"}, tmp_path)
    with pytest.raises(datasets.DatasetNotFound, match="cannot be loaded on this endpoint"):
        datasets.load("x")


def _write(tmp_path: Path, datasets_value: Any) -> Path:
    cfg = AgentConfig(endpoint_id="ep-1", name="pi", hub_url="http://127.0.0.1:8700", data_dir=tmp_path / "q",
                      credentials_file=tmp_path / "creds.json")
    Credentials(endpoint_id="ep-1", key="ab" * 32).save(cfg.credentials_file)
    raw = yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))
    raw["datasets"] = datasets_value
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_agent_config_declares_datasets_and_round_trips(tmp_path: Path) -> None:
    decl = {"digits": {"loader": "fl.datasets:digits", "kwargs": {"index": 2, "num_clients": 5}}, "scans": "/srv/scans.npz"}
    cfg, _ = load_config(_write(tmp_path, decl))
    assert cfg.datasets["scans"] == "/srv/scans.npz"
    assert cfg.datasets["digits"].kwargs == {"index": 2, "num_clients": 5}
    cfg.save(tmp_path / "again.yaml")
    assert load_config(tmp_path / "again.yaml")[0] == cfg


@pytest.mark.parametrize("bad, text", [
    ({"bad name!": "x.npz"}, "datasets"),
    ({"d": {"loader": "fl.datasets:digits", "path": "/x.npz"}}, "exactly one"),
    ({"d": {"kwargs": {}}}, "exactly one"),
    ({"d": {"loader": "not a loader"}}, "package.module:function"),
    ({"d": ""}, "datasets"),
    ({"d": {"loader": "a:b", "surprise": 1}}, "datasets"),
    (["digits"], "datasets"),
])
def test_agent_config_refuses_bad_dataset_declarations(tmp_path: Path, bad: Any, text: str) -> None:
    with pytest.raises(ConfigError, match=text):
        load_config(_write(tmp_path, bad))


def test_digits_loader_partitions_by_endpoint_index(endpoint_env, tmp_path: Path) -> None:
    kw = {"num_clients": 3, "scheme": "dirichlet", "alpha": 0.3, "seed": 1}
    export_worker_env("ep-1", "pi", {"digits": {"loader": "fl.datasets:digits", "kwargs": {"index": 1, **kw}}}, tmp_path)
    X, y = datasets.load("digits")
    Xr, yr = load_client_data(1, 3, "dirichlet", 0.3, 1)
    assert np.array_equal(X, Xr) and np.array_equal(y, yr)
    assert X.dtype == np.float32 and 0.0 <= X.min() and X.max() <= 1.0


def test_digits_read_without_scikit_learn_equal_load_digits() -> None:
    from sklearn.datasets import load_digits

    X, y = _digits()
    d = load_digits()
    assert np.array_equal(X, (d.data / 16.0).astype(np.float32)) and np.array_equal(y, d.target)
