"""Delivered ordered calls run at this member, and their replies batched back to the callers.

Theory of operation: the driver reports each run of deliveries of a protocol step in one call
(:meth:`Dispatcher.on_delivered`). Every call goes to its actor's
:class:`~derecho_async.runtime.runner.SerialRunner`, one at a time in delivery order; a free
runner runs it on the spot. The usual call (a free runner, a plain handler returning None, a
caller elsewhere) is run and its reply batched by
:func:`~derecho_async.hotpath.dispatch_calls` (the C loop, or its pure twin where the extension
is not built); it hands each event it does not take to :meth:`Dispatcher.deliver_one`, the general path, and goes on after
it. Replies made while the driver reports a step are batched per caller and sent as one REPLIES
message each when the step's events are done (:meth:`Dispatcher.flush`). A one-way call is run
the same way and answered to nobody. See docs/DESIGN.md §7.3 and §7.4.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import CoroutineType
from typing import TYPE_CHECKING, Final, NamedTuple

from derecho_async import hotpath, wire
from derecho_async.api.actor import Actor, ActorSpec
from derecho_async.api.calls import CAST, NIL, decode_result, encode_error, exception_text
from derecho_async.errors import DerechoError, ProtocolViolation, UsageError
from derecho_async.runtime import largecall
from derecho_async.runtime.dataplane import OutOfBand
from derecho_async.runtime.runner import SerialRunner
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.api.calls import CallTable
    from derecho_async.api.membership import Membership
    from derecho_async.api.once import ClientCalls
    from derecho_async.core import Delivered
    from derecho_async.runtime.observer import GroupObserver

__all__ = ["Dispatcher", "Hosted", "Methods", "encode_outcome"]

log = logging.getLogger("derecho_async.group")

Methods = dict[str, tuple[Callable[..., object], bool]]
"""Wire name of a call -> (the bound ordered method it runs, whether it is one-way)."""

# The loop over delivered calls (Dispatcher.on_delivered): the C one, or its pure twin where
# the extension is not built (one dispatch path either way).
_dispatch_calls: Final = hotpath.dispatch_calls
_REPLIES_BYTES = 16 << 20  # result bytes in one REPLIES frame, at most (about)


class Hosted(NamedTuple):
    """One actor this member hosts, as a delivered call of its subgroup needs it.

    The native dispatch (:func:`~derecho_async.hotpath.dispatch_calls`, and its pure twin)
    reads it by position: item 1 the runner, item 3 the method table. Keep the field order."""

    spec: ActorSpec
    runner: SerialRunner
    actor: Actor
    methods: Methods  # the wire names already checked against ``spec`` (ordered_method)


class Dispatcher:
    """Runs the ordered calls delivered here and sends their outcomes back (see the module
    header); the driver's ``Host.on_delivered`` and ``Host.flush`` are its methods.

    ``hosted`` maps a subgroup to its :class:`Hosted` actor; ``versions`` is the p2p server's
    map of the last call delivered per subgroup, written here at every run of deliveries;
    ``batching`` is true while the driver reports a step's events (replies wait for
    :meth:`flush`)."""

    __slots__ = (
        "_calls",
        "_casts",
        "_check_backlog",
        "_hosted",
        "_me",
        "_observer",
        "_on_own_delivered",
        "_once",
        "_outbox",
        "_record_reply",
        "_state",
        "_versions",
        "batching",
        "record",
    )

    def __init__(self, state: Membership, hosted: dict[str, Hosted], calls: CallTable,
                 versions: dict[str, tuple[int, int]],
                 observer: GroupObserver | None,
                 once: dict[str, ClientCalls] | None = None) -> None:
        self._state = state
        self._once = once if once is not None else {}  # per subgroup: clients' calls applied
        self._me = state.me
        self._hosted = hosted
        self._calls = calls
        self._casts = calls.casts  # (the same dict: the native loop completes own casts in it)
        # (bound once: called per delivered call)
        self._record_reply = calls.record_reply
        self._on_own_delivered = calls.on_own_delivered
        self._check_backlog = calls.check_backlog
        self._versions = versions
        self._observer = observer
        # Replies made while the driver reports a step's events, per caller: sent as one
        # REPLIES message per caller when the step's events are done (flush).
        self._outbox: dict[int, list[object]] = {}
        self.batching = False
        self.record: Callable[[list[Delivered]], None] | None = None
        """Told of each run of deliveries before its calls run (the durable log), if set."""

    @staticmethod
    def method_entry(
        spec: ActorSpec, actor: Actor, methods: Methods, name: str
    ) -> tuple[Callable[..., object], bool]:
        """The (method, one-way) a call named ``name`` runs (ProtocolViolation if none)."""
        return methods.get(name) or Dispatcher.ordered_method(spec, actor, methods, name)

    @staticmethod
    def ordered_method(
        spec: ActorSpec, actor: Actor, methods: Methods, name: str
    ) -> tuple[Callable[..., object], bool]:
        """The bound ordered method a call named ``name`` runs and whether the call is one-way
        (wire name ``<Actor>.<method>.cast``); checked once per name."""
        one_way = name.endswith(CAST)
        actor_name, _, method = (name[: -len(CAST)] if one_way else name).partition(".")
        if actor_name != spec.name or method not in spec.ordered:
            raise ProtocolViolation(f"no ordered method {name!r}")
        fn: Callable[..., object] = getattr(actor, method)
        methods[name] = entry = (fn, one_way)
        return entry

    def on_delivered(self, events: list[Delivered]) -> None:
        """Run the ordered calls of a run of deliveries, in order (Host.on_delivered).

        The usual call (a free runner, a plain handler returning None, a caller elsewhere) is
        run and its reply batched without the runner's queue or a callback per message, by
        :func:`hotpath.dispatch_calls` (native or its pure twin), which hands each event it does not take to :meth:`deliver_one`, the general path, and goes on
        after it. A one-way call is run the same way and answered to nobody."""
        self.batching = True
        if self.record is not None:
            self.record(events)
        last = self._versions
        if len(self._hosted) == 1:
            ev = events[-1]
            last[ev[0]] = (ev[2], ev[3])
        else:
            for ev in events:
                last[ev[0]] = (ev[2], ev[3])
        if self._observer is not None:
            self._observer.delivered(self._me, events)
            # every outcome goes through deliver_one, which reports it
            for ev in events:
                self.deliver_one(ev)
        else:
            dispatch = _dispatch_calls
            me, hosted, casts, finish = self._me, self._hosted, self._casts, self.finish_call
            state = self._state
            i, n = 0, len(events)
            while i < n:
                # replies are batched only while the group is open (as deliver_one decides)
                outbox = (self._outbox if state.closed is None and state.driver is not None
                          else None)
                i = dispatch(events, i, me, hosted, casts, outbox, NIL, finish)
                if i < n:
                    self.deliver_one(events[i])
                    i += 1
        self._check_backlog()

    def finish_call(self, ev: Delivered, one_way: bool, ok: bool, value: object) -> None:
        """An outcome of a call the native loop ran that is not the usual one (see
        :func:`hotpath.dispatch_calls`): an exception, a coroutine, a result to send back, any
        outcome of my own call awaiting replies."""
        if not one_way and ev.sender == self._me:
            self._on_own_delivered(ev)  # its repliers and version (the general path: before)
        if type(value) is CoroutineType:
            runner = self._hosted[ev.subgroup][1]
            done = self.cast_done if one_way else functools.partial(self.reply, ev)
            runner.step_coroutine(value, done)
        elif one_way:
            self.cast_done(ok, value)
        else:
            self.reply(ev, ok, value)

    def deliver_one(self, ev: Delivered) -> None:
        """Run one delivered ordered call: the general path of :meth:`on_delivered`."""
        subgroup, _, _, _, sender, _, payload = ev
        me = self._me
        if sender == me:
            self._on_own_delivered(ev)
        hosted = self._hosted.get(subgroup)
        if hosted is None:
            return
        spec, runner, actor, methods = hosted
        observer = self._observer
        reply: Callable[[bool, object], None]
        cast_done: Callable[[bool, object], None] = self.cast_done
        if observer is not None:  # every outcome reported: no shortcuts below
            reply = functools.partial(self._observed, ev, functools.partial(self.reply, ev))
            cast_done = functools.partial(self._observed, ev, self.cast_done)
        client: tuple[ClientCalls, tuple[bytes, int]] | None = None
        if type(payload) is bytes and payload[:1] == b"\x95":  # an external client's call
            tag = wire.client_tag(payload)
            table = self._once.get(subgroup)
            if tag is not None and table is not None:
                client = (table, tag)
        try:
            if type(payload) is bytes:
                # (the usual call of a known method is the native loop's: decode_call's own
                # native pass is enough for what reaches this path)
                name, args, kwargs = wire.decode_call(payload)
            elif isinstance(payload, OutOfBand):
                if largecall.is_large(payload):  # decoded off the loop, in turn on the runner
                    if observer is None:
                        reply = functools.partial(self.reply, ev)
                    call = largecall.OffLoopCall(
                        payload, functools.partial(self.method_entry, spec, actor, methods),
                        reply, cast_done, me, sender)
                    runner.submit(call.run, call.done, payload.nbytes)
                    return
                # my own call of device arrays alone comes back as it was sent; the rest (and
                # every peer's) is decoded and its arrays checked
                own = wire.own_device_call(wire.unstamped(payload.call),
                                           payload.arrays) if sender == me else None
                name, args, kwargs = own if own is not None else wire.decode_call(
                    payload.call, buffers=list(payload.arrays))
            else:
                raise ProtocolViolation("ordered call payload is not bytes")
            entry = methods.get(name)
            if entry is None:
                entry = self.ordered_method(spec, actor, methods, name)
        except (ProtocolViolation, DerechoError) as exc:
            log.warning("member %d: undeliverable call from %d: %s", me, sender, exc)
            if client is not None:  # (answered in its turn: a copy gets the first's answer)
                runner.submit_call(self._client_turn, (ev, client, False, _raise, exc), {},
                                   functools.partial(self._client_done, ev, client, False))
                return
            self.reply(ev, False, exc)
            return
        fn, one_way = entry
        if client is not None:  # run once per (client, seq), in its turn (api/once.py)
            done = functools.partial(self._client_done, ev, client, one_way)
            if observer is not None:
                done = functools.partial(self._observed, ev, done)
            runner.submit_call(self._client_turn, (ev, client, one_way, fn, *args), kwargs,
                               done)
            return
        if observer is not None or runner.stopped:
            runner.submit_call(fn, args, kwargs, cast_done if one_way else reply)
            return
        if one_way:
            if not runner.idle():
                runner.submit_call(fn, args, kwargs, self.cast_done,
                                   len(payload) if type(payload) is bytes else 0)
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # any outcome is the call's (a SystemExit: departure)
                self.cast_done(False, exc)
                return
            if type(result) is CoroutineType:
                runner.step_coroutine(result, self.cast_done)
            return
        if not runner.idle():
            runner.submit_call(fn, args, kwargs, functools.partial(self.reply, ev),
                               len(payload) if type(payload) is bytes else 0)
            return
        # A free runner would run it on the spot: do so here (as SerialRunner._run).
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # any outcome is the call's (a SystemExit: departure)
            self.reply(ev, False, exc)
            return
        if type(result) is CoroutineType:
            runner.step_coroutine(result, functools.partial(self.reply, ev))
        elif (
            result is None
            and sender != me
            and self.batching
            and self._state.closed is None
            and self._state.driver is not None
        ):
            out = self._outbox.get(sender)
            if out is None:
                out = self._outbox[sender] = []
            out += (ev.msg_no, True, NIL)
        elif sender == me:
            self._record_reply(ev.msg_no, me, result)  # as reply does
        else:
            self.reply(ev, True, result)

    def _observed(self, ev: Delivered, then: Callable[[bool, object], None], ok: bool,
                  value: object) -> None:
        """An outcome of a delivered call, told to the observer before it goes on to ``then``."""
        if self._observer is not None:
            self._observer.handler_finished(self._me, ev.subgroup, (ev.view_id, ev.seq), ok,
                                            value)
        then(ok, value)

    # -- outcomes --------------------------------------------------------------------------
    def _client_turn(self, ev: Delivered, client: tuple[ClientCalls, tuple[bytes, int]],
                     one_way: bool, fn: Callable[..., object], *args: object,
                     **kwargs: object) -> object:
        """An external client's call, when its runner gets to it: the first delivery of its
        ``(client, seq)`` runs ``fn``; a later copy runs nothing and is answered with the
        first's outcome (the table is read here, in the runner's order, so a joiner asks it
        only once its restored table is in)."""
        table, tag = client
        kept = table.admit(*tag)
        if kept is None:
            return fn(*args, **kwargs)
        return _Kept(kept if type(kept) is tuple else None)

    def _client_done(self, ev: Delivered, client: tuple[ClientCalls, tuple[bytes, int]],
                     one_way: bool, ok: bool, value: object) -> None:
        """The outcome of an external client's call here: the first's is kept in the
        subgroup's table (retried copies get it), then answered to the relay like any call's
        (a one-way call's to nobody); a copy's is the kept one."""
        if type(value) is _Kept:
            if not one_way and value.outcome is not None:
                self._reply_raw(ev, *value.outcome)
            return
        ok, body = encode_outcome(ok, value)
        table, (who, seq) = client
        table.done(who, seq, ok, body)
        if one_way:
            self.cast_done(ok, value)
            return
        self._reply_raw(ev, ok, body)
        if isinstance(value, (SystemExit, KeyboardInterrupt)):
            self.handler_exit(value)

    def _reply_raw(self, ev: Delivered, ok: bool, body: bytes) -> None:
        """An outcome already encoded, to the caller of ``ev``."""
        if ev.sender == self._me:
            self._record_reply(ev.msg_no, self._me, decode_result(self._me, ok, body))
            return
        state = self._state
        driver = state.driver
        if driver is None or state.closed is not None:
            return
        if self.batching:
            out = self._outbox.get(ev.sender)
            if out is None:
                out = self._outbox[ev.sender] = []
            out += (ev.msg_no, ok, body)
            return
        driver.transport.send(ev.sender, env.encode(env.REPLY, ev.subgroup, ev.msg_no, ok, body))

    def cast_done(self, ok: bool, value: object) -> None:
        """A one-way call's handler finished here: nobody waits for it, so only log a failure
        (a ``SystemExit`` or ``KeyboardInterrupt`` is this member's departure)."""
        if not ok:
            exc = value if isinstance(value, BaseException) else None
            log.warning("member %d: the handler of a one-way call raised %s: %s", self._me,
                        *exception_text(value), exc_info=exc)
            if isinstance(value, (SystemExit, KeyboardInterrupt)):
                self.handler_exit(value)

    def handler_exit(self, exc: BaseException) -> None:
        """A handler raised ``SystemExit`` or ``KeyboardInterrupt``: this member leaves the
        group in order (its reply to that call is already made); its handlers run no more."""
        state = self._state
        if state.exiting is not None:
            return
        state.exiting = exc
        for hosted in self._hosted.values():
            hosted.runner.stop()
        name, text = exception_text(exc)
        reason = f"a handler raised {name}: {text}"
        log.warning("member %d: %s; leaving the group", self._me, reason)
        driver = state.driver
        if driver is not None:
            driver.leave(reason)

    def reply(self, ev: Delivered, ok: bool, value: object) -> None:
        """The outcome of delivered call ``ev`` here, to its caller."""
        if not ok and isinstance(value, (SystemExit, KeyboardInterrupt)):
            self._reply_to(ev, ok, value)
            self.handler_exit(value)  # after the reply: the caller learns what happened
            return
        self._reply_to(ev, ok, value)

    def _reply_to(self, ev: Delivered, ok: bool, value: object) -> None:
        if ev.sender == self._me:
            self._record_reply(ev.msg_no, self._me, value)
            return
        if self._state.driver is None or self._state.closed is not None:
            return
        self._reply_raw(ev, *encode_outcome(ok, value))

    def flush(self) -> None:
        """Send the replies batched while the driver reported a step's events (and hand parked
        calls to the core if the step made room): Host.flush."""
        self.batching = False
        if self._calls.parked.count:
            self._calls.unpark()
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        state = self._state
        driver = state.driver
        if driver is None or state.closed is not None:
            return
        send = driver.transport.send
        for caller, items in outbox.items():
            # items is [msg_no, ok, body, ...]: one frame per caller, split where the bodies
            # add up to _REPLIES_BYTES, so a batch of large results never makes one huge frame
            start, size = 0, 0
            for i in range(2, len(items), 3):
                size += len(items[i])  # type: ignore[arg-type]
                if size >= _REPLIES_BYTES or i + 1 == len(items):
                    self._send_replies(send, caller, items[start : i + 1])
                    start, size = i + 1, 0

    def _send_replies(self, send: Callable[[int, bytes], None], caller: int,
                      items: list[object]) -> None:
        try:
            send(caller, env.encode(env.REPLIES, items))
        except (UsageError, ValueError, OverflowError) as exc:  # e.g. a result over the frame limit
            log.warning("member %d: replies to %d could not be sent (%s): sending errors",
                        self._me, caller, exc)
            failed: list[object] = []
            for i in range(0, len(items), 3):
                failed += [items[i], False, encode_error(exc)]
            send(caller, env.encode(env.REPLIES, failed))


class _Kept:
    """What a copy of an external client's call gives in its turn: the first's outcome (None
    when none was kept: the first is somehow still running)."""

    __slots__ = ("outcome",)

    def __init__(self, outcome: tuple[bool, bytes] | None) -> None:
        self.outcome = outcome


def _raise(exc: BaseException) -> object:
    raise exc


def encode_outcome(ok: bool, value: object) -> tuple[bool, bytes]:
    """A handler's outcome as a reply carries it: ``(ok, encoded result)``, or ``(False,
    encoded [type name, message])`` for an exception or a result that does not encode."""
    try:
        if ok and value is None:
            return True, NIL
        return ok, (wire.encode(value) if ok else encode_error(value))
    except (TypeError, ValueError, OverflowError) as exc:
        return False, encode_error(exc)
