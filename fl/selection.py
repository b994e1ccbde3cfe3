"""Client selection from the scheduler's predictions (Oort / FedCS spirit); pure logic.

Why: a synchronous round lasts as long as its slowest useful client, and a client that is
offline or too slow for the deadline wastes a seat. The hub's scheduler already predicts, per
endpoint, how long the training function takes there (its runtime profile, queue and transfer
time) and how likely the endpoint is to be online (its outage history). This module turns those
predictions into a pick:

* ``likelihood`` that a client reports before the deadline: ``p_online`` times a smooth
  ``P(time <= deadline)`` (a log-normal spread around the prediction, ``spread`` its sigma);
* the ``k`` clients with the highest likelihood-times-utility are picked, where utility is the
  client's share of the data (``num_samples``, as Oort weighs statistical utility), ties broken
  by a seeded shuffle so equal clients rotate;
* a **fairness floor**: a client not asked for ``fairness_rounds`` rounds is asked now (if it is
  online at all), so slow devices still contribute their data regularly and the model does not
  drift towards the fast ones' distribution;
* unknown clients (no profile yet) are explored: they get a seat before predicted-slow ones.

``select_random`` is the baseline the comparison uses (uniform among online clients).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = ["Candidate", "Selection", "select_predicted", "select_random", "report_probability"]


@dataclass(frozen=True)
class Candidate:
    """What the scheduler predicts for one client. ``predicted_s`` None: no profile yet."""

    client_id: str
    predicted_s: Optional[float]
    p_online: float = 1.0
    num_samples: int = 1
    last_round: Optional[int] = None  # last round this client was asked (None: never)


@dataclass
class Selection:
    chosen: List[str]
    forced: List[str]        # asked because of the fairness floor
    explored: List[str]      # asked because nothing is known about them yet
    scores: Dict[str, float]  # client -> P(report by the deadline), as estimated


def report_probability(c: Candidate, deadline_s: float, spread: float = 0.35) -> float:
    """P(online) * P(round time <= deadline) under a log-normal around the prediction."""
    p_on = min(1.0, max(0.0, float(c.p_online)))
    if c.predicted_s is None:
        return p_on * 0.5
    if c.predicted_s <= 0:
        return p_on
    z = (math.log(deadline_s) - math.log(c.predicted_s)) / max(spread, 1e-6)
    return p_on * 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def select_predicted(candidates: Sequence[Candidate], k: int, round: int, deadline_s: float, *,
                     fairness_rounds: int = 5, min_p_online: float = 0.05, spread: float = 0.35,
                     seed: int = 0) -> Selection:
    """Pick up to ``k`` clients for ``round`` (see the module docstring)."""
    if k < 1:
        raise ValueError("k must be >= 1")
    if deadline_s <= 0:
        raise ValueError("deadline_s must be > 0")
    if fairness_rounds < 1:
        raise ValueError("fairness_rounds must be >= 1")
    rng = random.Random(seed * 1_000_003 + round)
    pool = [c for c in candidates if c.p_online >= min_p_online]
    rng.shuffle(pool)
    scores = {c.client_id: report_probability(c, deadline_s, spread) for c in pool}
    total = sum(max(1, c.num_samples) for c in pool) or 1
    def last(c: Candidate) -> int:  # never asked counts as asked before round 1
        return 0 if c.last_round is None else int(c.last_round)

    forced = [c for c in pool if round - last(c) >= fairness_rounds]
    forced.sort(key=lambda c: (last(c), -scores[c.client_id]))
    explored = [c for c in pool if c.predicted_s is None and c.last_round is None]
    chosen: List[str] = []
    for c in forced[:k]:
        chosen.append(c.client_id)
    for c in explored:
        if len(chosen) >= k:
            break
        if c.client_id not in chosen:
            chosen.append(c.client_id)
    rest = sorted((c for c in pool if c.client_id not in chosen),
                  key=lambda c: -(scores[c.client_id] * (0.5 + 0.5 * max(1, c.num_samples) * len(pool) / total)))
    for c in rest:
        if len(chosen) >= k:
            break
        chosen.append(c.client_id)
    return Selection(chosen, [c.client_id for c in forced if c.client_id in chosen],
                     [c.client_id for c in explored if c.client_id in chosen], scores)


def select_random(candidates: Sequence[str], k: int, round: int, seed: int = 0) -> List[str]:
    """Uniform choice of ``k`` among the online candidates, deterministic per (seed, round)."""
    pool = sorted(candidates)
    random.Random(seed * 1_000_003 + round).shuffle(pool)
    return pool[:k]


def last_rounds(history_rounds: Sequence[Mapping[str, object]]) -> Dict[str, int]:
    """Client -> last round it was asked, from round records (``extra.asked``)."""
    out: Dict[str, int] = {}
    for r in history_rounds:
        for c in (r.get("extra") or {}).get("asked", []) or []:  # type: ignore[union-attr]
            out[str(c)] = int(r["round"])  # type: ignore[arg-type]
    return out
