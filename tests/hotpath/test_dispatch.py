"""Call dispatch of the twins: dispatch_calls runs the same handlers, stops at the same event
and hands on the same outcomes (derecho_async/_hotpath_pure/dispatch.py)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from derecho_async import wire
from tests.hotpath.twins import SETTINGS, native, needs_native, packed, plain_args

# -- dispatch_calls ------------------------------------------------------------------------------


class _Stop(BaseException):
    """Not an Exception: like CancelledError or SystemExit, it is still the call's outcome."""


class _Runner:
    """A runner whose idle() answers from a script (what SerialRunner.idle would say), and
    False once a coroutine was stepped on it (it suspended: the runner is busy)."""

    def __init__(self, answers: list[object]) -> None:
        self.answers = answers
        self.busy = False

    def idle(self) -> object:
        if self.busy:
            return False
        return self.answers.pop(0) if self.answers else True


async def _suspends() -> None:
    pass


def _dispatch_world(case: dict[str, Any], log: list[object]) -> dict[str, Any]:
    """Fresh state for one run of dispatch_calls: handlers that log what they are called with,
    real futures (of a loop that is never run) for this member's one-way calls."""

    def handler(name: str) -> Callable[..., object]:
        def fn(*args: object) -> object:
            log.append(("call", name, args))
            if name == "boom":
                raise ValueError(f"boom{args!r}")
            if name == "stop":
                raise _Stop("stop")
            if name == "value":
                return ("value", args)
            if name == "coro":
                return _suspends()
            return None

        return fn

    methods: dict[str, object] = {}
    for name in ("put", "boom", "stop", "value", "coro"):
        methods[f"A.{name}"] = (handler(name), False)
        methods[f"A.{name}.cast"] = (handler(name), True)
    methods["A.odd"] = (handler("put"), 1)  # not a bool: the general path takes it
    methods["A.short"] = (handler("put"),)
    hosted: dict[str, Any] = {"A": (None, _Runner(list(case["idle"])), None, methods)}
    if case["odd_hosted"]:
        hosted["C"] = ("not", "a", "table")
    loop = case["loop"]
    casts = {no: loop.create_future() for no in case["casts"]}
    for no in case["done_casts"]:
        if no in casts:
            casts[no].set_result("earlier")
    outbox: dict[int, list[object]] | None = (
        {1: ["old"]} if case["outbox"] else None
    )

    def finish(ev: Any, one_way: bool, ok: bool, value: object) -> None:
        if type(value).__name__ == "coroutine":
            value.close()  # type: ignore[attr-defined]
            value = "a coroutine"
            hosted["A"][1].busy = True  # as if it suspended on the runner
        log.append(("finish", ev, one_way, ok, repr(value)))
        if case["finish_raises"]:
            raise RuntimeError("finish failed")

    return {"hosted": hosted, "casts": casts, "outbox": outbox, "finish": finish}


_dispatch_methods = st.sampled_from(
    ["A.put"] * 4 + ["A.put.cast"] * 4
    + ["A.boom", "A.boom.cast", "A.stop.cast", "A.value", "A.value.cast", "A.coro",
       "A.coro.cast", "A.odd", "A.short", "A.missing", "B.put"]
)


