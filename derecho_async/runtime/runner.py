"""Runs an actor's handlers one at a time, in delivery order, without a Task per message.

Theory of operation: each delivered call is queued on its actor's :class:`SerialRunner`. When the
runner is free it starts the handler on the spot: a plain function runs to completion; a
coroutine is stepped by hand with ``send(None)``. If it finishes without suspending, which is the
common case for handlers that only touch memory, its result is reported synchronously and no
Task or Future is created. Only a handler that really suspends (it awaited an unfinished future)
is handed to a Task that resumes it exactly where it stopped; the runner stays busy until that
Task ends, then carries on with the queue. Results and exceptions go to a completion callback.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from types import CoroutineType
from typing import Any

__all__ = ["SerialRunner"]

Done = Callable[[bool, object], None]
"""``done(ok, value_or_exception)``."""


class _Yielded:
    """Awaitable that re-yields what a hand-stepped coroutine yielded, so a Task can wait on it."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, None]:
        yield self.value


async def _resume(coro: Coroutine[Any, Any, Any], first: object) -> Any:
    """Continue a coroutine that suspended once under hand stepping, until it returns."""
    pending = first
    while True:
        try:
            await _Yielded(pending)
        except BaseException as exc:  # cancellation or an error delivered to the awaiter
            try:
                pending = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            pending = coro.send(None)
        except StopIteration as stop:
            return stop.value


_NO_ARGS: tuple[object, ...] = ()
_NO_KWARGS: dict[str, object] = {}


class SerialRunner:
    """Runs queued calls one at a time, in order (one runner per actor)."""

    __slots__ = ("_busy", "_queue", "tasks_created")

    def __init__(self) -> None:
        self._queue: deque[
            tuple[Callable[..., object], tuple[object, ...], dict[str, object], Done]
        ] = deque()
        self._busy = False
        self.tasks_created = 0

    @property
    def busy(self) -> bool:
        return self._busy

    def idle(self) -> bool:
        """Nothing runs or waits: a caller may run a handler on the spot itself, as
        :meth:`submit_call` would, and hand a coroutine it returns to :meth:`step_coroutine`."""
        return not self._busy and not self._queue

    def submit(self, call: Callable[[], object], done: Done) -> None:
        """Queue ``call`` (a plain call or one returning a coroutine); ``done`` gets its result."""
        self.submit_call(call, _NO_ARGS, _NO_KWARGS, done)

    def submit_call(
        self,
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        done: Done,
    ) -> None:
        """Queue ``fn(*args, **kwargs)``; ``done`` gets its result. A free runner runs it on the
        spot (no closure, no Task unless it suspends)."""
        if self._busy or self._queue:
            self._queue.append((fn, args, kwargs, done))
            if not self._busy:
                self._drain()
        else:  # free and nothing waiting: run it now, without queuing it
            self._run(fn, args, kwargs, done)

    def _drain(self) -> None:
        q = self._queue
        while q:
            if self._run(*q.popleft()):
                return

    def _run(
        self,
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        done: Done,
    ) -> bool:
        """Run one call; True if it suspended (a Task now owns it and the runner is busy)."""
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            done(False, exc)
            return False
        if type(result) is not CoroutineType:
            done(True, result)
            return False
        return self.step_coroutine(result, done)

    def step_coroutine(self, result: CoroutineType[Any, Any, Any], done: Done) -> bool:
        """Step a coroutine a free runner's caller just made by calling a handler itself (see
        :meth:`idle`): as :meth:`submit_call` would; True if it suspended."""
        try:
            first = result.send(None)
        except StopIteration as stop:
            done(True, stop.value)
            return False
        except Exception as exc:
            done(False, exc)
            return False
        # It suspended: a Task resumes it; the queue waits for it.
        self._busy = True
        self.tasks_created += 1
        task = asyncio.ensure_future(_resume(result, first))

        def finished(t: asyncio.Future[Any], done: Done = done) -> None:
            self._finished(t, done)

        task.add_done_callback(finished)
        return True

    def _finished(self, task: asyncio.Future[Any], done: Done) -> None:
        self._busy = False
        if task.cancelled():
            done(False, asyncio.CancelledError())
        else:
            exc = task.exception()
            if exc is None:
                done(True, task.result())
            else:
                done(False, exc)
        self._drain()
