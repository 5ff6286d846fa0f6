"""Real member processes over shm and tcp: concurrent ordered sends, SIGKILL, join, leave."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue as queue_mod
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from derecho_async.localrun import LocalRun
from derecho_async.transport.shm import ShmTransport
from tests.runtime.run_support import assert_survivors_consistent, wait_for

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Event


@pytest.mark.parametrize(
    "transport,members,one_way",
    [
        ("shm", 3, False),
        ("shm", 5, False),
        ("tcp", 3, False),
        ("tcp", 5, False),
        ("shm", 3, True),
        ("tcp", 3, True),
    ],
)
def test_sigkill_mid_run_survivors_agree_and_lose_nothing(
    transport: str, members: int, one_way: bool
) -> None:
    # one_way: the appends are one-way calls (no replies); the survivors' calls that were not
    # delivered in the view of the crash are re-sent in the next one, so nothing is lost either.
    # Enough appends that the kill lands mid-run: progress is reported every 50 ms, and on a
    # quick machine 1000 one-way appends per member were all delivered within the first report.
    count = 20000 if one_way else 4000
    run = LocalRun(
        members,
        transport,
        count,
        200,
        8,
        members,
        heartbeat_ms=25,
        suspect_after_ms=1000,
        use_uvloop=True,
        one_way=one_way,
    )
    victim = members - 1
    try:
        wait_for(run, lambda: max(run.progress.values(), default=0) >= 200, 60)
        assert not run.reports, f"the run ended before the kill ({sorted(run.reports)}): " \
            "raise count"
        run.kill(victim)
        survivors = set(range(members)) - {victim}
        wait_for(run, lambda: survivors <= run.reports.keys(), 60)
    finally:
        run.finish(10)
    assert_survivors_consistent(run, survivors, victim, count)


def test_uvloop_and_stock_asyncio_members_interoperate() -> None:
    run = LocalRun(3, "shm", 50, 64, 4, 3, heartbeat_ms=25, suspect_after_ms=1000, use_uvloop=False)
    try:
        wait_for(run, lambda: len(run.reports) == 3, 60)
    finally:
        run.finish(10)
    assert len({r["digest"] for r in run.reports.values()}) == 1


def _joiner(fields: dict[str, object], q: Queue[object]) -> None:
    import uvloop

    import derecho_async as da
    from derecho_async.workload import ReplicatedLog, log_digest

    async def go() -> None:
        async with da.Group(da.Config(**fields), actors=[ReplicatedLog]) as g:  # type: ignore[arg-type]
            items = list(g.local(ReplicatedLog).items)
            r = await g.subgroup(ReplicatedLog).append(b"hello from the joiner")
            q.put(
                (
                    "joined",
                    fields["member_id"],
                    {
                        "view": list(g.view.members),
                        "items": len(items),
                        "digest": log_digest(items),
                        "replies": sorted(r),
                    },
                )
            )

    uvloop.run(go())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_new_process_joins_a_running_group_and_receives_the_state(transport: str) -> None:
    run = LocalRun(
        3,
        transport,
        100,
        64,
        8,
        3,
        heartbeat_ms=25,
        suspect_after_ms=1000,
        use_uvloop=True,
        linger=600.0,  # until released below: the founders must outlast a slow joiner
    )
    try:
        wait_for(run, lambda: len(run.reports) == 3, 60)
        fields = dict(run.base, member_id=7)
        if transport == "tcp":
            from derecho_async.launch import free_ports

            fields["listen"] = f"127.0.0.1:{free_ports(1)[0]}"
        p = run.ctx.Process(target=_joiner, args=(fields, run.q))
        p.start()
        got: list[tuple[object, ...]] = []
        deadline = time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got = [m for m in run.poll(0.2) if m[0] == "joined"]
        p.join(10)
    finally:
        run.release()
        run.finish(15)
    assert got, f"the joiner never reported; errors {run.errors}"
    joined = got[0][2]
    assert isinstance(joined, dict)
    assert joined["view"] == [0, 1, 2, 7] and joined["replies"] == [0, 1, 2, 7]
    assert joined["digest"] == run.reports[0]["digest"]  # state transfer: the whole log
    assert joined["items"] == run.reports[0]["delivered"]


def test_a_member_process_leaves_voluntarily_and_the_others_go_on(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    from pathlib import Path

    import derecho_async as da
    from tests.runtime import apps

    out = Path(str(tmp_path))
    monkeypatch.setenv("DA_TEST_OUT", str(out))
    codes = da.launch_local(
        3, apps.one_leaves_early, heartbeat_ms=25, suspect_after_ms=1000, timeout=60
    )
    assert codes == [0, 0, 0]
    results = [json.loads((out / f"m{m}.json").read_text()) for m in (0, 1)]
    for r in results:
        assert r["view"] == [0, 1] and r["replies"] == [0, 1] and r["n"] == 17
    assert results[0]["digest"] == results[1]["digest"]


JOINER = 3  # the id of the member that joins once member 0 was killed


def _founder(fields: dict[str, object], q: Queue[object], release: Event) -> None:
    """A member of the first view: reports each view it is in; once the joiner is in one, makes
    an ordered call and reports who replied; stays until released."""
    import uvloop

    import derecho_async as da
    from derecho_async.workload import ReplicatedLog

    async def go() -> None:
        async with da.Group(da.Config(**fields), actors=[ReplicatedLog]) as g:  # type: ignore[arg-type]
            reported: tuple[int, ...] = ()
            while JOINER not in g.view.members:
                if release.is_set():
                    return
                if g.view.members != reported:
                    reported = g.view.members
                    q.put(("view", g.member_id, list(reported)))
                await asyncio.sleep(0.01)
            replies = await g.subgroup(ReplicatedLog).append(b"after the join")
            q.put(("call", g.member_id, sorted(replies)))
            while not release.is_set():
                await asyncio.sleep(0.02)

    uvloop.run(go())


def _read(queues: dict[int, Queue[object]], seen: list[Any]) -> None:
    """Add the members' reports waiting now to ``seen``."""
    for q in queues.values():
        with contextlib.suppress(queue_mod.Empty):
            while True:
                seen.append(q.get_nowait())


