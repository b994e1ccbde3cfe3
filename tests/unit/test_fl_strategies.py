"""Aggregation math of fl.strategies against hand-computed results (small arrays)."""

import numpy as np
import pytest

from fl.strategies import (
    ClientUpdate,
    FedAdagrad,
    FedAdam,
    FedAsync,
    FedAvg,
    FedBuff,
    FedProx,
    FedYogi,
    Hierarchical,
    Krum,
    TrimmedMean,
    polynomial_staleness,
    proximal_term,
    validate_update,
)


def W(*vals):
    """Two tensors: a (2,) vector and a scalar-shaped (1,) bias."""
    return [np.array(vals[:2], dtype=np.float32), np.array(vals[2:], dtype=np.float32)]


CUR = W(0.0, 0.0, 0.0)


def U(cid, w, n, base=0, gw=None, **metrics):
    return ClientUpdate(cid, w, n, base_version=base, metrics=metrics, gateway_id=gw)


# ---------------------------------------------------------------------------- FedAvg
def test_fedavg_weighted_by_samples():
    s = FedAvg(min_clients=2)
    out = s.aggregate(1, [U("a", W(1, 2, 3), 1), U("b", W(4, 5, 6), 3)], CUR)
    # (1*[1,2,3] + 3*[4,5,6]) / 4 = [13/4, 17/4, 21/4]
    np.testing.assert_allclose(out[0], [3.25, 4.25])
    np.testing.assert_allclose(out[1], [5.25])
    assert out[0].dtype == np.float32
    assert s.last_report.aggregated and s.last_report.accepted == ["a", "b"]
    assert s.last_report.num_samples == 4 and s.last_report.reason is None


def test_fedavg_min_clients_not_met_returns_none_with_reason():
    s = FedAvg(min_clients=3)
    out = s.aggregate(2, [U("a", W(1, 1, 1), 5), U("b", W(2, 2, 2), 5)], CUR)
    assert out is None
    assert "min_clients=3" in s.last_report.reason
    assert not s.last_report.aggregated


def test_bad_updates_rejected_with_reason_and_rest_aggregated():
    s = FedAvg(min_clients=1)
    bad_shape = [np.zeros(3, np.float32), np.zeros(1, np.float32)]
    bad_len = [np.zeros(2, np.float32)]
    nan = W(np.nan, 0, 0)
    inf = W(0, np.inf, 0)
    ups = [U("good", W(2, 4, 6), 2), U("shape", bad_shape, 1), U("len", bad_len, 1),
           U("nan", nan, 1), U("inf", inf, 1), U("zero", W(1, 1, 1), 0)]
    out = s.aggregate(1, ups, CUR)
    np.testing.assert_allclose(np.concatenate(out), [2, 4, 6])
    why = s.last_report.dropped_reasons
    assert set(why) == {"shape", "len", "nan", "inf", "zero"}
    assert "shape" in why["shape"] and "(3,)" in why["shape"]
    assert "expected 2 tensors, got 1" in why["len"]
    assert "non-finite" in why["nan"] and "non-finite" in why["inf"]
    assert "num_samples" in why["zero"]
    assert len(s.rejections) == 5 and s.rejections[0][0] == 1


def test_all_updates_bad_returns_none_never_raises():
    s = FedAvg(min_clients=1)
    assert s.aggregate(1, [U("x", W(np.nan, 0, 0), 1)], CUR) is None
    assert "only 0 valid" in s.last_report.reason
    assert s.aggregate(1, [], CUR) is None


def test_accept_failures_false():
    s = FedAvg(min_clients=1, accept_failures=False)
    assert s.aggregate(1, [U("a", W(1, 1, 1), 1), U("b", W(np.nan, 1, 1), 1)], CUR) is None
    assert "accept_failures=False" in s.last_report.reason


def test_duplicate_client_update_rejected():
    s = FedAvg()
    out = s.aggregate(1, [U("a", W(1, 1, 1), 1), U("a", W(9, 9, 9), 1)], CUR)
    np.testing.assert_allclose(np.concatenate(out), [1, 1, 1])
    assert "duplicate" in s.last_report.dropped_reasons["a"]


