"""This member's own ordered calls, from the call to its outcome, and what a call answers.

Theory of operation: an ordered call is encoded with the msgpack codec (arrays and large byte
strings out of band) and submitted to the core; its future waits in the :class:`CallTable`
under the call's ``msg_no``. A call awaiting replies learns its version and the members whose
replies it awaits (the shard's members in the delivering view) when this member delivers it,
and completes as :class:`Replies` once every one of them answered; members that depart first
answer :class:`~derecho_async.errors.MemberFailed`. A one-way call (wire name
``<Actor>.<method>.cast``) completes with its version at that delivery. The table also applies
backpressure on both sides: calls are parked while this member's own calls in flight are at
``max_queued_calls`` or their bytes at ``max_queued_mb`` (in lanes that take turns: this
member's own calls in one, each client connection's relayed calls in its own; :mod:`.turns`),
and the member stops taking messages while its handlers lag. See docs/DESIGN.md §7.4 and §7.6.

Own bytes in flight are counted cheaply, as the count is: a call weighs its encoded size, at
least ``SMALL_CALL``; only calls over that are noted (``msg_no -> size``), the others are the
count times ``SMALL_CALL``. Calls leave ``casts`` and ``pending`` where this module cannot see
it (the native dispatch completes own one-way calls itself), so notes of completed calls are
dropped lazily: where this module removes a call, and by a sweep when the estimate (which can
only be too high) would refuse a call and calls completed since the last sweep.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from derecho_async import wire
from derecho_async.api.turns import OWN, Parked, Turns
from derecho_async.errors import (
    DerechoError,
    GroupClosed,
    MemberFailed,
    ProtocolViolation,
    QueueFull,
    UsageError,
)
from derecho_async.runtime.dataplane import MAX_ARRAYS, OutOfBand

if TYPE_CHECKING:
    from derecho_async.api.actor import ActorSpec
    from derecho_async.api.membership import Membership
    from derecho_async.core import Delivered, ShardAssignment
    from derecho_async.runtime.driver import Driver
    from derecho_async.runtime.runner import SerialRunner

__all__ = [
    "CAST",
    "NIL",
    "CallTable",
    "HandlerError",
    "Parked",
    "PendingCall",
    "Replies",
    "decode_result",
    "encode_error",
    "exception_text",
    "safe_text",
]

log = logging.getLogger("derecho_async.group")

CAST: Final = ".cast"
"""Wire name suffix of a one-way call: ``"<Actor>.<method>.cast"``."""
NIL: Final = b"\xc0"
"""msgpack None: the result of most handlers."""
SMALL_CALL: Final = 1024
"""Bytes an own call in flight weighs at least (for ``max_queued_mb``); only larger calls have
their size noted."""


class HandlerError(DerechoError):
    """A handler raised at another member: its exception type name and message."""

    def __init__(self, member: int, type_name: str, message: str) -> None:
        self.member = member
        self.type_name = type_name
        self.message = message
        super().__init__(f"member {member}: {type_name}: {message}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HandlerError) and (
            (other.member, other.type_name, other.message)
            == (self.member, self.type_name, self.message)
        )

    def __hash__(self) -> int:
        return hash((self.member, self.type_name, self.message))


R_co = TypeVar("R_co", covariant=True)


class Replies(Mapping[int, R_co | BaseException], Generic[R_co]):
    """The outcome of an ordered call: member id -> result, exception or :class:`MemberFailed`.

    ``version`` is the call's ``(view_id, seq)``, identical at every member. ``R_co`` is the
    handler's result type (``handle[KV.put]`` gives ``Replies[None]`` for a ``-> None``
    handler; ``handle.put`` gives ``Replies[Any]``). An entry is an exception when the handler
    raised at that member (the exception itself at the caller's own member, a
    :class:`HandlerError` from another) or the member left before replying
    (:class:`MemberFailed`); :meth:`raise_on_error` and :meth:`values_ok` sort them out.
    """

    def __init__(self, results: dict[int, R_co | BaseException],
                 version: tuple[int, int]) -> None:
        self._results = results  # the group hands it over (it keeps no reference)
        self._ordered = False  # sorted by member id on first iteration (most callers never do)
        self.version = version

    def _sorted(self) -> dict[int, R_co | BaseException]:
        if not self._ordered:
            self._results = dict(sorted(self._results.items()))
            self._ordered = True
        return self._results

    def __getitem__(self, member: int) -> R_co | BaseException:
        return self._results[member]

    def __iter__(self) -> Iterator[int]:
        return iter(self._sorted())

    def __len__(self) -> int:
        return len(self._results)

    def values_ok(self) -> list[R_co]:
        """The results of the members that answered without an exception, by member id (the
        handler raised at none of them; members that raised or left are left out)."""
        return [v for v in self._sorted().values() if not isinstance(v, BaseException)]

    def raise_on_error(self) -> dict[int, R_co]:
        """Every member's result, member id -> result (by member id), once no handler raised.

        If a handler raised at some member, its exception is raised instead: the one of the
        lowest member id that has one (the exception itself when that is the caller's own
        member, a :class:`HandlerError` for another; a deterministic handler raises alike
        everywhere). A member that left before replying (:class:`MemberFailed`) is not a
        handler's error: it is only left out of the result, as in :meth:`values_ok`.
        """
        results = self._sorted()
        for value in results.values():
            if isinstance(value, BaseException) and not isinstance(value, MemberFailed):
                raise value
        return {m: v for m, v in results.items() if not isinstance(v, BaseException)}

    def __repr__(self) -> str:
        return f"Replies({self._sorted()!r}, version={self.version})"


def safe_text(text: str) -> str:
    """``text`` with every code point UTF-8 cannot encode (a lone surrogate) escaped as
    ``backslashreplace`` does (``"\\udc80"``): text that always travels and logs."""
    # (str.encode: a __str__ may return a str subclass whose own encode is anything)
    return str.encode(text, "utf-8", "backslashreplace").decode("utf-8")


def exception_text(exc: object) -> tuple[str, str]:
    """A handler's exception in words that always travel: ``(type name, message)``.

    The message is ``str(exc)``, or ``"<Name: str() raised Other>"`` when that raises (the
    handler's own ``__str__`` is its code: whatever it does, the outcome is the same at every
    member); both with lone surrogates escaped (:func:`safe_text`). Nothing here raises."""
    name = type(exc).__name__
    if type(name) is not str:  # (a metaclass may make __name__ anything)
        name = "Exception"
    name = safe_text(name)
    try:
        text = str(exc)
    except BaseException as failed:  # any outcome of the handler's __str__ is its own
        text = f"<{name}: str() raised {safe_text(type(failed).__name__)}>"
    return name, safe_text(text)


def encode_error(exc: object) -> bytes:
    """A handler's exception as it travels: ``[type name, message]`` (:func:`exception_text`)."""
    return wire.encode(list(exception_text(exc)))


