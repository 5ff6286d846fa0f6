"""The plain call codec of the twins: decode_plain_call and encode_plain_call agree with each
other and with the general call codec (derecho_async/_hotpath_pure/plaincall.py)."""

from __future__ import annotations

import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from derecho_async import wire
from derecho_async.errors import ProtocolViolation
from derecho_async.wire import calls
from tests.hotpath.twins import (
    SETTINGS,
    U64,
    native,
    needs_native,
    outcome,
    packed,
    plain_args,
)

# -- decode_plain_call ---------------------------------------------------------------------------

msgpack_ints = st.integers(-(1 << 63), U64 - 1)
other_args = st.one_of(
    st.lists(msgpack_ints, max_size=2),
    st.dictionaries(st.text(max_size=3), msgpack_ints, max_size=2),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
)
method_names = st.one_of(
    st.sampled_from(["Log.append", "Sink.put.cast", "Weights.update"]),
    st.text(max_size=12),
    st.binary(max_size=6),
    msgpack_ints,
)


@st.composite
def call_bytes(draw: st.DrawFn) -> bytes:
    """Calls as msgpack writes them (plain or not), hand-written variants (non-canonical
    envelopes, kwargs as map16), cut or extended, or with one byte changed."""
    args = draw(st.lists(st.one_of(plain_args, other_args) if draw(st.booleans()) else plain_args,
                         max_size=6))
    kwargs = draw(st.sampled_from([{}, {}, {"k": 1}]))
    data = packed([draw(method_names), args, kwargs])
    how = draw(st.sampled_from(["as is", "as is", "cut", "extend", "flip", "array16", "map16",
                                "args32", "stamp", "stamp"]))
    if how == "stamp" and data[:1] == b"\x93":  # with its sender's clock (wire.stamp_call)
        data = wire.stamp_call(data, draw(st.integers(-(1 << 63), (1 << 63) - 1)) % (1 << 64))
        how = draw(st.sampled_from(["as is", "as is", "cut", "extend", "flip"]))
    if how == "cut":
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    elif how == "extend":
        data += draw(st.binary(min_size=1, max_size=3))
    elif how == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1 :]
    elif how == "array16":  # the same envelope as an array16 of 3: msgpack reads it alike
        data = b"\xdc\x00\x03" + data[1:]
    elif how == "map16" and data.endswith(b"\x80"):
        data = data[:-1] + b"\xde\x00\x00"
    elif how == "args32" and len(args) < 16 and data[0] == 0x93:
        head = packed(draw(method_names))
        data = b"\x93" + head + b"\xdd" + struct.pack(">I", len(args))
        data += b"".join(packed(a) for a in args) + packed(kwargs)
    return data


@needs_native
@SETTINGS
@given(call_bytes())
def test_decode_plain_call(data: bytes) -> None:
    """The twins agree on every input, and a call they decode whose method is a dotted name
    (what wire.decode_call then accepts) is the call the general decoder makes of it."""
    assert native is not None
    want = outcome(pure.decode_plain_call, data)
    got = outcome(native.decode_plain_call, data)
    assert repr(got) == repr(want), f"{data!r}: native {got!r}, pure {want!r}"
    assert want[0] == "ok"
    if want[1] is not None and calls.valid_method(want[1][0]):
        assert repr(calls._decode_call_checked(wire.unstamped(data), None)) == repr(want[1])
        assert repr(wire.decode_call(data)) == repr(want[1])


def test_decode_plain_call_examples() -> None:
    call = packed(["Log.append", [b"\x00" * 3, -1, 1.5, None, True, "é", U64 - 1, -(1 << 63)], {}])
    for mod in (pure, native) if native is not None else (pure,):
        assert mod.decode_plain_call(call) == (
            "Log.append", (b"\x00" * 3, -1, 1.5, None, True, "é", U64 - 1, -(1 << 63)), {}
        )
        assert mod.decode_plain_call(bytearray(call)) is None  # bytes only
        assert mod.decode_plain_call(call[:-1]) is None
        assert mod.decode_plain_call(call + b"\x00") is None
        assert mod.decode_plain_call(packed(["Log.append", [[1]], {}])) is None
        assert mod.decode_plain_call(packed(["Log.append", [], {"k": 1}])) is None
        assert mod.decode_plain_call(packed([b"Log.append", [], {}])) is None
        bad_utf8 = b"\x93\xa2\xff\xfe\x90\x80"
        assert mod.decode_plain_call(bad_utf8) is None
        # a count past the bytes left: refused before anything is allocated for it
        assert mod.decode_plain_call(b"\x93\xa1a\xdd\xff\xff\xff\xff\x80") is None


