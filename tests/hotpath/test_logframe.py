"""frame_log_records of the twins agrees, bytes and errors, on well-formed and broken records
(derecho_async/_hotpath_pure/logframe.py), and what it frames reads back through the log's own
scanner."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from derecho_async.durability import LogRecord
from derecho_async.durability.records import HEADER, _check
from tests.hotpath.twins import SETTINGS, needs_native, same

MAX = (1 << 63) - 1
good_ints = st.one_of(st.integers(0, 20), st.integers(0, MAX), st.just(MAX))
odd_ints = st.one_of(st.integers(-3, -1), st.just(MAX + 1), st.just(1 << 64))


@st.composite
def records(draw: Any) -> tuple[list[Any], int, Any, int]:
    """A batch of records with increasing versions, sometimes broken in one place."""
    n = draw(st.integers(0, 6))
    view = draw(st.integers(0, 5))
    seq = draw(st.integers(0, 50))
    out: list[Any] = []
    for _ in range(n):
        seq += draw(st.integers(1, 3))
        if draw(st.integers(0, 5)) == 0:
            view, seq = view + 1, draw(st.integers(0, 3))
        body = draw(st.binary(max_size=70))
        t = draw(st.one_of(st.integers(-(1 << 63), MAX), st.just(0)))
        rec: Any = LogRecord((view, seq), t, body) if draw(st.booleans()) else ((view, seq), t,
                                                                                 body)
        out.append(rec)
    if out and draw(st.integers(0, 3)) == 0:  # one broken field
        i = draw(st.integers(0, len(out) - 1))
        (v, s), t, b = out[i]
        broken = draw(st.sampled_from(["version", "order", "time", "body", "shape", "long"]))
        if broken == "version":
            out[i] = (draw(st.one_of(st.tuples(odd_ints, good_ints), st.just([v, s]),
                                     st.just((v, s, 0)), st.just((v, True)))), t, b)
        elif broken == "order" and i > 0:
            out[i] = (out[i - 1][0], t, b)
        elif broken == "time":
            out[i] = ((v, s), draw(st.one_of(st.just(1 << 63), st.just(-(1 << 63) - 1),
                                              st.just(1.0))), b)
        elif broken == "body":
            out[i] = ((v, s), t, draw(st.sampled_from([bytearray(b), memoryview(b), "x"])))
        elif broken == "shape":
            out[i] = draw(st.sampled_from([((v, s), t), [(v, s), t, b], None]))
    after = draw(st.one_of(st.none(), st.just((0, 0)), st.tuples(good_ints, good_ints),
                           st.just((-1, 0))))
    limit = draw(st.sampled_from([1 << 30, 40, 0]))
    return out, draw(st.integers(0, 1000)), after, limit


@needs_native
@SETTINGS
@given(records())
def test_frame_log_records(case: tuple[list[Any], int, Any, int]) -> None:
    recs, batch, after, limit = case
    kind, value = same("frame_log_records", recs, batch, after, limit)
    if kind != "ok":
        return
    # what it framed: each record's header and body, its crc right, in order
    at = 0
    for (version, t, body) in recs:
        header = value[at:at + HEADER.size]
        magic, crc, length, rkind, rbatch, view, seq, time_ns = HEADER.unpack(header)
        assert (magic, length, rkind, rbatch) == (b"DLR1", len(body), 1, batch)
        assert ((view, seq), time_ns) == (version, t)
        assert value[at + HEADER.size:at + HEADER.size + length] == body
        assert _check(header, body, crc)
        at += HEADER.size + length
    assert at == len(value)


def test_a_large_batch_frames_the_same_in_both_twins() -> None:
    recs = [((1, i), i * 7, bytes([i % 251]) * (1000 + i)) for i in range(300)]
    framed = pure.frame_log_records(recs, 9, None, 1 << 30)
    kind, value = same("frame_log_records", recs, 9, None, 1 << 30) if _native() else (
        "ok", framed)
    assert kind == "ok" and value == framed


def _native() -> bool:
    from tests.hotpath.twins import native

    return native is not None


def _stamped(call: bytes, clock: bytes) -> bytes:
    """A payload shaped as a call stamped with its sender's clock (wire.stamp_call)."""
    return b"\x94" + call[1:] + b"\xcf" + clock


def _time(payload: bytes, run_time: int) -> int:
    """The time a framed record of ``payload`` has: a stamped call's own, else its run's."""
    from derecho_async import wire

    at = wire.call_time(payload)
    return run_time if at is None else at


@st.composite
def runs(draw: Any) -> tuple[list[Any], int, Any, int, bytes]:
    """Runs of delivered calls (Delivered tuples), sometimes with a payload that is not bytes or
    a version out of order."""
    from derecho_async.core import Delivered

    out: list[Any] = []
    view, seq = draw(st.integers(0, 4)), draw(st.integers(0, 9))
    for _ in range(draw(st.integers(0, 4))):
        events = []
        for _ in range(draw(st.integers(0, 4))):
            seq += draw(st.integers(0, 2))  # 0: the same version again (out of order)
            payload: Any = draw(st.one_of(st.binary(max_size=60),
                                          st.sampled_from([bytearray(b"x"), None]),
                                          st.builds(_stamped, st.binary(min_size=4, max_size=40),
                                                    st.binary(min_size=8, max_size=8))))
            events.append(Delivered("S", 0, view, seq, 1, seq, payload))
        t = draw(st.one_of(st.integers(-(1 << 63), MAX), st.just(1 << 63)))
        out.append((events, t))
    after = draw(st.one_of(st.none(), st.tuples(good_ints, good_ints)))
    return (out, draw(st.integers(0, 99)), after, draw(st.sampled_from([1 << 30, 30])),
            draw(st.sampled_from([b"\x00", b"", b"ab"])))


@needs_native
@SETTINGS
@given(runs())
def test_frame_log_runs(case: tuple[list[Any], int, Any, int, bytes]) -> None:
    kind, value = same("frame_log_runs", *case)
    runs_, batch, after, limit, prefix = case
    if kind != "ok" or value is None:
        return
    records = [((ev[2], ev[3]), _time(ev[6], t), prefix + ev[6])
               for events, t in runs_ for ev in events]
    assert value == pure.frame_log_records(records, batch, after, limit)  # the same framing
