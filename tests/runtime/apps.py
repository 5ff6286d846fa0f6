"""Member programs for launch_local tests (importable by spawned children)."""

from __future__ import annotations

import asyncio

import derecho_async as da
from derecho_async.workload import ReplicatedLog, log_digest


async def append_and_check(config: da.Config) -> None:
    """20 appends per member; then every member's log must be the same."""
    async with da.Group(config, actors=[ReplicatedLog]) as group:
        log = group.subgroup(ReplicatedLog)
        members = set(group.view.members)
        for i in range(20):
            replies = await log.append(b"%d-%d" % (config.member_id, i))
            assert set(replies) == members
        total = 20 * len(members)
        for m in sorted(members):  # wait until every replica holds every append
            while await log.size.at(m)() < total:
                await asyncio.sleep(0.02)
        mine = log_digest(group.local(ReplicatedLog).items)
        for m in sorted(members):
            assert await log.digest.at(m)() == mine
        await asyncio.sleep(1.0)  # let the others finish their checks before anyone leaves


async def fail(config: da.Config) -> None:
    raise SystemExit(7 if config.member_id == 1 else 0)


async def one_leaves_early(config: da.Config) -> None:
    """Member 2 makes 5 appends and leaves; the others see the smaller view and go on."""
    import json
    import os

    async with da.Group(config, actors=[ReplicatedLog]) as group:
        log = group.subgroup(ReplicatedLog)
        for i in range(5):
            await log.append(b"%d-%d" % (config.member_id, i))
        if config.member_id == 2:
            return  # leaves on exiting the block
        while 2 in group.view.members:
            await asyncio.sleep(0.02)
        replies = await log.append(b"after-%d" % config.member_id)
        mine = group.local(ReplicatedLog).items
        while len(mine) < 17:  # 3 x 5 appends + one "after" from each of 0 and 1
            await asyncio.sleep(0.02)
        with open(os.path.join(os.environ["DA_TEST_OUT"], f"m{config.member_id}.json"), "w") as f:
            json.dump(
                {
                    "view": list(group.view.members),
                    "replies": sorted(replies),
                    "digest": log_digest(mine),
                    "n": len(mine),
                },
                f,
            )
        await asyncio.sleep(0.5)


