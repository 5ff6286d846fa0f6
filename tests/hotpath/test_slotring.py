"""The slot ring of the twins: scan_slots, deliver_messages and write_messages agree on every
ring, hostile ones included (derecho_async/_hotpath_pure/slotring.py)."""

from __future__ import annotations

import collections
import copy
import struct
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from tests.hotpath.twins import SETTINGS, U64, field, native, needs_native, outcome, same

# -- slot scan --------------------------------------------------------------------------------

kinds = st.one_of(st.sampled_from([1, 2, 3, 4]), st.integers(0, 255))
n_turns = st.one_of(st.just(1), st.integers(0, 5), st.sampled_from([1 << 40, (1 << 40) + 1]))


@st.composite
def slot_rings(draw: st.DrawFn) -> tuple[bytes, tuple[int, ...]]:
    window = draw(st.integers(1, 5))
    slot_bytes = 32 + 8 * draw(st.integers(0, 12))
    base = 8 * draw(st.integers(0, 3))
    buf = bytearray(base + window * slot_bytes + 8 * draw(st.integers(0, 2)))
    turn = draw(st.one_of(st.integers(0, 4), st.just((1 << 56) - 2)))
    lo = draw(st.integers(0, 20))
    hi = lo + draw(st.integers(0, window + 1))
    t = turn
    for rec_no in range(lo, min(hi, lo + window)):
        off = base + (rec_no % window) * slot_bytes
        valid = draw(st.booleans()) or draw(st.booleans())
        kind = draw(st.sampled_from([1, 2, 3, 4])) if valid else draw(kinds)
        turns = 1 if valid and kind != 3 else draw(n_turns)
        nbytes = draw(st.integers(0, slot_bytes - 32)) if valid else draw(field)
        first = t if valid else draw(st.one_of(st.just(t), field))
        msg_no = draw(field)
        body = bytearray(draw(st.binary(min_size=slot_bytes - 32, max_size=slot_bytes - 32)))
        if kind == 4 and valid and slot_bytes >= 64:  # a well-formed batch, perhaps spoiled
            sizes = draw(st.lists(st.integers(0, 12), min_size=2, max_size=(slot_bytes - 32) // 16))
            pos = 0
            turns = 0
            for size in sizes:
                need = 16 + (size + 7) // 8 * 8
                if pos + need > len(body):
                    break
                struct.pack_into("<2Q", body, pos, size, draw(field))
                pos += need
                turns += 1
            nbytes = pos
            turns = draw(st.sampled_from([turns, turns, turns, turns + 1, max(turns - 1, 0)]))
            nbytes = draw(st.sampled_from([nbytes, nbytes, nbytes, nbytes + 8, nbytes - 8]))
            if draw(st.integers(0, 5)) == 0 and pos:  # an entry claiming more than it holds
                struct.pack_into("<Q", body, 0, draw(field))
        struct.pack_into("<4Q", buf, off, first, (kind | turns << 8) % U64, nbytes % U64, msg_no)
        buf[off + 32 : off + slot_bytes] = body
        t += max(turns, 0)
    max_payload = draw(st.integers(0, 40))
    if draw(st.integers(0, 9)) == 0:  # occasionally arguments that do not describe a ring
        base = draw(st.integers(0, len(buf) + 16))
        slot_bytes = draw(st.integers(0, 64))
        window = draw(st.integers(0, 6))
    return bytes(buf), (base, window, slot_bytes, lo, hi, turn, max_payload)


@needs_native
@SETTINGS
@given(slot_rings())
def test_scan_slots(ring: tuple[bytes, tuple[int, ...]]) -> None:
    buf, args = ring
    kind, value = same("scan_slots", buf, *args)
    same("scan_slots", memoryview(bytearray(buf)), *args)
    if kind == "ok":
        records, turn, slots, error = value
        lo, hi = args[3], args[4]
        assert slots <= hi - lo
        assert (error is None) == (slots == hi - lo)
        # every record takes the turns after the one before it
        assert turn == args[5] + sum(r[2] for r in records)


def _batch_ring() -> bytearray:
    """Three 96-byte slots from turn 7: a message, a batch of three, a null of two turns."""
    buf = bytearray(3 * 96)
    struct.pack_into("<4Q", buf, 0, 7, 1 | 1 << 8, 3, 100)
    buf[32:35] = b"abc"
    entries = [(b"", 101), (b"hello", 102), (b"12345678", 103)]
    pos = 96 + 32
    for payload, msg_no in entries:
        struct.pack_into("<2Q", buf, pos, len(payload), msg_no)
        buf[pos + 16 : pos + 16 + len(payload)] = payload
        pos += 16 + (len(payload) + 7) // 8 * 8
    struct.pack_into("<4Q", buf, 96, 8, 4 | 3 << 8, pos - 96 - 32, 0)
    struct.pack_into("<4Q", buf, 192, 11, 3 | 2 << 8, 0, 0)
    return buf


@pytest.mark.parametrize("impl", ["pure", "native"])
def test_a_batch_record_comes_out_as_one_message_record_per_entry(impl: str) -> None:
    if impl == "native" and native is None:
        pytest.skip("derecho_async._native is not built")
    scan = (pure if impl == "pure" else native).scan_slots  # type: ignore[union-attr]
    buf = _batch_ring()
    records, turn, slots, error = scan(buf, 0, 3, 96, 0, 3, 7, 64)
    assert error is None and slots == 3 and turn == 13
    assert records == [
        (7, 1, 1, 3, 100, b"abc"),
        (8, 1, 1, 0, 101, b""),
        (9, 1, 1, 5, 102, b"hello"),
        (10, 1, 1, 8, 103, b"12345678"),
        (11, 3, 2, 0, 0, None),
    ]
    # An entry larger than the payloads allowed is refused, and nothing of its batch comes out.
    records, turn, slots, error = scan(buf, 0, 3, 96, 0, 3, 7, 4)
    assert (records, turn, slots) == ([(7, 1, 1, 3, 100, b"abc")], 8, 1)
    assert error == "batch entry 1 of 5 B does not fit"
    # A batch that claims one message more than it holds is refused.
    struct.pack_into("<Q", buf, 96 + 8, 4 | 4 << 8)
    _, _, slots, error = scan(buf, 0, 3, 96, 0, 3, 7, 64)
    assert slots == 1 and error == "batch entry 3 lies past the record's 64 B"


# -- deliver_messages ----------------------------------------------------------------------------


class _Event(tuple):  # type: ignore[type-arg]
    """Stands for Delivered: a tuple subclass."""


class _Other:
    """Stands for a record that is not an inline message (a Record object)."""

    def __repr__(self) -> str:
        return "Other"


@st.composite
def delivery_states(draw: st.DrawFn) -> tuple[Any, ...]:
    """Senders' pending deques of message and null tuples (first turns mostly in step,
    sometimes not) and other records, my own undelivered deque, a start and a limit."""
    n = draw(st.integers(1, 4))
    d = draw(st.integers(0, 12))
    pending = []
    for k in range(n):
        turn = (d + (k - d % n) % n) // n  # the turn of sender k's first seq at or after d
        recs: list[object] = []
        for _ in range(draw(st.integers(0, 6))):
            if draw(st.integers(0, 5)) == 0:
                recs.append(_Other())
            elif draw(st.integers(0, 7)) == 0:
                recs.append((turn - 1, 1, 1, 8, 7, b"late"))  # out of step
            elif draw(st.integers(0, 9)) == 0:
                recs.append((turn, 1, 1))  # not a 6-tuple
            elif draw(st.integers(0, 3)) == 0:  # a null of one or more turns
                n_turns = draw(st.sampled_from([1, 1, 2, 3, 0, -1]))
                late = draw(st.integers(0, 7)) == 0  # out of step: its turns are over
                recs.append((turn - (n_turns + 1 if late else 0), 3, n_turns, 0, 0, None))
                turn += max(n_turns, 1) - 1
            else:
                recs.append((turn, 1, 1, 4, 100 * k + turn, b"m%d" % turn))
            turn += 1
        pending.append(collections.deque(recs))
    my_index = draw(st.integers(-1, n - 1))
    own = collections.deque((s, "out") for s in sorted(draw(st.sets(st.integers(0, 30)))))
    limit = d + draw(st.integers(-2, 20))
    return pending, [10 + k for k in range(n)], own, my_index, d, limit


def _run_delivery(mod: Any, state: tuple[Any, ...]) -> tuple[Any, ...]:
    pending, ids, own, my_index, d, limit = copy.deepcopy(state)
    events: list[Any] = []
    result = outcome(
        mod.deliver_messages, pending, ids, own, events, _Event, ("sub", 0, 3), my_index, d, limit
    )
    assert all(type(e) is _Event for e in events)
    return result, repr(events), repr(pending), repr(own)


@needs_native
@SETTINGS
@given(delivery_states())
def test_deliver_messages(state: tuple[Any, ...]) -> None:
    assert native is not None
    want = _run_delivery(pure, state)
    assert _run_delivery(native, state) == want
    assert want[0][0] == "ok"


def test_deliver_messages_example() -> None:
    for mod in (pure, native) if native is not None else (pure,):
        other = _Other()
        pending: list[collections.deque[object]] = [
            collections.deque([(0, 1, 1, 4, 1, b"a"), (1, 1, 1, 4, 2, b"c")]),
            collections.deque([(0, 1, 1, 4, 9, b"b"), other]),
        ]
        own = collections.deque([(0, "mine"), (2, "mine too")])
        events: list[Any] = []
        d = mod.deliver_messages(pending, [5, 6], own, events, _Event, ("s", 1, 2), 0, 0, 10)
        assert d == 3  # stopped at seq 3: sender 1's next record is another kind
        assert events == [("s", 1, 2, 0, 5, 1, b"a"), ("s", 1, 2, 1, 6, 9, b"b"),
                          ("s", 1, 2, 2, 5, 2, b"c")]
        assert all(type(e) is _Event for e in events)
        assert list(own) == [] and list(pending[1]) == [other] and not pending[0]
        with pytest.raises(TypeError, match="tuple subclass"):
            mod.deliver_messages(pending, [5, 6], own, events, dict, ("s", 1, 2), 0, 0, 10)
        with pytest.raises(ValueError, match="no senders"):
            mod.deliver_messages([], [], own, events, _Event, ("s", 1, 2), 0, 0, 10)


def test_deliver_messages_skips_the_seqs_of_a_null() -> None:
    for mod in (pure, native) if native is not None else (pure,):
        pending: list[collections.deque[object]] = [
            collections.deque([(0, 1, 1, 4, 1, b"a"), (1, 1, 1, 4, 2, b"c"), (2, 1, 1, 4, 3, b"e")]),
            collections.deque([(0, 3, 2, 0, 0, None), (2, 1, 1, 4, 9, b"f")]),  # turns 0 and 1
        ]
        events: list[Any] = []
        d = mod.deliver_messages(pending, [5, 6], collections.deque(), events, _Event,
                                 ("s", 1, 2), 0, 0, 10)
        assert d == 6
        assert [e[3:] for e in events] == [(0, 5, 1, b"a"), (2, 5, 2, b"c"), (4, 5, 3, b"e"),
                                           (5, 6, 9, b"f")]
        assert not pending[0] and not pending[1]
        # a null whose turns are over is out of step: left to the caller
        pending = [collections.deque([(5, 1, 1, 4, 1, b"a")]),
                   collections.deque([(3, 3, 2, 0, 0, None)])]
        assert mod.deliver_messages(pending, [5, 6], collections.deque(), events, _Event,
                                    ("s", 1, 2), 0, 11, 20) == 11


# -- writing slot records ----------------------------------------------------------------------


class _Out:
    """A queued message as ShardState keeps one (the fields write_messages reads)."""

    __slots__ = ("large", "msg_no", "nbytes", "payload")

    def __init__(self, msg_no: Any, payload: Any, nbytes: Any, large: bool) -> None:
        self.msg_no, self.payload, self.nbytes, self.large = msg_no, payload, nbytes, large

    def __repr__(self) -> str:
        return f"_Out({self.msg_no!r}, {self.payload!r}, {self.nbytes!r}, {self.large!r})"


@st.composite
def write_cases(draw: st.DrawFn) -> tuple[Any, ...]:
    slot_bytes = draw(st.sampled_from([32, 40, 64, 96, 200, 256]))
    window = draw(st.integers(1, 5))
    base = draw(st.sampled_from([0, 8, 16]))
    room = slot_bytes - pure.SLOT_HEADER
    msgs = []
    for i in range(draw(st.integers(0, 12))):
        if draw(st.integers(0, 9)) == 0:
            msgs.append(_Out(1000 + i, object(), 1 << 20, True))  # a large one (descriptor)
            continue
        size = draw(st.integers(0, room))
        msgs.append(_Out(draw(st.sampled_from([i, i + (1 << 40), U64 - 1])),
                         draw(st.binary(min_size=size, max_size=size)), size, False))
    if draw(st.integers(0, 14)) == 0 and msgs:  # a local bug: refused, nothing popped for it
        bad = draw(st.sampled_from(["long", "len", "type", "neg_no"]))
        j = draw(st.integers(0, len(msgs) - 1))
        m = msgs[j]
        if bad == "long":
            msgs[j] = _Out(m.msg_no, b"x" * (room + 8), room + 8, False)
        elif bad == "len":
            msgs[j] = _Out(m.msg_no, b"xy", 3, False)
        elif bad == "type":
            msgs[j] = _Out(m.msg_no, bytearray(b"ab"), 2, False)
        else:
            msgs[j] = _Out(-1, b"ab", 2, False)
    extra = draw(st.integers(0, 24))
    return (slot_bytes, window, base, base + window * slot_bytes + extra,
            draw(st.integers(0, 40)), draw(st.integers(0, (1 << 56) - 64)), msgs,
            draw(st.integers(0, window + 1)), draw(st.integers(0, 14)),
            draw(st.integers(1, 4)), draw(st.integers(0, 3)))


def _run_write(mod: ModuleType, case: tuple[Any, ...]) -> tuple[Any, ...]:
    slot_bytes, window, base, size, rec_no, turn, msgs, free, limit, n, k = case
    buf = bytearray(b"\xee" * size)
    q = collections.deque(msgs)
    pend: collections.deque[Any] = collections.deque()
    own: collections.deque[Any] = collections.deque()
    inflight: collections.deque[int] = collections.deque()
    got = outcome(mod.write_messages, buf, base, window, slot_bytes, rec_no, turn, q, free,
                  limit, pend, own, inflight, n, k)
    return got, bytes(buf), list(q), list(pend), list(own), list(inflight)


@needs_native
@SETTINGS
@given(write_cases())
def test_write_messages(case: tuple[Any, ...]) -> None:
    """The twins write the same bytes, pop and queue the same messages and return the same; what
    they wrote reads back by scan_slots as the messages that were popped, in order."""
    assert native is not None
    want = _run_write(pure, case)
    assert _run_write(native, case) == want
    (status, value), buf, _, pend, own, inflight = want
    slot_bytes, window, base, _, rec_no, turn, msgs, free, limit, n, k = case
    if status != "ok":
        return
    records, written, next_turn = value
    assert records <= free and written <= limit and next_turn == turn + written
    assert [m for _, m in own] == msgs[:written]
    assert [seq for seq, _ in own] == [(turn + i) * n + k for i in range(written)]
    if records:
        got = pure.scan_slots(buf, base, window, slot_bytes, rec_no, rec_no + records, turn,
                              slot_bytes)
        assert got == (pend, next_turn, records, None)
        assert pend == [(turn + i, pure.KIND_MESSAGE, 1, m.nbytes, m.msg_no, m.payload)
                        for i, m in enumerate(msgs[:written])]
        assert len(inflight) == records and inflight[-1] == (next_turn - 1) * n + k


@pytest.mark.parametrize("impl", ["pure", "native"])
def test_write_messages_batches_what_fits_a_slot(impl: str) -> None:
    mod = pure if impl == "pure" else native
    if mod is None:
        pytest.skip("derecho_async._native is not built")
    slot_bytes, window = 96, 4  # 64 B of room: two 8 B messages share a slot (2 x (16 + 8))
    buf = bytearray(slot_bytes * window)
    q = collections.deque([_Out(1, b"a" * 8, 8, False), _Out(2, b"b" * 5, 5, False),
                           _Out(3, b"c" * 40, 40, False), _Out(4, None, 1 << 20, True),
                           _Out(5, b"d", 1, False)])
    pend: collections.deque[Any] = collections.deque()
    own: collections.deque[Any] = collections.deque()
    inflight: collections.deque[int] = collections.deque()
    assert mod.write_messages(buf, 0, window, slot_bytes, 6, 100, q, 4, 10, pend, own,
                              inflight, 3, 1) == (2, 3, 103)
    assert [m.msg_no for m in q] == [4, 5]  # stopped at the large one
    assert list(inflight) == [101 * 3 + 1, 102 * 3 + 1]
    recs, _, _, err = pure.scan_slots(buf, 0, window, slot_bytes, 6, 8, 100, 64)
    assert err is None and [r[4] for r in recs] == [1, 2, 3]
    assert struct.unpack_from("<4Q", buf, 2 * slot_bytes)[:2] == (100, pure.KIND_BATCH | 2 << 8)
    assert struct.unpack_from("<4Q", buf, 3 * slot_bytes) == (102, pure.KIND_MESSAGE | 1 << 8,
                                                              40, 3)
    with pytest.raises(ValueError, match="does not fit a slot"):
        mod.write_messages(buf, 0, window, slot_bytes, 8, 103,
                           collections.deque([_Out(9, b"x" * 72, 72, False)]), 4, 10, pend,
                           own, inflight, 3, 1)
    with pytest.raises(ValueError, match="slot ring does not fit"):
        mod.write_messages(buf, 8, window, slot_bytes, 0, 0, q, 4, 10, pend, own, inflight, 3,
                           1)


@pytest.mark.parametrize("impl", ["pure", "native"])
def test_write_messages_stops_before_a_bad_message_and_loses_nothing(impl: str) -> None:
    """A message that cannot be written ends the call before it is popped: what was written
    before it is returned (so the caller's counters stay in step), and the next call raises."""
    mod = pure if impl == "pure" else native
    if mod is None:
        pytest.skip("derecho_async._native is not built")
    slot_bytes, window = 96, 4  # 64 B of room: 0 (8 B) and 1 (1 B) share a slot
    buf = bytearray(slot_bytes * window)
    bad = _Out(2, b"x" * 72, 72, False)
    q = collections.deque([_Out(0, b"a" * 8, 8, False), _Out(1, b"b", 1, False), bad,
                           _Out(3, b"c", 1, False)])
    pend: collections.deque[Any] = collections.deque()
    own: collections.deque[Any] = collections.deque()
    inflight: collections.deque[int] = collections.deque()
    args = (buf, 0, window, slot_bytes, 0, 0, q, 4, 10, pend, own, inflight, 2, 0)
    assert mod.write_messages(*args) == (1, 2, 2)
    assert list(q) == [bad, q[1]] and [m.msg_no for _, m in own] == [0, 1]
    with pytest.raises(ValueError, match="does not fit a slot"):
        mod.write_messages(buf, 0, window, slot_bytes, 1, 2, q, 3, 10, pend, own, inflight, 2,
                           0)
    assert len(q) == 2 and len(pend) == 2 and list(inflight) == [2]


@pytest.mark.parametrize("impl", ["pure", "native"])
def test_write_messages_fills_a_large_slot_with_many_small_messages(impl: str) -> None:
    mod = pure if impl == "pure" else native
    if mod is None:
        pytest.skip("derecho_async._native is not built")
    slot_bytes, window = 65_568, 2  # room for 2048 entries of 16 + 16 B
    buf = bytearray(slot_bytes * window)
    msgs = [_Out(i, bytes([i % 251]) * 9, 9, False) for i in range(3000)]
    q = collections.deque(msgs)
    pend: collections.deque[Any] = collections.deque()
    own: collections.deque[Any] = collections.deque()
    inflight: collections.deque[int] = collections.deque()
    assert mod.write_messages(buf, 0, window, slot_bytes, 0, 0, q, 2, 1 << 62, pend, own,
                              inflight, 1, 0) == (2, 3000, 3000)
    got = pure.scan_slots(buf, 0, window, slot_bytes, 0, 2, 0, 64)
    assert got[2:] == (2, None) and [r[5] for r in got[0]] == [m.payload for m in msgs]
