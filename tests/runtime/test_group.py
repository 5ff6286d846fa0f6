"""The Group API in one process over the loopback transport (fast, real event loops)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence

import pytest

import derecho_async as da
from derecho_async.transport import loopback
from derecho_async.transport.loopback import LoopbackFabric, LoopbackTransport

_ids = itertools.count()


class Log(da.Actor):
    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.running = 0
        self.max_running = 0
        self.gate: asyncio.Event | None = None

    @da.ordered
    async def append(self, item: bytes) -> int:
        self.items.append(item)
        return len(self.items)

    @da.ordered
    async def slow_append(self, item: bytes) -> int:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        await asyncio.sleep(0.005)
        if self.gate is not None:
            await self.gate.wait()
        self.items.append(item)
        self.running -= 1
        return len(self.items)

    @da.ordered
    def boom(self, text: str) -> None:
        raise ValueError(text)

    @da.p2p
    async def size(self) -> int:
        return len(self.items)

    def snapshot(self) -> bytes:
        return b"\n".join(self.items)

    def restore(self, state: bytes) -> None:
        self.items = state.split(b"\n") if state else []


class Counter(da.Actor):
    def __init__(self) -> None:
        self.n = 0

    @da.ordered
    def blob(self, n: int) -> bytes:
        return bytes([n % 256]) * (3 << 20)

    @da.ordered
    def add(self, k: int) -> int:
        self.n += k
        return self.n


def cfg(group: str, member: int, n: int = 3) -> da.Config:
    return da.Config(
        group=group,
        member_id=member,
        initial_members=n,
        transport="sim",
        heartbeat_ms=5,
        suspect_after_ms=500,
    )


async def start(n: int, actors: list[type[da.Actor]] | None = None) -> tuple[str, list[da.Group]]:
    name = f"g{next(_ids)}"
    groups = await asyncio.gather(
        *(
            da.Group.join(cfg(name, i, n), actors=actors or [Log, Counter], timeout=10)
            for i in range(n)
        )
    )
    return name, list(groups)


async def close(groups: list[da.Group]) -> None:
    for g in groups:
        await g.leave()


async def test_ordered_calls_return_every_members_result_in_one_total_order() -> None:
    _, gs = await start(3)
    try:
        assert all(g.view == da.View(0, (0, 1, 2)) for g in gs)
        replies = await asyncio.gather(
            *(gs[i % 3].subgroup(Log).append(b"m%d" % i) for i in range(30))
        )
        logs = [g.local(Log).items for g in gs]
        assert logs[0] == logs[1] == logs[2] and len(logs[0]) == 30
        for r in replies:
            assert set(r) == {0, 1, 2} and len(set(r.values())) == 1
            assert isinstance(r, da.Replies) and r.version[0] == 0
        # the reply value is the position in the common log
        positions = sorted(next(iter(r.values())) for r in replies)
        assert positions == list(range(1, 31))
        assert len({r.version for r in replies}) == 30
    finally:
        await close(gs)


async def test_one_way_calls_keep_the_total_order_and_complete_on_local_delivery() -> None:
    _, gs = await start(3)
    try:
        logs = [g.local(Log).items for g in gs]
        futs: list[asyncio.Future[tuple[int, int]]] = []
        held: list[bool] = []
        replied = []
        for i in range(60):
            handle = gs[i % 3].subgroup(Log)
            if i % 4 == 3:  # replied calls interleaved with one-way ones: one total order
                replied.append(asyncio.ensure_future(handle.append(b"r%d" % i)))
            else:
                fut = handle.append.cast(b"c%d" % i)
                fut.add_done_callback(
                    # completion = delivered at the caller: its own replica holds the item
                    lambda f, m=i % 3, item=b"c%d" % i: held.append(item in logs[m])
                )
                futs.append(fut)
        versions = await asyncio.gather(*futs)
        await asyncio.gather(*replied)
        assert held == [True] * len(futs)
        assert all(isinstance(v, tuple) and v[0] == 0 for v in versions)
        assert len(set(versions)) == len(versions)  # one (view_id, seq) per call
        for _ in range(100):  # the other members deliver them too, in the same order
            if all(len(x) == 60 for x in logs):
                break
            await asyncio.sleep(0.01)
        assert logs[0] == logs[1] == logs[2] and len(logs[0]) == 60
        # the versions order the calls as the logs do
        by_seq = sorted(zip(versions, (f for f in range(60) if f % 4 != 3), strict=True))
        positions = [logs[0].index(b"c%d" % i) for _, i in by_seq]
        assert positions == sorted(positions)
    finally:
        await close(gs)


async def test_one_way_calls_report_handler_errors_only_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, gs = await start(3)
    try:
        with caplog.at_level("WARNING", logger="derecho_async.group"):
            version = await gs[1].subgroup(Log).boom.cast("bad input")
            r = await gs[1].subgroup(Log).append(b"after")  # the group goes on
        assert version[0] == 0 and set(r) == {0, 1, 2}
        assert "one-way call raised ValueError: bad input" in caplog.text
        assert gs[0].local(Log).items == [b"after"]
    finally:
        await close(gs)


async def test_a_one_way_call_fails_when_its_member_leaves_before_delivery() -> None:
    _, gs = await start(3)
    try:
        fut = gs[2].subgroup(Log).append.cast(b"never sent")  # queued, not yet pushed
        await gs[2].leave()
        with pytest.raises(da.GroupClosed):
            await fut
        with pytest.raises(da.GroupClosed):
            gs[2].subgroup(Log).append.cast(b"closed")
        assert b"never sent" not in gs[0].local(Log).items
    finally:
        await close(gs)


async def test_handlers_run_one_at_a_time_and_quick_ones_cost_no_task() -> None:
    _, gs = await start(3)
    try:
        await asyncio.gather(*(gs[0].subgroup(Counter).add(1) for _ in range(50)))
        for g in gs:
            assert g._runners["Counter"].tasks_created == 0
            assert g.local(Counter).n == 50
        await asyncio.gather(*(gs[i % 3].subgroup(Log).slow_append(b"s%d" % i) for i in range(9)))
        for g in gs:
            log = g.local(Log)
            assert log.max_running == 1
        assert gs[0].local(Log).items == gs[1].local(Log).items
    finally:
        await close(gs)


async def test_a_handler_that_awaits_holds_back_the_next_delivery() -> None:
    _, gs = await start(2)
    try:
        gate = asyncio.Event()
        gs[1].local(Log).gate = gate
        first = asyncio.ensure_future(gs[0].subgroup(Log).slow_append(b"first"))
        second = asyncio.ensure_future(gs[0].subgroup(Log).append(b"second"))
        await asyncio.sleep(0.2)
        assert not first.done() and not second.done()
        assert gs[1].local(Log).items == []
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert gs[1].local(Log).items == [b"first", b"second"]
    finally:
        await close(gs)


async def test_handler_exceptions_come_back_per_member() -> None:
    _, gs = await start(3)
    try:
        r = await gs[2].subgroup(Log).boom("bad input")
        assert isinstance(r[2], ValueError) and str(r[2]) == "bad input"
        for m in (0, 1):
            err = r[m]
            assert isinstance(err, da.HandlerError)
            assert (err.member, err.type_name, err.message) == (m, "ValueError", "bad input")
        assert r.values_ok() == []
    finally:
        await close(gs)


async def test_typed_access_is_the_handles_method_and_p2p_says_how_to_call() -> None:
    _, gs = await start(3)
    try:
        log = gs[2].subgroup(Log)
        assert log[Log.append] is log.append and log[Log.size] is log.size
        replies = await log[Log.append](b"a")
        assert replies.raise_on_error() == {0: 1, 1: 1, 2: 1}
        assert await log[Log.size].at(0)() == 1
        assert gs[1].local(Log).items == [b"a"]
        with pytest.raises(da.UsageError, match=r"handle\.size\.at\(member\)\(\.\.\.\)"):
            log[Log.size]()  # type: ignore[operator]
        with pytest.raises(da.UsageError, match=r"handle\[Log\.method\]"):
            log[Counter.add]  # type: ignore[index]
        failed = await log[Log.boom]("bad input")
        with pytest.raises(da.HandlerError) as got:  # member 0's: the lowest id with an error
            failed.raise_on_error()
        assert (got.value.member, got.value.type_name) == (0, "ValueError")
        with pytest.raises(ValueError, match="bad input"):  # the caller's own handler's
            (await gs[0].subgroup(Log)[Log.boom]("bad input")).raise_on_error()
    finally:
        await close(gs)


async def test_p2p_calls_reach_the_chosen_member() -> None:
    _, gs = await start(3)
    try:
        await gs[0].subgroup(Log).append(b"a")
        assert await gs[0].subgroup(Log).size.at(2)() == 1
        assert await gs[1].subgroup(Log).size.at(1)() == 1
        with pytest.raises(da.MemberFailed):
            await gs[0].subgroup(Log).size.at(99)()
    finally:
        await close(gs)


async def test_joiner_receives_state_then_deliveries_and_leave_shrinks_the_view() -> None:
    name, gs = await start(3)
    try:
        for i in range(5):
            await gs[i % 3].subgroup(Log).append(b"x%d" % i)
        joiner = await da.Group.join(cfg(name, 7), actors=[Log, Counter], timeout=10)
        gs.append(joiner)
        assert joiner.view.members == (0, 1, 2, 7) and joiner.view.view_id == 1
        assert joiner.local(Log).items == gs[0].local(Log).items
        r = await joiner.subgroup(Log).append(b"from joiner")
        assert set(r) == {0, 1, 2, 7}
        await gs[1].leave()
        for _ in range(100):
            if gs[0].view.members == (0, 2, 7):
                break
            await asyncio.sleep(0.02)
        assert gs[0].view == da.View(2, (0, 2, 7))
        r = await gs[0].subgroup(Log).append(b"after leave")
        assert set(r) == {0, 2, 7}
        with pytest.raises(da.GroupClosed):
            await gs[1].subgroup(Log).append(b"from the departed")
    finally:
        await close(gs)


async def test_a_member_that_leaves_before_replying_is_reported_as_failed() -> None:
    _, gs = await start(3)
    try:
        gate = asyncio.Event()  # never set: member 2 never finishes the handler
        gs[2].local(Log).gate = gate
        call = asyncio.ensure_future(gs[0].subgroup(Log).slow_append(b"x"))
        await asyncio.sleep(0.2)
        assert not call.done()
        await gs[2].leave()
        r = await asyncio.wait_for(call, 5)
        assert r[0] == 1 and r[1] == 1
        assert r[2] == da.MemberFailed(2, "left the group before replying")
    finally:
        await close(gs)


async def test_a_member_that_cannot_land_a_message_leaves_and_the_others_go_on() -> None:
    """A data plane reports a message whose bytes came but whose payload could not be made here
    (the GPU planes do, when a completion's landing raises): it would never be stable, so the
    member leaves rather than hold the group up, and says why to its application."""
    _, gs = await start(3)
    try:
        await gs[0].subgroup(Log).append(b"before")
        driver = gs[2]._driver
        assert driver is not None
        driver._landing_failed((0, 0, 99), MemoryError("no room for the arrays"))
        r = await asyncio.wait_for(gs[0].subgroup(Log).append(b"after"), 10)
        assert set(r) == {0, 1} and gs[0].view.members == (0, 1)
        with pytest.raises(da.GroupClosed, match="could not land here: MemoryError"):
            await gs[2].subgroup(Log).append(b"from the departed")
        assert gs[0].local(Log).items == gs[1].local(Log).items == [b"before", b"after"]
    finally:
        await close(gs)


async def test_misuse_gets_clear_errors() -> None:
    with pytest.raises(da.UsageError):
        da.Group(cfg("x", 0), actors=[int])  # type: ignore[list-item]

    class NoMethods(da.Actor):
        pass

    with pytest.raises(da.UsageError, match="no @ordered"):
        da.Group(cfg("x", 0), actors=[NoMethods])
    _, gs = await start(1, [Log])
    try:
        with pytest.raises(da.UsageError):
            gs[0].subgroup(Counter)
        with pytest.raises(AttributeError):
            gs[0].subgroup(Log).nope  # noqa: B018
        with pytest.raises(TypeError, match="cannot encode"):
            await gs[0].subgroup(Log).append(object())
        np = pytest.importorskip("numpy")
        with pytest.raises(da.UsageError, match="at most 4096 arrays"):
            # arrays past a slot's worth travel out of band, at most 4096 of them per call
            flat = np.zeros(4097 * 1100)
            await gs[0].subgroup(Log).append([flat[i * 1100 : (i + 1) * 1100] for i in range(4097)])
    finally:
        await close(gs)
    with pytest.raises(da.GroupClosed):
        await gs[0].subgroup(Log).append(b"closed")


async def test_join_times_out_with_a_clear_error_when_nobody_answers() -> None:
    c = da.Config(
        group=f"lonely{next(_ids)}",
        member_id=3,
        initial_members=2,
        transport="sim",
        heartbeat_ms=5,
        suspect_after_ms=500,
    )
    with pytest.raises(da.GroupClosed, match="not admitted"):
        await da.Group.join(c, actors=[Log], timeout=0.3)


async def test_many_large_results_of_one_step_all_come_back() -> None:
    # 3 MiB results from 2 members, 12 calls at once: the replies of a step are batched per
    # caller, and the batch is split (about 16 MiB a frame) instead of growing without bound
    _, gs = await start(3)
    try:
        counter = gs[0].subgroup(Counter)
        replies = await asyncio.gather(*(counter.blob(i) for i in range(12)))
        for i, r in enumerate(replies):
            assert set(r) == {0, 1, 2}
            assert all(v == bytes([i]) * (3 << 20) for v in r.values())
    finally:
        await close(gs)


class _Items(da.Actor):
    """Keeps what it was sent, in delivery order (a plain handler: no task per call). At the
    ``arm_at``-th item it arms ``armed`` (a transport's trigger)."""

    arm_at = -1
    armed: list[bool] = []

    def __init__(self) -> None:
        self.items: list[bytes] = []

    @da.ordered
    def put(self, item: bytes) -> None:
        self.items.append(item)
        if len(self.items) == self.arm_at:
            self.armed.append(True)


class _ReportsFailureInsidePush(LoopbackTransport):
    """A loopback endpoint that, at its first push after ``armed`` fills, reports ``member``
    failed from inside the push, as the TCP transport does when it finds a stream broken while
    writing to it."""

    def __init__(self, fabric: LoopbackFabric, member_id: int, member: int,
                 armed: list[bool]) -> None:
        super().__init__(fabric, member_id)
        self.member = member
        self.armed = armed
        self.reported = False

    def push(
        self, view_id: int, offset: int, data: bytes | memoryview, targets: Sequence[int]
    ) -> None:
        super().push(view_id, offset, data, targets)
        if self.armed and not self.reported and self._handler is not None:
            self.reported = True
            self._handler.on_failure(self.member, "stream broken while writing")


class _FabricReplacing(LoopbackFabric):
    """A loopback fabric whose endpoint for ``member`` is made by ``make``."""

    def __init__(self, member: int,
                 make: Callable[[LoopbackFabric, int], LoopbackTransport]) -> None:
        super().__init__()
        self.member = member
        self.make = make

    def transport(self, member_id: int) -> LoopbackTransport:
        if member_id == self.member:
            return self.make(self, member_id)
        return super().transport(member_id)


@contextlib.asynccontextmanager
async def _items_group(fabric: LoopbackFabric) -> AsyncIterator[list[da.Group]]:
    """Three members of an ``_Items`` group on ``fabric``."""
    name = f"g{next(_ids)}"
    loopback.use_fabric(name, fabric)
    gs = list(await asyncio.gather(
        *(da.Group.join(cfg(name, i), actors=[_Items], timeout=10) for i in range(3))
    ))
    try:
        yield gs
    finally:
        for g in gs:
            with contextlib.suppress(Exception):
                await g.leave()
        loopback.use_fabric(name, None)


async def _stream_until_member_2_is_out(gs: list[da.Group]) -> None:
    """Members 0 and 1 cast 400 items; member 2 is then out of their view, and they delivered
    the same sequence, every item once."""
    calls = [gs[i % 2].subgroup(_Items).put.cast(b"%d" % i) for i in range(400)]
    await asyncio.wait_for(asyncio.gather(*calls), 20)
    for _ in range(200):
        if all(g.view.members == (0, 1) for g in gs[:2]):
            break
        await asyncio.sleep(0.02)
    assert gs[0].view.members == gs[1].view.members == (0, 1)
    logs = [g.local(_Items).items for g in gs[:2]]
    assert logs[0] == logs[1], "the survivors delivered different sequences"
    assert sorted(logs[0], key=int) == [b"%d" % i for i in range(400)], "lost or doubled"


class _PushRaises(LoopbackTransport):
    """A loopback endpoint whose first push after ``armed`` fills raises, as a bug in carrying
    out a step would: that push, and the rest of its step, never go out."""

    def __init__(self, fabric: LoopbackFabric, member_id: int, armed: list[bool]) -> None:
        super().__init__(fabric, member_id)
        self.armed = armed
        self.raised = False

    def push(
        self, view_id: int, offset: int, data: bytes | memoryview, targets: Sequence[int]
    ) -> None:
        if self.armed and not self.raised:
            self.raised = True
            raise RuntimeError("injected: this push could not be carried out")
        super().push(view_id, offset, data, targets)


async def test_a_member_whose_step_fails_half_way_leaves_and_the_others_go_on_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Member 2's step fails while its pushes go out: peers may now hold a counter without the
    # slots it counts, and the step cannot be taken again (its deliveries ran). Member 2 must
    # leave, saying why; members 0 and 1 go on in a view of their own, with nothing lost.
    armed: list[bool] = []
    monkeypatch.setattr(_Items, "armed", armed)
    monkeypatch.setattr(_Items, "arm_at", 120)
    async with _items_group(_FabricReplacing(2, lambda f, m: _PushRaises(f, m, armed))) as gs:
        await _stream_until_member_2_is_out(gs)
        with pytest.raises(da.GroupClosed, match="carrying out a step failed"):
            await gs[2].subgroup(_Items).put(b"late")


@pytest.mark.parametrize("arm_at", [50, 150, 300])
async def test_a_failure_reported_from_inside_a_push_is_taken_once_and_nothing_is_delivered_twice(
    arm_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step carries out its pushes and deliveries; a transport may report a peer's failure
    # from inside one of those pushes (here: member 0's first push after its replica holds
    # ``arm_at`` items, while the stream goes on). What the core makes of that report belongs
    # to the next step: carried out in this one, half of it would be lost and the rest taken
    # again.
    armed: list[bool] = []
    monkeypatch.setattr(_Items, "armed", armed)
    monkeypatch.setattr(_Items, "arm_at", arm_at)
    fabric = _FabricReplacing(
        0, lambda f, m: _ReportsFailureInsidePush(f, m, member=2, armed=armed))
    async with _items_group(fabric) as gs:
        await _stream_until_member_2_is_out(gs)


async def test_a_leave_during_a_view_change_waits_for_it_and_the_last_member_goes_on() -> None:
    """Member 1 leaves right after proposing the view that removes member 0: it leaves the view
    it proposed (not the old one), so member 2 keeps a majority of what is left and goes on."""
    _, gs = await start(3)
    try:
        await gs[0].subgroup(Log).append(b"before")
        await gs[0].leave()
        core = gs[1]._driver.core if gs[1]._driver is not None else None
        assert core is not None
        for _ in range(500):  # member 1 leads the change that removes 0: wait for its proposal
            if core.wedged and core.table.mine(core.schema.prop_ballot):
                break
            await asyncio.sleep(0.001)
        else:
            pytest.fail("member 1 never proposed a view")
        await asyncio.wait_for(gs[1].leave(), 10)
        r = await asyncio.wait_for(gs[2].subgroup(Log).append(b"alone"), 10)
        assert r == {2: 2}
        assert gs[2].view.members == (2,)
        assert gs[2].local(Log).items == [b"before", b"alone"]
    finally:
        await close(gs)


async def _wait_view(group: da.Group, members: tuple[int, ...]) -> None:
    for _ in range(250):
        if group.view.members == members:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"view is {group.view}, not {members}")


async def test_the_log_says_why_a_member_is_suspected_and_a_leave_is_no_alarm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, gs = await start(4)
    try:
        with caplog.at_level("INFO", logger="derecho_async.driver"):
            await gs[3].leave()
            await _wait_view(gs[0], (0, 1, 2))
            left = [r for r in caplog.records if "suspects member 3" in r.getMessage()]
            assert left and all(r.levelname == "INFO" and r.getMessage().endswith(
                "it left the group") for r in left)
            caplog.clear()
            driver = gs[2]._driver
            assert driver is not None and driver._tick_handle is not None
            driver._tick_handle.cancel()  # member 2 goes silent: no more heartbeats
            await _wait_view(gs[0], (0, 1))
        silent = [r.getMessage() for r in caplog.records
                  if "suspects member 2" in r.getMessage() and r.levelname == "WARNING"]
        assert any(m.endswith("no sign of life for 500 ms") for m in silent), silent
    finally:
        await close(gs[:2])


async def test_the_log_says_when_the_event_loop_was_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, gs = await start(1)
    try:
        with caplog.at_level("WARNING", logger="derecho_async.driver"):
            await asyncio.sleep(0.05)
            time.sleep(0.3)  # a handler that blocks the loop: longer than suspect_after_ms / 3
            await asyncio.sleep(0.05)
        assert "member 0: the event loop was held for" in caplog.text
        assert "in view 0 (peers suspect a member after 500 ms)" in caplog.text
    finally:
        await close(gs)
