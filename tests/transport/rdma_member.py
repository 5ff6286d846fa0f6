"""A group member over the rdma transport in its own process, driven by test_rdma_processes.py.

Usage: rdma_member.py LOOP MODE MEMBER_ID HOST:PORT:SECRET_HEX
  LOOP  asyncio | uvloop;   MODE  run | crash;   the address and secret are member 0's.

Same protocol as member_process.py (whose Member, expected_from and payloads it reuses): say
["hello", id] to member 0, wait for ["go", peers], then in "run" mode push PUSHES words to member 0
and the other child interleaved with messages, a big message and ["done"], report whether the
other child's traffic arrived intact and in order, and wait for ["bye"]; in "crash" mode push 50
words, say ["crash-ready"] and sleep until killed.
"""

from __future__ import annotations

import asyncio
import os
import sys

import msgpack  # type: ignore[import-untyped]
import uvloop
from member_process import PUSHES, ROW, Member, big_payload, expected_from

from derecho_async.transport.rdma import RdmaTransport


async def main(mode: str, me: int, arg: str) -> None:
    m = Member(me)
    host, port, secret = arg.split(":")
    t = RdmaTransport(
        me,
        ("127.0.0.1", 0),
        secret=bytes.fromhex(secret),
        peers={0: (host, int(port))},
        device=os.environ.get("RXE_DEV"),
    )
    await t.start(m)
    t.set_view(1, [0, 1, 2], ROW)
    other = 3 - me
    t.send(0, msgpack.packb(["hello", me]))
    go = await m.expect(0, "go")
    peers = go[1]
    assert isinstance(peers, dict)
    for pid, addr in peers.items():
        t.add_peer(int(pid), tuple(addr) if addr is not None else None)
    targets = [0, other]
    if mode == "crash":
        for i in range(50):
            t.push(1, me * ROW + (i % 8) * 8, i.to_bytes(8, "little"), targets)
        await t.drain()
        t.send(0, msgpack.packb(["crash-ready"]))
        await asyncio.sleep(3600)
        return
    for i in range(PUSHES):
        t.push(1, me * ROW + (i % 8) * 8, i.to_bytes(8, "little"), targets)
        if i % 10 == 0:
            for x in targets:
                t.send(x, msgpack.packb(["m", i]))
        if i % 500 == 0:
            await asyncio.sleep(0)
    for x in targets:
        t.send(x, msgpack.packb(["big", big_payload(me)]))
        t.send(x, msgpack.packb(["done"]))
    await m.expect(other, "done")
    got = m.log.get(other, [])
    want = expected_from(other, me)
    ok = got == want
    detail = "" if ok else f"got {len(got)} events from {other}, want {len(want)}"
    t.send(0, msgpack.packb(["report", ok, detail]))
    await m.expect(0, "bye")
    await t.drain()
    await t.close()


if __name__ == "__main__":
    loop_, mode_, me_, arg_ = sys.argv[1:5]
    if loop_ == "uvloop":
        uvloop.run(main(mode_, int(me_), arg_))
    else:
        asyncio.run(main(mode_, int(me_), arg_))
