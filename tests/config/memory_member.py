"""A member program for tests/config/test_memory.py (importable by the processes that
``launch_local`` spawns): it joins, makes ordered calls and writes down what its memory grew by
and how long it took."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import derecho_async as da
from derecho_async.workload import ReplicatedLog

CALLS = 1000
"""Calls each member makes at once, after 20 one by one."""


def rss_anon() -> int:
    """This process's resident anonymous memory, in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


async def join_call_and_report(config: da.Config) -> None:
    """Join, make ordered calls, and write ``m<id>.json`` under ``$DA_TEST_OUT``: seconds to
    the first view (``started``) and to the end of the calls (``took``), and the growth of
    resident anonymous memory meanwhile (``grown``)."""
    before = rss_anon()
    began = time.monotonic()
    async with da.Group(config, actors=[ReplicatedLog]) as group:
        started = time.monotonic() - began
        log = group.subgroup(ReplicatedLog)
        members = sorted(group.view.members)
        for i in range(20):
            assert sorted(await log.append(b"%d" % i)) == members
        await asyncio.gather(*(log.append(b"x" * 100) for _ in range(CALLS)))
        took = time.monotonic() - began
        grown = rss_anon() - before
        mine = group.local(ReplicatedLog).items
        while len(mine) < len(members) * (20 + CALLS):  # the others' calls too, before leaving
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
    out = Path(os.environ["DA_TEST_OUT"]) / f"m{config.member_id}.json"
    out.write_text(json.dumps({"started": started, "took": took, "grown": grown}))
