"""The wire's caches (derecho_async.wire.caches): bounded, and never a cause of a different result."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from derecho_async import wire
from derecho_async.errors import ProtocolViolation
from derecho_async.wire import caches
from derecho_async.wire.caches import ALL_CACHES, BoundedCache, clear_all


@pytest.fixture(autouse=True)
def fresh_caches() -> Iterator[None]:
    clear_all()
    yield
    clear_all()  # what the tests put in (junk included) is gone for the other tests


def test_a_cache_keeps_what_it_has_once_full() -> None:
    cache: BoundedCache[str, int] = BoundedCache("test", 2)
    assert cache.put("a", 1) and cache.put("b", 2)
    assert cache.full() and len(cache) == 2
    assert not cache.put("c", 3)
    assert cache.table == {"a": 1, "b": 2}
    assert "test: 2 of 2" in repr(cache)
    with pytest.raises(ValueError, match="max_size"):
        BoundedCache("bad", -1)


def test_clear_empties_the_table_in_place() -> None:
    cache: BoundedCache[str, int] = BoundedCache("test", 4)
    bound = cache.table  # as a hot path binds it at import
    cache.put("a", 1)
    cache.clear()
    assert cache.table is bound and not bound
    assert cache.put("b", 2) and bound == {"b": 2}


def test_every_cache_of_the_wire_is_listed_once() -> None:
    made = [v for v in vars(caches).values() if isinstance(v, BoundedCache)]
    assert sorted(id(c) for c in made) == sorted(id(c) for c in ALL_CACHES)
    assert len({c.name for c in ALL_CACHES}) == len(ALL_CACHES)
    assert all(c.max_size > 0 for c in ALL_CACHES)


class _Dtype:
    def __init__(self, typestr: str) -> None:
        self.str = typestr
        self.fields = None


class ndarray:  # named and placed as CuPy's: the codec reads it as a CuPy array
    __module__ = "cupy._core.core"

    def __init__(self, typestr: str, shape: tuple[int, ...]) -> None:
        self.dtype = _Dtype(typestr)
        self.shape = shape


def _workload() -> list[str]:
    """Encode and decode the calls and values that fill each cache; their reprs."""
    np: Any = pytest.importorskip("numpy")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.arange(5, dtype=">i8")  # swapped to little-endian on the wire
    out: list[str] = []
    for _ in range(2):  # the second round hits what the first one remembered (if there is room)
        out.append(repr(wire.decode(wire.encode([x, y, np.float64(2.5), (1, "s")]))))
        out.append(repr(wire.decode_call(wire.encode_call("Log.append", (1, b"x"), {}))))
        for inline in (0, 1 << 20):
            buffers: list[object] = []
            data = wire.encode_call("W.update", ("fc1", x), {"bias": y}, buffers=buffers,
                                    inline_bytes=inline)
            received = [np.array(b) for b in buffers]  # the receiver's own arrays
            out.append(repr((data, wire.decode_call(data, received))))
        a, b = ndarray("<f4", (2, 3)), ndarray("<i8", (4,))
        held: list[object] = []
        data = wire.encode_call("W.load", (a, b), {}, buffers=held)  # the device-call memo
        own = wire.own_device_call(data, (a, b))  # None when the memo had no room
        call = own if own is not None else wire.decode_call(data, held)
        out.append(repr((data, held == [a, b], call == ("W.load", (a, b), {}))))
        bad = wire.encode_call("W.update", (x,), {}, buffers=[])
        with pytest.raises(ProtocolViolation, match="buffer 0"):
            wire.decode_call(bad, [np.zeros(3, np.float32)])
    return out


def test_full_caches_give_the_same_results() -> None:
    want = _workload()
    assert all(len(c) for c in ALL_CACHES)  # the workload fills every table
    clear_all()
    for cache in ALL_CACHES:  # fill every table with keys no real call makes
        for i in range(cache.max_size):
            cache.put(("junk", i), None)
        assert cache.full()
    assert _workload() == want
    assert all(len(c) == c.max_size for c in ALL_CACHES)  # nothing got past a bound
