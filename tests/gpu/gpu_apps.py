"""Member programs for the GPU tests (spawned by launch_local; need CuPy, torch and a GPU)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from typing import Any

import derecho_async as da


class Accumulator(da.Actor):
    """Receives device arrays in total order and keeps what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float, int]] = []
        self.total: Any = None

    @da.ordered
    def add(self, x: Any, tag: str) -> str:
        import cupy

        assert isinstance(x, cupy.ndarray), type(x)
        assert x.device.id == cupy.cuda.Device().id
        self.total = x.copy() if self.total is None else self.total + x
        self.seen.append((tag, float(x.ravel()[0]), int(x.size)))
        return tag

    @da.ordered
    def add_torch(self, t: Any, tag: str) -> str:
        import torch

        assert isinstance(t, torch.Tensor) and t.is_cuda, (type(t), getattr(t, "device", None))
        self.seen.append((tag, float(t[0].item()), int(t.numel())))
        return tag


async def sends_device_arrays(config: da.Config) -> None:
    import cupy
    import torch

    me = config.member_id
    count = int(os.environ.get("DA_GPU_COUNT", "20"))
    async with da.Group(config, actors=[Accumulator]) as group:
        acc = group.subgroup(Accumulator)
        n = len(group.view.members)
        calls = []
        for i in range(count):
            x = cupy.full((256, 256), float(me * 1000 + i), dtype=cupy.float32)
            calls.append(acc.add(x, f"c{me}-{i}"))
        calls.append(acc.add_torch(torch.full((1000,), float(me), device="cuda"), f"t{me}"))
        replies = await asyncio.gather(*calls)
        assert all(set(r) == set(group.view.members) for r in replies)
        local: Accumulator = group.local(Accumulator)  # type: ignore[assignment]
        while len(local.seen) < n * (count + 1):
            await asyncio.sleep(0.01)
        digest = hashlib.sha256(json.dumps(local.seen).encode()).hexdigest()
        total = float(local.total.sum())
        out = os.environ["DA_GPU_OUT"]
        with open(f"{out}/member{me}.json", "w") as f:
            json.dump({"digest": digest, "seen": len(local.seen), "total": total}, f)
        await asyncio.sleep(1.0)