def test_aggregate_metrics_sample_weighted():
    s = FedAvg()
    m = s.aggregate_metrics([U("a", CUR, 1, loss=1.0, acc=0.5), U("b", CUR, 3, loss=2.0, acc=1.0)])
    assert m == pytest.approx({"loss": 1.75, "acc": 0.875})


# ---------------------------------------------------------------------------- selection
def test_configure_round_fraction_min_and_seeded():
    clients = [f"c{i}" for i in range(10)]
    s = FedAvg(fraction_fit=0.3, min_clients=2, seed=42)
    a = s.configure_round(1, clients)
    assert len(a) == 3 and all(i.round == 1 for i in a)
    assert [i.client_id for i in a] == [i.client_id for i in FedAvg(fraction_fit=0.3, seed=42).configure_round(1, clients)]
    assert len({tuple(i.client_id for i in s.configure_round(r, clients)) for r in range(1, 8)}) > 1
    # min_clients dominates a small fraction
    assert len(FedAvg(fraction_fit=0.1, min_clients=4).configure_round(1, clients)) == 4
    # not enough available -> [] with reason
    s2 = FedAvg(min_clients=5)
    assert s2.configure_round(1, clients[:3]) == []
    assert "only 3 clients available" in s2.last_selection_reason


def test_fedprox_carries_mu_and_aggregates_like_fedavg():
    s = FedProx(proximal_mu=0.1, client_config={"lr": 0.05})
    inst = s.configure_round(3, ["a", "b"])
    assert all(i.config["proximal_mu"] == 0.1 and i.config["lr"] == 0.05 for i in inst)
    ups = [U("a", W(1, 2, 3), 1), U("b", W(4, 5, 6), 3)]
    np.testing.assert_allclose(np.concatenate(s.aggregate(3, ups, CUR)),
                               np.concatenate(FedAvg().aggregate(3, ups, CUR)))
    val, grads = proximal_term(W(1, 2, 3), CUR, 0.1)
    assert val == pytest.approx(0.05 * 14)
    np.testing.assert_allclose(np.concatenate(grads), [0.1, 0.2, 0.3], rtol=1e-6)


# ---------------------------------------------------------------------------- hierarchical
def test_hierarchical_equals_flat_fedavg():
    rng = np.random.default_rng(0)
    cur = [rng.normal(size=(3, 2)), rng.normal(size=(2,))]
    ups = []
    for i in range(7):
        w = [rng.normal(size=(3, 2)), rng.normal(size=(2,))]
        ups.append(U(f"c{i}", w, int(rng.integers(1, 50)), gw=f"g{i % 3}"))
    flat = FedAvg().aggregate(1, ups, cur)
    h = Hierarchical(FedAvg(), FedAvg())
    hier = h.aggregate(1, ups, cur)
    for a, b in zip(flat, hier):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert sorted(h.last_report.accepted) == sorted(u.client_id for u in ups)
    assert set(h.group_reports) == {"g0", "g1", "g2"}


def test_hierarchical_hand_computed_and_group_drop():
    # g1: a(n=1,[2,2,2]) b(n=1,[4,4,4]) -> [3,3,3], N=2 ; g2: c(n=2,[6,6,6]) -> N=2
    # outer: (2*3 + 2*6)/4 = 4.5 ; flat: (2+4+12)/4 = 4.5
    ups = [U("a", W(2, 2, 2), 1, gw="g1"), U("b", W(4, 4, 4), 1, gw="g1"), U("c", W(6, 6, 6), 2, gw="g2")]
    h = Hierarchical()
    np.testing.assert_allclose(np.concatenate(h.aggregate(1, ups, CUR)), [4.5] * 3)
    # inner needs 2 clients per gateway: g2 dropped with reason, result = g1 only
    h2 = Hierarchical(FedAvg(min_clients=2), FedAvg())
    np.testing.assert_allclose(np.concatenate(h2.aggregate(1, ups, CUR)), [3.0] * 3)
    assert "gateway g2 dropped" in h2.last_report.dropped_reasons["c"]
    # outer needs 2 gateways -> None with reason
    h3 = Hierarchical(FedAvg(min_clients=2), FedAvg(min_clients=2))
    assert h3.aggregate(1, ups, CUR) is None
    assert "outer aggregation" in h3.last_report.reason
    # gateway_of mapping overrides update.gateway_id
    h4 = Hierarchical(gateway_of={"a": "x", "b": "x", "c": "x"})
    np.testing.assert_allclose(np.concatenate(h4.aggregate(1, ups, CUR)), [4.5] * 3)
    assert list(h4.group_reports) == ["x"]


