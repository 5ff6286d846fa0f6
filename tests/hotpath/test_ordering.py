"""The ordering maths of the twins (frontier, turns_needed) agrees with each other and with
derecho_async.core.ordering (derecho_async/_hotpath_pure/ordering.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.hotpath.twins import SETTINGS, needs_native, same

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
