"""The hierarchical driver's LAN path (fl/drivers/hierarchical.py, fl.sites), without a hub: what
it does with a child's result that names its update by key. Bad results are refused with the
reason and leave nothing for the gateway's aggregate task; the whole path runs on a real site in
tests/integration/test_fl_site.py."""

from __future__ import annotations

from typing import Any

import pytest

from cloud_hub.client import Client
from fl import FedAvg, Federation
from fl.client import FunctionClientApp
from fl.drivers import RunParams
from fl.drivers.hierarchical import HierarchicalDriver
from fl.strategies import Hierarchical

KEY = "ab" * 32


def _train(w: Any, data: Any, cfg: Any) -> Any:
    return w, 1, {}


@pytest.fixture
def driver() -> HierarchicalDriver:
    fed = Federation(Client("http://127.0.0.1:9", "t"), gateways={"ep-gw": ["ep-a", "ep-b"]})
    run = RunParams(app=FunctionClientApp(_train), dataset="d", dataset_kwargs={}, strategy=Hierarchical(FedAvg(), FedAvg()),
                    mode="hierarchical", rounds=1, local_epochs=1, deadline_s=5, min_clients=1, on_insufficient="skip",
                    max_extensions=0, extension_s=1, eval_data=None, seed=0, include_offline=False, on_round=None,
                    on_round_start=None, ttl_s=10)
    d = HierarchicalDriver(fed, run)
    d._staged = {"ep-gw": (KEY, "127.0.0.1:1")}
    d._lan_updates = {}
    return d


def _result(**over: Any) -> dict:
    return {"v": 1, "kind": "update", "client_id": "ep-a", "round": 1, "base_version": 0, "weights_ref": KEY,
            "bytes_lan": 100, "num_samples": 7, "metrics": {"loss": 0.5}, **over}


def test_a_lan_update_is_kept_for_the_gateway(driver: HierarchicalDriver) -> None:
    upd, why, info = driver.decode_update("ep-a", _result(encoding={"spec": "q8"}), 0)
    assert why is None and upd is not None and upd.weights == [] and upd.num_samples == 7
    assert driver._lan_updates["ep-a"] == {"client_id": "ep-a", "ref": KEY, "encoding": {"spec": "q8"}, "num_samples": 7,
                                          "metrics": {"loss": 0.5}}
    assert info["bytes_lan"] == 100 and "weights" not in info


@pytest.mark.parametrize("client, result, reason", [
    ("ep-b", _result(), "not an fl update of this client"),  # claims another client
    ("ep-a", _result(kind="ready"), "not an fl update of this client"),
    ("ep-a", _result(weights_ref="zz"), "weights_ref is not a blob key"),
    ("ep-a", _result(num_samples="many"), "not integers"),
])
def test_bad_lan_results_are_refused(driver: HierarchicalDriver, client: str, result: dict, reason: str) -> None:
    upd, why, _ = driver.decode_update(client, result, 0)
    assert upd is None and reason in (why or "")
    assert driver._lan_updates == {}


def test_a_lan_update_for_an_unstaged_site_is_refused(driver: HierarchicalDriver) -> None:
    driver._staged = {}
    upd, why, _ = driver.decode_update("ep-a", _result(), 0)
    assert upd is None and "did not stage that site" in (why or "") and driver._lan_updates == {}


def test_train_payload_names_the_staged_model(driver: HierarchicalDriver) -> None:
    from fl.strategies import ClientInstruction

    p = driver.train_payload(ClientInstruction("ep-a", {}), 1, b"blob", 0)
    assert "weights" not in p and p["weights_ref"] == KEY and p["site_store"] == "127.0.0.1:1" and p["update_to_site"] is True
    fed = driver.fed
    fed._gateway_of.pop("ep-b")  # a direct client keeps its model inline
    p2 = driver.train_payload(ClientInstruction("ep-b", {}), 1, b"blob", 0)
    assert p2["weights"] == b"blob" and "weights_ref" not in p2
