"""A member for the network-partition test: appends in a loop, prints JSON lines of what it sees.

Usage: python partition_member.py MEMBER_ID PEERS_JSON GROUP SECRET SECONDS
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import uvloop

import derecho_async as da
from derecho_async.workload import ReplicatedLog


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


async def main() -> None:
    me = int(sys.argv[1])
    peers = {int(k): v for k, v in json.loads(sys.argv[2]).items()}
    config = da.Config(
        group=sys.argv[3],
        member_id=me,
        initial_members=len(peers),
        transport="tcp",
        peers=peers,
        listen=peers[me],
        secret=sys.argv[4],
        heartbeat_ms=20,
        suspect_after_ms=600,
    )
    seconds = float(sys.argv[5])
    group = await da.Group.join(config, actors=[ReplicatedLog], timeout=30)
    say(event="view", member=me, view=group.view.view_id, members=list(group.view.members))
    seen = 1
    log = group.subgroup(ReplicatedLog)
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        try:
            await asyncio.wait_for(log.append(b"%d:%d" % (me, i)), 2.0)
            i += 1
        except da.PartitionedError as exc:
            say(event="partitioned", member=me, error=str(exc))
            break
        except TimeoutError:
            pass
        for v in group.history[seen:]:
            say(event="view", member=me, view=v.view_id, members=list(v.members))
        seen = len(group.history)
        await asyncio.sleep(0.01)
    say(event="end", member=me, appended=i, items=len(group.local(ReplicatedLog).items))
    await group.leave()


uvloop.run(main())
