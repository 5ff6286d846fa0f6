"""Seeded actor-level schedules over real Groups in virtual time, each checked.

``run_and_check(seed)`` runs :func:`~.actorsim.run_actor_schedule` (2-5 real Groups hosting the
SimLog test actor on a seeded SimNetwork: one-way and replied calls, p2p reads, joins, leaves,
crashes, partitions, slow links) and checks the actor-level contract over what it recorded
(:func:`~.actorcheck.check_actor_run`). The same seed replays the same run exactly::

    python -m derecho_async.testing.actor_sweep --seed 1234       # replay one, verbosely
    python -m derecho_async.testing.actor_sweep --count 2000      # a sweep, with progress
    python -m derecho_async.testing.actor_sweep --count 500 --start 10000
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from derecho_async.testing.actorcheck import check_actor_run
from derecho_async.testing.actorsim import ActorRun, run_actor_schedule
from derecho_async.testing.checker import InvariantViolation

__all__ = ["main", "run_and_check"]


def run_and_check(seed: int, **knobs: Any) -> ActorRun:
    """Run actor schedule ``seed`` and check it; InvariantViolation at the first broken check.

    A schedule that raises (a stalled simulation, virtual time exceeded) is reported as an
    InvariantViolation too, naming the seed."""
    try:
        run = run_actor_schedule(seed, **knobs)
    except InvariantViolation:
        raise
    except Exception as exc:
        from derecho_async.testing.actorcheck import replay_command

        raise InvariantViolation(
            f"actor seed {seed}: the schedule did not run to its end: "
            f"{type(exc).__name__}: {exc}\nreplay: {replay_command(seed)}"
        ) from exc
    check_actor_run(run)
    return run


def _describe(run: ActorRun) -> str:
    ok = sum(1 for c in run.calls if c.ok)
    return (
        f"seed {run.seed}: {len(run.calls)} calls ({ok} ok), {len(run.reads)} p2p reads, "
        f"fates {dict(sorted(run.fates.items()))}, {run.virtual_s:.3f} virtual s, "
        f"{run.wall_s * 1000:.0f} ms wall"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--seed", type=int, help="replay one schedule and print its log")
    parser.add_argument("--start", type=int, default=0, help="first seed of a sweep")
    parser.add_argument("--count", type=int, default=500, help="number of schedules")
    args = parser.parse_args(argv)
    if args.seed is not None:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
        run = run_actor_schedule(args.seed, log_level="WARNING")
        print("knobs:", dict(sorted(run.knobs.items())))
        print("\n".join(run.log))
        for e in run.loop_errors:
            print("loop error:", e)
        print(_describe(run))
        try:
            check_actor_run(run)
        except InvariantViolation as exc:
            print(f"FAIL {exc}")
            return 1
        print("ok, digest", run.digest()[:16])
        return 0
    t0 = time.perf_counter()
    failures = 0
    slowest = 0.0
    for i, seed in enumerate(range(args.start, args.start + args.count)):
        t = time.perf_counter()
        try:
            run_and_check(seed)
        except InvariantViolation as exc:
            failures += 1
            print(f"FAIL {exc}", file=sys.stderr, flush=True)
        slowest = max(slowest, time.perf_counter() - t)
        if (i + 1) % 50 == 0 or i + 1 == args.count:
            dt = time.perf_counter() - t0
            print(
                f"{i + 1}/{args.count} schedules, {failures} failed, "
                f"{dt / (i + 1) * 1000:.1f} ms each (slowest {slowest * 1000:.0f} ms)",
                flush=True,
            )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
