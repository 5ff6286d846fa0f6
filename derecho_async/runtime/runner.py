"""Runs an actor's handlers one at a time, in delivery order, without a Task per message.

Theory of operation: each delivered call is queued on its actor's :class:`SerialRunner`. When the
runner is free it starts the handler on the spot: a plain function runs to completion; a
coroutine is stepped by hand with ``send(None)``. If it finishes without suspending, which is the
common case for handlers that only touch memory, its result is reported synchronously and no
Task or Future is created. Only a handler that really suspends (it awaited an unfinished future)
is handed to a Task that resumes it exactly where it stopped; the runner stays busy until that
Task ends, then carries on with the queue. Every outcome goes to a completion callback: a
result, an ``Exception`` or any other ``BaseException`` (cancellation, ``SystemExit``): nothing a
handler raises escapes the runner, so a caller never loses the calls queued behind it.

A *hold* (:meth:`SerialRunner.submit_hold`) is a queue item that is no call: when the runner
reaches it, it hands a ``release`` function to its owner and runs nothing more until that is
called. The group uses holds as fences: at a view that admits joiners, a sponsor's hold is
reached exactly when every call delivered before that view has finished (the snapshot is taken
there); a joiner's hold keeps every call of its first view waiting until its state is restored.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from types import CoroutineType
from typing import Any

__all__ = ["Done", "SerialRunner"]

Done = Callable[[bool, object], None]
"""``done(ok, value_or_exception)``."""


class _Yielded:
    """Awaitable that re-yields what a hand-stepped coroutine yielded, so a Task can wait on it."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __await__(self) -> Generator[Any, None, None]:
        yield self.value


async def _resume(coro: Coroutine[Any, Any, Any], first: object) -> tuple[bool, object]:
    """Continue a coroutine that suspended once under hand stepping, until it ends; its outcome
    as ``(ok, value)``. It never raises: a ``BaseException`` the handler raises is its outcome
    (raised out of a Task, ``SystemExit`` and ``KeyboardInterrupt`` would stop the loop)."""
    pending = first
    while True:
        try:
            await _Yielded(pending)
        except BaseException as exc:  # cancellation or an error delivered to the awaiter
            try:
                pending = coro.throw(exc)
            except StopIteration as stop:
                return True, stop.value
            except BaseException as raised:
                return False, raised
            continue
        try:
            pending = coro.send(None)
        except StopIteration as stop:
            return True, stop.value
        except BaseException as raised:
            return False, raised


_NO_ARGS: tuple[object, ...] = ()
_NO_KWARGS: dict[str, object] = {}


class _Hold:
    """A queued hold: ``reached(release)`` when the runner gets to it (see the module header)."""

    __slots__ = ("reached",)

    def __init__(self, reached: Callable[[Callable[[], None]], None]) -> None:
        self.reached = reached


_Item = tuple[Callable[..., object] | _Hold, tuple[object, ...], dict[str, object], Done, int]


def _no_done(ok: bool, value: object) -> None:
    return None


class SerialRunner:
    """Runs queued calls one at a time, in order (one runner per actor)."""

    __slots__ = ("_busy", "_queue", "queued_bytes", "stopped", "tasks_created", "watcher")

    def __init__(self) -> None:
        self._queue: deque[_Item] = deque()
        self._busy = False
        self.tasks_created = 0
        #: bytes of the calls waiting in the queue (what their submitters said they weigh)
        self.queued_bytes = 0
        #: called after each queued item was taken (backpressure watches the queue shrink)
        self.watcher: Callable[[], None] | None = None
        self.stopped = False

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def queued(self) -> int:
        """Items waiting (not the one running)."""
        return len(self._queue)

    def idle(self) -> bool:
        """Nothing runs or waits: a caller may run a handler on the spot itself, as
        :meth:`submit_call` would, and hand a coroutine it returns to :meth:`step_coroutine`."""
        return not self._busy and not self._queue and not self.stopped

    def submit(self, call: Callable[[], object], done: Done, nbytes: int = 0) -> None:
        """Queue ``call`` (a plain call or one returning a coroutine); ``done`` gets its result."""
        self.submit_call(call, _NO_ARGS, _NO_KWARGS, done, nbytes)

    def submit_call(
        self,
        fn: Callable[..., object],
        args: tuple[object, ...],
        kwargs: dict[str, object],
        done: Done,
        nbytes: int = 0,
    ) -> None:
        """Queue ``fn(*args, **kwargs)`` (weighing ``nbytes`` while it waits); ``done`` gets its
        outcome. A free runner runs it on the spot (no closure, no Task unless it suspends)."""
        if self.stopped:
            return
        if self._busy or self._queue:
            self._queue.append((fn, args, kwargs, done, nbytes))
            self.queued_bytes += nbytes
            if not self._busy:
                self._drain()
        else:  # free and nothing waiting: run it now, without queuing it
            self._run(fn, args, kwargs, done)

    def submit_hold(self, reached: Callable[[Callable[[], None]], None]) -> None:
        """Queue a hold: ``reached(release)`` is called once every item queued before it has
        finished; nothing queued after it runs until ``release()`` is called (see the module
        header). ``reached`` may call ``release`` at once."""
        if self.stopped:
            return
        self._queue.append((_Hold(reached), _NO_ARGS, _NO_KWARGS, _no_done, 0))
        if not self._busy:
            self._drain()

    def stop(self) -> None:
        """Run nothing more: drop what waits (the member is leaving the group)."""
        self.stopped = True
        self._queue.clear()
        self.queued_bytes = 0

    def _drain(self) -> None:
        q = self._queue
        while q and not self._busy:
            fn, args, kwargs, done, nbytes = q.popleft()
            self.queued_bytes -= nbytes
            if type(fn) is _Hold:
                self._hold(fn)
            else:
                self._run(fn, args, kwargs, done)  # type: ignore[arg-type]
            watcher = self.watcher
            if watcher is not None:
                watcher()

    def _hold(self, hold: _Hold) -> None:
        self._busy = True
        released = False
        inside = True

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._busy = False
            if not inside:
                self._drain()

        hold.reached(release)
        inside = False

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
        except BaseException as exc:
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
        except BaseException as exc:
            done(False, exc)
            return False
        # It suspended: a Task resumes it; the queue waits for it.
        self._busy = True
        self.tasks_created += 1
        task = asyncio.ensure_future(_resume(result, first))

        def finished(t: asyncio.Future[tuple[bool, object]], done: Done = done) -> None:
            self._finished(t, done)

        task.add_done_callback(finished)
        return True

    def _finished(self, task: asyncio.Future[tuple[bool, object]], done: Done) -> None:
        self._busy = False
        if task.cancelled():  # cancelled before it first ran (the loop is shutting down)
            done(False, asyncio.CancelledError())
        else:
            ok, value = task.result()
            done(ok, value)
        if not self._busy:
            self._drain()
