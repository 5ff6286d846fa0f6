"""What the hot-path tests share: both twins, the check that they agree, and the strategies
several concerns draw from.

Every function of the C extension is run on the same Hypothesis-generated inputs as the pure
twin, and must return the same value or raise the same exception with the same message. The
inputs include hostile buffer contents (bad record headers, lengths past the data, offsets
outside the buffer), which the C code must refuse exactly as the twin does.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure

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
# a header word of a slot or ring record: mostly small, sometimes anything
field = st.one_of(st.integers(0, 12), st.integers(0, U64 - 1))
# call arguments the plain call codec takes as they are
plain_args = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), U64 - 1),  # what msgpack can write
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=300),
)


def outcome(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """What calling ``fn(*args)`` comes to: ("ok", value) or (exception type name, message)."""
    try:
        return "ok", fn(*args)
    except Exception as exc:
        return type(exc).__name__, str(exc)


def same(name: str, *args: Any) -> tuple[str, Any]:
    """The outcome of the function ``name`` of the pure twin, checked equal to the native one's."""
    assert native is not None
    want = outcome(getattr(pure, name), *args)
    got = outcome(getattr(native, name), *args)
    assert got == want, f"{name}{args!r}: native {got!r}, pure {want!r}"
    return want


def packed(obj: object) -> bytes:
    """``obj`` as msgpack writes it (what the call codec writes)."""
    return bytes(msgpack.packb(obj, use_bin_type=True))
