"""The replicated-log workload behind ``derecho-async demo`` and ``bench`` and the multi-process
tests.

Each member process joins the group with a :class:`ReplicatedLog` actor, makes ``count`` ordered
appends (at most ``depth`` outstanding; one-way calls with ``one_way``), appends a ``done``
marker, waits until it has delivered the done markers of every other member of its view, and
reports to the parent through a queue:
``("view", member, view_id, members, installed_at)`` as views change (``installed_at`` from
``time.monotonic()``), ``("progress", member, delivered)`` while
running, and ``("done", member, report)`` at the end, where the report holds the delivered count,
throughput, call latencies (p50/p99/p99.9 in microseconds), the views installed and a SHA-256
digest of the delivered log. A member killed mid-run simply never reports ``done``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import derecho_async as da
from derecho_async.logsetup import log_to_stderr

__all__ = ["ReplicatedLog", "percentile", "pipelined", "run_member"]


class ReplicatedLog(da.Actor):
    """An append-only log of byte strings, replicated by ordered calls."""

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.on_append: Any = None

    @da.ordered
    def append(self, item: bytes) -> int:
        self.items.append(item)
        if self.on_append is not None:
            self.on_append(item)
        return len(self.items)

    @da.p2p
    def size(self) -> int:
        return len(self.items)

    @da.p2p
    def digest(self) -> str:
        return log_digest(self.items)

    def snapshot(self) -> bytes:
        import msgpack  # type: ignore[import-untyped]

        out = msgpack.packb(self.items, use_bin_type=True)
        assert isinstance(out, bytes)
        return out

    def restore(self, state: bytes) -> None:
        import msgpack

        items = msgpack.unpackb(state, raw=False) if state else []
        if not isinstance(items, list) or not all(isinstance(i, bytes) for i in items):
            raise da.ProtocolViolation("bad ReplicatedLog snapshot")
        self.items = items


def log_digest(items: list[bytes]) -> str:
    h = hashlib.sha256()
    for item in items:
        h.update(len(item).to_bytes(4, "little"))
        h.update(item)
    return h.hexdigest()


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


async def pipelined(call: Callable[[int], Awaitable[object]], count: int, depth: int,
                    latencies: list[float] | None = None) -> None:
    """Await ``call(0)`` .. ``call(count - 1)``, at most ``depth`` outstanding: ``depth`` workers
    each make the next call when their last one completes (no task per call, so the caller's
    own cost per call stays small beside the runtime's). With ``latencies``, each call's
    duration in seconds is appended. A failed call is raised at once; the other workers go on."""
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while issued < count:
            i = issued
            issued += 1
            if latencies is None:
                await call(i)
                continue
            start = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(worker() for _ in range(min(depth, count))))


async def run_member(
    config: da.Config,
    queue: Any,
    count: int,
    size: int,
    depth: int,
    sender: bool = True,
    linger: float = 0.3,
    one_way: bool = False,
    release: Any = None,
) -> None:
    """Run the workload as one member (see the module docstring); with ``one_way`` the appends
    are one-way calls (``log.append.cast``: no replies; a call completes when delivered here).

    After reporting, the member stays in the group for ``linger`` seconds, or until ``release``
    (an object with ``is_set()``, such as a ``multiprocessing.Event``) is set, whichever is first:
    a test that brings in a joiner keeps the founders up for as long as the joiner needs."""
    if depth < 1:
        raise da.UsageError(f"depth must be at least 1 (outstanding calls), not {depth}")
    me = config.member_id
    log_to_stderr(config.log_level)  # (the process is the command's: it configures logging)
    async with da.Group(config, actors=[ReplicatedLog]) as group:
        log = group.subgroup(ReplicatedLog)
        mine = group.local(ReplicatedLog)
        done_seen: set[int] = set()
        finished = asyncio.Event()

        def need() -> set[int]:
            return {m for m in group.view.members if m != me}

        def on_append(item: bytes) -> None:
            if item.startswith(b"done-"):
                done_seen.add(int(item[5:]))
            if need() <= done_seen:
                finished.set()

        mine.on_append = on_append
        views_seen = [group.view]

        def report_views() -> None:
            while len(views_seen) < len(group.history):
                i = len(views_seen)
                v = group.history[i]
                views_seen.append(v)
                queue.put(("view", me, v.view_id, list(v.members), group.installed_at[i]))

        queue.put(("view", me, group.view.view_id, list(group.view.members), group.installed_at[0]))
        latencies: list[float] = []
        pad = b"." * max(0, size - 16)
        append = log.append.cast if one_way else log.append
        t0 = time.perf_counter()
        last_report = t0
        calls = pipelined(
            lambda i: append(b"%d:%d:" % (me, i) + pad), count if sender else 0, depth, latencies
        )
        task = asyncio.ensure_future(calls)
        while not task.done():
            await asyncio.sleep(0.05)
            now = time.perf_counter()
            report_views()
            if now - last_report > 0.05:
                queue.put(("progress", me, len(mine.items)))
                last_report = now
        task.result()  # a failed call
        await append(b"done-%d" % me)
        while not need() <= done_seen:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished.wait(), 0.1)
            finished.clear()
            if need() <= done_seen:
                break
            report_views()
        elapsed = time.perf_counter() - t0
        report_views()
        items = [i for i in mine.items]
        queue.put(
            (
                "done",
                me,
                {
                    "delivered": len(items),
                    "elapsed": elapsed,
                    "msgs_per_s": len(items) / elapsed if elapsed > 0 else 0.0,
                    "p50_us": percentile(latencies, 0.5) * 1e6,
                    "p99_us": percentile(latencies, 0.99) * 1e6,
                    "p999_us": percentile(latencies, 0.999) * 1e6,
                    "views": [v.view_id for v in group.history],
                    "members": list(group.view.members),
                    "digest": log_digest(items),
                    "per_sender": _per_sender(items),
                },
            )
        )
        end = time.monotonic() + linger
        while (left := end - time.monotonic()) > 0:
            if release is not None and release.is_set():
                break
            await asyncio.sleep(min(0.05, left))


def _per_sender(items: list[bytes]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for item in items:
        head = item.split(b":", 1)[0]
        if head.isdigit():
            counts[int(head)] = counts.get(int(head), 0) + 1
    return counts
