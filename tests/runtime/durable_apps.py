"""Member programs for the durable kill-all trials (run in child processes by run_member)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from pathlib import Path

import derecho_async as da


class Store(da.Actor):
    """A map of keys to values, durable through the group's data_dir."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}

    @da.ordered
    def put(self, key: str, value: int) -> None:
        self.data[key] = value

    def snapshot(self) -> dict[str, int]:
        return dict(self.data)

    def restore(self, state: dict[str, int]) -> None:
        self.data = dict(state)


def digest(data: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(data.items())).encode()).hexdigest()


async def stream(config: da.Config) -> None:
    """Write keys as fast as persisted() allows (32 in flight); after each is persisted,
    append its key to this member's acked file (the parent kills everyone at a random
    moment and checks, after the restart, that every acked key survived)."""
    out = Path(os.environ["DA_DURABLE_OUT"])
    acked = (out / f"acked-{config.member_id}.txt").open("a", buffering=1)
    async with da.Group(config, actors=[Store]) as group:
        kv = group.subgroup(Store)
        (out / f"up-{config.member_id}").touch()
        pending: list[tuple[str, asyncio.Future[None]]] = []
        i = 0
        while True:
            key = f"{config.member_id}-{i}"
            i += 1
            version = await kv.put.cast(key, i)
            pending.append((key, asyncio.ensure_future(kv.persisted(version))))
            while len(pending) >= 32 or (pending and pending[0][1].done()):
                k, fut = pending.pop(0)
                await fut
                acked.write(k + "\n")


async def stream_until_stopped(config: da.Config) -> None:
    """Write keys (32 in flight) until the parent creates ``stop``; then report as
    :func:`report` does, from the same group."""
    out = Path(os.environ["DA_DURABLE_OUT"])
    group = await da.Group.join(config, actors=[Store], timeout=60)
    kv = group.subgroup(Store)
    (out / f"up-{config.member_id}").touch()
    pending: list[asyncio.Future[None]] = []
    i = 0
    while not (out / "stop").exists():
        i += 1
        version = await kv.put.cast(f"{config.member_id}-{i}", i)
        pending.append(asyncio.ensure_future(kv.persisted(version)))
        while len(pending) >= 32 or (pending and pending[0].done()):
            await pending.pop(0)
    await asyncio.gather(*pending)
    await _report(config, group)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def report(config: da.Config) -> None:
    """Restart from the files, then write this member's state and view and leave."""
    lines = _Lines()  # how its state came (in the report)
    logging.getLogger("derecho_async.statexfer").addHandler(lines)
    group = await da.Group.join(config, actors=[Store], timeout=60)
    logging.getLogger("derecho_async.statexfer").removeHandler(lines)
    await _report(config, group, lines.lines)


async def _report(config: da.Config, group: da.Group, lines: list[str] | None = None) -> None:
    out = Path(os.environ["DA_DURABLE_OUT"])
    store = group.local(Store)
    kv = group.subgroup(Store)
    # one call each after the restart; once all three are here, every member has delivered
    # the same calls, so the states compare at the same point
    version = await kv.put.cast(f"after-{config.member_id}", 1)
    await kv.persisted(version)
    marks = {f"after-{m}" for m in range(config.initial_members)}
    while not marks <= store.data.keys():
        await asyncio.sleep(0.01)
    data = dict(store.data)
    (out / f"report-{config.member_id}.json").write_text(json.dumps({
        "digest": digest(data), "keys": len(data),
        "view": [group.view.view_id, list(group.view.members)], "data": data,
        "joined": lines or []}))
    (out / f"reported-{config.member_id}").touch()
    while not all((out / f"reported-{m}").exists() for m in range(config.initial_members)):
        await asyncio.sleep(0.01)  # nobody leaves before every report is written
    await group.leave()


