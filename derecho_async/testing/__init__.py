"""Public testing kit: a deterministic simulated cluster with an invariant checker.

``SimCluster`` runs the real protocol core over a seeded simulated fabric (delays, word-by-word
landing, crashes mid-push, partitions); ``check()`` raises ``InvariantViolation`` naming the seed
and the step of the first broken guarantee.
"""

from __future__ import annotations

from derecho_async.core.view import View
from derecho_async.testing.checker import Delivery, InvariantViolation
from derecho_async.testing.sim import SimCluster

__all__ = ["Delivery", "InvariantViolation", "SimCluster", "View"]
