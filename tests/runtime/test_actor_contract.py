"""The actor-level contract through the public API: what replicas hold, whatever handlers do.

Each test reproduces a way replicas were made to diverge (or calls to be lost) from the public
API alone: a join while handlers await, p2p calls during an awaiting handler, handlers raising
``BaseException``, slow handlers under a stream of calls, calls near the size bound.
"""

from __future__ import annotations

import asyncio

import pytest

import derecho_async as da
from tests.runtime.simgroups import cfg, close, settle, start

# -- 1. a joiner gets the state after every handler of the calls before its view --------------


class SlowLog(da.Actor):
    def __init__(self) -> None:
        self.items: list[bytes] = []

    @da.ordered
    async def append(self, item: bytes) -> int:
        await asyncio.sleep(0.02)  # stands for GPU work or I/O
        self.items.append(item)
        return len(self.items)

    @da.p2p
    def size(self) -> int:
        return len(self.items)

    def snapshot(self) -> bytes:
        return b"\n".join(self.items)

    def restore(self, state: bytes) -> None:
        self.items = state.split(b"\n") if state else []


async def test_a_joiner_restores_the_state_after_every_awaiting_handler_before_its_view() -> None:
    name, gs = await start([SlowLog])
    log = gs[0].subgroup(SlowLog)
    try:
        await asyncio.gather(*(log.append.cast(b"x%d" % i) for i in range(30)))
        # every call is delivered (stable); most handlers have not run yet at any member
        joiner = await da.Group.join(cfg(name, 7), actors=[SlowLog], timeout=10)
        gs.append(joiner)
        await log.append(b"last")
        await settle(lambda: all(len(g.local(SlowLog).items) == 31
                                 for g in gs))
        states = [g.local(SlowLog).items for g in gs]
        assert all(s == states[0] for s in states)
        assert states[0][:30] == [b"x%d" % i for i in range(30)]
        assert states[0][30] == b"last"
    finally:
        await close(gs)


# -- 3. p2p calls run between ordered handlers and carry the version they saw -----------------


class Pair(da.Actor):
    """Two counters that every ordered call moves together: no replica ever holds a != b."""

    def __init__(self) -> None:
        self.a = 0
        self.b = 0

    @da.ordered
    async def bump(self) -> None:
        self.a += 1
        await asyncio.sleep(0.05)
        self.b += 1

    @da.p2p
    def read(self) -> tuple[int, int]:
        return (self.a, self.b)

    @da.p2p
    def scribble(self) -> None:
        self.a = 1000  # misuse: a p2p handler that writes

    def snapshot(self) -> bytes:
        return b"%d,%d" % (self.a, self.b)

    def restore(self, state: bytes) -> None:
        a, b = state.split(b",")
        self.a, self.b = int(a), int(b)


async def test_p2p_calls_never_see_a_half_applied_ordered_call() -> None:
    _, gs = await start([Pair])
    pair = gs[0].subgroup(Pair)
    try:
        for _ in range(3):
            call = asyncio.ensure_future(pair.bump())
            await asyncio.sleep(0.02)  # every member is inside bump now, between a and b
            for m in (0, 1, 2):
                a, b = await pair.read.at(m)()
                assert a == b, f"member {m} showed a half-applied call: a={a}, b={b}"
            await call
    finally:
        await close(gs)


async def test_p2p_results_carry_the_version_of_the_prefix_they_saw() -> None:
    _, gs = await start([Pair])
    pair = gs[0].subgroup(Pair)
    try:
        first = await pair.bump()
        second = await pair.bump()
        for m in (0, 1, 2):
            await settle(lambda m=m: gs[m].local(Pair).b == 2)
            got = await pair.read.at(m).versioned()
            assert isinstance(got, da.Versioned)
            assert got.value == (2, 2)
            assert got.version == second.version
            assert first.version < second.version
    finally:
        await close(gs)


async def test_a_p2p_handler_that_writes_is_refused_and_undone_when_checked() -> None:
    _, gs = await start([Pair], check_p2p_reads=True)
    pair = gs[0].subgroup(Pair)
    try:
        await pair.bump()
        with pytest.raises(da.HandlerError) as info:
            await pair.scribble.at(1)()
        assert info.value.type_name == "UsageError"
        assert "changed" in info.value.message
        with pytest.raises(da.UsageError):
            await pair.scribble.at(0)()  # the caller's own replica: its own exception
        for m in (0, 1, 2):
            assert await pair.read.at(m)() == (1, 1)
    finally:
        await close(gs)


# -- 4. a handler's BaseException is that call's outcome; nothing is lost -----------------------