class _Blobs(da.Actor):
    """Holds the sizes of the blobs it was given (the blobs themselves are dropped)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    @da.ordered
    def put(self, blob: bytes) -> int:
        self.sizes.append(len(blob))
        return len(blob)


async def large_call(config: da.Config) -> None:
    """Member 0 makes one ordered call of ``DA_TEST_CALL_MB`` MiB; every member measures how long
    its event loop was held at most meanwhile (a 1 ms ticker's worst gap), waits until the
    call ran here, and reports views, sizes and that gap."""
    import json
    import os
    import time

    size = int(os.environ["DA_TEST_CALL_MB"]) << 20
    async with da.Group(config, actors=[_Blobs]) as group:
        worst = 0.0
        stop = False

        async def tick() -> None:
            nonlocal worst
            last = time.monotonic()
            while not stop:
                await asyncio.sleep(0.001)
                now = time.monotonic()
                worst = max(worst, now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        mine = group.local(_Blobs)
        if config.member_id == 0:
            await asyncio.sleep(0.2)
            replies = await group.subgroup(_Blobs).put(bytes(size))
            assert set(replies.values()) == {size}, replies
        deadline = time.monotonic() + 60
        while not mine.sizes and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        stop = True
        await ticker
        with open(os.path.join(os.environ["DA_TEST_OUT"], f"m{config.member_id}.json"), "w") as f:
            json.dump({"sizes": mine.sizes, "views": [v.view_id for v in group.history],
                       "worst_gap_s": worst}, f)
        await asyncio.sleep(1.0)  # the others finish before anyone leaves


def _slow_first_import(module: str, delay_s: float) -> None:
    """Make this process's first ``import module`` take ``delay_s`` longer (as on a slow or
    emulated machine, where importing numpy takes seconds): a finder that sleeps, then lets
    the usual finders find it."""
    import importlib.abc
    import sys
    import time

    class Slow(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object, target: object = None) -> None:
            if name == module:
                sys.meta_path.remove(self)
                time.sleep(delay_s)
            return None

    sys.meta_path.insert(0, Slow())


async def large_call_slow_numpy(config: da.Config) -> None:
    """:func:`large_call` in a process where numpy was not imported yet and its first import
    takes ``DA_TEST_IMPORT_DELAY_S`` seconds (a byte string over ``wire.LARGE_BYTES`` arrives
    as a numpy array)."""
    import os
    import sys

    assert "numpy" not in sys.modules, "numpy was imported before the group started"
    _slow_first_import("numpy", float(os.environ["DA_TEST_IMPORT_DELAY_S"]))
    await large_call(config)


class BigState(da.Actor):
    """A state of ``DA_TEST_STATE_MB`` MiB of host bytes; ordered calls count."""

    def __init__(self) -> None:
        self.blob = b""
        self.calls = 0

    @da.ordered
    def touch(self) -> int:
        self.calls += 1
        return len(self.blob)

    @da.p2p
    def digest(self) -> bytes:
        import hashlib

        return hashlib.sha256(self.blob).digest()

    def snapshot(self) -> bytes:
        return self.blob

    def restore(self, state: bytes) -> None:
        self.blob = state


def _pattern_bytes(size: int) -> bytes:
    """``size`` bytes of 0, 1, ..., 255, 0, 1, ... made without holding the GIL for long (a
    plain ``bytes * n`` of 1 GiB holds it, and the loop, for seconds on a loaded host)."""
    import numpy as np

    from derecho_async import hotpath

    pattern = np.empty(size, np.uint8)
    pattern[:256] = np.arange(min(size, 256), dtype=np.uint8)[:size]
    done = min(size, 256)
    while done < size:  # doubling: each step one large copy, which numpy makes without the GIL
        n = min(done, size - done)
        pattern[done:done + n] = pattern[:n]
        done += n
    return hotpath.bytes_copy(pattern)


async def big_state_join(config: da.Config) -> None:
    """Members 0-2 found the group with a state of ``DA_TEST_STATE_MB`` MiB; member 3 joins once
    they are up (``ready`` file), then every member makes a call and reports what it holds, its
    views and its peak RSS (and the joiner how long its join took)."""
    import hashlib
    import json
    import os
    import resource
    import time

    out = os.environ["DA_TEST_OUT"]
    size = int(os.environ["DA_TEST_STATE_MB"]) << 20
    ready = os.path.join(out, "ready")
    joined_in = 0.0
    if config.member_id == 3:
        while not os.path.exists(ready):
            await asyncio.sleep(0.05)
        began = time.monotonic()
        group = await da.Group.join(config, actors=[BigState], timeout=120)
        joined_in = time.monotonic() - began
    else:
        group = await da.Group.join(config, actors=[BigState], timeout=60)
        state = group.local(BigState)
        # built and hashed off the loop: on a loaded host (4 members on 2 cores) a loop held
        # for seconds gets this member suspected before any state moves
        state.blob = await asyncio.to_thread(_pattern_bytes, size)
        await group.subgroup(BigState).touch()
        if config.member_id == 0:
            with open(ready, "w") as f:
                f.write("1")
    try:
        while len(group.view.members) < 4:
            await asyncio.sleep(0.05)
        replies = await group.subgroup(BigState).touch()
        blob = group.local(BigState).blob
        report = {
            "members": list(group.view.members),
            "views": [v.view_id for v in group.history],
            "replies": {str(k): v for k, v in replies.items()},
            "size": len(blob),
            "digest": await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10,
            "join_s": joined_in,
        }
        with open(os.path.join(out, f"m{config.member_id}.json"), "w") as f:
            json.dump(report, f)
        while len([n for n in os.listdir(out) if n.endswith(".json")]) < 4:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
    finally:
        await group.leave()


async def one_holds_its_loop(config: da.Config) -> None:
    """Member 2 holds its event loop (``DA_TEST_HOLD``: ``sleep`` a synchronous sleep,
    ``gil`` one C call that keeps the GIL, ``stop`` SIGSTOP of its whole process) for
    ``DA_TEST_HOLD_MS``; then every member that is still in the group makes one append. Each
    member writes the views it saw, whether its append completed (else the error) and how long
    it took to ``DA_TEST_OUT``."""
    import json
    import os
    import random
    import signal
    import subprocess
    import time

    how = os.environ["DA_TEST_HOLD"]
    hold_s = float(os.environ["DA_TEST_HOLD_MS"]) / 1000.0
    views: list[list[int]] = []
    appended: bool | str = False
    async with da.Group(config, actors=[ReplicatedLog]) as group:
        log = group.subgroup(ReplicatedLog)
        await log.append(b"before-%d" % config.member_id)
        await asyncio.sleep(0.3)  # every member is past its first append
        if config.member_id == 2:
            if how == "sleep":
                time.sleep(hold_s)
            elif how == "gil":
                data = [random.random() for _ in range(200_000)]
                end = time.monotonic() + hold_s
                while time.monotonic() < end:
                    sorted(data)  # C code that keeps the GIL for its whole run
            else:  # the process stops, threads and all; a helper wakes it
                subprocess.Popen(["sh", "-c", f"sleep {hold_s}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
        else:
            await asyncio.sleep(hold_s + 0.5)
        views.append(list(group.view.members))
        start = time.monotonic()
        if config.member_id in group.view.members and not group.closed.done():
            try:
                await asyncio.wait_for(log.append(b"after-%d" % config.member_id), 10)
                appended = True
            except (TimeoutError, da.DerechoError) as exc:
                appended = repr(exc)
        took = time.monotonic() - start
        views.append(list(group.view.members))
        out = os.environ["DA_TEST_OUT"]
        with open(os.path.join(out, f"m{config.member_id}.tmp"), "w") as f:
            json.dump({"views": views, "appended": appended, "took": took}, f)
        os.rename(os.path.join(out, f"m{config.member_id}.tmp"),
                  os.path.join(out, f"m{config.member_id}.json"))
        # nobody leaves before the others have written what they saw (a leave is a view
        # change they would record), unless they are out already
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
                os.path.exists(os.path.join(out, f"m{m}.json"))
                for m in group.view.members if not group.closed.done()):
            await asyncio.sleep(0.02)


class _Sizes(da.Actor):
    """Counts the blobs it was given (dropping them) and is told when the sender is done."""

    def __init__(self) -> None:
        self.count = 0
        self.finished = False

    @da.ordered
    def put(self, blob: bytes) -> None:
        self.count += 1

    @da.ordered
    def finish(self) -> int:
        self.finished = True
        return self.count


def _status_kib(field: str) -> int:
    """This process's ``field`` (VmRSS, VmHWM) from /proc/self/status, in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


