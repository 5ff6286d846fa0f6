"""Member processes of the derecho_async comparison benchmarks (see benchmarks/compare.py).

A run is one group of N spawned member processes that play a *plan*: a list of phases, each a
dict. Every phase starts with a barrier (each member makes one ordered ``mark`` call and waits
until it has delivered the marks of all members), so all members start the phase's clock at the
same point of the total order. Phase kinds:

- ``stream``: each member in ``senders`` makes ``count`` ordered ``put`` calls of ``size`` bytes
  with at most ``depth`` outstanding; every member times the phase from the barrier to its
  delivery of the last of the ``count * len(senders)`` puts (delivered msgs/s and MB/s). With
  ``keep_latencies`` the senders also record each call's latency (submit to every member's
  reply) and report them all, with percentiles; throughput phases leave them out (two clock
  reads and an append per call that the peers' benchmarks do not pay). With ``one_way`` the
  calls are one-way (``handle.put.cast``): nobody replies, and a call's latency ends when the
  sender delivers it (stable: every member holds it).
  With ``persisted`` (one-way calls in a group with ``data_dir``) each call is a ``cast`` and
  then ``handle.persisted(version)``: a worker's next call starts once its last one is durable
  at every member; with ``keep_latencies`` the senders record both the time to delivery (the
  cast) and the time to persisted. With ``persist_end`` (a group with ``data_dir``) every member,
  once it delivered the phase, waits until the last call it delivered is persisted. Senders
  report ``calls_elapsed`` (barrier to their last call complete), ``persist_end`` members
  ``persisted_elapsed`` (barrier to the phase persisted).
- ``blob``: member ``sender`` makes ``count`` ordered ``blob`` calls carrying a numpy array of
  ``size`` bytes (the data plane), ``depth`` outstanding; every member times its deliveries.

Each member reports ``("phase", member, index, report)`` per phase, ``("done", member)`` at the
end, or ``("error", member, text)``. The parent side is :class:`GroupRun`: it starts the
processes, collects the reports, and always kills what is left and unlinks the group's shared
memory (``ShmTransport.cleanup_group``). A member's stderr goes to a log file that the parent
prints only when the run fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import multiprocessing
import os
import queue as queue_mod
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable
from typing import Any

import derecho_async as da
from derecho_async.launch import free_ports
from derecho_async.workload import percentile, pipelined

__all__ = ["BenchSink", "GroupRun", "RunFailed", "percentile"]

Phase = dict[str, Any]


class RunFailed(RuntimeError):
    """A benchmark group did not complete its plan; ``results`` holds the phases reported."""

    def __init__(self, message: str, results: list[dict[int, dict[str, Any]]]) -> None:
        super().__init__(message)
        self.results = results


class BenchSink(da.Actor):
    """Counts what is delivered; ``mark`` is the phase barrier."""

    def __init__(self) -> None:
        self.marks: dict[int, set[int]] = {}
        self.puts = 0
        self.bytes = 0
        self.target = -1
        self.last = 0.0
        self.first = 0.0
        self.t0 = 0.0
        self.members: set[int] = set()
        self.next_target = -1
        self.wake = asyncio.Event()

    def _count(self, nbytes: int) -> None:
        now = time.perf_counter()
        if self.puts == 0:
            self.first = now
        self.puts += 1
        self.bytes += nbytes
        self.last = now
        if self.puts >= self.target:
            self.wake.set()

    @da.ordered
    def put(self, item: bytes) -> None:
        self._count(len(item))

    @da.ordered
    def blob(self, data: Any) -> None:
        self._count(int(data.nbytes))

    @da.ordered
    def mark(self, phase: int, member: int) -> None:
        marks = self.marks.setdefault(phase, set())
        marks.add(member)
        if self.members <= marks:
            # The barrier completes here, at one point of the total order at every member:
            # counters reset before any of the phase's messages can be delivered.
            self.puts = 0
            self.bytes = 0
            self.target = self.next_target
            self.t0 = self.first = self.last = time.perf_counter()
        self.wake.set()


async def _barrier(group: da.Group, handle: Any, sink: BenchSink, phase: int) -> None:
    me = group.member_id
    call = asyncio.ensure_future(handle.mark(phase, me))
    while not set(group.view.members) <= sink.marks.get(phase, set()):
        sink.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sink.wake.wait(), 0.5)
    await call


def _payload(me: int, ph: Phase) -> Any:
    """What a sender of phase ``ph`` sends (made before the phase's clock starts)."""
    if me not in ph["senders"]:
        return None
    if ph["kind"] == "blob":
        import numpy as np

        return np.ones(ph["size"], dtype=np.uint8)
    return b"x" * ph["size"]


def _steps(group: da.Group) -> int:
    """Protocol steps this member took so far (the driver's count; steps that did something)."""
    driver = group._driver  # a benchmark's look inside
    return driver.steps if driver is not None else 0


async def _stream(
    group: da.Group, handle: Any, sink: BenchSink, ph: Phase, payload: Any
) -> dict[str, Any]:
    me = group.member_id
    senders: list[int] = ph["senders"]
    count: int = ph["count"]
    depth: int = ph["depth"]
    latencies: list[float] | None = [] if ph.get("keep_latencies") else None
    cpu0 = time.process_time()
    steps0 = _steps(group)
    method = handle.blob if ph["kind"] == "blob" else handle.put
    if ph.get("one_way"):
        method = method.cast  # no replies: a call completes when it is delivered here
    to_delivery: list[float] = []
    calls: asyncio.Future[float] | None = None
    if me in senders:
        if ph.get("persisted"):
            persisted = _PersistedCall(handle, method, payload, latencies, to_delivery)
            work = pipelined(persisted, count, depth)
        else:
            work = pipelined(lambda _: method(payload), count, depth, latencies)
        calls = asyncio.ensure_future(_finished_at(work))
    while sink.puts < sink.target:
        # a failed call (e.g. this member was partitioned) ends the run
        if calls is not None and calls.done() and not calls.cancelled():
            calls.result()
        sink.wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sink.wake.wait(), 0.5)
    calls_done = await calls if calls is not None else None
    persisted_at = None
    if ph.get("persist_end"):
        await handle.persisted(_last_delivered(group, handle))
        persisted_at = time.perf_counter()
    elapsed = max(sink.last - sink.t0, 1e-9)
    report: dict[str, Any] = {
        "delivered": sink.puts,
        "elapsed": elapsed,
        "msgs_per_s": sink.puts / elapsed,
        "mb_per_s": sink.bytes / elapsed / 1e6,
        "sender": me in senders,
        "cpu_s": time.process_time() - cpu0,
        "steps": _steps(group) - steps0,
    }
    if calls_done is not None:
        report["calls_elapsed"] = calls_done - sink.t0
    if persisted_at is not None:
        report["persisted_elapsed"] = persisted_at - sink.t0
    if to_delivery:
        report["delivered_us"] = [x * 1e6 for x in to_delivery]
    if latencies:
        report.update(
            calls=len(latencies),
            p50_us=percentile(latencies, 0.5) * 1e6,
            p99_us=percentile(latencies, 0.99) * 1e6,
            p999_us=percentile(latencies, 0.999) * 1e6,
            latencies_us=[x * 1e6 for x in latencies],
        )
    return report


