"""Client-level DP (fl.privacy): epsilon from dp-accounting, clipping bounds, noise scale."""

from __future__ import annotations

import numpy as np
import pytest

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

from fl.privacy import (DEFAULT_ORDERS, DPConfig, PrivacyAccountant, clip_by_norm, clip_weights_delta,
                        noise_for_epsilon, privatize_mean)


@pytest.mark.parametrize("z,q,steps", [(1.1, 0.2, 50), (0.8, 1.0, 10), (2.0, 0.05, 400)])
def test_epsilon_matches_the_accountant_computed_directly(z, q, steps):
    acc = PrivacyAccountant(z, delta=1e-5)
    for _ in range(steps):
        acc.step(q)
    direct = rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS))
    ev = dp_accounting.GaussianDpEvent(z)
    direct.compose(ev if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, ev), steps)
    assert acc.epsilon() == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    # the library's own default orders give the same answer to within its order grid
    lib = rdp_privacy_accountant.RdpAccountant()
    lib.compose(ev if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, ev), steps)
    assert acc.epsilon() == pytest.approx(lib.get_epsilon(1e-5), rel=0.05)


def test_epsilon_grows_with_rounds_and_survives_a_checkpoint():
    acc = PrivacyAccountant(1.0)
    assert acc.epsilon() == 0.0
    eps = []
    for _ in range(5):
        acc.step(0.5)
        eps.append(acc.epsilon())
    assert eps == sorted(eps) and eps[0] > 0
    again = PrivacyAccountant.from_state(acc.to_state())
    assert again.epsilon() == pytest.approx(eps[-1]) and again.rounds == 5
    assert PrivacyAccountant(0.0, steps=[(1.0, 1)]).epsilon() == float("inf")


def test_calibration_hits_the_target():
    z = noise_for_epsilon(8.0, rounds=30, sample_rate=0.5)
    acc = PrivacyAccountant(z)
    acc.step(0.5, 30)
    assert acc.epsilon() == pytest.approx(8.0, rel=0.02)


def test_clipping_bounds_the_norm():
    rng = np.random.default_rng(0)
    for scale in (0.01, 1.0, 100.0):
        v = rng.normal(0, scale, 1000)
        c, n = clip_by_norm(v, 1.5)
        assert np.linalg.norm(c) <= 1.5 + 1e-9 and n == pytest.approx(np.linalg.norm(v))
        if n <= 1.5:
            assert np.array_equal(c, v)
    new, base = [rng.normal(0, 5, (4, 3)), rng.normal(0, 5, 7)], [np.zeros((4, 3)), np.zeros(7)]
    d, n = clip_weights_delta(new, base, 2.0)
    assert [x.shape for x in d] == [(4, 3), (7,)]
    assert np.sqrt(sum((x ** 2).sum() for x in d)) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="non-finite"):
        clip_by_norm(np.array([np.nan, 1.0]), 1.0)


def test_central_noise_has_the_configured_scale():
    cfg = DPConfig(noise_multiplier=2.0, clip_norm=0.5)
    zeros = [np.zeros(200_000) for _ in range(4)]
    mean, norms = privatize_mean(zeros, cfg, np.random.default_rng(1))
    assert norms == [0.0] * 4
    assert np.std(mean * 4) == pytest.approx(1.0, rel=0.01)  # z * C on the sum


def test_bad_config_is_refused():
    for kw, msg in [({"noise_multiplier": -1}, "noise_multiplier"), ({"noise_multiplier": 1, "mode": "x"}, "mode"),
                    ({"noise_multiplier": 1, "clip_norm": 0}, "clip_norm"), ({"noise_multiplier": 1, "delta": 2}, "delta")]:
        with pytest.raises(ValueError, match=msg):
            DPConfig(**kw)


def test_subsampling_amplification_only_for_uniform_random_selection():
    """Issue 11: the accountant's q. Deterministic selection (the scheduler's predictions, or the
    strategy's own choice) gets q = 1; only selection="random" is accounted as subsampled."""
    from fl.drivers.features import Features

    dp = {"noise_multiplier": 1.0, "clip_norm": 1.0}
    assert Features(dp=dp, selection="predicted", clients_per_round=2).dp_sample_rate(2, 10) == 1.0
    assert Features(dp=dp).dp_sample_rate(2, 10) == 1.0
    assert Features(dp={**dp, "mode": "local"}, selection="random", clients_per_round=2).dp_sample_rate(2, 10) == 1.0
    assert Features(dp=dp, selection="random", clients_per_round=2).dp_sample_rate(2, 10) == pytest.approx(0.2)
    assert Features(dp={**dp, "sample_rate": 0.3}, selection="random", clients_per_round=2).dp_sample_rate(2, 10) == 0.3
    # the epsilon that follows: q = 1 spends more than the amplified q = 0.2 for the same rounds
    full, sub = PrivacyAccountant(1.0, 1e-5), PrivacyAccountant(1.0, 1e-5)
    for _ in range(5):
        full.step(Features(dp=dp, selection="predicted", clients_per_round=2).dp_sample_rate(2, 10))
        sub.step(Features(dp=dp, selection="random", clients_per_round=2).dp_sample_rate(2, 10))
    assert full.epsilon() > 2 * sub.epsilon()
    # a sample rate that claims amplification without uniform draws is refused
    for sel, extra in [("predicted", {"clients_per_round": 2}), ("strategy", {})]:
        with pytest.raises(ValueError, match="amplification by subsampling.*selection='random'"):
            Features(dp={**dp, "sample_rate": 0.2}, selection=sel, **extra)
    assert Features(dp={**dp, "sample_rate": 1.0}, selection="predicted", clients_per_round=2).dp_sample_rate(2, 10) == 1.0
