"""Workload generation: submissions (arrival times and sizes) and per-task attributes.

Everything is drawn up front with numpy from the scenario seed, so every policy sees exactly
the same tasks (common random numbers: differences between policies are not sampling noise).
Per-task values are stored in compact ``array`` columns (a million tasks fit in a few tens of
MB and reading an element yields a plain Python number, which the event loop needs).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import numpy as np

from .scenario import Scenario


def lognormal_unit(rng: np.random.Generator, cv: float, n: int) -> np.ndarray:
    """Lognormal multipliers with mean 1 and coefficient of variation ``cv``."""
    if cv <= 0:
        return np.ones(n)
    s2 = math.log1p(cv * cv)
    return rng.lognormal(-s2 / 2.0, math.sqrt(s2), n)


@dataclass
class Workload:
    fn: array  # function index per task ('i')
    nbytes: array  # payload bytes ('d')
    noise: array  # runtime multiplier of this call ('d'): its intrinsic size
    sub_time: array  # submission times, seconds after the workload starts ('d')
    sub_start: array  # first task of each submission; sub_start[-1] == n ('q')
    phase_start: tuple[int, ...] = ()  # ``phases`` arrivals: first task of each phase, then n

    @property
    def n(self) -> int:
        return len(self.fn)


def generate(sc: Scenario) -> Workload:
    rng = np.random.default_rng([sc.seed, 1])
    fids = [f.id for f in sc.functions]
    wl = sc.workload
    arr = wl.arrival
    n = wl.tasks

    def mix_probs(mix: dict[str, float]) -> np.ndarray:
        p = np.array([mix.get(f, 0.0) for f in fids], dtype=float)
        return p / p.sum()

    main_p = mix_probs(wl.mix)
    fn = np.empty(n, dtype=np.int64)
    if arr.kind == "batch":
        sizes = [arr.batch_size] * (n // arr.batch_size) + ([n % arr.batch_size] if n % arr.batch_size else [])
        times = np.zeros(len(sizes))
        fn[:] = rng.choice(len(fids), size=n, p=main_p)
    elif arr.kind == "poisson":
        m = -(-n // arr.batch_size)
        sizes = [arr.batch_size] * m
        sizes[-1] = n - arr.batch_size * (m - 1)
        times = np.cumsum(rng.exponential(1.0 / arr.rate_per_s, m))
        fn[:] = rng.choice(len(fids), size=n, p=main_p)
    elif arr.kind == "phases":
        sizes, t_phase, pstart = [], [], [0]
        pos = 0
        for ph in arr.phases:
            fn[pos:pos + ph.tasks] = rng.choice(len(fids), size=ph.tasks, p=mix_probs(ph.mix or wl.mix))
            k = ph.tasks
            while k > 0:
                sizes.append(min(ph.batch_size, k))
                t_phase.append(ph.at_s)
                k -= sizes[-1]
            pos += ph.tasks
            pstart.append(pos)
        times = np.array(t_phase)
    else:  # bursty
        burst_p = mix_probs(arr.burst_mix) if arr.burst_mix else main_p
        t_list: list[float] = []
        s_list: list[int] = []
        kinds: list[int] = []
        total = 0
        t_burst = 0.0
        t_bg = rng.exponential(1.0 / arr.rate_per_s) if arr.rate_per_s > 0 else math.inf
        while total < n:
            if t_burst <= t_bg:
                k = min(arr.burst_size, n - total)
                t_list.append(t_burst)
                t_burst += arr.burst_every_s
                kinds.append(1)
            else:
                k = min(arr.batch_size, n - total)
                t_list.append(t_bg)
                t_bg += rng.exponential(1.0 / arr.rate_per_s)
                kinds.append(0)
            s_list.append(k)
            total += k
        sizes = s_list
        times = np.array(t_list)
        pos = 0
        for k, kind in zip(s_list, kinds):
            fn[pos:pos + k] = rng.choice(len(fids), size=k, p=burst_p if kind else main_p)
            pos += k

    noise = np.empty(n)
    nbytes = np.empty(n)
    for i, f in enumerate(sc.functions):
        idx = np.nonzero(fn == i)[0]
        if len(idx) == 0:
            continue
        noise[idx] = lognormal_unit(rng, f.cv, len(idx))
        nbytes[idx] = np.round(f.payload_kb * 1024.0 * lognormal_unit(rng, f.payload_cv, len(idx)))
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Workload(
        fn=array("i", fn.astype(np.int32).tobytes()),
        nbytes=array("d", nbytes.tobytes()),
        noise=array("d", noise.tobytes()),
        sub_time=array("d", np.asarray(times, dtype=float).tobytes()),
        sub_start=array("q", starts.tobytes()),
        phase_start=tuple(pstart) if arr.kind == "phases" else (),
    )
