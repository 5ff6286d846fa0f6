"""Words: load_u64, store_u64, min_u64 and fence of the twins agree, and a word stored by one
process is never seen torn by another (derecho_async/_hotpath_pure/words.py)."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from tests.hotpath.twins import SETTINGS, ints, native, needs_native, outcome, same

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
