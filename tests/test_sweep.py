"""Seeded random fault schedules over the simulated cluster, each ending idle and checked.

The default run covers 1,000 schedules (the suite's time on 2 cores is bounded: ``make sweep``
and the long sweep cover more). ``DERECHO_ASYNC_LONG_SWEEP=1`` runs 100,000 (or
``DERECHO_ASYNC_SWEEP_COUNT``); ``DERECHO_ASYNC_SEED=S`` replays one schedule. A failure prints
the command that replays its seed.
"""

from __future__ import annotations

import os

import pytest

from derecho_async.testing.checker import InvariantViolation
from derecho_async.testing.sweep import run_schedule

DEFAULT_COUNT = 1000
CHUNK = 100
LONG = os.environ.get("DERECHO_ASYNC_LONG_SWEEP") == "1"
COUNT = int(os.environ.get("DERECHO_ASYNC_SWEEP_COUNT", 100_000 if LONG else DEFAULT_COUNT))


def _run(seed: int) -> None:
    try:
        run_schedule(seed)
    except InvariantViolation as exc:
        pytest.fail(
            f"{exc}\nreplay with: python -m derecho_async.testing.sweep --seed {seed}",
            pytrace=False,
        )


@pytest.mark.parametrize("first", range(0, COUNT, CHUNK), ids=lambda f: f"seeds{f}-{f + CHUNK - 1}")
def test_sweep(first: int) -> None:
    for seed in range(first, min(first + CHUNK, COUNT)):
        _run(seed)


@pytest.mark.skipif("DERECHO_ASYNC_SEED" not in os.environ, reason="set DERECHO_ASYNC_SEED=S")
def test_replay() -> None:
    _run(int(os.environ["DERECHO_ASYNC_SEED"]))


def test_a_failing_schedule_names_its_replay_command() -> None:
    # The checker's message carries the seed, the step and the replay command.
    from derecho_async.testing import Delivery, SimCluster

    c = SimCluster(2, seed=321)
    with pytest.raises(InvariantViolation) as info:
        c.checker.on_delivery(0, 0, Delivery(0, 0, 1, b"?"), 5, frozenset())
    assert "seed 321" in str(info.value) and "DERECHO_ASYNC_SEED=321" in str(info.value)
