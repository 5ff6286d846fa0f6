"""Groups of ``transport="sim"`` members in one process, for tests of the public API."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import derecho_async as da

_ids = itertools.count()


def group_name() -> str:
    """A group name no other test of this process uses."""
    return f"sim{next(_ids)}"


def cfg(group: str, member: int, n: int = 3, **extra: object) -> da.Config:
    """A sim member's config: fast heartbeats, ``n`` initial members, ``extra`` keys."""
    fields: dict[str, object] = {
        "group": group,
        "member_id": member,
        "initial_members": n,
        "transport": "sim",
        "heartbeat_ms": 5,
        "suspect_after_ms": 500,
    }
    fields.update(extra)
    return da.Config(**fields)  # type: ignore[arg-type]


async def start(
    actors: Sequence[type[da.Actor]], n: int = 3, **extra: object
) -> tuple[str, list[da.Group]]:
    """A fresh group of ``n`` members hosting ``actors``: its name and the members."""
    name = group_name()
    groups = await asyncio.gather(
        *(da.Group.join(cfg(name, i, n, **extra), actors=actors, timeout=10) for i in range(n))
    )
    return name, list(groups)


async def close(groups: Sequence[da.Group]) -> None:
    for g in groups:
        await g.leave()


async def settle(cond: object, timeout: float = 10.0) -> None:
    """Wait until ``cond()`` holds (polling the loop)."""
    assert callable(cond)
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)
