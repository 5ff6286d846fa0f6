"""A sender's own calls in flight are bounded in bytes too (``max_queued_mb``; contract item 12).

Member 0 of three member processes over shm makes hundreds of one-way calls of 600 KiB without
awaiting any. Its own calls in flight are held until delivered (for a re-send after a view
change), so without a bound in bytes they would all be held at once. With
``max_queued_mb = 16``: ``when_queue_full = "error"`` raises ``QueueFull`` once the calls in
flight reach 16 MiB; ``"wait"`` parks as many again (the bound on calls waiting for room) and
raises past that; every call accepted is delivered, and the sender's memory stays near the
bound.
"""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest

import derecho_async as da
from tests.runtime import apps
from tests.runtime.simgroups import close, start

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

BOUND_MB = 16
CALL_KB = 600
CASTS = 400  # 234 MiB of calls: far past the bound


@pytest.mark.parametrize("when", ["error", "wait"])
def test_a_senders_own_calls_in_flight_are_bounded_in_bytes(
    when: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DA_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("DA_TEST_CALL_KB", str(CALL_KB))
    monkeypatch.setenv("DA_TEST_CASTS", str(CASTS))
    codes = da.launch_local(3, apps.own_calls_bound, timeout=60, max_queued_mb=BOUND_MB,
                            when_queue_full=when, heartbeat_ms=50, suspect_after_ms=1000)
    assert codes == [0, 0, 0]
    report = json.loads((tmp_path / "m0.json").read_text())
    bound = BOUND_MB << 20
    size = CALL_KB << 10
    # a call in flight weighs its encoded size (a few bytes over the blob), so the bound holds
    # bound // size of them; a parked one weighs that and a little more
    in_flight = bound // size
    assert in_flight - 1 <= report["sent"] <= in_flight, report
    if when == "error":
        assert report["accepted"] == report["sent"], report
        assert "max_queued_mb" in report["full"], report
    else:
        assert in_flight - 1 <= report["accepted"] - report["sent"] <= in_flight, report
        assert "max_queued_mb" in report["full"], report
    # every accepted call was delivered (distinct versions) and ran at every member
    assert report["versions"] == report["accepted"], report
    assert set(report["counts"].values()) == {3 + report["accepted"]}, report
    # Memory: the calls in flight (at most the bound), their copies in the data plane's shm
    # pool (at most as many bytes again), the parked calls ("wait": at most the bound), and
    # 32 MiB for the allocator and the interpreter; far below the 234 MiB of the burst.
    allowed_kib = (3 * bound + (32 << 20)) >> 10
    grew = report["hwm_kib"] - report["rss_base_kib"]
    assert grew <= allowed_kib, report


class Blobs(da.Actor):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    @da.ordered
    def put(self, blob: bytes) -> int:
        self.sizes.append(len(blob))
        return len(blob)


async def test_a_call_larger_than_the_bound_goes_when_nothing_else_is_in_flight() -> None:
    # max_call_mb may exceed max_queued_mb: such a call waits for the calls before it, not
    # for ever (and with "error" it is refused only while others are in flight)
    _, gs = await start([Blobs], max_queued_mb=1, when_queue_full="error")
    h = gs[0].subgroup(Blobs)
    big = b"x" * (2 << 20)
    try:
        replies = await asyncio.wait_for(h.put(big), 10)
        assert set(replies.values()) == {2 << 20}
        first = h.put.cast(big)
        with pytest.raises(da.QueueFull, match="max_queued_mb=1"):
            h.put.cast(big)
        with pytest.raises(da.QueueFull):
            h.put.cast(b"small")  # bytes in flight, not the size of the call, decide
        await asyncio.wait_for(first, 10)
        await asyncio.wait_for(h.put.cast(big), 10)  # nothing in flight again: it goes
    finally:
        await close(gs)


async def test_waiting_calls_larger_than_the_bound_park_one_at_a_time() -> None:
    _, gs = await start([Blobs], max_queued_mb=1)
    h = gs[0].subgroup(Blobs)
    big = b"x" * (2 << 20)
    try:
        first = h.put.cast(big)
        second = h.put.cast(big)  # parked: the only one waiting, however large
        with pytest.raises(da.QueueFull, match="waiting for room"):
            h.put.cast(b"small")  # past the bound on parked bytes, small or not
        versions = await asyncio.wait_for(asyncio.gather(first, second), 10)
        assert versions[0] < versions[1]
        replies = await asyncio.wait_for(h.put(b"after"), 10)
        assert replies.version > versions[1]
        for g in gs:
            assert g.local(Blobs).sizes == [2 << 20, 2 << 20, 5]
    finally:
        await close(gs)
