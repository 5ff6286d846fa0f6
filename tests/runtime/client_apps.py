"""Processes of the client trials (test_client_processes.py): members hosting Tally over tcp,
serving clients, and a client making numbered calls through them."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import derecho_async as da


class Tally(da.Actor):
    """Every token an ordered call brought, in delivery order."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    @da.ordered
    def add(self, token: int) -> int:
        self.tokens.append(token)
        return len(self.tokens)

    def snapshot(self) -> list[int]:
        return self.tokens

    def restore(self, state: list[int]) -> None:
        self.tokens = list(state)


async def member(config: da.Config) -> None:
    """Join, say where clients reach this member, serve until told to stop, then report."""
    out = Path(os.environ["DA_CLIENT_OUT"])
    me = config.member_id
    group = await da.Group.join(config, actors=[Tally], timeout=60)
    (out / f"up-{me}").write_text(str(group.client_address))
    while not (out / "stop").exists():
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the last calls run everywhere
    tally = group.local(Tally)
    (out / f"report-{me}.json").write_text(json.dumps(
        {"tokens": tally.tokens, "view": list(group.view.members)}))
    await group.leave()


async def client(group: str, peers: dict[int, str], secret: str, calls: int,
                 out: Path) -> None:
    """Make ``calls`` ordered calls, ``add(0)`` .. ``add(calls - 1)``, 32 at a time and about
    2,000 a second (so members die mid-stream), and write which were acknowledged."""
    acked: dict[int, int] = {}
    failed: dict[int, str] = {}
    async with await da.Client.connect(group=group, peers=peers, secret=secret,
                                       timeout=60) as c:
        tally = c.subgroup(Tally)
        todo = iter(range(calls))

        async def worker() -> None:
            for token in todo:
                try:
                    replies = await tally.add(token)
                except da.DerechoError as exc:
                    failed[token] = repr(exc)
                    continue
                acked[token] = len(replies.values_ok())
                if token % 100 == 0:
                    (out / "progress").write_text(f"{token} {c.relay}")
                await asyncio.sleep(0.016)

        await asyncio.gather(*(worker() for _ in range(32)))
        result: dict[str, Any] = {"acked": sorted(acked), "failed": failed,
                                  "failovers": c._failovers}
    (out / "client.json").write_text(json.dumps(result))


def run_client(group: str, peers: dict[int, str], secret: str, calls: int, out: str) -> None:
    """The client process's entry point."""
    import uvloop

    uvloop.run(client(group, peers, secret, calls, Path(out)))
