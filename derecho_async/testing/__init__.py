"""Public testing kit: a deterministic simulated cluster with an invariant checker.

``SimCluster`` runs the real protocol core over a seeded simulated fabric (delays, word-by-word
landing, crashes mid-push, partitions); ``check()`` raises ``InvariantViolation`` naming the seed
and the step of the first broken guarantee.

For running real Groups (driver, runners, data planes) in one process instead of the bare core:
``VirtualTimeLoop`` / ``run_virtual`` (:mod:`.vloop`) run asyncio on a virtual clock, and
``SimNetwork`` (:mod:`.simnet`) gives each member a real transport over a seeded network with the
same faults; ``crash_group`` crashes a Group on it.

The actor-level kit runs real Groups on that network: ``run_actor_schedule(seed)`` (:mod:`.actorsim`)
builds 2-5 Groups hosting ``SimLog`` (a replicated log whose handlers await, raise ``ValueError``,
a ``BaseException`` or ``CancelledError``, deterministically per call) and drives them from
``random.Random(seed)``: one-way and replied calls, p2p reads, joins, leaves, crashes mid-push,
partitions, slow links; it returns an ``ActorRun`` (the observer's and the replicas' records,
every caller's outcome). ``check_actor_run`` (:mod:`.actorcheck`) checks the actor contract over it
(ran == delivered, virtual synchrony, joiners' state, replicas agreeing, replies, p2p reads,
nothing lost) and raises ``InvariantViolation`` naming the seed and
``python -m derecho_async.testing.actor_sweep --seed S``, which replays it.

For transports: ``check_transport(factory)`` (:mod:`.conformance`) runs the conformance suite
every transport passes against the members a ``TransportFactory`` makes.
"""

from __future__ import annotations

from derecho_async.core.view import View
from derecho_async.testing.actorcheck import check_actor_run
from derecho_async.testing.actorsim import (
    ActorRun,
    CallOutcome,
    P2POutcome,
    RecordingObserver,
    run_actor_schedule,
)
from derecho_async.testing.checker import Delivery, InvariantViolation
from derecho_async.testing.conformance import TransportFactory, check_transport
from derecho_async.testing.sim import SimCluster
from derecho_async.testing.simlog import SimLog, SimLogStop
from derecho_async.testing.simnet import SimNetwork, SimTransport, TraceEvent, crash_group
from derecho_async.testing.vloop import (
    SimulationStalled,
    VirtualTimeExceeded,
    VirtualTimeLoop,
    run_virtual,
)

__all__ = [
    "ActorRun",
    "CallOutcome",
    "Delivery",
    "InvariantViolation",
    "P2POutcome",
    "RecordingObserver",
    "SimCluster",
    "SimLog",
    "SimLogStop",
    "SimNetwork",
    "SimTransport",
    "SimulationStalled",
    "TraceEvent",
    "TransportFactory",
    "View",
    "VirtualTimeExceeded",
    "VirtualTimeLoop",
    "check_actor_run",
    "check_transport",
    "crash_group",
    "run_actor_schedule",
    "run_virtual",
]
