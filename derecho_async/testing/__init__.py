"""Public testing kit: a deterministic simulated cluster with an invariant checker.

``SimCluster`` runs the real protocol core over a seeded simulated fabric (delays, word-by-word
landing, crashes mid-push, partitions); ``check()`` raises ``InvariantViolation`` naming the seed
and the step of the first broken guarantee.

For running real Groups (driver, runners, data planes) in one process instead of the bare core:
``VirtualTimeLoop`` / ``run_virtual`` (:mod:`.vloop`) run asyncio on a virtual clock, and
``SimNetwork`` (:mod:`.simnet`) gives each member a real transport over a seeded network with the
same faults; ``crash_group`` crashes a Group on it.
"""

from __future__ import annotations

from derecho_async.core.view import View
from derecho_async.testing.checker import Delivery, InvariantViolation
from derecho_async.testing.sim import SimCluster
from derecho_async.testing.simnet import SimNetwork, SimTransport, TraceEvent, crash_group
from derecho_async.testing.vloop import (
    SimulationStalled,
    VirtualTimeExceeded,
    VirtualTimeLoop,
    run_virtual,
)

__all__ = [
    "Delivery",
    "InvariantViolation",
    "SimCluster",
    "SimNetwork",
    "SimTransport",
    "SimulationStalled",
    "TraceEvent",
    "View",
    "VirtualTimeExceeded",
    "VirtualTimeLoop",
    "crash_group",
    "run_virtual",
]
