"""Tests of derecho_async.wire: round trips, limits, hostile input, call envelopes (buffers:
test_codec_buffers.py)."""

from __future__ import annotations

import collections
import contextlib
import enum
import struct
import subprocess
import sys
from typing import Any, NamedTuple

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from derecho_async.errors import ProtocolViolation, UsageError
from derecho_async.wire import (
    DTYPES,
    MAX_DEPTH,
    MAX_NDIM,
    decode,
    decode_call,
    encode,
    encode_call,
)


@pytest.fixture
def np() -> Any:
    return pytest.importorskip("numpy", reason="numpy is not installed (needed for array tests)")


def assert_same(a: object, b: object) -> None:
    """Equal values of identical types, recursively (1 vs True vs 1.0 and list vs tuple differ)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert list(a) == list(b)
        for ka, kb in zip(a, b, strict=True):
            assert_same(ka, kb)
            assert_same(a[ka], b[kb])
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


def roundtrip(value: object) -> object:
    return decode(encode(value))


def ext(code: int, payload: bytes) -> bytes:
    """A raw msgpack ext 32 record (any code, including the reserved negative ones)."""
    return b"\xc9" + struct.pack(">Ib", len(payload), code) + payload


def pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


# ------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -1,
        2**63 - 1,
        -(2**63),
        2**64 - 1,
        0.0,
        -1.5,
        float("inf"),
        float("nan"),
        "",
        "héllo ✓",
        b"",
        b"\x00\xff",
        [],
        (),
        {},
        [1, [2, [3]]],
        (1, (2,), [3, (4,)]),
        {"a": 1, 2: "b", b"c": None, (1, "x", b"y", (2,)): [()], -5: {}},
        {True: 1, 2: 2},
    ],
    ids=repr,
)
def test_roundtrip_values(value: object) -> None:
    assert_same(roundtrip(value), value)


def test_bytes_like_decode_to_bytes() -> None:
    assert_same(roundtrip(bytearray(b"ab")), b"ab")
    assert_same(roundtrip(memoryview(b"abcd")[1:3]), b"bc")
    assert_same(roundtrip(memoryview(bytes(range(6))).cast("B", (2, 3))), bytes(range(6)))


def test_subclasses_encode_as_base_types() -> None:
    class Colour(enum.IntEnum):
        RED = 1

    class Point(NamedTuple):
        x: int
        y: int

    class Name(str):
        pass

    value = [Colour.RED, Point(1, 2), collections.OrderedDict(a=1), Name("n"), 2.5]
    assert_same(roundtrip(value), [1, (1, 2), {"a": 1}, "n", 2.5])


def test_decode_accepts_bytes_like() -> None:
    data = encode([1, "x"])
    assert decode(bytearray(data)) == [1, "x"]
    assert decode(memoryview(data)) == [1, "x"]
    with pytest.raises(TypeError):
        decode("text")  # type: ignore[arg-type]


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text()
    | st.binary()
)
keys = st.recursive(
    st.text() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.binary(),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=5,
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.dictionaries(keys, inner, max_size=5)
    ),
    max_leaves=30,
)


@given(values)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_roundtrip_property(value: object) -> None:
    assert_same(roundtrip(value), value)


@given(values)
def test_encoding_is_deterministic(value: object) -> None:
    assert encode(value) == encode(value)


# ------------------------------------------------------------------------- encoder rejections


class Foo:
    pass


def test_type_error_names_path() -> None:
    with pytest.raises(TypeError, match=r"^obj\[1\]\['w'\]: cannot encode object of type Foo$"):
        encode([0, {"w": Foo()}])
    with pytest.raises(TypeError, match=r"^args\[1\]\['w'\]: cannot encode object of type Foo$"):
        encode_call("f", (0, {"w": Foo()}), {})
    with pytest.raises(TypeError, match=r"^kwargs\['k'\]\[0\]\[2\]: .* complex$"):
        encode_call("f", (), {"k": ((1, 2, 3j),)})
    with pytest.raises(TypeError, match=r"^obj: cannot encode object of type set$"):
        encode({1})


@pytest.mark.parametrize("key", [1.5, None, frozenset(), (1, 2.0), (1, (None,))], ids=repr)
def test_bad_dict_keys(key: object) -> None:
    with pytest.raises(TypeError, match=r"^obj\[0\]\[.*\]: dict key of type \w+ is not allowed"):
        encode([{key: 1}])


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 10**100])
def test_int_out_of_range(value: int) -> None:
    with pytest.raises(OverflowError, match=r"^obj\['n'\]: int .* outside the 64-bit range"):
        encode({"n": value})
    with pytest.raises(OverflowError):
        encode({value: 1})


def nested(depth: int, leaf: object = 0, kinds: int = 3) -> object:
    value = leaf
    for i in range(depth):
        value = [value] if i % kinds == 0 else (value,) if i % kinds == 1 else {"k": value}
    return value


def test_depth_limit_on_encode() -> None:
    assert_same(roundtrip(nested(MAX_DEPTH)), nested(MAX_DEPTH))
    with pytest.raises(ValueError, match="deeper than"):
        encode(nested(MAX_DEPTH + 1))


def test_lone_surrogate() -> None:
    with pytest.raises(ValueError, match=r"^obj\[0\]\['x\\ud800'\]: str is not valid Unicode"):
        encode([{"x\ud800": 1}])
    with pytest.raises(ValueError, match=r"^obj\[1\]: str is not valid Unicode"):
        encode(("ok", "\udfff"))


def test_no_numpy_import_for_plain_values() -> None:
    code = (
        "import sys; import derecho_async.wire as c; "
        "assert c.decode(c.encode([1, (2,), {'a': b'x'}])) == [1, (2,), {'a': b'x'}]; "
        "assert 'numpy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cyclic_value() -> None:
    cycle: list[object] = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="cyclic"):
        encode(cycle)


# -------------------------------------------------------------------------- hostile input


@given(st.binary(max_size=300))
@settings(max_examples=500)
def test_random_bytes_only_raise_protocol_violation(data: bytes) -> None:
    with contextlib.suppress(ProtocolViolation):
        decode(data)


@given(values, st.data())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_damaged_messages_only_raise_protocol_violation(value: object, data: st.DataObject) -> None:
    good = bytearray(encode(value))
    if data.draw(st.booleans()):
        good = good[: data.draw(st.integers(0, len(good)))]
    else:
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolViolation):
        decode(bytes(good))


@given(st.binary(max_size=200), st.sampled_from([1, 2, 3, 4, 7, -1]))
def test_random_ext_payloads_only_raise_protocol_violation(payload: bytes, code: int) -> None:
    with contextlib.suppress(ProtocolViolation):
        decode(ext(code, payload), buffers=[])


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never used
        b"\x92\x01",  # truncated array
        b"\x01\x02",  # trailing data
        b"\xa2\xff\xfe",  # invalid UTF-8
        b"\xdd\xff\xff\xff\xff",  # array claiming 2**32-1 items
        b"\xdb\xff\xff\xff\xff",  # str claiming 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin claiming 4 GiB
        b"\xdf\xff\xff\xff\xff",  # map claiming 2**32-1 items
        b"\xd6\xff\x00\x00\x00\x01",  # msgpack Timestamp ext
        b"\x81\x91\x01\x02",  # map with a list key
        b"\x81\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x01",  # map with a float key
        b"\x81\xc0\x01",  # map with a nil key
        b"\x91" * 2000 + b"\xc0",  # deep lists
    ],
    ids=lambda b: b[:12].hex(),
)
def test_malformed_input(data: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        decode(data)


def test_decode_depth_limit() -> None:
    assert decode(b"\x91" * MAX_DEPTH + b"\xc0") == nested(MAX_DEPTH, None, kinds=1)
    with pytest.raises(ProtocolViolation, match="deeper"):
        decode(b"\x91" * (MAX_DEPTH + 1) + b"\xc0")


def test_decode_depth_limit_nested_tuples() -> None:
    payload = pack([])
    for _ in range(MAX_DEPTH + 5):
        payload = pack([msgpack.ExtType(1, payload)])
    with pytest.raises(ProtocolViolation, match="deeper"):
        decode(payload)
    payload = pack(0)
    for _ in range(5000):  # would overflow the Python stack without the ext depth counter
        payload = pack(msgpack.ExtType(1, pack([msgpack.ExtType(1, payload)])))[2:]
    with pytest.raises(ProtocolViolation):
        decode(payload)


def test_unknown_ext_type_and_bad_tuple_record() -> None:
    with pytest.raises(ProtocolViolation, match="unknown msgpack ext type 42"):
        decode(ext(42, b""))
    with pytest.raises(ProtocolViolation):
        decode(ext(1, pack({"not": "a list"})))


def test_max_size() -> None:
    data = encode("x" * 100)
    assert decode(data, max_size=len(data)) == "x" * 100
    with pytest.raises(ProtocolViolation, match="exceeds"):
        decode(data, max_size=len(data) - 1)


# -------------------------------------------------------------------------------- numpy


SHAPES = [(), (0,), (1,), (5,), (2, 3), (3, 0, 2), (2, 1, 3, 1)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_numpy_roundtrip(np: Any, dtype: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(7)
    arr = np.asarray(rng.integers(0, 100, size=shape) * 1.5).astype(dtype)
    if dtype.startswith("complex"):
        arr = np.asarray(arr + 1j * arr, dtype=dtype)
    out = decode(encode({"a": arr}))
    assert isinstance(out, dict)
    got = out["a"]
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.dtype(dtype)
    assert got.shape == shape
    assert np.array_equal(got, arr)
    assert got.flags.writeable and got.flags.c_contiguous
    assert not np.shares_memory(got, arr)


@pytest.mark.parametrize(
    "make",
    [
        lambda np: np.arange(24.0).reshape(4, 6)[::2, 1::2],
        lambda np: np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
        lambda np: np.arange(10, dtype=np.uint32)[::-1],
        lambda np: np.arange(6, dtype=">i8").reshape(2, 3),
        lambda np: np.arange(6, dtype=">c16"),
        lambda np: np.broadcast_to(np.arange(3.0), (4, 3)),
        lambda np: np.zeros((2, 3), dtype=bool).T,
    ],
)
def test_numpy_noncontiguous_and_byte_order(np: Any, make: Any) -> None:
    arr = make(np)
    got = roundtrip(arr)
    assert isinstance(got, np.ndarray)
    assert got.shape == arr.shape and got.dtype.name == arr.dtype.name
    assert got.dtype.isnative
    assert np.array_equal(got, arr)
    assert got.flags.writeable and got.flags.c_contiguous


def test_numpy_special_values(np: Any) -> None:
    arr = np.array([np.nan, np.inf, -np.inf, -0.0], dtype=np.float16)
    got = roundtrip(arr)
    assert isinstance(got, np.ndarray)
    assert got.tobytes() == arr.tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_numpy_scalars(np: Any, dtype: str) -> None:
    value = np.dtype(dtype).type(1)
    got = roundtrip([value])
    assert isinstance(got, list)
    assert type(got[0]) is type(value)
    assert got[0] == value


def test_numpy_in_structures_and_calls(np: Any) -> None:
    arr = np.arange(4, dtype=np.float32)
    method, args, kwargs = decode_call(encode_call("W.update", ("fc1", arr), {"scale": arr[:2]}))
    assert method == "W.update"
    assert args[0] == "fc1" and np.array_equal(args[1], arr)
    assert np.array_equal(kwargs["scale"], arr[:2])


@pytest.mark.parametrize(
    "make",
    [
        lambda np: np.array([object()], dtype=object),
        lambda np: np.array(["a"]),
        lambda np: np.array([b"a"]),
        lambda np: np.zeros(2, dtype="datetime64[s]"),
        lambda np: np.zeros(2, dtype=[("x", "f4")]),
        lambda np: np.zeros(2, dtype=np.longdouble),
        lambda np: np.datetime64("2020-01-01"),
    ],
)
def test_numpy_rejected_dtypes(np: Any, make: Any) -> None:
    with pytest.raises(TypeError, match=r"^obj\[0\]: cannot encode numpy data of dtype"):
        encode([make(np)])


def test_numpy_masked_array_rejected(np: Any) -> None:
    with pytest.raises(TypeError, match=r"^obj\['m'\]: cannot encode a masked array"):
        encode({"m": np.ma.masked_array([1, 2], mask=[0, 1])})


def test_numpy_too_many_dims(np: Any) -> None:
    assert roundtrip(np.zeros((1,) * MAX_NDIM)).shape == (1,) * MAX_NDIM  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="dimensions"):
        encode(np.zeros((1,) * (MAX_NDIM + 1)))


def ndarray_ext(dtype: object, shape: object, raw: bytes) -> bytes:
    return ext(2, pack(dtype) + pack(shape) + raw)


@pytest.mark.parametrize(
    ("dtype", "shape", "raw"),
    [
        ("object", [1], b"\x00" * 8),
        ("float128", [1], b"\x00" * 16),
        ("<f8", [1], b"\x00" * 8),
        (7, [1], b"\x00" * 8),
        ("float64", [-1], b""),
        ("float64", [2], b"\x00" * 15),  # truncated
        ("float64", [2], b"\x00" * 17),  # too long
        ("float64", [2**40, 2**40], b"\x00" * 8),
        ("float64", [True], b"\x00" * 8),
        ("float64", [1.0], b"\x00" * 8),
        ("float64", 3, b"\x00" * 8),
        ("float64", [1] * (MAX_NDIM + 1), b"\x00" * 8),
        ("float64", [2**63, 0], b""),
        ("int8", [2**62, 2**62, 0, 5], b""),
    ],
)
def test_numpy_malformed_records(np: Any, dtype: object, shape: object, raw: bytes) -> None:
    with pytest.raises(ProtocolViolation):
        decode(ndarray_ext(dtype, shape, raw))


def test_numpy_record_with_zero_dim_but_huge_other_dim(np: Any) -> None:
    got = decode(ndarray_ext("int8", [2**40, 0], b""))
    assert isinstance(got, np.ndarray) and got.shape == (2**40, 0)


def test_numpy_scalar_malformed(np: Any) -> None:
    with pytest.raises(ProtocolViolation):
        decode(ext(3, pack("float64") + b"\x00" * 7))
    with pytest.raises(ProtocolViolation):
        decode(ext(3, pack("object") + b"\x00" * 8))


@given(st.data())
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
def test_numpy_property_roundtrip_and_damage(data: st.DataObject) -> None:
    np = pytest.importorskip("numpy", reason="numpy is not installed (needed for array tests)")
    from hypothesis.extra import numpy as hnp

    dtype = data.draw(st.sampled_from(list(DTYPES)))
    order = data.draw(st.sampled_from("<>"))
    arr = data.draw(
        hnp.arrays(np.dtype(dtype).newbyteorder(order), hnp.array_shapes(min_dims=0, min_side=0))
    )
    if arr.ndim and data.draw(st.booleans()):
        arr = arr[::-1]
    value = [arr, (np.dtype(dtype).type(0),)]
    got = decode(encode(value))
    assert isinstance(got, list)
    assert got[0].dtype.name == dtype and got[0].shape == arr.shape
    assert got[0].tobytes() == arr.astype(got[0].dtype).tobytes()
    damaged = bytearray(encode(value))
    damaged[data.draw(st.integers(0, len(damaged) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(ProtocolViolation):
        decode(bytes(damaged))
    with contextlib.suppress(ProtocolViolation):
        decode(bytes(damaged[: data.draw(st.integers(0, len(damaged)))]))


@given(st.binary(max_size=64))
def test_numpy_random_array_payloads(data: bytes) -> None:
    pytest.importorskip("numpy")
    with contextlib.suppress(ProtocolViolation):
        decode(ext(2, data))
    with contextlib.suppress(ProtocolViolation):
        decode(ext(2, pack("uint8") + data))


def test_decode_without_numpy(monkeypatch: pytest.MonkeyPatch, np: Any) -> None:
    data = encode(np.zeros(3))
    monkeypatch.setitem(sys.modules, "numpy", None)
    assert roundtrip([1, (2,)]) == [1, (2,)]
    with pytest.raises(UsageError, match="numpy is not installed"):
        decode(data)


# ------------------------------------------------------------------------------- envelopes


def test_call_roundtrip() -> None:
    method, args, kwargs = decode_call(encode_call("update", (1, [2], (3,)), {"name": "fc1"}))
    assert method == "update"
    assert_same(args, (1, [2], (3,)))
    assert_same(kwargs, {"name": "fc1"})
    assert decode_call(encode_call("Actor.m_2", (), {})) == ("Actor.m_2", (), {})


@pytest.mark.parametrize(
    ("method", "args", "kwargs"),
    [
        ("", (), {}),
        ("1abc", (), {}),
        ("a..b", (), {}),
        ("a b", (), {}),
        (3, (), {}),
        ("f", [1], {}),
        ("f", (), [("a", 1)]),
        ("f", (), {"not-ident": 1}),
        ("f", (), {1: 1}),
    ],
)
def test_encode_call_usage_errors(method: Any, args: Any, kwargs: Any) -> None:
    with pytest.raises(UsageError):
        encode_call(method, args, kwargs)


@pytest.mark.parametrize(
    "envelope",
    [
        [],
        ["f", []],
        ["f", [], {}, None],
        [None, [], {}],
        ["", [], {}],
        ["f g", [], {}],
        ["f", {}, {}],
        ["f", [], []],
        ["f", [], {1: 2}],
        ["f", [], {"a-b": 2}],
        {"method": "f"},
        "f",
    ],
    ids=repr,
)
def test_decode_call_rejects_bad_envelopes(envelope: object) -> None:
    with pytest.raises(ProtocolViolation, match="envelope"):
        decode_call(pack(envelope))


def test_decode_call_rejects_tuple_args() -> None:
    with pytest.raises(ProtocolViolation):
        decode_call(encode(["f", (1,), {}]))


@given(st.binary(max_size=200))
def test_decode_call_random_bytes(data: bytes) -> None:
    with contextlib.suppress(ProtocolViolation):
        decode_call(data)
