"""A group member in its own process, driven by test_transport_processes.py.

Usage: member_process.py KIND LOOP MODE MEMBER_ID ARG
  KIND  shm | tcp;   LOOP  asyncio | uvloop;   MODE  run | crash
  ARG   shm: the group name;   tcp: "host:port:secret_hex" of member 0 (the test process)

Protocol (msgpack messages): the member starts, says ["hello", id] to member 0 and waits for
["go", peers] (peers: id -> [host, port], tcp only). In "run" mode it then pushes PUSHES words
into its row of view 1 to member 0 and the other child, interleaving messages, sends a big
message, and ["done"]; once it has ["done"] from the other child it reports whether that
child's traffic arrived intact and in order (["report", ok, detail]) and waits for ["bye"]. In
"crash" mode it pushes a little and then sleeps until it is killed.
"""

from __future__ import annotations

import asyncio
import sys

import msgpack  # type: ignore[import-untyped]
import uvloop

from derecho_async.transport import Transport
from derecho_async.transport.shm import ShmTransport
from derecho_async.transport.tcp import TcpTransport

ROW = 64
PUSHES = 3000
BIG = 2 << 20


def big_payload(member: int) -> bytes:
    return bytes((member * 31 + i) % 251 for i in range(256)) * (BIG // 256)


class Member:
    def __init__(self, me: int) -> None:
        self.me = me
        self.inbox: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self.log: dict[int, list[tuple[object, ...]]] = {}

    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        self.log.setdefault(sender, []).append(("push", view_id, offset, data))

    def on_message(self, sender: int, payload: bytes) -> None:
        msg = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        self.log.setdefault(sender, []).append(("msg", msg))
        self.inbox.put_nowait((sender, msg))

    def on_failure(self, member: int, reason: str) -> None:
        print(f"member {self.me}: failure of {member}: {reason}", file=sys.stderr)

    async def expect(self, sender: int, tag: str) -> list[object]:
        while True:
            s, msg = await self.inbox.get()
            if s == sender and isinstance(msg, list) and msg and msg[0] == tag:
                return msg


def expected_from(sender: int, receiver: int) -> list[tuple[object, ...]]:
    """What a child sends to a receiver, in order (the test process checks the same)."""
    rank = sender
    out: list[tuple[object, ...]] = [("msg", ["hello", sender])] if receiver == 0 else []
    for i in range(PUSHES):
        out.append(("push", 1, rank * ROW + (i % 8) * 8, i.to_bytes(8, "little")))
        if i % 10 == 0:
            out.append(("msg", ["m", i]))
    out.append(("msg", ["big", big_payload(sender)]))
    out.append(("msg", ["done"]))
    return out


async def main(kind: str, mode: str, me: int, arg: str) -> None:
    m = Member(me)
    t: Transport
    if kind == "shm":
        t = ShmTransport(arg, me, ring_bytes=64 << 10)
    else:
        host, port, secret = arg.split(":")
        t = TcpTransport(
            me, ("127.0.0.1", 0), secret=bytes.fromhex(secret), peers={0: (host, int(port))}
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
    kind_, loop_, mode_, me_, arg_ = sys.argv[1:6]
    if loop_ == "uvloop":
        uvloop.run(main(kind_, mode_, int(me_), arg_))
    else:
        asyncio.run(main(kind_, mode_, int(me_), arg_))
