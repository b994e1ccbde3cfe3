"""Client-level differential privacy for federated rounds: clipping, Gaussian noise, and the
privacy budget spent, from Google's ``dp-accounting`` RDP accountant (not a formula of ours).

Client-level DP (McMahan et al., "Learning differentially private recurrent language models",
2018; DP-FedAvg): each client's model *delta* is clipped to L2 norm ``clip_norm``, so one client
changes the sum by at most ``clip_norm``; Gaussian noise of standard deviation
``noise_multiplier * clip_norm`` is added to the sum of the round's deltas, which is then divided
by the number of clients (uniform weighting: sample-count weighting would let a client's
influence exceed the clip). Each round is the sampled Gaussian mechanism with sampling rate
``q = clients per round / clients in the population``; the accountant composes the rounds.

* ``central``: the aggregator (the driver) clips and adds the noise once. It protects the
  released models from everyone, but the driver sees individual deltas (unless secure
  aggregation hides them: then clipping happens on the device and the noise on the sum).
* ``local``: every client clips and adds ``noise_multiplier * clip_norm`` to its own delta
  before it leaves the device, so not even the driver sees a clean update; the accountant then
  charges each round with q = 1 (a device cannot count on having been sampled secretly). The
  sum then carries sqrt(m) times the noise of the central variant: more privacy, lower accuracy.

Pure logic (numpy and dp-accounting; no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["DPConfig", "PrivacyAccountant", "clip_by_norm", "clip_weights_delta", "noise_for_epsilon",
           "DEFAULT_ORDERS", "privatize_mean"]

#: RDP orders the accountant tries (integers avoid the library's slow fractional-order path;
#: this range is what TF Privacy and Opacus use for the regimes FL runs in)
DEFAULT_ORDERS: Tuple[float, ...] = tuple(list(range(2, 64)) + [80, 96, 128, 256, 512])


def clip_by_norm(vec: np.ndarray, max_norm: float) -> Tuple[np.ndarray, float]:
    """Scale ``vec`` down to L2 norm ``max_norm`` if it is longer; returns (clipped, original norm)."""
    if not max_norm > 0:
        raise ValueError("clip norm must be > 0")
    v = np.asarray(vec, dtype=np.float64)
    norm = float(np.linalg.norm(v))
    if not np.isfinite(norm):
        raise ValueError("update has non-finite values")
    return (v * (max_norm / norm) if norm > max_norm else v.copy()), norm


def clip_weights_delta(new: Sequence[np.ndarray], base: Sequence[np.ndarray], max_norm: float) -> Tuple[List[np.ndarray], float]:
    """Clip the delta ``new - base`` of a whole model (all tensors together); returns the clipped
    delta as a list of arrays and the delta's norm before clipping."""
    flat = np.concatenate([(np.asarray(n, np.float64) - np.asarray(b, np.float64)).reshape(-1) for n, b in zip(new, base)])
    clipped, norm = clip_by_norm(flat, max_norm)
    out, pos = [], 0
    for b in base:
        k = int(np.size(b))
        out.append(clipped[pos:pos + k].reshape(np.shape(b)))
        pos += k
    return out, norm


@dataclass
class DPConfig:
    """``noise_multiplier`` z (std = z * clip_norm), ``clip_norm`` C, ``mode`` central|local,
    ``delta`` of (epsilon, delta)-DP, ``sample_rate`` q for amplification by subsampling, only
    with ``selection="random"`` (None: clients asked / clients in the federation there; every
    other selection is accounted with q = 1, see ``fl.drivers.features.Features.dp_sample_rate``)."""

    noise_multiplier: float
    clip_norm: float = 1.0
    mode: str = "central"
    delta: float = 1e-5
    sample_rate: Optional[float] = None

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0 or not np.isfinite(self.noise_multiplier):
            raise ValueError("noise_multiplier must be >= 0")
        if not self.clip_norm > 0:
            raise ValueError("clip_norm must be > 0")
        if self.mode not in ("central", "local"):
            raise ValueError(f"DP mode must be 'central' or 'local', not {self.mode!r}")
        if not 0 < self.delta < 1:
            raise ValueError("delta must be in (0, 1)")
        if self.sample_rate is not None and not 0 < self.sample_rate <= 1:
            raise ValueError("sample_rate must be in (0, 1]")

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.clip_norm


