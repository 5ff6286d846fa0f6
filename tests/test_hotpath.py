"""The native hot path (derecho_async._native) against its pure-Python twin.

Every function of the C extension is run on the same Hypothesis-generated inputs as the pure
twin, and must return the same value or raise the same exception with the same message. The
inputs include hostile buffer contents (bad record headers, lengths past the data, offsets
outside the buffer), which the C code must refuse exactly as the twin does.

A separate test fails when the normal install did not build the extension, so a build that
silently fell back to pure Python cannot pass CI (set DERECHO_ASYNC_ALLOW_NO_NATIVE=1 to run the
suite on a machine without a C compiler).
"""

from __future__ import annotations

import collections
import copy
import importlib.util
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from derecho_async import hotpath, wire
from derecho_async.errors import ProtocolViolation
from derecho_async.wire import calls

native: ModuleType | None
try:
    from derecho_async import _native as native
except ImportError:  # pragma: no cover - only on installs without a compiler
    native = None

needs_native = pytest.mark.skipif(native is None, reason="derecho_async._native is not built")
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

U64 = 1 << 64
ints = st.one_of(
    st.integers(-3, 300),
    st.integers(0, U64 + 3),
    st.sampled_from([U64 - 1, U64, 1 << 56, (1 << 56) + 1, 1 << 63, -1]),
)


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)


def same(name: str, *args: Any) -> tuple[str, Any]:
    assert native is not None
    want = outcome(getattr(pure, name), *args)
    got = outcome(getattr(native, name), *args)
    assert got == want, f"{name}{args!r}: native {got!r}, pure {want!r}"
    return want


# -- installation and selection ---------------------------------------------------------------


def test_the_normal_install_built_the_native_module() -> None:
    if os.environ.get("DERECHO_ASYNC_ALLOW_NO_NATIVE", "") not in ("", "0"):
        pytest.skip("DERECHO_ASYNC_ALLOW_NO_NATIVE is set")
    spec = importlib.util.find_spec("derecho_async._native")
    assert spec is not None, (
        "derecho_async._native was not built by the install (is a C compiler available?)"
    )
    assert native is not None and native.IMPLEMENTATION == "native"