def test_a_stamped_call_decodes_as_the_call_and_carries_its_time() -> None:
    call = wire.encode_call("Log.append", (b"x", 7), {})
    for t in (0, 1_733_500_000_123_456_789, -5):
        stamped = wire.stamp_call(call, t % (1 << 64))
        assert stamped[0] == 0x94 and len(stamped) == len(call) + wire.calls.STAMP_BYTES
        assert wire.call_time(stamped) == t
        assert wire.unstamped(stamped) == call
        assert wire.decode_call(stamped) == wire.decode_call(call)
        assert msgpack.unpackb(stamped)[3] == t % (1 << 64)  # a plain msgpack array of four
        for mod in (pure, native) if native is not None else (pure,):
            assert mod.decode_plain_call(stamped) == mod.decode_plain_call(call)
    arrays_call = wire.encode_call("Log.append", ({"k": [1, 2]},), {"w": 3})  # not plain
    stamped = wire.stamp_call(arrays_call, 99)
    assert wire.decode_call(stamped) == wire.decode_call(arrays_call)
    assert wire.call_time(call) is None and wire.unstamped(call) == call
    with pytest.raises(ValueError, match="not an encoded call"):
        wire.stamp_call(b"\x92\x01\x02", 1)
    with pytest.raises(ProtocolViolation):  # a fourth item that is no stamp
        wire.decode_call(packed(["Log.append", [], {}, "when"]))


def test_decode_call_checks_the_method_of_a_plain_call() -> None:
    """A plain call with a method that is no dotted identifier still fails as before."""
    for name in ["not a name", "", "a..b", "x" * 600]:
        with pytest.raises(ProtocolViolation, match="method"):
            wire.decode_call(packed([name, [1], {}]))
    assert wire.decode_call(packed(["Log.append", [1], {}])) == ("Log.append", (1,), {})


# -- encode_plain_call ---------------------------------------------------------------------------


class _Int(int):
    pass


class _Str(str):
    pass


encodable_args = st.lists(
    st.one_of(
        plain_args,
        st.integers(-(1 << 70), 1 << 70),  # some out of range
        st.sampled_from([_Int(3), _Str("s"), "\udc80", bytearray(b"ba"), 1j, [1], {"k": 1}]),
        st.text(min_size=31, max_size=33),
        st.binary(min_size=255, max_size=257),
    ),
    max_size=20,
)


@needs_native
@SETTINGS
@given(st.one_of(method_names, st.just("Log.append")), encodable_args, st.booleans())
def test_encode_plain_call(method: Any, args: list[Any], as_tuple: bool) -> None:
    """The twins agree; what they encode is what msgpack writes for the call, and decodes back
    to it."""
    assert native is not None
    items = tuple(args) if as_tuple else args
    want = outcome(pure.encode_plain_call, method, items)
    got = outcome(native.encode_plain_call, method, items)
    assert got == want, f"{method!r}, {items!r}: native {got!r}, pure {want!r}"
    assert want[0] == "ok"
    if want[1] is not None:
        assert want[1] == packed([method, list(items), {}])
        assert repr(pure.decode_plain_call(want[1])) == repr((method, tuple(items), {}))


def test_encode_plain_call_examples() -> None:
    for mod in (pure, native) if native is not None else (pure,):
        args = (b"x" * 70000, -1, U64 - 1, -(1 << 63), 2.5, None, True, "é" * 20)
        assert mod.encode_plain_call("Log.append", args) == packed(["Log.append", list(args), {}])
        assert mod.encode_plain_call("Log.append", tuple(range(70000))) == packed(
            ["Log.append", list(range(70000)), {}]
        )
        for refused in [U64, -(1 << 63) - 1, _Int(1), _Str("s"), "\udc80", [1], bytearray(b"")]:
            assert mod.encode_plain_call("Log.append", (refused,)) is None, refused
        assert mod.encode_plain_call("Log.append", [1]) is None  # args must be a tuple
        assert mod.encode_plain_call(b"Log.append", (1,)) is None
        # bytes over wire.LARGE_BYTES may travel out of band: left to the general encoder
        edge = b"x" * wire.LARGE_BYTES
        assert mod.encode_plain_call("Log.append", (edge,)) == packed(["Log.append", [edge], {}])
        assert mod.encode_plain_call("Log.append", (edge + b"x",)) is None


def test_encode_call_reports_what_the_plain_pass_refuses() -> None:
    """Calls the native pass leaves to the general encoder still encode or fail as before."""
    wire.encode_call("Log.append", (1,), {})  # the method is known from here on
    with pytest.raises(OverflowError, match=r"^args\[0\]: int"):
        wire.encode_call("Log.append", (U64,), {})
    assert wire.decode_call(wire.encode_call("Log.append", (_Int(7), _Str("s")), {})) == (
        "Log.append", (7, "s"), {}
    )
    with pytest.raises(TypeError, match=r"^args\[0\]: cannot encode"):
        wire.encode_call("Log.append", (1j,), {})