def _until(queues: dict[int, Queue[object]], seen: list[Any],
           cond: Callable[[list[Any]], bool], timeout: float) -> None:
    """Read the members' reports into ``seen`` until ``cond(seen)`` (fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not cond(seen):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; reports {seen}")
        _read(queues, seen)
        time.sleep(0.01)


async def _join_and_call(fields: dict[str, object], queues: dict[int, Queue[object]],
                         seen: list[Any]) -> tuple[float, list[int], list[int]]:
    """Join; then an ordered call; stay in the group until the founders' calls are answered.
    Returns how long the join took, the view and who replied."""
    import derecho_async as da
    from derecho_async.workload import ReplicatedLog

    t0 = time.monotonic()
    group = await da.Group.join(da.Config(**fields), actors=[ReplicatedLog])  # type: ignore[arg-type]
    took = time.monotonic() - t0
    try:
        replies = await group.subgroup(ReplicatedLog).append(b"from the joiner")
        deadline = time.monotonic() + 30
        while sum(1 for m in seen if m[0] == "call") < len(queues):
            assert time.monotonic() < deadline, f"the founders' calls never came: {seen}"
            _read(queues, seen)
            await asyncio.sleep(0.02)
        return took, sorted(group.view.members), sorted(replies)
    finally:
        await group.leave()


def test_over_shm_a_member_joins_through_a_live_member_once_member_0_was_killed() -> None:
    # Issue 41 row 4: the shm contact was always member 0, so once it died a joiner waited
    # join_timeout_s and failed with "member 0 is not running". It now asks the members whose
    # doorbells are bound, and through them reaches the leader.
    ctx = multiprocessing.get_context("spawn")
    group = f"rejoin-{os.getpid()}-{secrets.token_hex(3)}"
    base: dict[str, object] = {"group": group, "initial_members": 3, "transport": "shm",
                               "heartbeat_ms": 25, "suspect_after_ms": 1000}
    queues: dict[int, Queue[object]] = {m: ctx.Queue() for m in range(3)}
    release = ctx.Event()
    procs = {m: ctx.Process(target=_founder, args=(dict(base, member_id=m), queues[m], release))
             for m in range(3)}
    for p in procs.values():
        p.start()
    seen: list[Any] = []
    try:
        _until(queues, seen, lambda s: {m[1] for m in s if m[2] == [0, 1, 2]} == {0, 1, 2}, 60)
        procs[0].kill()  # SIGKILL
        del queues[0]  # (the kill may have torn its pipe: never read again)
        _until(queues, seen, lambda s: {m[1] for m in s if m[2] == [1, 2]} == {1, 2}, 30)
        took, view, replies = asyncio.run(
            _join_and_call(dict(base, member_id=JOINER, join_timeout_s=10), queues, seen))
        print(f"joined in {took:.3f} s")
    finally:
        release.set()
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        ShmTransport.cleanup_group(group)
    assert took < 5.0, f"the join took {took:.1f} s"
    assert view == replies == [1, 2, JOINER]
    calls = {m[1]: m[2] for m in seen if m[0] == "call"}
    assert calls == {1: [1, 2, JOINER], 2: [1, 2, JOINER]}
    assert ShmTransport.segments(group) == []