class _PersistedCall:
    """One call of a ``persisted`` phase: ``cast``, then wait until the version is persisted;
    with ``latencies``, the time to persisted goes there and the time to delivery to
    ``to_delivery``."""

    def __init__(self, handle: Any, cast: Any, payload: Any, latencies: list[float] | None,
                 to_delivery: list[float]) -> None:
        self.handle = handle
        self.cast = cast
        self.payload = payload
        self.latencies = latencies
        self.to_delivery = to_delivery

    async def __call__(self, _i: int) -> None:
        start = time.perf_counter()
        version = await self.cast(self.payload)
        delivered = time.perf_counter()
        await self.handle.persisted(version)
        if self.latencies is not None:
            self.latencies.append(time.perf_counter() - start)
            self.to_delivery.append(delivered - start)


async def _finished_at(work: Awaitable[None]) -> float:
    await work
    return time.perf_counter()


def _last_delivered(group: da.Group, handle: Any) -> tuple[int, int]:
    """The version of the last call of ``handle``'s subgroup delivered at this member."""
    return group._p2p.last_delivered[handle._spec.name]  # a benchmark's look inside


async def _member(config: da.Config, q: Any, plan: list[Phase], profile: str | None) -> None:
    me = config.member_id
    async with da.Group(config, actors=[BenchSink]) as group:
        handle = group.subgroup(BenchSink)
        sink = group.local(BenchSink)
        prof: Any = None
        sink.members = set(group.view.members)
        for i, ph in enumerate(plan):
            sink.next_target = ph["count"] * len(ph["senders"])
            payload = _payload(me, ph)
            await _barrier(group, handle, sink, i)
            if profile and ph.get("profile"):
                import cProfile

                # CPU time, not wall time: on a shared 2-core machine wall time charges the
                # time a member waits for a core to whatever call it was in (often sendto)
                prof = cProfile.Profile(time.process_time)
                prof.enable()
            report = await _stream(group, handle, sink, ph, payload)
            del payload
            if prof is not None:
                prof.disable()
                prof.dump_stats(profile)
                prof = None
            q.put(("phase", me, i, report))
        await _barrier(group, handle, sink, len(plan))
        q.put(("done", me))
        await asyncio.sleep(0.2)


