# Theory of operation
# -------------------
# ``VirtualTimeLoop`` is the stdlib ``asyncio.BaseEventLoop`` with its two contacts with the outside
# world replaced: the clock and the I/O poll. ``time()`` returns a virtual clock that starts at 0.0
# and moves only when the loop has nothing else to do. ``BaseEventLoop._run_once`` computes how
# long it may block (0 when a callback is ready, the gap to the earliest timer otherwise, None when
# there is neither) and calls ``self._selector.select(timeout)``; here the selector is a tiny
# object whose ``select`` moves the virtual clock forward by exactly that gap (to the earliest
# timer's due time, bit for bit) and reports no I/O. So a program that sleeps for hours runs in
# the wall time its callbacks take, and a ``select(None)``, where blocking would be forever, is
# reported as :class:`SimulationStalled` instead of hanging. An optional bound on virtual time
# (``max_virtual_s``) turns a livelock (timers firing for ever) into :class:`VirtualTimeExceeded`.
#
# Determinism: callbacks run in the stdlib's order (ready callbacks FIFO, then due timers); ties
# between timers due at the same instant are broken by the order in which they were scheduled
# (the stdlib's heap leaves that order unspecified). ``run_in_executor`` runs the function inline
# and returns a completed future, so no thread ever runs user code. The loop is single-threaded:
# ``call_soon_threadsafe`` from another thread is refused, and everything that needs real I/O
# (readers, sockets, pipes, subprocesses, signals, name lookups) raises NotImplementedError.
# Nothing in this module reads the wall clock or draws random numbers: the same program gives the
# same sequence of callbacks at the same virtual instants.
"""A virtual-time asyncio event loop for deterministic simulation (no wall-clock waiting)."""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import math
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, NoReturn, TypeVar, TypeVarTuple, Unpack

__all__ = ["SimulationStalled", "VirtualTimeExceeded", "VirtualTimeLoop", "run_virtual"]

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

#: Timers due within this many virtual seconds of ``time()`` are run (the stdlib's
#: ``_clock_resolution``; fixed here so a run does not depend on the platform's clock; raised
#: to the spacing of floats near ``time()`` where that is larger).
CLOCK_RESOLUTION = 1e-9


class SimulationStalled(RuntimeError):
    """No callback is ready and no timer is scheduled: nothing can ever happen again."""


class VirtualTimeExceeded(RuntimeError):
    """Virtual time would pass the loop's ``max_virtual_s`` bound."""


class _TimerHandle(asyncio.TimerHandle):
    """A timer ordered by (due time, scheduling order): ties fire first come, first served."""

    __slots__ = ("_seq",)

    def __init__(
        self,
        when: float,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        context: contextvars.Context | None,
        seq: int,
    ) -> None:
        super().__init__(when, callback, args, loop, context)
        self._seq = seq

    def __lt__(self, other: object) -> bool:
        if isinstance(other, _TimerHandle):
            return (self.when(), self._seq) < (other.when(), other._seq)
        return super().__lt__(other)  # type: ignore[operator]