@st.composite
def dispatch_cases(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly the usual calls (so runs of them are taken), now and then something the loop must
    leave to the general path, or must refuse."""
    usual = draw(st.booleans())  # only the usual calls: long runs the loop takes whole
    usual_casts: set[int] = set()  # their own one-way calls' futures
    events: list[object] = []
    for i in range(draw(st.integers(0, 10))):
        kind = draw(st.sampled_from(["call"] * 12 + ["other payload", "short", "not a tuple"]))
        if usual:
            method = draw(st.sampled_from(["A.put", "A.put.cast"]))
            sender = draw(st.sampled_from([0, 1, 2]))
            if sender == 2 and method == "A.put.cast":
                usual_casts.add(i)
            call = packed([method, draw(st.lists(plain_args, max_size=3)), {}])
            if draw(st.booleans()):  # with its sender's clock
                call = wire.stamp_call(call, draw(st.integers(0, (1 << 64) - 1)))
            events.append(("A", 0, 7, i, sender, i, call))
            continue
        if kind == "not a tuple":
            events.append(["A", 0, 1, 2, 1, 3, b""])
            continue
        if kind == "other payload":
            payload: object = draw(st.sampled_from([
                bytearray(b"\x93"), None, b"", b"\xc0",
                b"\x93\xa2\xff\xfe\x90\x80",  # a method that is not UTF-8
                packed(["A." + "x" * 70, [], {}]),  # a long method name, not in the table
                packed(["A.put", [], {"k": 1}]),  # kwargs: not the plain call
                b"\x94" + packed(["A.put", [], {}])[1:] + b"\xcf\x00",  # a stamp cut short
            ]))
        else:
            payload = packed([draw(_dispatch_methods),
                               draw(st.lists(plain_args, max_size=3)), {}])
        ev = (draw(st.sampled_from(["A"] * 6 + ["B", "C"])), 0, 7, i,
              draw(st.sampled_from([0, 1, 2] * 3 + [1 << 70, "1"])), i, payload)
        events.append(ev[:6] if kind == "short" else ev)
    return {
        "events": events,
        "start": draw(st.sampled_from([0] * 6 + [1, 3, 1 << 70])),
        "me": draw(st.sampled_from([2] * 12 + [1 << 70])),
        "idle": draw(st.lists(st.sampled_from([True] * 8 + [False, 1]), max_size=6)),
        "casts": (usual_casts if usual
                  else draw(st.sets(st.integers(0, 10), min_size=draw(st.integers(0, 10))))),
        "done_casts": draw(st.sets(st.integers(0, 10), max_size=2)),
        "outbox": draw(st.integers(0, 5)) > 0,
        "odd_hosted": draw(st.booleans()),
        "finish_raises": draw(st.integers(0, 9)) == 0,
    }


def _run_dispatch(mod: ModuleType, case: dict[str, Any]) -> list[object]:
    log: list[object] = []
    w = _dispatch_world(case, log)
    futures = dict(w["casts"])
    try:
        result: object = ("ok", mod.dispatch_calls(case["events"], case["start"], case["me"],
                                                   w["hosted"], w["casts"], w["outbox"],
                                                   b"\xc0", w["finish"]))
    except (Exception, _Stop) as exc:
        result = (type(exc).__name__, str(exc))
    results = {no: (f.result() if f.done() else None) for no, f in futures.items()}
    return [result, log, w["outbox"], sorted(w["casts"]), results]


@needs_native
@SETTINGS
@given(dispatch_cases())
def test_dispatch_calls(case: dict[str, Any]) -> None:
    """The twins run the same handlers in the same order with the same arguments, stop at the
    same event, hand the same outcomes to finish, batch the same replies and complete the same
    futures; every event they take is one the general path would run the same way."""
    assert native is not None
    import asyncio

    loop = asyncio.new_event_loop()
    try:
        case["loop"] = loop
        want = _run_dispatch(pure, case)
        got = _run_dispatch(native, case)
    finally:
        loop.close()
    assert repr(got) == repr(want), f"native {got!r}\npure {want!r}"


@pytest.mark.parametrize("impl", ["pure", "native"])
def test_dispatch_calls_runs_the_usual_calls_and_stops_before_the_rest(impl: str) -> None:
    import asyncio

    mod = pure if impl == "pure" else native
    if mod is None:
        pytest.skip("derecho_async._native is not built")
    loop = asyncio.new_event_loop()
    try:
        case = {"idle": [], "casts": {4}, "done_casts": set(), "outbox": True,
                "odd_hosted": False, "finish_raises": False, "loop": loop}
        log: list[Any] = []
        w = _dispatch_world(case, log)
        put = packed(["A.put", [b"x", 1], {}])
        cast = packed(["A.put.cast", [b"y"], {}])
        events = [
            ("A", 0, 7, 10, 1, 3, put),  # a peer's call: run, reply batched
            ("B", 0, 7, 11, 1, 4, put),  # a subgroup not hosted here: skipped
            ("A", 0, 7, 12, 2, 4, cast),  # my one-way call: its future completes
            ("A", 0, 7, 13, 0, 5, packed(["A.boom", [], {}])),  # raises: to finish
            ("A", 0, 7, 14, 2, 6, put),  # my call awaiting replies: run, its reply to finish
            ("A", 0, 7, 15, 2, 8, cast),  # my one-way call without a future: general path
            ("A", 0, 7, 16, 1, 7, put),
        ]
        n = mod.dispatch_calls(events, 0, 2, w["hosted"], w["casts"], w["outbox"], b"\xc0",
                               w["finish"])
        assert n == 5
        assert [entry[:2] for entry in log] == [("call", "put"), ("call", "put"), ("call", "boom"),
                                                ("finish", events[3]), ("call", "put"),
                                                ("finish", events[4])]
        assert log[0][2] == (b"x", 1) and log[1][2] == (b"y",)
        assert log[3][2:] == (False, False, "ValueError('boom()')")
        assert log[5][2:] == (False, True, "None")
        assert w["outbox"] == {1: ["old", 3, True, b"\xc0"]}
        assert w["casts"] == {}
        assert mod.dispatch_calls(events, 6, 2, w["hosted"], {}, w["outbox"], b"\xc0",
                                  w["finish"]) == 7
        assert w["outbox"] == {1: ["old", 3, True, b"\xc0", 7, True, b"\xc0"]}
        with pytest.raises(ValueError, match="start"):
            mod.dispatch_calls(events, -1, 2, {}, {}, None, b"", w["finish"])
        with pytest.raises(TypeError, match="events must be a list"):
            mod.dispatch_calls(tuple(events), 0, 2, {}, {}, None, b"", w["finish"])
    finally:
        loop.close()
