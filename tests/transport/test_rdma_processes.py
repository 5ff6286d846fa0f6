"""The rdma transport across processes on a device (marked ``rdma``): three processes exchange
in order, a SIGKILLed member is reported, a 3-member group over ``transport="rdma"`` survives a
SIGKILLed member, and a process joins a running rdma group (members: rdma_member.py and
rdma_group.py)."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import queue as queue_mod
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from member_process import ROW, expected_from
from rdma_support import loop_name, needs_device, word
from transport_support import SECRET, Recorder

from derecho_async.config.strength import new_secret
from derecho_async.launch import free_ports
from derecho_async.transport.rdma import RdmaTransport

HERE = Path(__file__).parent


# -- separate processes ------------------------------------------------------------------------

SCRIPT = HERE / "rdma_member.py"


async def _spawn(mode: str, member: int, arg: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        loop_name(),
        mode,
        str(member),
        arg,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )


def _decoded(rec: Recorder, sender: int) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for e in rec.from_sender(sender):
        if e[0] == "push":
            out.append(("push", e[1], e[3], e[4]))
        else:
            out.append(("msg", msgpack.unpackb(e[2], raw=False, strict_map_key=False)))
    return out


async def _parent() -> tuple[RdmaTransport, Recorder, str]:
    t = RdmaTransport(0, ("127.0.0.1", 0), secret=SECRET, device=os.environ.get("RXE_DEV"))
    rec = Recorder()
    await t.start(rec)
    t.set_view(1, [0, 1, 2], ROW)
    return t, rec, f"{t.address[0]}:{t.address[1]}:{SECRET.hex()}"


@pytest.mark.rdma
@needs_device
async def test_three_processes_exchange_in_order_over_rdma() -> None:
    t, rec, arg = await _parent()
    procs = [await _spawn("run", m, arg) for m in (1, 2)]
    try:
        async with asyncio.timeout(240):
            await rec.wait_for(lambda: all(rec.messages(m) for m in (1, 2)), timeout=120)
            peers: dict[int, object] = {m: list(t._tcp._links[m].addr or ()) for m in (1, 2)}
            peers[0] = list(t.address)
            for m in (1, 2):
                t.send(m, msgpack.packb(["go", peers]))
            reports: dict[int, list[object]] = {}

            def reported() -> bool:
                for m in (1, 2):
                    for e in _decoded(rec, m):
                        msg = e[1]
                        if e[0] == "msg" and isinstance(msg, list) and msg[0] == "report":
                            reports[m] = msg
                return len(reports) == 2

            await rec.wait_for(reported, timeout=200)
            for m in (1, 2):
                assert reports[m][1] is True, reports[m]
                got = [
                    e
                    for e in _decoded(rec, m)
                    if not (e[0] == "msg" and e[1][0] == "report")  # type: ignore[index]
                ]
                assert got == expected_from(m, 0)
                t.send(m, msgpack.packb(["bye"]))
            for p in procs:
                assert await p.wait() == 0, (await p.stderr.read()).decode() if p.stderr else ""
        assert rec.failures() == []
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
        await t.close()


@pytest.mark.rdma
@needs_device
async def test_sigkilled_rdma_member_is_reported() -> None:
    t, rec, arg = await _parent()
    proc = await _spawn("crash", 1, arg)
    try:
        async with asyncio.timeout(120):
            await rec.wait_for(lambda: bool(rec.messages(1)), timeout=120)
            t.send(1, msgpack.packb(["go", {0: list(t.address)}]))
            await rec.wait_for(lambda: any(b"crash-ready" in m for m in rec.messages(1)))
        assert len(rec.pushes(1)) == 50
        os.kill(proc.pid, signal.SIGKILL)
        await proc.wait()
        t.push(1, 0, word(1), [1])  # into the void: must end in a report, not a hang
        await rec.wait_for(lambda: bool(rec.failures(1)))
        assert any("connection lost" in f or "rdma" in f for f in rec.failures(1))
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await t.close()


# -- a group over transport="rdma", one member SIGKILLed --------------------------------------


@pytest.mark.rdma
@needs_device
def test_group_over_rdma_survives_a_sigkilled_member() -> None:
    import rdma_group

    members, count, victim = 3, 300, 2
    ctx = multiprocessing.get_context("spawn")
    # One queue per member. They must not share one: a member SIGKILLed while it holds a
    # shared queue's write lock blocks every other member's reports for good.
    queues = [ctx.Queue() for _ in range(members)]
    ports = free_ports(members)
    base: dict[str, Any] = {
        "group": f"rdma-{os.getpid()}-{secrets.token_hex(3)}",
        "initial_members": members,
        "transport": "rdma",
        "heartbeat_ms": 20,
        "suspect_after_ms": 1500,
        "peers": {i: f"127.0.0.1:{p}" for i, p in enumerate(ports)},
        "secret": new_secret(),
        "rdma_device": os.environ.get("RXE_DEV"),
        "log_level": "INFO",  # view installs and transport reports, shown if the test fails
    }
    procs = {}
    for i in range(members):
        fields = dict(base, member_id=i, listen=base["peers"][i])
        p = ctx.Process(target=rdma_group.child, args=(fields, queues[i], count, 200, 8, True))
        p.start()
        procs[i] = p
    t0 = time.monotonic()
    progress: dict[int, tuple[int, float]] = {}  # member -> (delivered, when it last grew)
    views: dict[int, list[tuple[int, list[int]]]] = {}
    reports: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    killed: set[int] = set()

    def pump(until: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until():
            msg = None
            for m, q in enumerate(queues):
                if m in killed:  # its pipe may end in a torn message: a read could block
                    continue
                with contextlib.suppress(queue_mod.Empty):
                    msg = q.get_nowait()
                    break
            if msg is None:
                time.sleep(0.02)
                continue
            if msg[0] == "progress":
                if msg[2] != progress.get(msg[1], (None, 0.0))[0]:
                    progress[msg[1]] = (msg[2], round(time.monotonic() - t0, 1))
            elif msg[0] == "view":
                views.setdefault(msg[1], []).append((msg[2], msg[3]))
            elif msg[0] == "done":
                reports[msg[1]] = msg[2]
            elif msg[0] == "error":
                errors[msg[1]] = msg[2]
        if not until():
            # a hang: every live child writes its threads' stacks to stderr (see rdma_group)
            for p in procs.values():
                if p.is_alive() and p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGUSR1)
            time.sleep(2)
        assert until(), (
            f"timed out at {time.monotonic() - t0:.1f} s: progress (delivered, at s) {progress},"
            f" views {views}, reports {sorted(reports)}, errors {errors}"
        )

    survivors = set(range(members)) - {victim}
    try:
        pump(lambda: max((n for n, _ in progress.values()), default=0) >= 100 or bool(errors), 180)
        assert not errors, errors
        pid = procs[victim].pid
        assert pid is not None
        killed.add(victim)
        os.kill(pid, signal.SIGKILL)
        pump(lambda: survivors <= reports.keys() or bool(errors), 180)
        assert not errors, errors
    finally:
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    got = [reports[m] for m in sorted(survivors)]
    print(f"\nrdma group: survivors {sorted(survivors)}, delivered {[r['delivered'] for r in got]}")
    assert len({r["digest"] for r in got}) == 1, "survivors' logs differ"
    for r in got:
        assert r["members"] == sorted(survivors)
        assert len(r["views"]) >= 2
        for m in survivors:
            assert r["per_sender"][m] == count, f"member {m}'s appends lost or duplicated"
        assert r["per_sender"].get(victim, 0) <= count


@pytest.mark.rdma
@needs_device
def test_a_process_joins_a_running_rdma_group_and_gets_state_and_ordered_traffic() -> None:
    """Connection data for a joiner is exchanged like for the founders (CONNECT over the
    authenticated channel when a link is first used in the new view)."""
    import rdma_group

    from derecho_async.localrun import LocalRun

    # The founders stay until released: a slow machine (CI runs this in a VM) must not see them
    # leave before the joiner has made its calls (they lingered 40 s once, and that was too short).
    run = LocalRun(3, "rdma", 60, 64, 8, 3, heartbeat_ms=25, suspect_after_ms=3000, linger=600.0)
    got: list[tuple[object, ...]] = []
    try:
        deadline = time.monotonic() + 180
        while len(run.reports) < 3 and not run.errors and time.monotonic() < deadline:
            run.poll(0.2)
        assert len(run.reports) == 3, f"founders: {run.progress} {run.errors}"
        fields = dict(run.base, member_id=7, listen=f"127.0.0.1:{free_ports(1)[0]}")
        p = run.ctx.Process(target=rdma_group.joiner, args=(fields, run.q, 2 << 20))
        started = time.monotonic()
        p.start()
        deadline = time.monotonic() + 120
        while not got and time.monotonic() < deadline and 7 not in run.errors:
            got = [m for m in run.poll(0.2) if m[0] == "joined"]
        took = time.monotonic() - started
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()
    finally:
        run.release()
        run.finish(15)
    assert got, f"the joiner never reported; errors {run.errors}"
    joined = got[0][2]
    assert isinstance(joined, dict)
    print(f"\njoiner: reported {took:.1f} s after it was started")
    assert joined["view"] == [0, 1, 2, 7], f"after {took:.1f} s; errors {run.errors}"
    assert joined["replies"] == [[0, 1, 2, 7], [0, 1, 2, 7]]
    assert joined["at_join"] == run.reports[0]["delivered"]  # state transfer: the whole log
    assert joined["items"] == joined["at_join"] + 2 and joined["big_ok"]
    # every member holds the same log in the same order, the joiner's large item included
    assert set(joined["digests"]) == {joined["digest"]}
    # the joiner's large item reached the founders by the rdma bulk path
    print(f"\njoiner: bulk blocks sent per founder {joined['rdma_blocks']}")
    assert all(joined["rdma_blocks"].get(m, 0) >= 2 for m in (0, 1, 2)), joined["rdma_blocks"]


@pytest.mark.rdma
@needs_device
def test_launch_local_forms_a_group_over_rdma() -> None:
    # launch_local gives the members free loopback ports for the tcp channel and a fresh secret
    import derecho_async as da
    from tests.runtime import apps

    codes = da.launch_local(2, apps.append_and_check, transport="rdma",
                            rdma_device=os.environ.get("RXE_DEV"), heartbeat_ms=20,
                            suspect_after_ms=1500, timeout=120)
    assert codes == [0, 0]