class _VirtualSelector:
    """Stands in for the selector ``BaseEventLoop._run_once`` polls: it advances virtual time."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        self._loop._advance(timeout)
        return []

    def close(self) -> None:
        """Nothing to release."""


def _refuse(name: str) -> Callable[..., NoReturn]:
    def refused(self: VirtualTimeLoop, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"VirtualTimeLoop.{name}: the virtual-time loop does no real I/O (sockets, pipes,"
            " subprocesses, signals, name lookups); simulate it (e.g. with"
            " derecho_async.testing.simnet) or use a real event loop"
        )

    refused.__name__ = refused.__qualname__ = name
    return refused


class VirtualTimeLoop(asyncio.BaseEventLoop):
    """An asyncio event loop whose clock is virtual (see the module header).

    ``time()`` starts at 0.0 and jumps straight to the next timer whenever no callback is ready.
    ``max_virtual_s`` (None: unbounded) bounds virtual time: passing it raises
    :class:`VirtualTimeExceeded` out of ``run_until_complete`` / ``run_forever``. A loop with
    nothing ready and no timer raises :class:`SimulationStalled` the same way.
    """

    def __init__(self, *, max_virtual_s: float | None = None) -> None:
        super().__init__()
        self._now = 0.0
        self._max_virtual_s = max_virtual_s
        self._selector = _VirtualSelector(self)
        self._clock_resolution = CLOCK_RESOLUTION
        self._timer_seq = itertools.count()
        self._task_seq = itertools.count()
        # creation order of the tasks made through create_task (cancelled in that order at exit)
        self._task_order: weakref.WeakKeyDictionary[asyncio.Task[Any], int] = (
            weakref.WeakKeyDictionary()
        )

    # -- the clock ---------------------------------------------------------------------------
    def time(self) -> float:
        """Virtual seconds since the loop was made."""
        return self._now

    @property
    def max_virtual_s(self) -> float | None:
        """The bound on virtual time (None: unbounded)."""
        return self._max_virtual_s

    def _advance(self, timeout: float | None) -> None:
        """Move the clock by ``timeout`` (what ``_run_once`` would block for)."""
        if timeout is None:
            raise SimulationStalled(self._stall_report())
        if timeout <= 0:
            return
        target = self._now + timeout
        scheduled: list[asyncio.TimerHandle] = self._scheduled  # type: ignore[attr-defined]
        if scheduled:
            # _run_once computed timeout = when - now: land on ``when`` exactly (no rounding)
            when = scheduled[0].when()
            if when - self._now == timeout:
                target = when
        if self._max_virtual_s is not None and target > self._max_virtual_s:
            raise VirtualTimeExceeded(
                f"virtual time would pass the bound of {self._max_virtual_s} s "
                f"(now {self._now} s, next timer at {target} s)"
            )
        self._now = target
        # _run_once runs the timers due before now + resolution: keep that strictly above now
        # even where a float's spacing exceeds the base resolution (virtual times of ~1e7 s on)
        self._clock_resolution = max(CLOCK_RESOLUTION, math.ulp(target))

    def _stall_report(self) -> str:
        tasks = sorted(asyncio.all_tasks(self), key=self._creation_key)
        waiting = "; ".join(repr(t) for t in tasks[:8])
        more = f" (and {len(tasks) - 8} more)" if len(tasks) > 8 else ""
        return (
            f"simulation stalled at virtual time {self._now} s: no callback is ready and no timer"
            f" is scheduled, so nothing can happen again. Waiting tasks: {waiting or 'none'}{more}"
        )

    # -- scheduling --------------------------------------------------------------------------
    def call_at(
        self,
        when: float,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        """Schedule ``callback(*args)`` at virtual time ``when`` (ties: first scheduled first)."""
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]
        if self.get_debug():
            self._check_thread()  # type: ignore[attr-defined]
            self._check_callback(callback, "call_at")  # type: ignore[attr-defined]
        timer = _TimerHandle(when, callback, args, self, context, next(self._timer_seq))
        if timer._source_traceback:  # type: ignore[attr-defined]
            del timer._source_traceback[-1]  # type: ignore[attr-defined]
        heapq.heappush(self._scheduled, timer)  # type: ignore[attr-defined]
        timer._scheduled = True  # type: ignore[attr-defined]
        return timer

    def call_soon_threadsafe(
        self,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: contextvars.Context | None = None,
    ) -> asyncio.Handle:
        """``call_soon`` for the loop's own thread; other threads are refused (determinism)."""
        owner = self._thread_id  # type: ignore[attr-defined]
        if owner is not None and owner != threading.get_ident():
            raise NotImplementedError(
                "VirtualTimeLoop is single-threaded: another thread may not schedule callbacks"
                " on it (virtual time would not wait for that thread)"
            )
        return self.call_soon(callback, *args, context=context)

    def create_task(
        self,
        coro: Generator[Any, None, _T] | Coroutine[Any, Any, _T],
        *,
        name: object = None,
        context: contextvars.Context | None = None,
        **kwargs: Any,
    ) -> asyncio.Task[_T]:
        """Create a task, remembering its creation order (leftovers are cancelled in it)."""
        task = super().create_task(coro, name=name, context=context, **kwargs)
        self._task_order[task] = next(self._task_seq)
        return task

    def _creation_key(self, task: asyncio.Task[Any]) -> tuple[int, str]:
        return (self._task_order.get(task, -1), task.get_name())

    def tasks_in_creation_order(self) -> list[asyncio.Task[Any]]:
        """The loop's unfinished tasks, oldest first (tasks not made by ``create_task`` first)."""
        return sorted(asyncio.all_tasks(self), key=self._creation_key)

    def run_in_executor(
        self, executor: Any, func: Callable[[Unpack[_Ts]], _T], *args: *_Ts
    ) -> asyncio.Future[_T]:
        """Run ``func(*args)`` now, inline, and return a completed future of its outcome.

        ``executor`` is ignored: no thread runs user code, so the outcome is deterministic.
        """
        self._check_closed()  # type: ignore[attr-defined]
        fut: asyncio.Future[_T] = self.create_future()
        try:
            result = func(*args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
        return fut

    # -- what BaseEventLoop leaves to subclasses ------------------------------------------------
    def _process_events(self, event_list: list[Any]) -> None:
        """No I/O events: the virtual selector never reports any."""

    def _write_to_self(self) -> None:
        """Nothing to wake: the loop never blocks in wall time and has one thread."""

    def close(self) -> None:
        """Close the loop (it must not be running)."""
        super().close()
        self._selector.close()

    # -- real I/O is refused ---------------------------------------------------------------------
    def add_reader(
        self, fd: Any, callback: Callable[[Unpack[_Ts]], Any], *args: *_Ts
    ) -> NoReturn:
        """Refused: no file descriptors are polled."""
        _refuse("add_reader")(self)

    def add_writer(
        self, fd: Any, callback: Callable[[Unpack[_Ts]], Any], *args: *_Ts
    ) -> NoReturn:
        """Refused: no file descriptors are polled."""
        _refuse("add_writer")(self)

    def add_signal_handler(
        self, sig: int, callback: Callable[[Unpack[_Ts]], Any], *args: *_Ts
    ) -> NoReturn:
        """Refused: signals are real-world events."""
        _refuse("add_signal_handler")(self)

    remove_reader = _refuse("remove_reader")
    remove_writer = _refuse("remove_writer")
    remove_signal_handler = _refuse("remove_signal_handler")
    getaddrinfo = _refuse("getaddrinfo")
    getnameinfo = _refuse("getnameinfo")
    create_connection = _refuse("create_connection")
    create_server = _refuse("create_server")
    create_unix_connection = _refuse("create_unix_connection")
    create_unix_server = _refuse("create_unix_server")
    create_datagram_endpoint = _refuse("create_datagram_endpoint")
    connect_accepted_socket = _refuse("connect_accepted_socket")
    connect_read_pipe = _refuse("connect_read_pipe")
    connect_write_pipe = _refuse("connect_write_pipe")
    subprocess_exec = _refuse("subprocess_exec")
    subprocess_shell = _refuse("subprocess_shell")
    sock_recv = _refuse("sock_recv")
    sock_recv_into = _refuse("sock_recv_into")
    sock_recvfrom = _refuse("sock_recvfrom")
    sock_recvfrom_into = _refuse("sock_recvfrom_into")
    sock_sendall = _refuse("sock_sendall")
    sock_sendto = _refuse("sock_sendto")
    sock_connect = _refuse("sock_connect")
    sock_accept = _refuse("sock_accept")
    sock_sendfile = _refuse("sock_sendfile")
    sendfile = _refuse("sendfile")
    start_tls = _refuse("start_tls")


def run_virtual(main: Callable[[], Awaitable[_T]], *, max_virtual_s: float | None = 3600.0) -> _T:
    """Run ``main()`` to completion on a fresh :class:`VirtualTimeLoop` and return its result.

    ``main`` is called on the running loop (so what it creates binds to that loop). Tasks still
    unfinished when it returns are cancelled, oldest first, and given the chance to finish; then
    async generators are shut down and the loop is closed. Raises :class:`VirtualTimeExceeded`
    if virtual time would pass ``max_virtual_s`` (None: no bound), :class:`SimulationStalled` if
    everything waits on something that can never happen, or whatever ``main`` raised.
    """
    loop = VirtualTimeLoop(max_virtual_s=max_virtual_s)

    async def outer() -> _T:
        return await main()

    ok = False
    try:
        result = loop.run_until_complete(outer())
        ok = True
        return result
    finally:
        try:
            _finish(loop)
        except Exception:
            if ok:  # the program succeeded but left tasks that could not end: say so
                raise
            # otherwise the program's own error is the one to see
        finally:
            loop.close()


def _finish(loop: VirtualTimeLoop) -> None:
    """Cancel leftover tasks (oldest first), wait for them, shut async generators down."""
    leftovers = loop.tasks_in_creation_order()
    for task in leftovers:
        task.cancel()
    if leftovers:
        outcomes = loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        for task, outcome in zip(leftovers, outcomes, strict=True):
            if isinstance(outcome, BaseException) and not isinstance(
                outcome, asyncio.CancelledError
            ):
                loop.call_exception_handler(
                    {
                        "message": "unhandled exception in a task cancelled by run_virtual",
                        "exception": outcome,
                        "task": task,
                    }
                )
    loop.run_until_complete(loop.shutdown_asyncgens())
