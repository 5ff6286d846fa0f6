"""The virtual-time event loop: virtual clock, ordering, inline executor, stalls, determinism."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from derecho_async.testing.vloop import (
    SimulationStalled,
    VirtualTimeExceeded,
    VirtualTimeLoop,
    run_virtual,
)


def test_hours_of_sleep_take_no_wall_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        assert loop.time() == 0.0
        await asyncio.gather(*(asyncio.sleep(3600.0 * h) for h in (1, 5, 3)))
        await asyncio.sleep(0.25)
        return loop.time()

    wall = time.perf_counter()
    assert run_virtual(main, max_virtual_s=None) == 5 * 3600.0 + 0.25
    assert time.perf_counter() - wall < 0.5


def test_timers_land_on_their_due_time_exactly() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen: list[float] = []
        for when in (0.1, 0.3, 0.7, 123.456, 1e9 + 0.1):  # (far out, floats are sparse)
            loop.call_at(when, lambda: seen.append(loop.time()))
        await asyncio.sleep(1e9 + 1)
        return seen

    assert run_virtual(main, max_virtual_s=None) == [0.1, 0.3, 0.7, 123.456, 1e9 + 0.1]


def test_wait_for_and_timeout_fire_in_virtual_time() -> None:
    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        never = loop.create_future()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(never, 30.0)
        first = loop.time()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(2.5):
                await asyncio.sleep(10.0)
        return first, loop.time()

    wall = time.perf_counter()
    assert run_virtual(main) == (30.0, 32.5)
    assert time.perf_counter() - wall < 0.5


def test_call_soon_runs_fifo_and_defers_callbacks_scheduled_meanwhile() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        order: list[str] = []

        def first(i: int) -> None:
            order.append(f"a{i}")
            loop.call_soon(order.append, f"b{i}")

        for i in range(50):
            loop.call_soon(first, i)
        await asyncio.sleep(0.001)
        return order

    order = run_virtual(main)
    assert order == [f"a{i}" for i in range(50)] + [f"b{i}" for i in range(50)]


def test_call_later_orders_by_time_and_ties_by_scheduling_order() -> None:
    rnd = random.Random(5)

    async def main() -> list[tuple[float, int]]:
        loop = asyncio.get_running_loop()
        fired: list[tuple[float, int]] = []
        plan = [(rnd.choice((1.0, 2.0, 3.0)), i) for i in range(300)]
        for delay, i in plan:
            loop.call_later(delay, fired.append, (delay, i))
        cancelled = loop.call_later(1.0, fired.append, (9.9, -1))
        cancelled.cancel()
        await asyncio.sleep(4.0)
        assert fired == sorted(plan)  # by time, then by scheduling order (i)
        return fired

    first = run_virtual(main)
    assert len(first) == 300


def test_run_in_executor_runs_inline_and_returns_a_finished_future() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        me = threading.get_ident()
        fut = loop.run_in_executor(None, lambda a, b: (a + b, threading.get_ident()), 2, 3)
        assert fut.done()
        assert await fut == (5, me)

        def boom() -> None:
            raise ValueError("inline")

        failed = loop.run_in_executor(None, boom)
        assert failed.done()
        with pytest.raises(ValueError, match="inline"):
            await failed
        assert await asyncio.to_thread(threading.get_ident) == me
        assert loop.time() == 0.0

    run_virtual(main)


def test_stall_is_reported_not_hung() -> None:
    async def main() -> None:
        await asyncio.sleep(12.0)
        await asyncio.get_running_loop().create_future()  # nobody will ever complete it

    wall = time.perf_counter()
    with pytest.raises(SimulationStalled, match=r"virtual time 12\.0 s"):
        run_virtual(main)
    assert time.perf_counter() - wall < 0.5


def test_virtual_time_bound_stops_a_livelock() -> None:
    async def main() -> None:
        while True:
            await asyncio.sleep(1.0)

    with pytest.raises(VirtualTimeExceeded, match=r"bound of 100\.0 s"):
        run_virtual(main, max_virtual_s=100.0)


def test_real_io_and_other_threads_are_refused() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        with pytest.raises(NotImplementedError, match="no real I/O"):
            await asyncio.open_connection("127.0.0.1", 9)
        with pytest.raises(NotImplementedError, match="no real I/O"):
            loop.add_reader(0, print)
        with pytest.raises(NotImplementedError, match="no real I/O"):
            await loop.getaddrinfo("localhost", 80)
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                loop.call_soon_threadsafe(print)
            except NotImplementedError as exc:
                errors.append(exc)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert len(errors) == 1 and "single-threaded" in str(errors[0])
        ran: list[int] = []
        loop.call_soon_threadsafe(ran.append, 1)  # the loop's own thread may
        await asyncio.sleep(0)
        assert ran == [1]

    run_virtual(main)


def test_leftover_tasks_are_cancelled_oldest_first() -> None:
    cancelled: list[int] = []

    async def sleeper(i: int) -> None:
        try:
            await asyncio.sleep(1000.0)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def main() -> str:
        for i in (3, 1, 4, 1, 5, 9, 2, 6):
            asyncio.get_running_loop().create_task(sleeper(i))
        await asyncio.sleep(1.0)
        return "done"

    assert run_virtual(main) == "done"
    assert cancelled == [3, 1, 4, 1, 5, 9, 2, 6]


def _seeded_program(seed: int) -> list[tuple[float, str]]:
    """A few tasks sleeping random (seeded) amounts, racing timeouts and queues; its trace."""
    rnd = random.Random(seed)

    async def main() -> list[tuple[float, str]]:
        loop = asyncio.get_running_loop()
        trace: list[tuple[float, str]] = []
        queue: asyncio.Queue[int] = asyncio.Queue()

        async def worker(w: int) -> None:
            for step in range(20):
                await asyncio.sleep(rnd.choice((0.0, 0.001, 0.01, rnd.random())))
                trace.append((loop.time(), f"w{w}.{step}"))
                queue.put_nowait(w * 100 + step)
                if rnd.random() < 0.3:
                    try:
                        await asyncio.wait_for(asyncio.sleep(rnd.random()), rnd.random())
                        trace.append((loop.time(), f"w{w} slept"))
                    except TimeoutError:
                        trace.append((loop.time(), f"w{w} timed out"))

        async def consumer() -> None:
            while True:
                item = await queue.get()
                trace.append((loop.time(), f"got {item}"))

        consume = asyncio.create_task(consumer())
        await asyncio.gather(*(worker(w) for w in range(5)))
        await asyncio.sleep(0)
        consume.cancel()
        return trace

    return run_virtual(main)


def test_same_program_same_trace_bit_for_bit() -> None:
    first = _seeded_program(11)
    second = _seeded_program(11)
    assert len(first) >= 200
    assert first == second
    assert _seeded_program(12) != first


def test_loop_is_usable_by_hand() -> None:
    loop = VirtualTimeLoop()
    try:
        assert loop.run_until_complete(asyncio.sleep(7.0, result="x")) == "x"
        assert loop.time() == 7.0
        with pytest.raises(SimulationStalled):
            loop.run_forever()
    finally:
        loop.close()