async def own_calls_bound(config: da.Config) -> None:
    """Member 0 makes ``DA_TEST_CASTS`` one-way calls of ``DA_TEST_CALL_KB`` KiB without awaiting
    any (a fresh blob each, as an application would), stopping at the first QueueFull; then it
    awaits those accepted and a replied call every member answers. It reports how many were
    accepted, every member's count of calls run, and its own RSS before the burst and at its
    peak (VmHWM) to ``DA_TEST_OUT``; the others wait for that last call."""
    import json
    import os
    import time

    size = int(os.environ["DA_TEST_CALL_KB"]) << 10
    casts = int(os.environ["DA_TEST_CASTS"])
    async with da.Group(config, actors=[_Sizes]) as group:
        sizes = group.subgroup(_Sizes)
        mine = group.local(_Sizes)
        if config.member_id != 0:
            deadline = time.monotonic() + 60
            while not mine.finished and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5)  # member 0 has its replies before anyone leaves
            return
        while len(group.view.members) < config.initial_members:
            await asyncio.sleep(0.02)
        for _ in range(3):  # warm up: the data plane's pool and buffers exist before the base
            await sizes.put.cast(b"w" * size)
        rss_base = _status_kib("VmRSS")
        hwm_base = _status_kib("VmHWM")
        sent_base = group.stats()["sent"]
        futures = []
        full: str | None = None
        for _ in range(casts):
            try:
                futures.append(sizes.put.cast(b"x" * size))
            except da.QueueFull as exc:
                full = str(exc)
                break
        sent = group.stats()["sent"] - sent_base  # handed to the core; the rest wait for room
        versions = await asyncio.wait_for(asyncio.gather(*futures), 60)
        replies = await asyncio.wait_for(sizes.finish(), 60)
        report = {
            "accepted": len(futures),
            "full": full,
            "sent": sent,
            "versions": len(set(versions)),
            "counts": dict(replies.raise_on_error()),
            "rss_base_kib": rss_base,
            "hwm_base_kib": hwm_base,
            "hwm_kib": _status_kib("VmHWM"),
        }
        with open(os.path.join(os.environ["DA_TEST_OUT"], "m0.json"), "w") as f:
            json.dump(report, f)