def _selected(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("DERECHO_ASYNC_PURE_PYTHON", None)
    if env_value is not None:
        env["DERECHO_ASYNC_PURE_PYTHON"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", "from derecho_async import hotpath; print(hotpath.IMPLEMENTATION)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@needs_native
def test_selection_follows_the_environment() -> None:
    assert _selected(None) == "native"
    assert _selected("0") == "native"
    assert _selected("1") == "pure"
    assert ("pure" if hotpath.REQUESTED_PURE else "native") == hotpath.IMPLEMENTATION


def test_both_twins_have_the_same_api() -> None:
    names = set(hotpath.__all__) - {"REQUESTED_PURE"}
    for name in names:
        assert hasattr(pure, name), name
        if native is not None:
            assert hasattr(native, name), name
    if native is not None:
        public = {n for n in dir(native) if not n.startswith("_")}
        assert public == names


# -- words ------------------------------------------------------------------------------------


@needs_native
@SETTINGS
@given(st.binary(max_size=80), st.integers(-20, 100))
def test_load_u64(data: bytes, offset: int) -> None:
    kind, value = same("load_u64", data, offset)
    if kind == "ok":
        assert value == int.from_bytes(data[offset : offset + 8], "little")
    same("load_u64", memoryview(bytearray(data)), offset)


@needs_native
@SETTINGS
@given(st.binary(max_size=80), st.integers(-20, 100), ints)
def test_store_u64(data: bytes, offset: int, value: int) -> None:
    assert native is not None
    a, b = bytearray(data), bytearray(data)
    want = outcome(pure.store_u64, a, offset, value)
    got = outcome(native.store_u64, b, offset, value)
    assert got == want
    assert a == b
    if want[0] == "ok":
        assert pure.load_u64(a, offset) == value


@needs_native
def test_store_refuses_read_only_buffers_and_fence_runs() -> None:
    assert native is not None
    assert same("store_u64", b"\0" * 16, 0, 1) == ("TypeError", "buffer is not writable")
    native.fence()
    pure.fence()


@needs_native
@SETTINGS
@given(st.binary(max_size=96), st.lists(st.integers(-10, 100), max_size=8), ints)
def test_min_u64(data: bytes, offsets: list[int], start: int) -> None:
    kind, value = same("min_u64", data, offsets, start)
    if kind == "ok":
        words = [int.from_bytes(data[o : o + 8], "little") for o in offsets]
        assert value == min([start, *words])


# -- bytes_copy -------------------------------------------------------------------------------


def _copy_sources(draw: Any) -> object:
    """A buffer of one of the shapes a received payload takes (or not a buffer at all)."""
    data = draw(st.binary(max_size=300))
    form = draw(st.sampled_from(["bytes", "bytearray", "memoryview", "strided", "cast", "int",
                                 "str", "numpy"]))
    if form == "bytes":
        return data
    if form == "bytearray":
        return bytearray(data)
    if form == "memoryview":
        start = draw(st.integers(0, len(data)))
        return memoryview(data)[start:]
    if form == "strided":
        step = draw(st.integers(-3, 3).filter(bool))
        return memoryview(data)[::step]
    if form == "cast":
        n = len(data) // 4 * 4
        return memoryview(data[:n]).cast("I")
    if form == "numpy":
        np = pytest.importorskip("numpy")
        arr = np.frombuffer(bytearray(data), np.uint8)
        return arr[:: draw(st.sampled_from([1, 2, -1]))]
    return 7 if form == "int" else "text"


copy_sources = st.composite(_copy_sources)


@needs_native
@SETTINGS
@given(copy_sources())
def test_bytes_copy(source: object) -> None:
    kind, value = same("bytes_copy", source)
    if kind == "ok":
        assert type(value) is bytes and value == bytes(memoryview(source))  # type: ignore[arg-type]


@needs_native
def test_bytes_copy_of_a_large_buffer_is_a_new_bytes_object() -> None:
    np = pytest.importorskip("numpy")
    src = np.arange(3 << 20, dtype=np.uint8)[1:]  # a large one: copied with the GIL released
    for impl in (pure, native):
        assert impl is not None
        out = impl.bytes_copy(src)
        assert type(out) is bytes and len(out) == src.nbytes and out == src.tobytes()


# -- ordering maths ---------------------------------------------------------------------------

turn_lists = st.lists(
    st.one_of(st.integers(0, 1000), st.integers(-2, (1 << 56) + 2)), min_size=0, max_size=70
)


@needs_native
@SETTINGS
@given(turn_lists)
def test_frontier(held: list[int]) -> None:
    from derecho_async.core.ordering import frontier as reference

    kind, value = same("frontier", held)
    if kind == "ok":
        assert value == reference(held)


@needs_native
@SETTINGS
@given(st.integers(-2, 70), turn_lists)
def test_turns_needed(my_index: int, seen: list[int]) -> None:
    from derecho_async.core.ordering import turns_needed as reference

    kind, value = same("turns_needed", my_index, seen)
    if kind == "ok":
        assert value == reference(my_index, seen)


# -- slot scan --------------------------------------------------------------------------------

field = st.one_of(st.integers(0, 12), st.integers(0, U64 - 1))
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


# -- ring scan --------------------------------------------------------------------------------


@st.composite
def rings(draw: st.DrawFn) -> tuple[bytearray, int, int, int]:
    cap = 8 * draw(st.integers(4, 40))
    data = bytearray(draw(st.binary(min_size=cap, max_size=cap)))
    tail = 8 * draw(st.integers(0, 3 * cap // 8))
    pos = tail
    for _ in range(draw(st.integers(0, 5))):
        length = draw(st.integers(0, 40))
        padded = (length + 7) & ~7
        if pos + 32 + padded - tail > cap:
            break
        good = draw(st.booleans()) or draw(st.booleans())
        typ = draw(st.sampled_from([1, 2])) if good else draw(st.integers(0, 4))
        flags = 0 if good else draw(st.sampled_from([0, 1, 0x80000000]))
        a = draw(st.integers(0, 5)) if good else draw(field)
        b = draw(st.integers(0, 5)) if good else draw(field)
        hdr = struct.pack("<IIQQQ", typ, flags, a, b, length if good else draw(field))
        for i, byte in enumerate(hdr + draw(st.binary(min_size=padded, max_size=padded))):
            data[(pos + i) % cap] = byte
        pos += 32 + padded
    head = pos if draw(st.integers(0, 5)) else tail + 8 * draw(st.integers(0, cap // 8 + 1))
    budget = draw(st.one_of(st.just(1024), st.integers(0, 6)))
    return data, tail, head, budget


@needs_native
@SETTINGS
@given(rings())
def test_ring_scan(ring: tuple[bytearray, int, int, int]) -> None:
    data, tail, head, budget = ring
    kind, value = same("ring_scan", data, tail, head, budget)
    same("ring_scan", memoryview(data), tail, head, budget)
    if kind == "ok":
        records, new_tail, error = value
        assert tail <= new_tail <= head
        assert len(records) <= budget
        if error is None:
            assert new_tail == head or len(records) == budget


@needs_native
def test_ring_scan_refuses_examples() -> None:
    cap = 64
    data = bytearray(cap)
    struct.pack_into("<IIQQQ", data, 0, 1, 0, 1, 2, 1000)
    assert same("ring_scan", data, 0, 40, 10)[1] == (
        [],
        0,
        "record of 1000 bytes overruns published data",
    )
    struct.pack_into("<IIQQQ", data, 0, 9, 0, 1, 2, 0)
    assert same("ring_scan", data, 0, 32, 10)[1] == ([], 0, "unknown record type 9")
    struct.pack_into("<IIQQQ", data, 0, 1, 3, 1, 2, 0)
    assert same("ring_scan", data, 0, 32, 10)[1] == ([], 0, "record flags 0x3 are not zero")
    struct.pack_into("<IIQQQ", data, 0, 1, 0, 1 << 63, 2, 0)
    assert same("ring_scan", data, 0, 32, 10)[1][2] == f"push view {1 << 63} / offset 2 out of range"
    assert same("ring_scan", data, 0, 72, 10)[0] == "ValueError"


@st.composite
def puts(draw: st.DrawFn) -> tuple[int, int, list[tuple[Any, ...]]]:
    """A ring size, a start position and records to write one after the other (some of them
    out of range: a bad type, field or size)."""
    cap = 8 * draw(st.integers(1, 40))
    start = draw(st.one_of(st.integers(0, 3 * cap), st.sampled_from([U64 - 8, 1 << 63])))
    recs = draw(st.lists(st.tuples(
        st.one_of(st.sampled_from([1, 2]), ints),
        st.one_of(st.integers(0, 9), ints),
        st.one_of(st.integers(0, 9), ints),
        st.binary(max_size=3 * cap // 2),
    ), max_size=4))
    return cap, start, recs


@needs_native
@SETTINGS
@given(puts())
def test_ring_put(case: tuple[int, int, list[tuple[Any, ...]]]) -> None:
    """Both twins write the same bytes and refuse the same records; what they write reads back
    through ring_scan as written, across the ring's wrap."""
    assert native is not None
    cap, start, recs = case
    rings = {name: bytearray(b"\xee" * cap) for name in ("pure", "native")}
    pos = start
    for typ, a, b, payload in recs:
        results = {
            name: outcome(mod.ring_put, memoryview(rings[name]), pos, typ, a, b, payload)
            for name, mod in (("pure", pure), ("native", native))
        }
        assert results["pure"] == results["native"], (typ, a, b, len(payload), pos)
        assert rings["pure"] == rings["native"]
        kind, size = results["pure"]
        if kind != "ok":
            continue
        assert size == 32 + (len(payload) + 7) // 8 * 8
        readable = typ == 2 or (typ == 1 and a < 1 << 63 and b < 1 << 63)
        if readable and pos + size < U64:
            got = same("ring_scan", bytes(rings["pure"]), pos, pos + size, 1)[1]
            assert got == ([(typ, a, b, payload)], pos + size, None)
        pos += size
    assert same("ring_put", bytes(cap), 0, 1, 0, 0, b"") == ("TypeError", "buffer is not writable")


def test_ring_put_refuses_examples() -> None:
    for mod in (pure, native) if native is not None else (pure,):
        with pytest.raises(ValueError, match="whole words"):
            mod.ring_put(bytearray(64), 4, 1, 0, 0, b"")
        with pytest.raises(ValueError, match="does not fit a ring of 64"):
            mod.ring_put(bytearray(64), 0, 1, 0, 0, bytes(33))
        with pytest.raises(ValueError, match="typ must be"):
            mod.ring_put(bytearray(64), 0, 1 << 32, 0, 0, b"")
        data = bytearray(64)
        assert mod.ring_put(data, 48, 2, 7, 3, b"abcdefghij") == 48  # wraps: 16 + 32 bytes
        assert hotpath.ring_scan(data, 48, 96, 9) == ([(2, 7, 3, b"abcdefghij")], 96, None)


# -- decode_plain_call ---------------------------------------------------------------------------

plain_args = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), U64 - 1),  # what msgpack can write
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=300),
)
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


def _packed(obj: object) -> bytes:
    return bytes(msgpack.packb(obj, use_bin_type=True))


@st.composite
def call_bytes(draw: st.DrawFn) -> bytes:
    """Calls as msgpack writes them (plain or not), hand-written variants (non-canonical
    envelopes, kwargs as map16), cut or extended, or with one byte changed."""
    args = draw(st.lists(st.one_of(plain_args, other_args) if draw(st.booleans()) else plain_args,
                         max_size=6))
    kwargs = draw(st.sampled_from([{}, {}, {"k": 1}]))
    data = _packed([draw(method_names), args, kwargs])
    how = draw(st.sampled_from(["as is", "as is", "cut", "extend", "flip", "array16", "map16",
                                "args32"]))
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
        head = _packed(draw(method_names))
        data = b"\x93" + head + b"\xdd" + struct.pack(">I", len(args))
        data += b"".join(_packed(a) for a in args) + _packed(kwargs)
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
        assert repr(calls._decode_call_checked(data, None)) == repr(want[1])
        assert repr(wire.decode_call(data)) == repr(want[1])


def test_decode_plain_call_examples() -> None:
    call = _packed(["Log.append", [b"\x00" * 3, -1, 1.5, None, True, "é", U64 - 1, -(1 << 63)], {}])
    for mod in (pure, native) if native is not None else (pure,):
        assert mod.decode_plain_call(call) == (
            "Log.append", (b"\x00" * 3, -1, 1.5, None, True, "é", U64 - 1, -(1 << 63)), {}
        )
        assert mod.decode_plain_call(bytearray(call)) is None  # bytes only
        assert mod.decode_plain_call(call[:-1]) is None
        assert mod.decode_plain_call(call + b"\x00") is None
        assert mod.decode_plain_call(_packed(["Log.append", [[1]], {}])) is None
        assert mod.decode_plain_call(_packed(["Log.append", [], {"k": 1}])) is None
        assert mod.decode_plain_call(_packed([b"Log.append", [], {}])) is None
        bad_utf8 = b"\x93\xa2\xff\xfe\x90\x80"
        assert mod.decode_plain_call(bad_utf8) is None
        # a count past the bytes left: refused before anything is allocated for it
        assert mod.decode_plain_call(b"\x93\xa1a\xdd\xff\xff\xff\xff\x80") is None


def test_decode_call_checks_the_method_of_a_plain_call() -> None:
    """A plain call with a method that is no dotted identifier still fails as before."""
    for name in ["not a name", "", "a..b", "x" * 600]:
        with pytest.raises(ProtocolViolation, match="method"):
            wire.decode_call(_packed([name, [1], {}]))
    assert wire.decode_call(_packed(["Log.append", [1], {}])) == ("Log.append", (1,), {})


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
        assert want[1] == _packed([method, list(items), {}])
        assert repr(pure.decode_plain_call(want[1])) == repr((method, tuple(items), {}))


def test_encode_plain_call_examples() -> None:
    for mod in (pure, native) if native is not None else (pure,):
        args = (b"x" * 70000, -1, U64 - 1, -(1 << 63), 2.5, None, True, "é" * 20)
        assert mod.encode_plain_call("Log.append", args) == _packed(["Log.append", list(args), {}])
        assert mod.encode_plain_call("Log.append", tuple(range(70000))) == _packed(
            ["Log.append", list(range(70000)), {}]
        )
        for refused in [U64, -(1 << 63) - 1, _Int(1), _Str("s"), "\udc80", [1], bytearray(b"")]:
            assert mod.encode_plain_call("Log.append", (refused,)) is None, refused
        assert mod.encode_plain_call("Log.append", [1]) is None  # args must be a tuple
        assert mod.encode_plain_call(b"Log.append", (1,)) is None
        # bytes over wire.LARGE_BYTES may travel out of band: left to the general encoder
        edge = b"x" * wire.LARGE_BYTES
        assert mod.encode_plain_call("Log.append", (edge,)) == _packed(["Log.append", [edge], {}])
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


# -- words shared between processes -----------------------------------------------------------

_A, _B = 0x00000000000000FF, 0x0000000000000100  # differ in two bytes: a torn word is neither


def _read_words(path: str, impl: str, seconds: float, q: Any) -> None:
    import mmap
    import time

    mod = importlib.import_module(f"derecho_async.{impl}")
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 4096)
    words = memoryview(mm)
    torn = reads = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            v = mod.load_u64(words, 64)
            if v != _A and v != _B:
                torn += 1
        reads += 1000
    words.release()
    mm.close()
    q.put((torn, reads))


@pytest.mark.parametrize("impl", ["_hotpath_pure", "_native"])
def test_a_word_stored_by_one_process_is_never_seen_torn_by_another(
    impl: str, tmp_path: Any
) -> None:
    """A ring counter is stored by one process and loaded by another: each load must see a
    whole word (struct's little-endian packer, which stores byte by byte, fails this)."""
    import mmap
    import multiprocessing
    import time

    if impl == "_native" and native is None:
        pytest.skip("derecho_async._native is not built")
    mod = importlib.import_module(f"derecho_async.{impl}")
    path = str(tmp_path / "word")
    with open(path, "w+b") as f:
        f.truncate(4096)
        mm = mmap.mmap(f.fileno(), 4096)
    words = memoryview(mm)
    mod.store_u64(words, 64, _A)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    reader = ctx.Process(target=_read_words, args=(path, impl, 0.6, q))
    reader.start()
    try:
        end = time.perf_counter() + 8.0
        while reader.is_alive() and time.perf_counter() < end:
            for _ in range(500):
                mod.store_u64(words, 64, _B)
                mod.store_u64(words, 64, _A)
        torn, reads = q.get(timeout=10)
    finally:
        reader.join(5)
        if reader.is_alive():
            reader.kill()
        words.release()
        mm.close()
    assert reads > 0
    assert torn == 0, f"{torn} of {reads} loads saw a torn word"


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
            events.append(("A", 0, 7, i, sender, i,
                           _packed([method, draw(st.lists(plain_args, max_size=3)), {}])))
            continue
        if kind == "not a tuple":
            events.append(["A", 0, 1, 2, 1, 3, b""])
            continue
        if kind == "other payload":
            payload: object = draw(st.sampled_from([
                bytearray(b"\x93"), None, b"", b"\xc0",
                b"\x93\xa2\xff\xfe\x90\x80",  # a method that is not UTF-8
                _packed(["A." + "x" * 70, [], {}]),  # a long method name, not in the table
                _packed(["A.put", [], {"k": 1}]),  # kwargs: not the plain call
            ]))
        else:
            payload = _packed([draw(_dispatch_methods),
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
        put = _packed(["A.put", [b"x", 1], {}])
        cast = _packed(["A.put.cast", [b"y"], {}])
        events = [
            ("A", 0, 7, 10, 1, 3, put),  # a peer's call: run, reply batched
            ("B", 0, 7, 11, 1, 4, put),  # a subgroup not hosted here: skipped
            ("A", 0, 7, 12, 2, 4, cast),  # my one-way call: its future completes
            ("A", 0, 7, 13, 0, 5, _packed(["A.boom", [], {}])),  # raises: to finish
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
