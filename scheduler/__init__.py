"""Delta-style profiling scheduler for the Continuum Mesh, as pure logic.

No I/O, no asyncio, no clock: every call takes ``now``, so the hub and the discrete-event
simulator (``sim.des``) drive exactly the same code. Stdlib only.

Public surface:

* :class:`Scheduler` - the facade the hub calls (``add_endpoint``, ``heartbeat``,
  ``endpoint_offline``/``sweep``, ``message_timing``, ``place``, ``task_completed``,
  ``task_requeued``, ``decisions``, ``to_dict``/``from_dict``).
* Data: :class:`TaskInfo`, :class:`Constraints`, :class:`EndpointState`, :class:`Placement`,
  :class:`Prediction`, :class:`Decision`, :class:`NoEligibleEndpoint`.
* Learned state: :class:`Profiles` (and its estimators, :class:`Availability`).
* Policies: :class:`Policy` (protocol), ``POLICIES``, :func:`make_policy`, :func:`register_policy`.
"""

from .availability import Availability
from .core import BLOCKING_ERRORS, Scheduler
from .events import EndpointOffline, Event, Heartbeat, MessageTiming, TaskCompleted, TaskRequeued
from .fleet import Fleet
from .model import (
    NO_CONSTRAINTS,
    Constraints,
    Decision,
    EndpointState,
    NoEligibleEndpoint,
    Placement,
    Prediction,
    TaskInfo,
)
from .policies import POLICIES, BasePolicy, Policy, make_policy, register_policy
from .predict import Predictor
from .profiles import DecayedMean, LinkStats, Profiles, RuntimeStats, Throughput

__all__ = [
    "Availability",
    "BLOCKING_ERRORS",
    "BasePolicy",
    "Constraints",
    "Decision",
    "DecayedMean",
    "EndpointOffline",
    "EndpointState",
    "Event",
    "Fleet",
    "Heartbeat",
    "LinkStats",
    "MessageTiming",
    "NO_CONSTRAINTS",
    "NoEligibleEndpoint",
    "POLICIES",
    "Placement",
    "Policy",
    "Prediction",
    "Predictor",
    "Profiles",
    "RuntimeStats",
    "Scheduler",
    "TaskCompleted",
    "TaskInfo",
    "TaskRequeued",
    "Throughput",
    "make_policy",
    "register_policy",
]
