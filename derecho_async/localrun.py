"""Member processes of one group on this host running the replicated-log workload
(:mod:`derecho_async.workload`), and the reports they send back: what ``derecho-async demo`` and
``bench``, the process tests and the benchmarks start.

Each member is a spawned process with its own event loop and its own report queue (a member
SIGKILLed in the middle of a put tears only its own pipe); :class:`LocalRun` polls the queues
and keeps each member's progress, views, final report and error.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue as queue_mod
import secrets
import signal
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from derecho_async.launch import local_network
from derecho_async.transport import registry

__all__ = ["LocalRun"]


def _child(
    fields: dict[str, Any],
    q: Any,
    count: int,
    size: int,
    depth: int,
    sender: bool,
    use_uvloop: bool,
    linger: float = 0.3,
    one_way: bool = False,
    release: Any = None,
) -> None:
    import derecho_async as da
    from derecho_async.workload import run_member

    config = da.Config(**fields)
    coro = run_member(config, q, count, size, depth, sender, linger, one_way, release)
    try:
        if use_uvloop:
            import uvloop

            uvloop.run(coro)
        else:
            asyncio.run(coro)
    except da.DerechoError as exc:
        q.put(("error", config.member_id, f"{type(exc).__name__}: {exc}"))
        sys.exit(3)


class LocalRun:
    """Member processes of one local group running the workload, and their reports."""

    def __init__(
        self,
        members: int,
        transport: str,
        count: int,
        size: int,
        depth: int,
        senders: int,
        heartbeat_ms: float,
        suspect_after_ms: float,
        use_uvloop: bool = True,
        linger: float = 0.3,
        one_way: bool = False,
        member_fields: Callable[[str, int], Mapping[str, Any]] | None = None,
    ) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        # One queue per member: a member SIGKILLed in the middle of a put leaves a torn message in
        # its own pipe only, not in the reports of the others. ``q`` is for extra processes.
        self.q = self.ctx.Queue()
        self.queues = [self.q] + [self.ctx.Queue() for _ in range(members)]
        self.group = f"cli-{os.getpid()}-{secrets.token_hex(3)}"
        self.procs: dict[int, Any] = {}
        self.reports: dict[int, dict[str, Any]] = {}
        self.progress: dict[int, int] = {}
        self.views: dict[int, tuple[int, list[int]]] = {}
        self.view_times: dict[tuple[int, int], float] = {}  # (member, view_id) -> monotonic
        self.errors: dict[int, str] = {}
        self.killed: set[int] = set()  # their queues are no longer read (see kill)
        self.linger = linger
        self.released = self.ctx.Event()  # set by release(): the members stop lingering
        base: dict[str, Any] = {
            "group": self.group,
            "initial_members": members,
            "transport": transport,
            "heartbeat_ms": heartbeat_ms,
            "suspect_after_ms": suspect_after_ms,
        }
        if registry.kind(transport).networked:  # (each member listens at its peers entry)
            base.update(local_network(members))
        self.base = base
        for i in range(members):
            fields = dict(base, member_id=i)
            if member_fields is not None:  # (group, member id) -> e.g. the member's TLS files
                fields.update(member_fields(self.group, i))
            p = self.ctx.Process(
                target=_child,
                name=f"derecho-member-{i}",
                args=(
                    fields,
                    self.queues[i + 1],
                    count,
                    size,
                    depth,
                    i < senders,
                    use_uvloop,
                    linger,
                    one_way,
                    self.released,
                ),
            )
            p.start()
            self.procs[i] = p

    def poll(self, timeout: float) -> list[tuple[Any, ...]]:
        out = []
        deadline = time.monotonic() + timeout
        while True:
            msg = None
            for i, q in enumerate(self.queues):
                if i - 1 in self.killed:
                    continue
                try:
                    msg = q.get_nowait()
                    break
                except queue_mod.Empty:
                    continue
            if msg is None:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.005)
                continue
            out.append(msg)
            kind, member = msg[0], msg[1]
            if kind == "progress":
                self.progress[member] = msg[2]
            elif kind == "view":
                self.views[member] = (msg[2], msg[3])
                self.view_times[(member, msg[2])] = msg[4]
            elif kind == "done":
                self.reports[member] = msg[2]
                self.progress[member] = msg[2]["delivered"]
            elif kind == "error":
                self.errors[member] = msg[2]
            if time.monotonic() >= deadline:
                break
        return out

    def kill(self, member: int) -> None:
        """SIGKILL ``member``. Its queue is not read from then on: the kill may have torn a
        message in its pipe, and reading a torn message would block for good."""
        self.killed.add(member)
        os.kill(self.procs[member].pid, signal.SIGKILL)

    def release(self) -> None:
        """End the members' linger now (they leave the group and exit)."""
        self.released.set()

    def alive(self) -> list[int]:
        return [m for m, p in self.procs.items() if p.is_alive()]

    def finish(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            self.poll(0.1)
        self.poll(0.2)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join()
        registry.kind(self.base["transport"]).clean(self.group)
