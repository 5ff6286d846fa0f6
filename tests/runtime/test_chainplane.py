"""The tcp chain plane alone (pipelined blocks, relayed member to member): hostile blocks, and
a large call laid out off the event loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import derecho_async as da
from derecho_async.runtime.chainplane import ChainPlane
from tests.runtime.offloop import big_call, gated_executor, view_installed, wait_until

# -- hostile frames ---------------------------------------------------------------------------


def _block_frames(chain_targets: tuple[int, ...], nbytes: int) -> list[list[Any]]:
    from derecho_async.wire import envelope as env

    frames: list[tuple[int, bytes]] = []
    plane = ChainPlane(0, lambda to, f: frames.append((to, f)), lambda k, p: None, 4096)
    assert plane.start((2, 0, 9), b"\x07" * nbytes, chain_targets)
    if nbytes > 4096:
        assert {to for to, _ in frames} == {min(chain_targets)}
    else:
        assert [to for to, _ in frames] == sorted(chain_targets)
    return [env.decode(f) for _, f in frames]


def test_hostile_blocks_are_protocol_violations() -> None:
    import msgpack  # type: ignore[import-untyped]

    from derecho_async.core import View, ViewInstalled

    def in_view(plane: ChainPlane) -> ChainPlane:
        plane.on_event(ViewInstalled(View(2, (0, 1, 2, 3)), (), (), True))
        return plane

    good = _block_frames((1, 2), 10_000)  # 3 blocks of 4096, 4096, 1808
    assert [b[4] for b in good] == [0, 1, 2] and len(good[2][8]) == 1808
    head = msgpack.unpackb(good[0][7])

    def with_head(chain: object, meta: object, bs: object) -> bytes:
        out = msgpack.packb([chain, meta, bs])
        assert isinstance(out, bytes)
        return out

    def b0(**kw: Any) -> list[Any]:
        f = list(good[0])
        for i, name in enumerate(("view", "origin", "msg", "index", "count", "total", "head", "block"), 1):
            if name in kw:
                f[i] = kw[name]
        return f

    cases: list[tuple[str, int, list[list[Any]]]] = [
        ("first block from a non-predecessor", 2, [good[0]]),
        ("chain without me", 0, [b0(head=with_head([2, 3], head[1], 4096))]),
        ("chain holding the origin", 0, [b0(head=with_head([1, 0], head[1], 4096))]),
        ("duplicate chain ids", 0, [b0(head=with_head([1, 1, 2], head[1], 4096))]),
        ("block size too small", 0, [b0(head=with_head(head[0], head[1], 16))]),
        ("meta disagrees with total", 0, [b0(total=20_000)]),
        ("wrong block count", 0, [b0(count=2)]),
        ("short block", 0, [b0(block=b"\x07" * 100)]),
        ("undecodable head", 0, [b0(head=b"\xc1")]),
        ("head is not a list", 0, [b0(head=msgpack.packb({"a": 1}))]),
        ("block without block 0", 0, [good[1]]),
        ("block out of order", 0, [good[0], good[2]]),
        ("block 0 twice", 0, [good[0], good[0]]),
        ("later block with a head", 0, [good[0], [*good[1][:7], good[0][7], good[1][8]]]),
        ("later block changes the total", 0, [good[0], [*good[1][:6], 10_001, *good[1][7:]]]),
        ("chain not in its origin's order", 3, [b0(origin=0, head=with_head([3, 1, 2], head[1], 4096))]),
        ("another member's message injected", 3, [b0(origin=0, head=with_head([3, 1], head[1], 4096))]),
        ("chain member outside the view", 0, [b0(head=with_head([1, 7], head[1], 4096))]),
        ("a view far ahead", 0, [b0(view=9)]),
        ("a huge total", 0, [b0(total=1 << 40, count=(1 << 40) // 4096)]),
    ]
    for why, frm, frames in cases:
        landed: list[object] = []
        relayed: list[int] = []

        def relay(to: int, f: bytes, r: list[int] = relayed) -> None:
            r.append(to)

        def land(k: tuple[int, int, int], p: object, ld: list[object] = landed) -> None:
            ld.append(p)

        plane = in_view(ChainPlane(1, relay, land))
        with pytest.raises(da.ProtocolViolation):
            for f in frames:
                plane.receive(frm, f, b"raw")
        assert landed == [], why
        assert len(relayed) <= 1, why  # only an accepted first block was passed on
    # the genuine frames: member 1 relays each to 2 and lands the payload
    landed = []
    relayed = []
    plane = in_view(ChainPlane(1, lambda to, f: relayed.append(to), lambda k, p: landed.append(p)))
    for f in good:
        plane.receive(0, f, b"raw")
    assert relayed == [2, 2, 2] and landed == [b"\x07" * 10_000]
    # one block: the sender sends it to each target directly (a chain of one each)
    single = _block_frames((1, 2, 3), 4096)
    assert [msgpack.unpackb(f[7])[0] for f in single] == [[1], [2], [3]]
    one: list[object] = []
    plane = in_view(ChainPlane(2, lambda to, f: relayed.append(to), lambda k, p: one.append(p)))
    plane.receive(0, single[1], b"raw")
    assert one == [b"\x07" * 4096]
    tail: list[object] = []
    last = in_view(ChainPlane(2, lambda to, f: relayed.append(to), lambda k, p: tail.append(p)))
    with pytest.raises(da.ProtocolViolation):
        last.receive(0, good[0], b"raw")  # 2's predecessor is 1, not the origin
    for f in good:
        last.receive(1, f, b"raw")
    assert tail == [b"\x07" * 10_000] and relayed == [2, 2, 2]


# -- copies off the event loop -------------------------------------------------------------------


async def test_a_large_chain_call_is_laid_out_off_the_loop_before_its_blocks_go() -> None:
    from derecho_async.wire import envelope as env

    frames: list[tuple[int, list[Any]]] = []
    failed: list[Any] = []
    plane = ChainPlane(0, lambda to, f: frames.append((to, env.decode(f))), lambda k, p: None,
                       staging_failed=lambda k, e: failed.append(k))
    plane.on_event(view_installed(0, (0, 1, 2)))
    with gated_executor() as gate:
        assert plane.start((0, 0, 1), big_call(5), (1, 2))
        await asyncio.sleep(0.05)
        assert frames == []
        gate.open.set()
        await wait_until(lambda: frames)
        blocks = [msg for _, msg in frames]
        assert {to for to, _ in frames} == {1} and len(blocks) == blocks[0][5]
        assert b"".join(m[8] for m in blocks)[64:] == bytes([5]) * len(big_call().arrays[0])
        # superseded by a newer view, or closed, while being laid out: no block goes out
        frames.clear()
        gate.open.clear()
        assert plane.start((0, 0, 2), big_call(), (1, 2))
        plane.on_event(view_installed(1, (0, 1, 2)))
        gate.open.set()
        await asyncio.sleep(0.1)
        assert frames == []
        gate.open.clear()
        assert plane.start((1, 0, 3), big_call(), (1, 2))
        plane.close()
        gate.open.set()
        await asyncio.sleep(0.1)
        assert frames == [] and failed == []
