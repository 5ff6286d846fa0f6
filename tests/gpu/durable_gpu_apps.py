"""Member programs for durable groups whose calls carry CuPy arrays (run by launch_local)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import derecho_async as da

COUNT = 5


class DeviceSums(da.Actor):
    """Sums of the arrays it was sent (a CuPy array live; a numpy array when replayed)."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    @da.ordered
    def add(self, x: Any) -> None:
        self.sums.append(float(x.sum()))

    def snapshot(self) -> list[float]:
        return list(self.sums)

    def restore(self, state: list[float]) -> None:
        self.sums = list(state)


async def log_device_calls(config: da.Config) -> None:
    """Cast COUNT CuPy arrays, wait until each is persisted, then read the log back."""
    import cupy

    out = Path(os.environ["DA_GPU_OUT"])
    async with da.Group(config, actors=[DeviceSums]) as group:
        kv = group.subgroup(DeviceSums)
        for i in range(COUNT):
            x = cupy.full((512, 512), float(config.member_id * 10 + i), dtype=cupy.float32)
            await kv.persisted(await kv.add.cast(x))
        n = config.initial_members * COUNT
        local = group.local(DeviceSums)
        while len(local.sums) < n:
            await asyncio.sleep(0.01)
        history = [e async for e in kv.history()]
        (out / f"log-{config.member_id}.json").write_text(json.dumps({
            "types": sorted({type(e.args[0]).__module__.split(".")[0] for e in history}),
            "sums": [float(e.args[0].sum()) for e in history],
            "state": local.sums}))
        (out / f"logged-{config.member_id}").touch()
        while not all((out / f"logged-{m}").exists() for m in range(config.initial_members)):
            await asyncio.sleep(0.01)


async def restart_device_log(config: da.Config) -> None:
    """Restart from the files the first run left (every member had stopped)."""
    out = Path(os.environ["DA_GPU_OUT"])
    group = await da.Group.join(config, actors=[DeviceSums], timeout=60)
    local = group.local(DeviceSums)
    (out / f"restarted-{config.member_id}.json").write_text(json.dumps({"state": local.sums}))
    (out / f"back-{config.member_id}").touch()
    while not all((out / f"back-{m}").exists() for m in range(config.initial_members)):
        await asyncio.sleep(0.01)
    await group.leave()
