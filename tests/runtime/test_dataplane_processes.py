"""Large messages on the bulk data planes across real member processes, with SIGKILL.

Every member appends multi-block payloads (the tcp chain cuts them into 1 MiB blocks, so with
three or more members every member relays the others' blocks; over shm they sit in the
senders' pools). One member is killed in the middle: it was a sender with transfers in flight
and, on tcp, a relay in the chain of others. The survivors must deliver identical logs, lose
none of their own appends, and clean up the killed member's pool segments.
"""

from __future__ import annotations

import pytest

from derecho_async.localrun import LocalRun
from derecho_async.transport.shm.pool import pool_segments
from tests.runtime.run_support import assert_survivors_consistent, wait_for


@pytest.mark.parametrize(
    "transport,members,victim", [("shm", 3, 1), ("tcp", 3, 1), ("tcp", 5, 2)]
)
def test_sigkill_of_a_sender_and_relay_mid_transfer(
    transport: str, members: int, victim: int
) -> None:
    # Enough appends that the victim is still sending when the kill lands: with 16 it could
    # finish (its done marker delivered) within one 50 ms progress report of the trigger.
    count = 32
    size = (3 << 20) // 2  # 1.5 MiB: two blocks on the chain
    run = LocalRun(
        members,
        transport,
        count,
        size,
        2,
        members,
        heartbeat_ms=25,
        suspect_after_ms=1500,
        use_uvloop=True,
    )
    survivors = set(range(members)) - {victim}
    try:
        wait_for(run, lambda: min(run.progress.values(), default=0) >= members * 3, 90)
        if transport == "shm":
            assert [p for p, owner, _ in pool_segments(run.group) if owner == victim]
        run.kill(victim)
        wait_for(run, lambda: survivors <= run.reports.keys(), 90)
        if transport == "shm":
            # the survivors removed the dead member's pool segments when they installed the
            # view without it (before any launcher cleanup)
            assert [p for p, owner, _ in pool_segments(run.group) if owner == victim] == []
    finally:
        run.finish(15)
    assert_survivors_consistent(run, survivors, victim, count)
