"""The group's loop over a run of delivered calls: the pure twin of ``native/dispatch.c``.

:func:`dispatch_calls` runs the usual ordered calls on idle runners and hands every other
outcome to the caller's ``finish``; the shapes it reads are those :mod:`derecho_async.hotpath`
documents (see docs/DESIGN.md §7.3, §8.3).
"""

from __future__ import annotations

from collections.abc import Callable
from types import CoroutineType
from typing import Any

from derecho_async._hotpath_pure.plaincall import decode_plain_call

__all__ = ["dispatch_calls"]

_I64_LO, _I64_HI = -(1 << 63), (1 << 63) - 1
_MISSING: Any = object()


def dispatch_calls(
    events: list[Any],
    start: int,
    me: int,
    hosted: dict[str, Any],
    casts: dict[int, Any],
    outbox: dict[int, list[object]] | None,
    nil: bytes,
    finish: Callable[[Any, bool, bool, object], object],
    /,
) -> int:
    """The usual ordered calls of a run of deliveries, run in order from ``events[start]`` on,
    as ``Group.on_delivered``'s general path runs them; returns the index of the first event it
    does not take (``len(events)`` when it takes them all), before any effect of that event.

    ``events`` holds Delivered 7-tuples ``(subgroup, shard, view_id, seq, sender, msg_no,
    payload)``; ``hosted`` maps a hosted subgroup to a 4-tuple whose item 1 is its runner (with
    ``idle()``) and item 3 its method table (wire name -> ``(fn, one_way)``, one_way a bool);
    ``casts`` maps msg_no of this member's one-way calls to their futures; ``outbox`` maps a
    caller to its batched replies (``[msg_no, ok, body, ...]``), None when no reply may be
    batched. An event is taken when:

    * its sender is not ``me`` and ``hosted`` lacks its subgroup (nothing to run: skipped); or
    * its payload is bytes :func:`decode_plain_call` decodes, whose method is in the table, and
      whose runner is idle (see below); and, for a call of ``me``, ``casts`` holds its msg_no exactly when
      it is one-way; and, for another's call awaiting replies, ``outbox`` is not None.

    Whether a runner is idle is asked (``idle() is True``) at the first call on it and again
    only after a call to ``finish`` or a call on another runner: only ``finish`` may step a
    coroutine on it, nothing else a handler can reach moves a runner. A taken one-way call of
    ``me`` first pops its future from ``casts`` and, unless it is done, sets its result to
    ``(view_id, seq)``. Then ``fn(*args)`` runs. A one-way call's result is
    dropped unless it is a coroutine; another's call awaiting replies that returns None gets
    ``msg_no, True, nil`` appended to ``outbox[sender]`` (a new list for a new sender). The
    other outcomes go to ``finish(ev, one_way, ok, value)``: anything the handler raised
    (``ok`` False, the exception: any ``BaseException``, cancellation and ``SystemExit``
    included), a coroutine (to step on the runner), another result of a call awaiting replies,
    and every result of a call of ``me`` awaiting replies (None included: the caller records
    its own reply). Anything ``finish`` raises propagates."""
    if not isinstance(events, list) or not isinstance(hosted, dict) or (
        not isinstance(casts, dict) or (outbox is not None and not isinstance(outbox, dict))
    ):
        raise TypeError(
            "dispatch_calls: events must be a list, hosted and casts dicts, outbox a dict or None"
        )
    if not isinstance(start, int) or not isinstance(me, int):
        raise TypeError("dispatch_calls: start and me must be ints")
    if not _I64_LO <= start <= _I64_HI or not _I64_LO <= me <= _I64_HI:
        raise OverflowError("dispatch_calls: start or me is not an int64")
    if start < 0:
        raise ValueError("dispatch_calls: start must be at least 0")
    i = start
    idle_runner: Any = None  # the runner last found idle, until a finish call
    while i < len(events):
        ev = events[i]
        if not isinstance(ev, tuple) or len(ev) != 7:
            break
        subgroup, _, view_id, seq, sender, msg_no, payload = ev
        if type(sender) is not int or type(subgroup) is not str:
            break
        if not _I64_LO <= sender <= _I64_HI:
            break
        own = sender == me
        entry = hosted.get(subgroup, _MISSING)
        if entry is _MISSING:
            if own:
                break
            i += 1
            continue
        if not isinstance(entry, tuple) or len(entry) != 4 or not isinstance(entry[3], dict):
            break
        runner, methods = entry[1], entry[3]
        cast: Any = _MISSING
        if own:
            cast = casts.get(msg_no, _MISSING)
        if type(payload) is not bytes:
            break
        plain = decode_plain_call(payload)
        if plain is None:
            break
        fe = methods.get(plain[0], _MISSING)
        if not isinstance(fe, tuple) or len(fe) != 2 or (fe[1] is not True and fe[1] is not False):
            break
        fn, one_way = fe
        if (one_way != (cast is not _MISSING)) if own else (not one_way and outbox is None):
            break
        if runner is not idle_runner:  # asked once until a finish (nothing else changes it)
            if runner.idle() is not True:
                break
            idle_runner = runner
        if cast is not _MISSING:
            del casts[msg_no]
            if not cast.done():
                cast.set_result((view_id, seq))
        try:
            result = fn(*plain[1])
        except BaseException as exc:
            idle_runner = None
            finish(ev, one_way, False, exc)
        else:
            if one_way and type(result) is not CoroutineType:
                pass
            elif not one_way and result is None and not own:
                assert outbox is not None
                out = outbox.get(sender)
                if out is None:
                    out = outbox[sender] = []
                if not isinstance(out, list):
                    raise TypeError("dispatch_calls: an outbox entry is not a list")
                out += (msg_no, True, nil)
            else:
                idle_runner = None
                finish(ev, one_way, True, result)
        i += 1
    return i