# ---------------------------------------------------------------------------- FedAsync
def test_fedasync_staleness_weighting():
    s = FedAsync(alpha=0.5, a=0.5)
    cur = W(0, 0, 0)
    # fresh update (staleness 0): a_t = 0.5 -> w = 0.5 * 4
    out = s.on_update(U("a", W(4, 4, 4), 10, base=5), cur, server_version=5)
    np.testing.assert_allclose(np.concatenate(out), [2, 2, 2])
    assert s.last_mixing == pytest.approx(0.5)
    # staleness 3: s = (1+3)^-0.5 = 0.5 -> a_t = 0.25 ; w = 0.75*2 + 0.25*10 = 4
    out2 = s.on_update(U("b", W(10, 10, 10), 10, base=3), out, server_version=6)
    assert s.last_mixing == pytest.approx(0.25)
    np.testing.assert_allclose(np.concatenate(out2), [4, 4, 4])
    assert polynomial_staleness(8, a=1.0) == pytest.approx(1 / 9)


def test_fedasync_rejections():
    s = FedAsync(alpha=0.5, max_staleness=2)
    assert s.on_update(U("a", W(1, 1, 1), 1, base=7), CUR, server_version=5) is None
    assert "newer than server" in s.last_report.reason
    assert s.on_update(U("a", W(1, 1, 1), 1, base=0), CUR, server_version=5) is None
    assert "max_staleness" in s.last_report.reason
    assert s.on_update(U("a", W(np.inf, 1, 1), 1, base=5), CUR, server_version=5) is None
    assert "non-finite" in s.last_report.reason
    with pytest.raises(NotImplementedError):
        s.aggregate(1, [], CUR)
    assert s.is_async and not FedAvg().is_async


# ---------------------------------------------------------------------------- FedBuff
def test_fedbuff_waits_for_k_and_uses_deltas_from_base():
    s = FedBuff(buffer_size=3, server_lr=1.0, a=0.5)
    v0 = W(1, 1, 1)
    s.register_version(0, v0)
    v1 = W(2, 2, 2)
    # update from version 0 arriving at version 1: delta = 4-1 = 3, staleness 1 -> s = 2^-0.5
    assert s.on_update(U("a", W(4, 4, 4), 1, base=0), v1, server_version=1) is None
    assert "buffering (1/3)" in s.last_report.reason and s.buffered == 1
    # fresh updates from version 1: deltas 1 and -2 (s = 1)
    assert s.on_update(U("b", W(3, 3, 3), 1, base=1), v1, server_version=1) is None
    out = s.on_update(U("c", W(0, 0, 0), 1, base=1), v1, server_version=1)
    assert out is not None and s.buffered == 0
    expected = 2 + (3 * 2 ** -0.5 + 1 - 2) / 3
    np.testing.assert_allclose(np.concatenate(out), [expected] * 3, rtol=1e-6)
    assert s.last_report.accepted == ["a", "b", "c"] and s.last_report.num_samples == 3


def test_fedbuff_server_lr_normalize_and_unknown_base():
    s = FedBuff(buffer_size=2, server_lr=0.5, normalize="weights", staleness="constant")
    cur = W(0, 0, 0)
    assert s.on_update(U("a", W(2, 2, 2), 1, base=0), cur, 0) is None
    out = s.on_update(U("b", W(4, 4, 4), 1, base=0), cur, 0)
    np.testing.assert_allclose(np.concatenate(out), [1.5] * 3)  # 0.5 * (2+4)/2
    # a stale update whose base (version 0) is still kept is buffered, staleness 5 (constant s=1)
    assert s.on_update(U("c", W(1, 1, 1), 1, base=0), out, 5) is None
    assert s.buffered == 1 and "buffering (1/2)" in s.last_report.reason
    s2 = FedBuff(buffer_size=1, keep_versions=1)
    s2.on_update(U("a", W(1, 1, 1), 1, base=0), cur, 0)  # aggregates -> version 1 kept only
    assert s2.on_update(U("b", W(1, 1, 1), 1, base=0), out, 1) is None
    assert "unknown" in s2.last_report.reason
    assert s2.on_update(U("c", [np.zeros(5)], 1, base=1), out, 1) is None
    assert "expected 2 tensors" in s2.last_report.reason