@dataclass
class PrivacyAccountant:
    """Rounds spent so far, composed by dp-accounting's RDP accountant.

    Kept as the list of (sample rate, rounds) so it can be checkpointed and rebuilt on resume."""

    noise_multiplier: float
    delta: float = 1e-5
    orders: Tuple[float, ...] = DEFAULT_ORDERS
    steps: List[Tuple[float, int]] = field(default_factory=list)

    def step(self, sample_rate: float, count: int = 1) -> None:
        if not 0 < sample_rate <= 1 or count < 1:
            raise ValueError("sample_rate in (0, 1] and count >= 1 required")
        if self.steps and self.steps[-1][0] == sample_rate:
            self.steps[-1] = (sample_rate, self.steps[-1][1] + count)
        else:
            self.steps.append((float(sample_rate), int(count)))

    @property
    def rounds(self) -> int:
        return sum(c for _, c in self.steps)

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta`` (inf with no noise, 0 before any round)."""
        if not self.steps:
            return 0.0
        if self.noise_multiplier <= 0:
            return float("inf")
        import dp_accounting
        from dp_accounting.rdp import rdp_privacy_accountant

        acc = rdp_privacy_accountant.RdpAccountant(list(self.orders))
        for q, n in self.steps:
            ev = dp_accounting.GaussianDpEvent(self.noise_multiplier)
            acc.compose(ev if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, ev), n)
        return float(acc.get_epsilon(self.delta))

    def to_state(self) -> Dict[str, object]:
        return {"noise_multiplier": self.noise_multiplier, "delta": self.delta, "steps": [list(s) for s in self.steps]}

    @classmethod
    def from_state(cls, d: Dict[str, object]) -> "PrivacyAccountant":
        return cls(float(d["noise_multiplier"]), float(d["delta"]),  # type: ignore[arg-type]
                   steps=[(float(q), int(n)) for q, n in d.get("steps", [])])  # type: ignore[union-attr]


def noise_for_epsilon(target_epsilon: float, rounds: int, sample_rate: float, delta: float = 1e-5) -> float:
    """The smallest noise multiplier whose ``rounds`` rounds at ``sample_rate`` stay within
    ``target_epsilon`` (dp-accounting's own calibration)."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    def event(z: float):
        ev = dp_accounting.GaussianDpEvent(z)
        one = ev if sample_rate >= 1 else dp_accounting.PoissonSampledDpEvent(sample_rate, ev)
        return dp_accounting.SelfComposedDpEvent(one, rounds)

    return float(dp_accounting.calibrate_dp_mechanism(
        lambda: rdp_privacy_accountant.RdpAccountant(list(DEFAULT_ORDERS)), event, target_epsilon, delta,
        dp_accounting.mechanism_calibration.LowerEndpointAndGuess(0.05, 1.0)))


def privatize_mean(deltas: Sequence[np.ndarray], cfg: DPConfig, rng: np.random.Generator,
                   already_clipped: bool = False) -> Tuple[np.ndarray, List[float]]:
    """Central DP aggregate of flat deltas: clip each (unless the devices did), sum, add
    N(0, (z*C)^2), divide by the count. Returns (noisy mean delta, the norms before clipping)."""
    if not deltas:
        raise ValueError("no deltas to aggregate")
    norms: List[float] = []
    total = np.zeros_like(np.asarray(deltas[0], dtype=np.float64))
    for d in deltas:
        c, n = (np.asarray(d, np.float64), float(np.linalg.norm(d))) if already_clipped else clip_by_norm(d, cfg.clip_norm)
        norms.append(n)
        total += c
    if cfg.mode == "central" and cfg.noise_multiplier > 0:
        total += rng.normal(0.0, cfg.noise_std, total.shape)
    return total / len(deltas), norms