def member_entry(
    fields: dict[str, Any], q: Any, plan: list[Phase], log_path: str, profile: str | None
) -> None:
    """Child entry point (spawned): run the plan as one member on uvloop."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    config = da.Config(**fields)
    try:
        import uvloop

        uvloop.run(_member(config, q, plan, profile if config.member_id == 0 else None))
    except BaseException as exc:
        q.put(("error", config.member_id, f"{type(exc).__name__}: {exc}"))
        raise



#: Config fields applied to every member of every GroupRun (set from command-line options)
CONFIG_OVERRIDES: dict[str, Any] = {}


class GroupRun:
    """One benchmark group: start ``members`` processes on ``plan``, collect, clean up."""

    def __init__(
        self,
        members: int,
        transport: str,
        plan: list[Phase],
        *,
        suspect_after_ms: float = 5000.0,
        profile: str | None = None,
        max_payload: int | None = None,
        data_dir: str | None = None,
    ) -> None:
        self.members = members
        self.transport = transport
        self.plan = plan
        self.group = f"bench-{os.getpid()}-{secrets.token_hex(3)}"
        self.fields: dict[str, Any] = {
            "group": self.group,
            "initial_members": members,
            "transport": transport,
            "heartbeat_ms": 50.0,
            "suspect_after_ms": suspect_after_ms,
        }
        if max_payload is not None:
            self.fields["max_payload"] = max_payload
        if data_dir is not None:  # durable actors: each member's log under data_dir
            self.fields["data_dir"] = data_dir
        self.fields.update(CONFIG_OVERRIDES)
        if transport == "tcp":
            ports = free_ports(members)
            self.fields["peers"] = {i: f"127.0.0.1:{p}" for i, p in enumerate(ports)}
            self.fields["secret"] = da.new_secret()
        self.profile = profile

    def run(self, timeout: float, stall: float = 60.0) -> list[dict[int, dict[str, Any]]]:
        """Play the plan; returns, per phase, member -> report.

        Raises RunFailed when a member dies, the run takes longer than ``timeout`` seconds, or
        no member reports anything for ``stall`` seconds (then every member's Python stacks are
        dumped into its log first, which the exception quotes).
        """
        ctx = multiprocessing.get_context("spawn")
        q: Any = ctx.Queue()
        procs: dict[int, Any] = {}
        results: list[dict[int, dict[str, Any]]] = [{} for _ in self.plan]
        done: set[int] = set()
        errors: dict[int, str] = {}
        logdir = tempfile.mkdtemp(prefix="derecho-bench-")
        logs = {i: os.path.join(logdir, f"member-{i}.log") for i in range(self.members)}
        try:
            for i in range(self.members):
                fields = dict(self.fields, member_id=i)
                if self.transport == "tcp":
                    fields["listen"] = self.fields["peers"][i]
                p = ctx.Process(
                    target=member_entry,
                    args=(fields, q, self.plan, logs[i], self.profile),
                    name=f"bench-member-{i}",
                    daemon=True,
                )
                p.start()
                procs[i] = p
            deadline = time.monotonic() + timeout
            last_news = time.monotonic()
            why = f"timed out after {timeout:.0f} s"
            while len(done) < self.members and time.monotonic() < deadline:
                if time.monotonic() - last_news > stall:
                    why = f"stalled: no report for {stall:.0f} s"
                    for p in procs.values():
                        with contextlib.suppress(OSError):
                            os.kill(p.pid, signal.SIGUSR1)  # faulthandler: dump stacks
                    time.sleep(1.0)
                    break
                try:
                    msg = q.get(timeout=0.2)
                    last_news = time.monotonic()
                except queue_mod.Empty:
                    dead = [m for m, p in procs.items() if not p.is_alive() and m not in done]
                    if dead:
                        time.sleep(0.2)
                        self._drain(q, results, done, errors)
                        if any(m not in done for m in dead):
                            why = f"members {dead} exited early"
                            break
                    continue
                self._take(msg, results, done, errors)
            if len(done) < self.members:
                tails = "".join(
                    f"\n--- member {m} log ---\n{_tail(logs[m])}" for m in range(self.members)
                )
                raise RunFailed(
                    f"{self.members}-member {self.transport} run {why}: reports per phase "
                    f"{[sorted(r) for r in results]}, errors {errors}{tails}",
                    results,
                )
            for p in procs.values():
                p.join(5.0)
            return results
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
                p.join(5.0)
            q.close()
            q.join_thread()
            from derecho_async.transport.shm import ShmTransport

            ShmTransport.cleanup_group(self.group)
            for path in logs.values():
                with contextlib.suppress(OSError):
                    os.unlink(path)
            with contextlib.suppress(OSError):
                os.rmdir(logdir)

    def _drain(
        self,
        q: Any,
        results: list[dict[int, dict[str, Any]]],
        done: set[int],
        errors: dict[int, str],
    ) -> None:
        while True:
            try:
                msg = q.get_nowait()
            except queue_mod.Empty:
                return
            self._take(msg, results, done, errors)

    @staticmethod
    def _take(
        msg: tuple[Any, ...],
        results: list[dict[int, dict[str, Any]]],
        done: set[int],
        errors: dict[int, str],
    ) -> None:
        if msg[0] == "phase":
            results[msg[2]][msg[1]] = msg[3]
        elif msg[0] == "done":
            done.add(msg[1])
        elif msg[0] == "error":
            errors[msg[1]] = msg[2]


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-limit:]
    except OSError:
        return ""
