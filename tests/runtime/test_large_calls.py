"""Large calls: over shm between real processes, delivered with no member's loop stalling; in
a sim group, run in delivery order with the calls around them."""

from __future__ import annotations

import asyncio
import itertools
import json
import pathlib
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

import derecho_async as da
from derecho_async import hotpath
from derecho_async.runtime.largecall import OFF_LOOP_BYTES
from tests.runtime import apps

_ids = itertools.count()


def _run_large_call(app: Callable[[da.Config], Coroutine[Any, Any, None]], mb: int,
                    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Run ``app`` (a :func:`apps.large_call` variant) in 3 member processes with an ``mb``
    MiB call; every member must exit 0; their reports."""
    monkeypatch.setenv("DA_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("DA_TEST_CALL_MB", str(mb))
    codes = da.launch_local(3, app, timeout=120, heartbeat_ms=50, suspect_after_ms=500)
    assert codes == [0, 0, 0]
    return [json.loads((tmp_path / f"m{m}.json").read_text()) for m in range(3)]


@pytest.mark.skipif(
    hotpath.IMPLEMENTATION == "pure",
    reason="the pure twin's bytes_copy holds the GIL by design (it is the reference, not the "
    "fast path): a worker's copy of hundreds of MiB stalls the loop there",
)
def test_a_large_call_is_delivered_without_stalling_any_members_loop(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for r in _run_large_call(apps.large_call, 384, tmp_path, monkeypatch):
        assert r["sizes"] == [384 << 20]
        assert r["views"] == [0]  # nobody was suspected or removed
        # heartbeats go on: no stretch the loop could not run anywhere near a suspicion timeout
        assert r["worst_gap_s"] < 0.25, r


def test_a_slow_first_import_of_numpy_stalls_no_members_loop(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where importing numpy takes seconds (CI's emulated rdma VM: 2.5 s and more), a member
    that first imported it on its event loop, to rebuild a large call's byte string or a state
    transfer's parts, missed heartbeats and was suspected: the group lost members. numpy is
    imported off the loop before a member joins a view."""
    monkeypatch.setenv("DA_TEST_IMPORT_DELAY_S", "1.5")
    for r in _run_large_call(apps.large_call_slow_numpy, 2, tmp_path, monkeypatch):
        assert r["sizes"] == [2 << 20]
        assert r["views"] == [0], r  # nobody was suspected or removed
        assert r["worst_gap_s"] < 0.25, r


class Ordered(da.Actor):
    """Records what each call brought, in the order the calls ran."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int, int]] = []

    @da.ordered
    def put(self, tag: str, blob: bytes) -> int:
        assert type(blob) is bytes
        if tag == "fail":
            raise ValueError("refused")
        self.seen.append((tag, len(blob), blob[-1] if blob else -1))
        return len(blob)

    @da.ordered
    async def put_async(self, tag: str, blob: bytes) -> int:
        await asyncio.sleep(0.01)
        self.seen.append((tag, len(blob), blob[-1]))
        return len(blob)


async def test_large_calls_run_in_delivery_order_with_the_small_ones() -> None:
    """In a sim group (host staging): large byte strings arrive as bytes, and the calls around
    a large one (decoded off the loop) run in the same order at every member; one-way calls,
    async handlers and a handler's error behave as for any call."""
    n = 3
    name = f"large{next(_ids)}"
    groups = await asyncio.gather(*(
        da.Group.join(da.Config(group=name, member_id=i, initial_members=n, transport="sim",
                                heartbeat_ms=5, suspect_after_ms=2000),
                      actors=[Ordered], timeout=10) for i in range(n)))
    try:
        big = OFF_LOOP_BYTES + 1  # decoded off the loop
        calls = []
        for k, g in zip(range(6), itertools.cycle(groups), strict=False):
            h = g.subgroup(Ordered)
            calls.append(h.put(f"s{k}", b"x"))
            calls.append(h.put(f"b{k}", bytes(big - 1) + bytes([k])))
            calls.append(h.put_async(f"a{k}", bytes(big - 1) + bytes([k + 100])))
        cast = groups[1].subgroup(Ordered).put.cast("c", bytes(big - 1) + b"\xff")
        failing = groups[2].subgroup(Ordered).put("fail", bytes(big))
        replies = await asyncio.wait_for(asyncio.gather(*calls, cast, failing), 60)
        assert all(set(r.values()) in ({1}, {big}) for r in replies[:-2])
        assert {type(v) for v in replies[-1].values()} == {ValueError, da.HandlerError}
        await asyncio.sleep(0.2)
        seen = [g.local(Ordered).seen for g in groups]
        assert seen[0] == seen[1] == seen[2] and len(seen[0]) == 19
        assert ("c", big, 255) in seen[0]
        for k in range(6):  # each caller's calls in the order it made them
            mine = [e for e in seen[0] if e[0][1:] == str(k)]
            assert mine == [(f"s{k}", 1, 120), (f"b{k}", big, k), (f"a{k}", big, k + 100)]
    finally:
        for g in groups:
            await g.leave()

