"""bytes_copy of the twins agrees on every shape a received payload takes
(derecho_async/_hotpath_pure/bytescopy.py)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from tests.hotpath.twins import SETTINGS, native, needs_native, same

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
