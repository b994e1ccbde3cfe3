"""Outage processes: each yields its (time, going_down) transitions lazily, from its own seeded
random stream, so the outage timeline is identical whatever policy is being simulated.

* Markov on/off: exponential up and down times; starts in its stationary state.
* Scheduled: offline every day in a local-time window (e.g. 22:00-06:00), shifted per
  endpoint by a fixed random offset.
* A process can cover one endpoint or a whole region (correlated outage): the engine counts,
  per endpoint, how many of its processes are currently down; it is online when none is.
"""

from __future__ import annotations

# The models live in ``sim.outages`` (shared with the emulation mode); this module keeps the
# names the engine has always used.
from sim.outages import DAY, markov, scheduled

__all__ = ["DAY", "markov", "scheduled"]