class Stubborn(BaseException):
    """A BaseException that is not an Exception (as CancelledError is)."""


class Poisoned(da.Actor):
    def __init__(self) -> None:
        self.items: list[int] = []
        self.me = -1

    @da.ordered
    def add(self, i: int) -> None:
        self.items.append(i)

    @da.ordered
    async def cancelled(self, i: int) -> None:
        self.items.append(i)
        fut = asyncio.get_running_loop().create_future()
        fut.cancel()
        await fut  # raises CancelledError in the handler

    @da.ordered
    async def suspended_then_cancelled(self, i: int) -> None:
        await asyncio.sleep(0.001)
        self.items.append(i)
        fut = asyncio.get_running_loop().create_future()
        fut.cancel()
        await fut

    @da.ordered
    def stubborn(self, i: int) -> None:
        self.items.append(i)
        raise Stubborn("no")

    @da.ordered
    def exit_at(self, member: int) -> int:
        if self.me == member:
            raise SystemExit(3)
        return self.me

    @da.p2p
    async def p2p_cancelled(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        fut.cancel()
        await fut

    @da.p2p
    def count(self) -> int:
        return len(self.items)


async def test_handlers_raising_base_exceptions_lose_no_call_at_any_member() -> None:
    _, gs = await start([Poisoned])
    h = gs[0].subgroup(Poisoned)
    kinds = [h.add, h.cancelled, h.suspended_then_cancelled, h.stubborn]
    try:
        futs = [kinds[i % 7 % 4].cast(i) for i in range(600)]
        versions = await asyncio.wait_for(asyncio.gather(*futs), 20)
        assert len(set(versions)) == 600
        await settle(lambda: all(len(g.local(Poisoned).items) == 600
                                 for g in gs))
        items = [g.local(Poisoned).items for g in gs]
        assert items[0] == items[1] == items[2] == list(range(600))
        assert all(g.view.view_id == 0 for g in gs)  # nobody was removed
    finally:
        await close(gs)


async def test_a_base_exception_comes_back_in_the_replies() -> None:
    _, gs = await start([Poisoned])
    h = gs[1].subgroup(Poisoned)
    try:
        replies = await asyncio.wait_for(h.cancelled(1), 10)
        assert isinstance(replies[1], asyncio.CancelledError)
        for m in (0, 2):
            assert replies[m] == da.HandlerError(m, "CancelledError", "")
        replies = await asyncio.wait_for(h.stubborn(2), 10)
        assert isinstance(replies[1], Stubborn)
        assert replies[0] == da.HandlerError(0, "Stubborn", "no")
        assert await h.count.at(0)() == 2
    finally:
        await close(gs)


async def test_a_p2p_handler_raising_cancelled_error_answers_and_the_member_goes_on() -> None:
    _, gs = await start([Poisoned])
    h = gs[0].subgroup(Poisoned)
    try:
        with pytest.raises(da.HandlerError) as info:
            await asyncio.wait_for(h.p2p_cancelled.at(2)(), 5)
        assert info.value.type_name == "CancelledError"
        await asyncio.wait_for(h.add(5), 5)
        assert await asyncio.wait_for(h.count.at(2)(), 5) == 1
        assert all(g.view.view_id == 0 for g in gs)
    finally:
        await close(gs)


async def test_system_exit_in_a_handler_is_that_members_orderly_departure() -> None:
    _, gs = await start([Poisoned])
    for i, g in enumerate(gs):
        g.local(Poisoned).me = i
    h = gs[0].subgroup(Poisoned)
    try:
        replies = await asyncio.wait_for(h.exit_at(2), 10)
        assert replies[0] == 0 and replies[1] == 1
        assert replies[2] == da.HandlerError(2, "SystemExit", "3")
        await settle(lambda: gs[0].view.members == (0, 1))
        assert gs[1].view.members == (0, 1)
        with pytest.raises(da.GroupClosed, match="SystemExit"):
            await gs[2].subgroup(Poisoned).add(1)
        await asyncio.wait_for(h.add(9), 5)  # the others go on: a leave, not a failure
    finally:
        await close(gs)


# -- 6. backpressure: a slow handler slows its senders, memory stays bounded --------------------


class Slow(da.Actor):
    def __init__(self) -> None:
        self.n = 0

    @da.ordered
    async def work(self, i: int) -> None:
        await asyncio.sleep(0.002)
        self.n += 1

    @da.ordered
    def ping(self) -> int:
        return self.n


async def test_a_slow_handler_slows_its_senders_instead_of_queuing_without_bound() -> None:
    bound = 64
    _, gs = await start([Slow], max_queued_calls=bound)
    h = gs[0].subgroup(Slow)
    peak = [0]

    async def watch() -> None:
        while True:
            peak[0] = max(peak[0], *(g.queued_calls for g in gs))
            await asyncio.sleep(0.001)

    watcher = asyncio.ensure_future(watch())
    try:
        futs = []
        for i in range(1000):
            futs.append(h.work.cast(i))
            if i % 50 == 49:
                await asyncio.sleep(0)
        ping = await asyncio.wait_for(h.ping(), 30)  # a replied call behind the backlog
        assert ping[0] >= 0
        await asyncio.wait_for(asyncio.gather(*futs), 30)
        await settle(lambda: all(g.local(Slow).n == 1000 for g in gs), 30)
        # delivered calls waiting for the handler stay near the bound (plus what was already
        # stable when the member stopped taking more), not the whole stream
        assert peak[0] <= 4 * bound, peak[0]
    finally:
        watcher.cancel()
        await close(gs)


async def test_a_full_queue_fails_calls_with_a_clear_error_when_asked_to() -> None:
    _, gs = await start([Slow], max_queued_calls=16, when_queue_full="error")
    h = gs[0].subgroup(Slow)
    try:
        futs = []
        with pytest.raises(da.QueueFull, match="max_queued_calls"):
            for i in range(1000):
                futs.append(h.work.cast(i))
        assert 16 <= len(futs) < 1000
        await asyncio.wait_for(asyncio.gather(*futs), 30)  # those accepted are delivered
    finally:
        await close(gs)


# -- 5. the size bound is checked on the encoded call, at the call -----------------------------


class Sink(da.Actor):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    @da.ordered
    def put(self, blob: bytes) -> int:
        self.sizes.append(len(blob))
        return len(blob)


async def test_a_call_over_the_size_bound_fails_at_once_and_nothing_is_sent() -> None:
    _, gs = await start([Sink], max_call_mb=1)
    h = gs[0].subgroup(Sink)
    try:
        with pytest.raises(da.UsageError, match="max_call_mb"):
            h.put.cast(b"x" * (1 << 20))  # the encoding is a few bytes over 1 MiB
        with pytest.raises(da.UsageError, match="max_call_mb"):
            await h.put(b"x" * (1 << 20))
        replies = await h.put(b"x" * ((1 << 20) - 64))  # within the bound: delivered
        assert set(replies.values()) == {(1 << 20) - 64}
        assert all(g.local(Sink).sizes == [(1 << 20) - 64] for g in gs)
    finally:
        await close(gs)


async def test_a_call_of_exactly_the_default_bound_fails_at_once() -> None:
    _, gs = await start([Sink])
    h = gs[0].subgroup(Sink)
    try:
        blob = bytes(1 << 30)  # its encoding is a few bytes over the 1 GiB bound
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(da.UsageError, match="max_call_mb"):
            h.put.cast(blob)
        assert loop.time() - began < 0.5  # sized, not encoded, copied and shipped
        del blob
        await h.put(b"small")
        assert all(g.local(Sink).sizes == [5] for g in gs)
    finally:
        await close(gs)


# -- 7. one configuration system ---------------------------------------------------------------


def test_every_tuning_knob_is_a_config_key_read_from_the_environment() -> None:
    env = {
        "DERECHO_ASYNC_GPU_BUSY_POLL_US": "0",
        "DERECHO_ASYNC_GPU_POLL_INTERVAL_US": "40",
        "DERECHO_ASYNC_NCCL_STALL_S": "30",
        "DERECHO_ASYNC_NCCL_SETUP_S": "20",
    }
    config = da.Config.load(environ=env, group="g", member_id=0)
    assert config.gpu_busy_poll_us == 0
    assert config.gpu_poll_interval_us == 40
    assert config.nccl_stall_s == 30
    assert config.nccl_setup_s == 20


def test_no_module_reads_its_own_settings_from_the_environment() -> None:
    import pathlib
    import re

    import derecho_async

    root = pathlib.Path(derecho_async.__file__).parent
    allowed = {"config.py", "hotpath.py"}  # Config itself; hotpath's build switch (ENV_RESERVED)
    offenders = []
    for path in root.rglob("*.py"):
        if path.name in allowed:
            continue
        text = path.read_text()
        if re.search(r"environ(\.get)?\s*[\[(]\s*[\"']DERECHO_ASYNC_", text) or re.search(
            r"getenv\(\s*[\"']DERECHO_ASYNC_", text
        ) or re.search(r"_from_env\(\s*[\"']DERECHO_ASYNC_", text):
            offenders.append(str(path.relative_to(root)))
    assert offenders == []