def decode_result(sender: int, ok: bool, body: bytes) -> object:
    """A result ``sender`` sent back: the value, or a :class:`HandlerError` for an error (the
    ``ProtocolViolation`` itself when ``body`` does not decode)."""
    try:
        value = wire.decode(body)
    except ProtocolViolation as exc:
        return exc
    if ok:
        return value
    if isinstance(value, list | tuple) and len(value) == 2:
        return HandlerError(sender, str(value[0]), str(value[1]))
    return HandlerError(sender, "Exception", repr(value))


@dataclass(slots=True)
class PendingCall:
    """A call of this member awaiting replies: whose (once delivered here), and those in."""

    future: asyncio.Future[Replies[Any]]
    expected: frozenset[int] | None = None
    version: tuple[int, int] = (0, 0)
    results: dict[int, object] = field(default_factory=dict)


class CallTable:
    """This member's own ordered calls in flight and waiting for room (see the module header).

    ``pending`` maps the msg_no of a call awaiting replies to its :class:`PendingCall`,
    ``casts`` that of a one-way call to the future of its version; the dispatcher reads both
    (the native dispatch completes own one-way calls in ``casts`` itself)."""

    __slots__ = ("_assignment", "_early_replies", "_loop", "_max_call", "_max_queued",
                 "_max_queued_bytes", "_max_small", "_noted", "_noted_bytes", "_repliers",
                 "_runners", "_sent", "_stamp", "_state", "_swept_at", "casts", "parked",
                 "paused", "pending")

    def __init__(self, state: Membership, assignment: Callable[[], ShardAssignment],
                 runners: Sequence[SerialRunner],
                 clock: Callable[[], int] = time.time_ns) -> None:
        config = state.config
        self._state = state
        self._assignment = assignment  # the current view's shards (the group's, per view)
        self._runners = tuple(runners)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the group runs on
        self._max_call = config.max_call_mb << 20  # bytes of an encoded ordered call, at most
        # a durable member's calls carry its clock (None: no stamp)
        self._stamp = clock if config.data_dir is not None else None
        self.pending: dict[int, PendingCall] = {}
        # One-way calls of mine not delivered yet: msg_no -> future of their version.
        self.casts: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self._early_replies: dict[int, dict[int, object]] = {}
        # Members per shard in the current view (whose replies an ordered call awaits).
        self._repliers: dict[tuple[str, int], frozenset[int]] = {}
        # Backpressure (see room): calls waiting for room, by lane in turns (own calls in one,
        # each client connection's in its own), and whether this member stopped taking new
        # messages because its handlers lag.
        self._max_queued = config.max_queued_calls
        self._max_queued_bytes = config.max_queued_mb << 20
        self.parked = Turns()
        self.paused = False
        # Own bytes in flight (see the module header): msg_no -> size of calls over SMALL_CALL
        # (some perhaps completed), their sum, the calls ever put in casts or pending, and how
        # many of those had left them at the last sweep of the notes.
        self._noted: dict[int, int] = {}
        self._noted_bytes = 0
        self._max_small = self._max_queued_bytes // SMALL_CALL  # small calls the bytes hold
        self._sent = 0
        self._swept_at = 0

    # -- making calls ----------------------------------------------------------------------
    def encode(
        self, wire_name: str, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[Driver, bytes | OutOfBand, int]:
        """Encode a call: (driver, payload, encoded size). UsageError when its encoding is over
        ``max_call_mb``."""
        state = self._state
        driver = state.driver
        if (driver is None or driver.core is None or state.closed is not None
                or state.view is None or state.exiting is not None):
            driver = state.check_open()  # raises why (the open group is tested inline: per call)
        core = driver.core
        assert core is not None
        arrays: list[object] = []
        # Small numpy arrays (up to a slot's worth) are copied into the call itself: they skip
        # the data plane's pool, descriptor frame and landing report, several times cheaper per
        # message; the handler gets the same owned numpy arrays either way.
        call = wire.encode_call(wire_name, args, kwargs, buffers=arrays,
                                 inline_bytes=core.config.max_payload)
        if len(arrays) > MAX_ARRAYS:
            raise UsageError(f"an ordered call carries at most {MAX_ARRAYS} arrays, not "
                             f"{len(arrays)}: pack them into fewer")
        if self._stamp is not None:  # the sender's clock: every durable member logs it so
            call = wire.stamp_call(call, self._stamp())
        oob = OutOfBand(call, tuple(arrays)) if arrays else None
        # the encoded size: large byte strings and arrays are out of band, so nothing is copied
        size = len(call) if oob is None else oob.nbytes
        if size > self._max_call:
            raise UsageError(f"an ordered call of {size} bytes encoded is over the bound of "
                             f"max_call_mb={state.config.max_call_mb} ({self._max_call} bytes)")
        return driver, (call if oob is None else oob), size

    @staticmethod
    def send(driver: Driver, subgroup: str, payload: bytes | OutOfBand,
             size: int) -> int | None:
        """Queue an encoded call in the core: its msg_no, None when this member cannot send."""
        core = driver.core
        assert core is not None
        if type(payload) is bytes:
            return core.submit(subgroup, payload)
        return core.submit(subgroup, payload, nbytes=size)  # arrays travel on the data plane

    async def ordered_call(
        self, spec: ActorSpec, wire_name: str, args: tuple[object, ...],
        kwargs: dict[str, object]
    ) -> Replies[Any]:
        """Submit an ordered call named ``wire_name`` (``<Actor>.<method>``) and await its
        replies."""
        driver, payload, size = self.encode(wire_name, args, kwargs)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[Replies[Any]] = loop.create_future()
        if not self.room(size):
            self.park(spec, payload, size, fut, one_way=False)
            return await fut
        msg_no = self.send(driver, spec.name, payload, size)
        if msg_no is None:
            raise self._state.closed or GroupClosed("this member cannot send now")
        self.pending[msg_no] = PendingCall(fut)
        self._sent += 1
        if size > SMALL_CALL:
            self.note(msg_no, size)
        driver.kick()
        return await fut

    def cast(
        self, spec: ActorSpec, wire_name: str, args: tuple[object, ...],
        kwargs: dict[str, object]
    ) -> asyncio.Future[tuple[int, int]]:
        """Submit a one-way ordered call named ``wire_name`` (``<Actor>.<method>.cast``; see
        :meth:`~derecho_async.api.handles.OrderedMethod.cast`)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        driver, payload, size = self.encode(wire_name, args, kwargs)
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        if not self.room(size):
            self.park(spec, payload, size, fut, one_way=True)
            return fut
        msg_no = self.send(driver, spec.name, payload, size)
        if msg_no is None:
            raise self._state.closed or GroupClosed("this member cannot send now")
        self.casts[msg_no] = fut
        self._sent += 1
        if size > SMALL_CALL:
            self.note(msg_no, size)
        driver.kick()
        return fut

    def relay(self, spec: ActorSpec, payload: bytes, one_way: bool,
              lane: Hashable) -> asyncio.Future[Any]:
        """Submit an external client's call (``wire.client_call`` bytes) as this member's own:
        the future of its :class:`Replies`, or of its version when ``one_way``. Backpressure as
        for this member's calls, except that without room it waits in ``lane`` (its
        connection's), taking turns with the other lanes (:mod:`.turns`); raises at once when
        this member cannot send."""
        driver = self._state.check_open()
        size = len(payload)
        if size > self._max_call:
            raise UsageError(f"an ordered call of {size} bytes encoded is over the bound of "
                             f"max_call_mb={self._state.config.max_call_mb}")
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self.room(size):
            self.park(spec, payload, size, fut, one_way=one_way, lane=lane)
            return fut
        msg_no = self.send(driver, spec.name, payload, size)
        if msg_no is None:
            raise self._state.closed or GroupClosed("this member cannot send now")
        if one_way:
            self.casts[msg_no] = fut
        else:
            self.pending[msg_no] = PendingCall(fut)
        self._sent += 1
        if size > SMALL_CALL:
            self.note(msg_no, size)
        driver.kick()
        return fut

    # -- backpressure ----------------------------------------------------------------------
    def room(self, size: int) -> bool:
        """Whether a call of ``size`` encoded bytes may go to the core now: none waits before
        it, this member takes messages (its handlers keep up: :meth:`check_backlog`), and its
        own calls not completed stay within ``max_queued_calls`` and, with this one, within
        ``max_queued_mb`` (:meth:`fits`)."""
        n = len(self.casts) + len(self.pending)
        # (the usual case inline, per call: small calls only, n + 1 of them within the bytes)
        return (not self.parked.count and not self.paused and n < self._max_queued
                and ((n < self._max_small and size <= SMALL_CALL and not self._noted)
                     or self.fits(size)))

    def note(self, msg_no: int, size: int) -> None:
        """Own call ``msg_no`` of ``size`` bytes (over ``SMALL_CALL``) went in flight."""
        noted = self._noted
        noted[msg_no] = size
        self._noted_bytes += size
        if len(noted) > 2 * (len(self.casts) + len(self.pending)) + 64:
            self._sweep()  # (most notes are of completed calls: a sweep pays for itself)

    def _forget(self, msg_no: int) -> None:
        """Own call ``msg_no`` left ``casts`` or ``pending`` here: drop its note, if any."""
        size = self._noted.pop(msg_no, 0)
        self._noted_bytes -= size

    def _sweep(self) -> None:
        """Drop the notes of calls no longer in ``casts`` or ``pending``."""
        casts, pending = self.casts, self.pending
        self._noted = {m: s for m, s in self._noted.items() if m in casts or m in pending}
        self._noted_bytes = sum(self._noted.values())
        self._swept_at = self._sent - len(casts) - len(pending)

    def in_flight_bytes(self) -> int:
        """What this member's own calls not completed weigh (for ``max_queued_mb``): each its
        encoded size, at least ``SMALL_CALL``. Exact after a sweep, never too low."""
        n = len(self.casts) + len(self.pending)
        return self._noted_bytes + (n - len(self._noted)) * SMALL_CALL

    def fits(self, size: int) -> bool:
        """Whether a call of ``size`` bytes may join this member's own calls in flight within
        ``max_queued_mb``; a call larger than the bound goes when none is in flight. Sweeps
        the notes first when the estimate refuses it and calls completed since the last."""
        n = len(self.casts) + len(self.pending)
        if n == 0:
            if self._noted:
                self._noted.clear()
                self._noted_bytes = 0
            return True
        if len(self._noted) > n and self._sent - n != self._swept_at:
            self._sweep()  # notes of completed calls for sure: the usual path comes back
        weight = max(size, SMALL_CALL)
        if self.in_flight_bytes() + weight <= self._max_queued_bytes:
            return True
        if self._sent - n != self._swept_at:  # calls completed since the last sweep
            self._sweep()
            return self.in_flight_bytes() + weight <= self._max_queued_bytes
        return False

    def park(self, spec: ActorSpec, payload: bytes | OutOfBand, size: int,
             future: asyncio.Future[Any], one_way: bool, lane: Hashable = OWN) -> None:
        """No room for a call now: wait for it in ``lane`` (in call order, in the lane's turns:
        :mod:`.turns`) or fail (``when_queue_full``; past ``max_queued_mb`` of waiting calls)."""
        config = self._state.config
        me = self._state.me
        if config.when_queue_full == "error":
            raise QueueFull(
                f"member {me}: {len(self.casts) + len(self.pending)} own calls in flight "
                f"({self.in_flight_bytes()} bytes; this one {size}) and {self.queued_calls} "
                f"delivered calls waiting for handlers here (max_queued_calls="
                f"{self._max_queued}, max_queued_mb={config.max_queued_mb}); "
                f"when_queue_full='error'")
        call = Parked(spec.name, payload, size, future, one_way, lane)
        parked = self.parked
        if parked.count and parked.bytes + call.weight > self._max_queued_bytes:
            raise QueueFull(
                f"member {me}: the calls waiting for room here reached max_queued_mb="
                f"{config.max_queued_mb} (max_queued_calls={self._max_queued}): await "
                f"earlier calls before making more")
        parked.push(call)

    def drop_lane(self, lane: Hashable, exc: BaseException) -> None:
        """Fail the calls waiting in ``lane`` with ``exc`` (its client's connection closed):
        they are never sent."""
        for call in self.parked.drop(lane):
            if not call.future.done():
                call.future.set_exception(exc)
        if self.parked.count and not self.paused:
            self.unpark()

    def unpark(self) -> None:
        """Hand parked calls to the core, in their lanes' turns, while there is room."""
        parked = self.parked
        state = self._state
        driver = state.driver
        if driver is None or state.closed is not None:
            return
        sent = False
        while parked.count and not self.paused and (
                len(self.casts) + len(self.pending) < self._max_queued):
            call = parked.head()
            if not call.future.done() and not self.fits(call.size):
                break
            parked.pop()
            if call.future.done():  # cancelled by its caller while it waited: never sent
                continue
            msg_no = self.send(driver, call.subgroup, call.payload, call.size)
            if msg_no is None:
                call.future.set_exception(
                    state.closed or GroupClosed("this member cannot send now"))
                continue
            if call.one_way:
                self.casts[msg_no] = call.future
            else:
                self.pending[msg_no] = PendingCall(call.future)
            self._sent += 1
            if call.size > SMALL_CALL:
                self.note(msg_no, call.size)
            sent = True
        if sent:
            driver.kick()

    @property
    def queued_calls(self) -> int:
        """Delivered ordered calls waiting here for their handlers (all actors)."""
        return sum(r.queued for r in self._runners)

    def check_backlog(self) -> None:
        """Stop taking new messages while the delivered calls waiting for this member's handlers
        are over ``max_queued_calls`` or ``max_queued_mb``: nothing new becomes stable anywhere
        until they drain, so every sender's calls wait (backpressure; see the README)."""
        if self.paused:
            return
        runners = self._runners
        if (sum(r.queued for r in runners) >= self._max_queued
                or sum(r.queued_bytes for r in runners) >= self._max_queued_bytes):
            driver = self._state.driver
            if driver is not None and driver.core is not None:
                self.paused = True
                driver.core.set_receiving(False)

    def on_runner_progress(self) -> None:
        """A runner took a queued call: resume taking messages once the backlog halved."""
        if self.paused:
            runners = self._runners
            if (sum(r.queued for r in runners) <= self._max_queued // 2
                    and sum(r.queued_bytes for r in runners) <= self._max_queued_bytes // 2):
                self.paused = False
                driver = self._state.driver
                if driver is not None and driver.core is not None:
                    driver.core.set_receiving(True)
                    driver.kick()
        if self.parked.count and not self.paused:
            self.unpark()

    # -- replies ---------------------------------------------------------------------------
    def complete_call(self, msg_no: int, call: PendingCall, expected: frozenset[int]) -> None:
        """Resolve pending ``call`` once every expected member replied."""
        if len(call.results) >= len(expected):  # results only ever hold expected members
            del self.pending[msg_no]
            if self._noted:
                self._forget(msg_no)
            if not call.future.done():
                call.future.set_result(Replies(call.results, call.version))
            if self.parked.count:  # room for a call that waits (replies come outside steps too)
                self.unpark()

    def record_reply(self, msg_no: int, member: int, value: object) -> None:
        """``member``'s outcome of my call ``msg_no`` (kept until the call is delivered here,
        when it learns whose replies it awaits)."""
        call = self.pending.get(msg_no)
        if call is None:
            return
        if call.expected is None:
            self._early_replies.setdefault(msg_no, {})[member] = value
            return
        if member in call.expected:
            call.results.setdefault(member, value)
            self.complete_call(msg_no, call, call.expected)

    def on_replies(self, sender: int, items: list[object]) -> None:
        """A REPLIES message: ``sender``'s outcomes of my calls as (msg_no, ok, body) triples."""
        if len(items) % 3:
            raise ProtocolViolation("a batch of replies is not (msg_no, ok, result) triples")
        it = iter(items)
        pending = self.pending
        for msg_no, ok, body in zip(it, it, it, strict=False):  # len % 3 == 0
            if type(msg_no) is not int or type(ok) is not bool or type(body) is not bytes:
                raise ProtocolViolation("malformed reply in a batch of replies")
            # None, the usual result, is what decode_result gives for NIL
            value = None if ok and body == NIL else decode_result(sender, ok, body)
            call = pending.get(msg_no)
            if call is None:
                continue
            expected = call.expected
            if expected is not None and sender in expected:  # the usual reply, as
                call.results.setdefault(sender, value)  # record_reply records it
                self.complete_call(msg_no, call, expected)
            else:
                self.record_reply(msg_no, sender, value)

    def _expected_repliers(self, subgroup: str, shard: int) -> frozenset[int]:
        members = self._repliers.get((subgroup, shard))
        if members is None:
            view = self._state.view
            if view is None:
                raise UsageError("the group has not installed a view yet")
            info = self._assignment().find(subgroup, shard)
            members = frozenset(info.members if info is not None else view.members)
            self._repliers[(subgroup, shard)] = members
        return members

    def on_own_delivered(self, ev: Delivered) -> None:
        """One of my ordered calls is delivered: its repliers and version are now known (a
        one-way call is complete)."""
        if self.casts:
            cast = self.casts.pop(ev.msg_no, None)
            if cast is not None:
                if self._noted:
                    self._forget(ev.msg_no)
                if not cast.done():
                    cast.set_result((ev.view_id, ev.seq))
                return
        call = self.pending.get(ev.msg_no)
        if call is not None:
            call.expected = self._expected_repliers(ev.subgroup, ev.shard)
            call.version = (ev.view_id, ev.seq)
            early = self._early_replies.pop(ev.msg_no, None)
            if early:
                for m, v in early.items():
                    if m in call.expected:
                        call.results.setdefault(m, v)

    # -- views and failures ----------------------------------------------------------------
    def new_view(self) -> None:
        """A view is installed: whose replies a call awaits is asked of it anew."""
        self._repliers = {}

    def on_departed(self, gone: set[int]) -> None:
        """Members ``gone`` departed: calls awaiting their replies get :class:`MemberFailed`."""
        for msg_no, call in list(self.pending.items()):
            expected = call.expected
            if expected is None:
                continue
            for m in expected - call.results.keys():
                if m in gone:
                    call.results[m] = MemberFailed(m, "left the group before replying")
            self._complete(msg_no)

    def _complete(self, msg_no: int) -> None:
        call = self.pending.get(msg_no)
        if call is not None and call.expected is not None:
            self.complete_call(msg_no, call, call.expected)

    def send_failed(self, msg_no: int, reason: str) -> None:
        """The core could not send my call ``msg_no``: it fails with :class:`GroupClosed`."""
        self._forget(msg_no)
        call = self.pending.pop(msg_no, None)
        if call is not None and not call.future.done():
            call.future.set_exception(GroupClosed(f"call not delivered: {reason}"))
        cast = self.casts.pop(msg_no, None)
        if cast is not None and not cast.done():
            cast.set_exception(GroupClosed(f"call not delivered: {reason}"))

    def fail_in_flight(self, exc: BaseException) -> None:
        """This member is out: every call sent and not completed fails with ``exc``."""
        for call in self.pending.values():
            if not call.future.done():
                call.future.set_exception(exc)
        self.pending.clear()
        for cast in self.casts.values():
            if not cast.done():
                cast.set_exception(exc)
        self.casts.clear()
        self._noted.clear()
        self._noted_bytes = 0

    def fail_parked(self, exc: BaseException) -> None:
        """This member is out: every call waiting for room fails with ``exc``."""
        for parked in self.parked.clear():
            if not parked.future.done():
                parked.future.set_exception(exc)
