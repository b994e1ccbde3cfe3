"""Cold start of a task's execution environment (docs/environments.md): Delta's cold-start term,
extended with what an endpoint must build or pull before it can start the worker.

An endpoint that already holds the environment (it reports the spec ids it can start without a
build in its heartbeats) pays nothing extra; any other pays the build time plus the bytes it must
fetch over its link, and a metered endpoint (LTE, paid per byte) pays those bytes again at
``metered_s_per_mb``: a price in seconds, so that a slightly faster metered Pi does not win a task
whose environment would cost it 80 MB of its data plan. Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EnvCost", "EnvCosts", "env_cold_start", "block_key", "ENV_ERROR", "PIP_PRIOR", "CONTAINER_PRIOR", "METERED_S_PER_MB"]

#: The short type name of a result whose environment could not be built (mesh_agent.engine.EnvError).
ENV_ERROR = "EnvError"


def block_key(function_id: str, env: str | None) -> str:
    """What a failure blocks on an endpoint: the function, or the function in that environment.
    A function that failed with a missing module in the agent's own Python is not blocked when a
    task brings the environment that has the module, and an environment that failed to build
    there blocks only that pair, until the spec (and so its id) changes."""
    return function_id if env is None else f"{function_id}@{env}"

#: Price of one MiB fetched on a metered link, in seconds of predicted completion time.
METERED_S_PER_MB = 2.0


@dataclass(frozen=True, slots=True)
class EnvCost:
    """What building an environment costs an endpoint that lacks it: seconds of build or pull
    (besides the download) and bytes fetched over its link."""

    build_s: float
    fetch_bytes: int


#: Priors before a build was measured (bench/coldstart.py, docs/environments.md): a small pip
#: environment from wheels, and a container image pulled and started.
PIP_PRIOR = EnvCost(build_s=5.0, fetch_bytes=20 * 2**20)
CONTAINER_PRIOR = EnvCost(build_s=20.0, fetch_bytes=200 * 2**20)


def env_cold_start(cost: EnvCost | None, held: bool, bandwidth: float, metered: bool,
                   metered_s_per_mb: float = METERED_S_PER_MB) -> float:
    """Seconds an endpoint adds before the task's worker can start (0 when it holds the
    environment or the task names none). ``bandwidth``: the endpoint's link in bytes/s."""
    if cost is None or held:
        return 0.0
    t = cost.build_s
    if cost.fetch_bytes:
        t += cost.fetch_bytes / bandwidth if bandwidth > 0 else 0.0
        if metered:
            t += cost.fetch_bytes / 2**20 * metered_s_per_mb
    return t


class EnvCosts:
    """Learned cost per environment id: an exponentially weighted mean of the builds reported,
    starting from the prior of its kind."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._costs: dict[str, EnvCost] = {}

    def get(self, env: str | None, container: bool = False) -> EnvCost | None:
        if env is None:
            return None
        return self._costs.get(env) or (CONTAINER_PRIOR if container else PIP_PRIOR)

    def observe(self, env: str, build_s: float, fetch_bytes: int, container: bool = False) -> EnvCost:
        """A measured build (its seconds and the bytes it fetched) folds into the estimate."""
        if not (build_s >= 0 and fetch_bytes >= 0):
            raise ValueError(f"a build takes >= 0 s and fetches >= 0 bytes, got {build_s!r} s and {fetch_bytes!r} bytes")
        old = self._costs.get(env)
        if old is None:
            new = EnvCost(float(build_s), int(fetch_bytes))
        else:
            a = self.alpha
            new = EnvCost(old.build_s + a * (build_s - old.build_s), int(old.fetch_bytes + a * (fetch_bytes - old.fetch_bytes)))
        self._costs[env] = new
        return new
