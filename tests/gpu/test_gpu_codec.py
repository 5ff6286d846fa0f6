"""The codec's path for calls of CuPy arrays alone, on a real device (marker ``gpu``).

A call whose arguments are all distinct CuPy arrays is encoded once per method, dtype and shape
and its bytes reused (``wire.call_memos.device_call``); a member's own such call comes back without a
decode (``wire.own_device_call``). Both must give exactly what the general path gives.
"""

from __future__ import annotations

import pytest

from derecho_async import wire
from derecho_async.errors import ProtocolViolation
from derecho_async.wire.values import encode_call_walked
from tests.gpu import need_cupy

pytestmark = pytest.mark.gpu


def _walked(method: str, args: tuple[object, ...]) -> tuple[bytes, list[object]]:
    """The general path's bytes and buffers (every argument walked, nothing memoized)."""
    buffers: list[object] = []
    return encode_call_walked(method, args, {}, buffers, 0), buffers


def test_a_call_of_device_arrays_alone_encodes_as_the_general_path_and_round_trips() -> None:
    cp = need_cupy()
    method = "Weights.load_pair_for_codec_test"
    for _ in range(3):  # the first fills the memo, the others read it: new arrays each time
        a = cp.ones((16, 4), dtype=cp.float16)
        b = cp.arange(10, dtype=cp.int32)
        buffers: list[object] = []
        data = wire.encode_call(method, (a, b), {}, buffers=buffers)
        want, want_buffers = _walked(method, (a, b))
        assert data == want
        assert buffers == want_buffers and buffers[0] is a and buffers[1] is b
        name, args, kwargs = wire.decode_call(data, buffers=buffers)
        assert name == method and args[0] is a and args[1] is b and kwargs == {}
        own = wire.own_device_call(data, (a, b))
        assert own is not None and own == (method, (a, b), {}) and own[1][0] is a
    # another shape is another encoding, and arrays of the old shape no longer match it
    c = cp.ones((16, 5), dtype=cp.float16)
    other = wire.encode_call(method, (c, b), {}, buffers=[])
    assert other != data
    with pytest.raises(ProtocolViolation):
        wire.decode_call(other, buffers=[a, b])


def test_calls_that_are_not_device_arrays_alone_take_the_general_path() -> None:
    cp = need_cupy()
    a = cp.zeros(8, dtype=cp.float32)
    method = "Weights.mixed_for_codec_test"
    # the same array twice travels once; an array with a scalar; a host array
    for args in ((a, a), (a, 3), (a, cp.asnumpy(a))):
        buffers: list[object] = []
        data = wire.encode_call(method, args, {}, buffers=buffers, inline_bytes=0)
        want_buffers: list[object] = []
        want = encode_call_walked(method, args, {}, want_buffers, 0)
        assert data == want and len(buffers) == len(want_buffers)
        assert wire.own_device_call(data, tuple(buffers)) is None
        name, decoded, _ = wire.decode_call(data, buffers=buffers)
        assert name == method and len(decoded) == len(args)
    # a buffers list that already holds arrays numbers the new ones after them
    held: list[object] = [cp.ones(2)]
    data = wire.encode_call(method, (a,), {}, buffers=held)
    assert len(held) == 2 and held[1] is a
    assert data == encode_call_walked(method, (a,), {}, [cp.ones(2)], 0)


def test_own_device_call_refuses_bytes_it_did_not_make_and_a_wrong_array_count() -> None:
    cp = need_cupy()
    a = cp.zeros(4, dtype=cp.float64)
    method = "Weights.count_for_codec_test"
    data = wire.encode_call(method, (a,), {}, buffers=[])
    assert wire.own_device_call(data, (a,)) == (method, (a,), {})
    assert wire.own_device_call(data, (a, a)) is None
    assert wire.own_device_call(wire.encode_call(method, (1,), {}), ()) is None
