"""Tests of derecho_async.wire with out-of-band buffers: arrays and large byte strings beside the
message, references checked on decode, the memo of such calls."""

from __future__ import annotations

import struct
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from derecho_async.errors import ProtocolViolation
from derecho_async.wire import LARGE_BYTES, decode, decode_call, encode, encode_call


@pytest.fixture
def np() -> Any:
    return pytest.importorskip("numpy", reason="numpy is not installed (needed for array tests)")


def ext(code: int, payload: bytes) -> bytes:
    """A raw msgpack ext 32 record (any code, including the reserved negative ones)."""
    return b"\xc9" + struct.pack(">Ib", len(payload), code) + payload


def pack(obj: object) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


# ----------------------------------------------------------------------- out-of-band buffers


class FakeCuda:
    """Stands in for a CuPy array or CUDA torch tensor."""

    def __init__(self, typestr: str, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {
            "typestr": typestr,
            "shape": shape,
            "data": (0, False),
            "version": 3,
        }


class FakeDlpack:
    """Stands in for a torch / JAX array exposing DLPack."""

    def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
        self.dtype = dtype
        self.shape = shape

    def __dlpack__(self) -> object:
        raise NotImplementedError


def test_device_array_needs_buffers() -> None:
    with pytest.raises(TypeError, match=r"^obj\[0\]: .*FakeCuda.*buffers=\[\]"):
        encode([FakeCuda("<f4", (2,))])


def test_buffers_numpy(np: Any) -> None:
    a = np.arange(600.0).reshape(20, 30)
    b = np.arange(4, dtype=np.int8)[::2]
    buffers: list[object] = []
    data = encode({"a": a, "again": a, "b": (b,), "n": 1}, buffers)
    assert len(buffers) == 2
    assert buffers[0] is a
    assert isinstance(buffers[1], np.ndarray) and buffers[1].flags.c_contiguous
    assert len(data) < 200  # nothing inline
    out = decode(data, buffers)
    assert isinstance(out, dict)
    assert out["a"] is buffers[0] and out["again"] is buffers[0]
    assert out["b"][0] is buffers[1] and out["n"] == 1
    # The receiver supplies its own copies (here: a tuple of fresh arrays).
    out = decode(data, (np.array(a), np.array([0, 2], dtype=np.int8)))
    assert isinstance(out, dict) and np.array_equal(out["a"], a)


def test_buffers_device_objects() -> None:
    sent = [FakeCuda("<f4", (2, 3)), FakeDlpack("torch.float16", (4,)), FakeCuda("|u1", ())]
    buffers: list[object] = []
    data = encode_call("W.update", tuple(sent), {}, buffers)
    assert buffers == sent
    received = [FakeDlpack("float32", (2, 3)), FakeCuda("<f2", (4,)), FakeDlpack("uint8", ())]
    method, args, kwargs = decode_call(data, received)
    assert (method, list(args), kwargs) == ("W.update", received, {})


def test_a_repeated_out_of_band_call_gets_each_messages_own_buffers(np: Any) -> None:
    sent = np.zeros((2, 3), dtype=np.float32)
    buffers: list[object] = []
    data = encode_call("W.update", (sent, "fc1", 7), {"scale": 0.5, "w": sent}, buffers)
    for i in range(3):  # the same bytes each time (as a sender's repeated calls make them)
        received = [np.full((2, 3), i, dtype=np.float32)]
        method, args, kwargs = decode_call(data, received)
        assert method == "W.update" and args[1:] == ("fc1", 7)
        assert args[0] is received[0] and kwargs["w"] is received[0]
        assert kwargs == {"scale": 0.5, "w": received[0]}
        kwargs["extra"] = i  # a handler may change what it was given: the next call is unaffected
    with pytest.raises(ProtocolViolation, match=r"\(6,\)"):
        decode_call(data, [np.zeros(6, dtype=np.float32)])
    with pytest.raises(ProtocolViolation, match="float64"):
        decode_call(data, [np.zeros((2, 3))])
    with pytest.raises(ProtocolViolation, match="out of range"):
        decode_call(data, [])
    # containers in the arguments are new objects at every decode
    data = encode_call("f", ([1, 2], sent), {}, buffers := [])
    for _ in range(2):
        _, args, _ = decode_call(data, [np.ones((2, 3), dtype=np.float32)])
        assert args[0] == [1, 2]
        args[0].append(3)


def test_remembered_calls_and_references_keep_every_check(np: Any) -> None:
    union = np.dtype((np.float32, {"lo": (np.int16, 0), "hi": (np.int16, 2)}))  # str is '<f4'
    data = encode_call("take", (np.zeros(3, dtype=np.float32),), {}, buffers=[])
    x = np.ones(3, dtype=np.float32)
    decode_call(data, [x, x])  # one object twice: the reference's own index still decides
    b, c = np.full(3, 2, dtype=np.float32), np.full(3, 3, dtype=np.float32)
    assert decode_call(data, [b, c])[1][0] is b
    assert decode_call(data, [c])[1][0] is c
    with pytest.raises(ProtocolViolation, match="dtype"):
        decode_call(data, [np.zeros(3, dtype=union)])
    encode_call("take", (np.zeros(3, dtype=np.float32),), {}, buffers=[])
    with pytest.raises(TypeError, match="dtype"):
        encode_call("take", (np.zeros(3, dtype=union),), {}, buffers=[])


@pytest.mark.parametrize(
    "obj",
    [
        FakeCuda(">f4", (2,)),
        FakeCuda("<M8", (2,)),
        FakeDlpack("torch.bfloat16", (2,)),
        FakeCuda("<f4", (-1,)),
    ],
)
def test_buffers_unsupported_device_dtype(obj: object) -> None:
    with pytest.raises(TypeError, match=r"^obj\[0\]: "):
        encode([obj], [])


def test_buffer_reference_validation(np: Any) -> None:
    buffers: list[object] = []
    data = encode([np.zeros((2, 2), dtype=np.float32)], buffers)
    with pytest.raises(ProtocolViolation, match="none were given"):
        decode(data)
    with pytest.raises(ProtocolViolation, match="out of range"):
        decode(data, [])
    with pytest.raises(ProtocolViolation, match="float64"):
        decode(data, [np.zeros((2, 2))])
    with pytest.raises(ProtocolViolation, match=r"\(4,\)"):
        decode(data, [np.zeros(4, dtype=np.float32)])
    with pytest.raises(ProtocolViolation):
        decode(data, ["not an array"])


@pytest.mark.parametrize(
    "fields",
    [
        [0, "float32", [2], "numpy", "extra"],
        [-1, "float32", [2], "numpy"],
        [True, "float32", [2], "numpy"],
        [0, "object", [2], "numpy"],
        [0, "float32", [-2], "numpy"],
        [0, "float32", [2], "pickle"],
        {"index": 0},
    ],
)
def test_malformed_buffer_references(fields: object) -> None:
    with pytest.raises(ProtocolViolation):
        decode(ext(4, pack(fields)), [FakeCuda("<f4", (2,))])


# ------------------------------------------------------------------ large byte strings


def test_large_byte_strings_travel_out_of_band_and_decode_as_bytes(np: Any) -> None:
    big = bytes(range(256)) * ((LARGE_BYTES >> 8) + 1)
    mutable = bytearray(big[: LARGE_BYTES + 1])
    view = memoryview(big).cast("I")  # any format: its bytes travel
    buffers: list[object] = []
    data = encode_call("Blob.put", (big, mutable), {"v": [view], "again": big}, buffers)
    assert len(data) < 200  # nothing inline
    assert len(buffers) == 3  # the same object twice travels once
    src: Any
    b: Any
    for b, src in zip(buffers, (big, mutable, view), strict=True):
        assert type(b) is np.ndarray and b.dtype == np.uint8 and b.ndim == 1
        assert b.nbytes == memoryview(src).nbytes and not b.flags.writeable  # a view, no copy
    # the sender's own arrays: a whole view of a bytes object gives that object back
    method, args, kwargs = decode_call(data, buffers)
    assert method == "Blob.put" and args[0] is big and kwargs["again"] is big
    assert type(args[1]) is bytes and args[1] == mutable
    assert kwargs["v"] == [big]
    # a receiver's own copies decode as new bytes objects
    received = [np.array(b) for b in buffers]
    _, args, kwargs = decode_call(data, received)
    assert (args[0], args[1], kwargs["v"]) == (big, bytes(mutable), [big])
    assert all(type(v) is bytes for v in (*args, kwargs["again"]))
    # decode() takes them too
    out: list[object] = []
    assert decode(encode(big, out), out) is big


def test_byte_strings_up_to_the_threshold_stay_inline(np: Any) -> None:
    edge = b"x" * LARGE_BYTES
    buffers: list[object] = []
    data = encode_call("Blob.put", (edge,), {}, buffers)
    assert buffers == [] and decode_call(data) == ("Blob.put", (edge,), {})
    data = encode_call("Blob.put", (edge + b"y",), {})  # without buffers: inline
    assert decode_call(data) == ("Blob.put", (edge + b"y",), {})
    strided = memoryview(edge + b"yz")[::2]  # not contiguous: copied inline, as before
    data = encode_call("Blob.put", ([strided],), {}, buffers)
    assert buffers == [] and decode_call(data)[1] == ([strided.tobytes()],)
    data = encode_call("Blob.put", (edge + b"y",), {}, buffers, inline_bytes=1 << 30)
    assert len(buffers) == 1  # the array budget does not keep a large byte string inline


def test_a_repeated_call_of_a_large_byte_string_gets_each_messages_bytes(np: Any) -> None:
    n = LARGE_BYTES + 8
    data = encode_call("Blob.put", (bytes(n), 3), {}, [])
    for i in range(3):  # the same call bytes each time: never answered from a memo
        _, args, _ = decode_call(data, [np.full(n, i, dtype=np.uint8)])
        assert args == (bytes([i]) * n, 3)


@pytest.mark.parametrize(
    ("fields", "buffer", "match"),
    [
        ([0, "float32", [4], "bytes"], ("uint8", 4), "uint8 of one dimension"),
        ([0, "uint8", [2, 2], "bytes"], ("uint8", 4), "uint8 of one dimension"),
        ([0, "uint8", [], "bytes"], ("uint8", 4), "uint8 of one dimension"),
        ([0, "uint8", [5], "bytes"], ("uint8", 4), r"uint8\(4,\) but the message says bytes of 5"),
        ([0, "uint8", [4], "bytes"], ("int8", 4), r"int8\(4,\)"),
        ([0, "uint8", [4], "bytes"], ("uint8", (2, 2)), r"uint8\(2, 2\)"),
        ([0, "uint8", [4], "bytes"], ("bytes", 4), "not an array"),
        ([1, "uint8", [4], "bytes"], ("uint8", 4), "out of range"),
    ],
)
def test_hostile_bytes_references_are_refused(
    np: Any, fields: list[object], buffer: tuple[str, Any], match: str
) -> None:
    kind, shape = buffer
    buf: object = b"abcd" if kind == "bytes" else np.zeros(shape, dtype=kind)
    with pytest.raises(ProtocolViolation, match=match):
        decode_call(pack(["Blob.put", [msgpack.ExtType(4, pack(fields))], {}]), [buf])