def test_validate_update_ok():
    assert validate_update(U("a", W(1, 2, 3), 1), CUR) is None
    assert "integer" in validate_update(U("a", W(1, 2, 3), "x"), CUR)


# ---------------------------------------------------------------------------- FedOpt
def test_fedopt_first_steps_hand_computed():
    ups = [U("a", W(1, -2, 0.5), 1), U("b", W(3, -2, 0.5), 1)]  # mean delta from CUR: [2, -2, 0.5]
    d = np.array([2.0, -2.0, 0.5])
    tau = 1e-3
    # Adagrad (beta_1 = 0): m = d, v = d^2 -> w = eta * d / (|d| + tau)
    s = FedAdagrad(eta=0.1, tau=tau)
    out = np.concatenate(s.aggregate(1, ups, CUR))
    np.testing.assert_allclose(out, 0.1 * d / (np.abs(d) + tau), rtol=1e-6)
    # second step, same delta again from the new weights: v = 2 d^2
    cur2 = s.aggregate(1, ups, CUR)  # (restart from CUR for a clean hand computation)
    assert s.steps == 2
    np.testing.assert_allclose(np.concatenate(cur2), 0.1 * d / (np.sqrt(2 * d * d) + tau), rtol=1e-6)
    # Adam: m = 0.1 d, v = 0.01 d^2 -> w = eta * 0.1 d / (0.1 |d| + tau)
    s = FedAdam(eta=0.1, tau=tau)
    np.testing.assert_allclose(np.concatenate(s.aggregate(1, ups, CUR)), 0.1 * 0.1 * d / (0.1 * np.abs(d) + tau), rtol=1e-6)
    # Yogi: v0 = tau^2, v1 = tau^2 + 0.01 d^2 (d^2 > v0)
    s = FedYogi(eta=0.1, tau=tau)
    v1 = tau ** 2 + 0.01 * d * d
    np.testing.assert_allclose(np.concatenate(s.aggregate(1, ups, CUR)), 0.1 * 0.1 * d / (np.sqrt(v1) + tau), rtol=1e-6)
    # Adam with bias correction: eta * sqrt(1 - b2) / (1 - b1)
    s = FedAdam(eta=0.1, tau=tau, bias_correction=True)
    eta1 = 0.1 * np.sqrt(1 - 0.99) / (1 - 0.9)
    np.testing.assert_allclose(np.concatenate(s.aggregate(1, ups, CUR)), eta1 * 0.1 * d / (0.1 * np.abs(d) + tau), rtol=1e-6)


def test_fedopt_keeps_fedavg_checks_and_integer_tensors():
    s = FedAdam(min_clients=2)
    assert s.aggregate(1, [U("a", W(1, 1, 1), 1)], CUR) is None and "min_clients=2" in s.last_report.reason
    assert s.m is None  # no step was taken
    cur = [np.zeros(2, np.float32), np.array(4, np.int64)]
    out = FedYogi().aggregate(1, [ClientUpdate("a", [np.ones(2, np.float32), np.array(6, np.int64)], 1),
                                  ClientUpdate("b", [np.ones(2, np.float32), np.array(8, np.int64)], 1)], cur)
    assert out[1].dtype == np.float64 and out[1] == 7.0  # averaged as FedAvg does (torch_support rounds it back)
    for bad in ({"eta": 0}, {"tau": 0}, {"beta_1": 1.0}, {"beta_2": -0.1}):
        with pytest.raises(ValueError):
            FedAdam(**bad)