async def join_or_report_error(config: da.Config) -> None:
    """Restart from the files; a refusal (``DataLost``, ``LogCorrupted``, ...) is written to
    ``error-<id>.json`` with how long it took, instead of raised; else as
    :func:`serve_until_stopped`."""
    out = Path(os.environ["DA_DURABLE_OUT"])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        group = await da.Group.join(config, actors=[Store], timeout=60)
    except da.DerechoError as exc:
        (out / f"error-{config.member_id}.json").write_text(json.dumps({
            "type": type(exc).__name__, "message": str(exc), "seconds": loop.time() - t0}))
        return
    await _serve(config, group, loop.time() - t0)


async def serve_until_stopped(config: da.Config) -> None:
    """Restart from the files (or join); write ``joined-<id>.json`` (the view, how long it
    took); once the parent writes ``barrier`` (the members to wait for, as JSON), make one
    call, wait for theirs, and write ``report-<id>.json``; leave once ``stop`` exists."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    group = await da.Group.join(config, actors=[Store], timeout=60)
    await _serve(config, group, loop.time() - t0)


async def _serve(config: da.Config, group: da.Group, took: float) -> None:
    out = Path(os.environ["DA_DURABLE_OUT"])
    me = config.member_id
    (out / f"joined-{me}.json").write_text(json.dumps({
        "view": [group.view.view_id, list(group.view.members)], "seconds": took}))
    while not (out / "barrier").exists():
        await asyncio.sleep(0.02)
    members = json.loads((out / "barrier").read_text())
    store = group.local(Store)
    kv = group.subgroup(Store)
    await kv.persisted(await kv.put.cast(f"after-{me}", 1))
    while not {f"after-{m}" for m in members} <= store.data.keys():
        await asyncio.sleep(0.01)
    data = dict(store.data)
    (out / f"report-{me}.json").write_text(json.dumps({
        "digest": digest(data), "keys": len(data), "data": data,
        "view": [group.view.view_id, list(group.view.members)]}))
    while not (out / "stop").exists():
        await asyncio.sleep(0.02)
    await group.leave()


async def persist_until_stopped(config: da.Config) -> None:
    """Make calls, each awaited to ``persisted()`` (32 in flight), until the parent creates
    ``stop`` or this member is out of the group; log records (asyncio's included) go to
    ``log-<id>.txt``. The member named by ``DA_FSIZE_MEMBER`` runs under a file size limit of
    ``DA_FSIZE_BYTES`` (its log fails once it grows past it). Writes ``closed-<id>.json`` (why
    it is out) or ``done-<id>.json`` (calls persisted after the limited member left, the view)."""
    import resource

    out = Path(os.environ["DA_DURABLE_OUT"])
    me = config.member_id
    handler = logging.FileHandler(out / f"log-{me}.txt")
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    if me == int(os.environ["DA_FSIZE_MEMBER"]):
        _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(os.environ["DA_FSIZE_BYTES"]), hard))
    group = await da.Group.join(config, actors=[Store], timeout=60)
    kv = group.subgroup(Store)
    (out / f"up-{me}").touch()
    pending: list[asyncio.Future[None]] = []
    persisted_without = 0  # calls persisted in a view without the limited member
    pad = "x" * 1000  # (1 KB calls: the limited member's log reaches its limit soon)
    i = 0
    try:
        while not (out / "stop").exists():
            i += 1
            version = await kv.put.cast(f"{me}-{i}-{pad}", i)
            pending.append(asyncio.ensure_future(kv.persisted(version)))
            while len(pending) >= 32 or (pending and pending[0].done()):
                await pending.pop(0)
                if len(group.view.members) < config.initial_members:
                    persisted_without += 1
    except da.GroupClosed as exc:
        for fut in pending:
            fut.cancel()
        await asyncio.sleep(0.5)  # (time for anything a failed flush would still log)
        (out / f"closed-{me}.json").write_text(json.dumps({"message": str(exc)}))
        return
    await asyncio.gather(*pending)
    (out / f"done-{me}.json").write_text(json.dumps({
        "persisted_without": persisted_without, "view": list(group.view.members)}))
    while not all((out / f"done-{m}.json").exists() or (out / f"closed-{m}.json").exists()
                  for m in range(config.initial_members)):
        await asyncio.sleep(0.02)  # (nobody leaves before every member wrote its figures)
    await group.leave()
