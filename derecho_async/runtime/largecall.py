"""Large ordered calls: their byte strings are made into bytes off the event loop.

Theory of operation: a byte string longer than ``wire.LARGE_BYTES`` in an ordered call travels
out of band (a "bytes" buffer), so the call arrives as an :class:`OutOfBand` payload whose
array is a one-dimensional uint8 numpy array; decoding it copies the whole argument into a new
bytes object. When such arrays add up to :data:`OFF_LOOP_BYTES` or more, the group does not
decode the call on the loop: :class:`OffLoopCall` is queued on the actor's
:class:`~derecho_async.runtime.runner.SerialRunner` as a coroutine that decodes in the loop's
default executor (the copy runs with the GIL released where the native hot path is built),
then runs the handler on the loop. The runner keeps the actor's calls in delivery order (later
calls wait behind this one) while the loop, its heartbeats and other actors' calls go on.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from types import CoroutineType
from typing import Any, Final

from derecho_async import wire
from derecho_async.errors import DerechoError, ProtocolViolation
from derecho_async.runtime.dataplane import OutOfBand

__all__ = ["OFF_LOOP_BYTES", "OffLoopCall", "is_large"]

log = logging.getLogger("derecho_async.group")

OFF_LOOP_BYTES: Final = 4 << 20
"""Bytes of uint8 buffers in one call from which it is decoded off the event loop."""


def is_large(payload: OutOfBand) -> bool:
    """Whether decoding ``payload`` copies :data:`OFF_LOOP_BYTES` or more: its one-dimensional
    uint8 numpy arrays (what "bytes" buffers arrive as) add up to that much, views of a bytes
    object (this member's own call: decoded without a copy) not counted."""
    np: Any = sys.modules.get("numpy")
    if np is None:
        return False
    total = 0
    for a in payload.arrays:
        if type(a) is np.ndarray:
            arr: Any = a
            if arr.ndim == 1 and arr.dtype.str == "|u1" and type(arr.base) is not bytes:
                total += arr.nbytes
    return total >= OFF_LOOP_BYTES


Entry = tuple[Callable[..., object], bool]
"""(the bound ordered method a call runs, whether it is one-way)."""


class OffLoopCall:
    """One delivered call decoded off the loop, then run; submit :meth:`run` and :meth:`done`
    to the actor's runner (``runner.submit(call.run, call.done)``).

    ``resolve(name)`` gives the method a wire name runs (ProtocolViolation when there is none);
    ``reply(ok, value)`` answers a call awaiting replies, ``cast_done(ok, value)`` a one-way
    call's outcome. A call that cannot be decoded or resolved is logged and answered with the
    error, as the group's general path does."""

    __slots__ = ("_cast_done", "_me", "_one_way", "_payload", "_reply", "_resolve", "_sender",
                 "_undeliverable")

    def __init__(self, payload: OutOfBand, resolve: Callable[[str], Entry],
                 reply: Callable[[bool, object], None],
                 cast_done: Callable[[bool, object], None], me: int, sender: int) -> None:
        self._payload = payload
        self._resolve = resolve
        self._reply = reply
        self._cast_done = cast_done
        self._me = me
        self._sender = sender
        self._one_way = False
        self._undeliverable: BaseException | None = None

    async def run(self) -> object:
        """Decode in the executor, then run the handler here (awaiting it if it is async)."""
        payload = self._payload
        try:
            name, args, kwargs = await asyncio.get_running_loop().run_in_executor(
                None, wire.decode_call, payload.call, list(payload.arrays))
            fn, self._one_way = self._resolve(name)
        except (ProtocolViolation, DerechoError) as exc:
            self._undeliverable = exc
            return None
        self._payload = None  # type: ignore[assignment]  # the handler may drop the arguments
        result = fn(*args, **kwargs)
        del args, kwargs
        if type(result) is CoroutineType:
            result = await result
        return result

    def done(self, ok: bool, value: object) -> None:
        """The runner's report of :meth:`run`: answer the call."""
        exc = self._undeliverable
        if exc is not None:
            log.warning("member %d: undeliverable call from %d: %s", self._me, self._sender, exc)
            self._reply(False, exc)
        elif self._one_way:
            self._cast_done(ok, value)
        else:
            self._reply(ok, value)
