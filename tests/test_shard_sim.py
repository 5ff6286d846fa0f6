"""The sharded-actor schedules (derecho_async.testing.shardsim): seeded runs of real Groups
whose shards move under crashes, joins and leaves, checked; and the checks catch a broken
member (one that runs every copy of a retried call, one that drops a shard's state)."""

from __future__ import annotations

import os

import pytest

from derecho_async.api.handoff import Handoffs
from derecho_async.api.once import ClientCalls
from derecho_async.testing import InvariantViolation
from derecho_async.testing.shardsim import check_shard_run, run_shard_schedule

COUNT = int(os.environ.get("DERECHO_ASYNC_SHARD_SCHEDULES", "40"))


def test_shard_schedules_hold() -> None:
    moved = 0
    for seed in range(COUNT):
        run = run_shard_schedule(seed)
        check_shard_run(run)
        moved += any(not f.startswith("live") for f in run.fates.values())
    assert moved > COUNT // 3  # the schedules did change views


def test_a_schedule_replays_exactly() -> None:
    a, b = run_shard_schedule(12), run_shard_schedule(12)
    assert a.log == b.log and a.logs == b.logs


def test_the_checks_catch_a_retried_call_run_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ClientCalls, "admit", lambda self, client, seq: None)
    with pytest.raises(InvariantViolation, match=r"check \(s2\)"):
        for seed in range(200):  # until a forwarded call was retried after it ran
            check_shard_run(run_shard_schedule(seed, moving=False, replicas=2))


def test_the_checks_catch_a_gainer_that_keeps_its_old_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def keep(self: Handoffs, name: str, gain: object) -> None:  # never restores: releases
        release = getattr(gain, "release", None)
        if release is not None:
            self._gains.pop(name, None)
            self.held[name] = gain.shard  # type: ignore[attr-defined]
            release()

    monkeypatch.setattr(Handoffs, "_try_restore", keep)
    with pytest.raises(InvariantViolation, match=r"check \(s[12]\)"):
        for seed in range(200):
            check_shard_run(run_shard_schedule(seed, moving=True))