# ---------------------------------------------------------------------------- robust aggregation
def test_trimmed_mean_drops_extremes_per_coordinate_unweighted():
    ups = [U(c, W(v, -v, v), n) for c, v, n in (("a", 1, 1), ("b", 2, 50), ("c", 3, 1), ("d", 4, 1), ("e", 100, 1))]
    s = TrimmedMean(beta=0.2)
    out = s.aggregate(1, ups, CUR)
    np.testing.assert_allclose(np.concatenate(out), [3, -3, 3])  # mean of 2, 3, 4 in each coordinate
    assert s.last_trimmed == 1 and s.last_report.accepted == ["a", "b", "c", "d", "e"]
    np.testing.assert_allclose(np.concatenate(TrimmedMean(beta=0.0).aggregate(1, ups, CUR)), [22, -22, 22])
    with pytest.raises(ValueError):
        TrimmedMean(beta=0.5)


def test_krum_keeps_the_most_central_update_and_names_the_rest():
    close = [U(f"h{i}", W(1 + 0.01 * i, 1, 1), 10) for i in range(4)]
    attacker = U("bad", W(-50, -50, -50), 1000)
    s = Krum(num_byzantine=1)
    out = s.aggregate(1, close + [attacker], CUR)
    assert len(s.last_report.accepted) == 1 and s.last_report.accepted[0].startswith("h")
    assert "not selected by Krum" in s.last_report.dropped_reasons["bad"]
    np.testing.assert_allclose(out[1], [1.0])
    # multi-Krum (m = n - f): the four honest ones, averaged by samples
    m = Krum(num_byzantine=1, num_selected=None)
    np.testing.assert_allclose(np.concatenate(m.aggregate(1, close + [attacker], CUR)), [1.015, 1, 1], rtol=1e-6)
    assert sorted(m.last_report.accepted) == ["h0", "h1", "h2", "h3"] and m.last_report.num_samples == 40
    # too few for the assumed number of Byzantine clients: no model, with the reason
    k2 = Krum(num_byzantine=2)
    assert k2.aggregate(1, close + [attacker], CUR) is None and "needs 7" in k2.last_report.reason


def _softmax_train(w, X, y, steps=20, lr=0.5):
    Wt, b = (np.array(p, np.float64) for p in w)
    for _ in range(steps):
        z = X @ Wt + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        Wt -= lr * X.T @ p / len(y)
        b -= lr * p.mean(0)
    return [Wt.astype(np.float32), b.astype(np.float32)]


def _federated_accuracy(strategy, flip: float, rounds: int = 10) -> float:
    """5 clients, non-IID digits (Dirichlet 0.5, seed 0), softmax regression; client 0 sends
    ``-flip`` times its update (sign flipping). Test accuracy of the final global model."""
    from fl.data import load_client_data, load_test_data

    data = [load_client_data(k, 5, scheme="dirichlet", alpha=0.5, seed=0) for k in range(5)]
    Xt, yt = load_test_data()
    w = [np.zeros((64, 10), np.float32), np.zeros(10, np.float32)]
    for r in range(1, rounds + 1):
        ups = []
        for k, (X, y) in enumerate(data):
            new = _softmax_train(w, X, y)
            if k == 0 and flip:
                new = [c - flip * (a - c) for a, c in zip(new, w)]
            ups.append(ClientUpdate(f"c{k}", new, len(y)))
        w = strategy.aggregate(r, ups, w)
        assert w is not None
    return float(((Xt @ w[0] + w[1]).argmax(1) == yt).mean())


def test_sign_flipping_client_fedavg_degrades_trimmed_mean_and_krum_hold():
    honest = _federated_accuracy(FedAvg(), 0)
    assert honest > 0.9
    attacked = _federated_accuracy(FedAvg(), 10)
    trimmed = _federated_accuracy(TrimmedMean(beta=0.2), 10)
    multi_krum = _federated_accuracy(Krum(num_byzantine=1, num_selected=None), 10)
    assert attacked < 0.5, attacked  # one client in five wrecks the average
    assert trimmed > 0.75 and trimmed - attacked > 0.4, (trimmed, attacked)
    assert multi_krum > 0.9, multi_krum  # it drops the attacker every round
    for opt in (FedAdam(), FedYogi(), FedAdagrad()):  # and the server optimizers train (no attacker)
        assert _federated_accuracy(opt, 0) > 0.9, opt.name
