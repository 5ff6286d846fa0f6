"""Ordering and stability maths against a naive twin that enumerates seqs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from derecho_async.core.ordering import frontier, seq_of, stable_limit, turn_of, turns_needed

held_lists = st.lists(st.integers(0, 30), min_size=1, max_size=7)


def naive_frontier(held: list[int]) -> int:
    n = len(held)
    have = {i * n + k for k, h in enumerate(held) for i in range(h)}
    s = 0
    while s in have:
        s += 1
    return s


def naive_needed(me: int, seen: list[int]) -> int:
    """Fewest turns of mine, counted one by one, such that my first uncovered seq lies after
    the whole round of the latest seq any other sender took."""
    n = len(seen)
    last = max((((t - 1) * n + j) for j, t in enumerate(seen) if j != me and t), default=-1)
    round_end = (last // n + 1) * n - 1 if last >= 0 else -1
    mine = 0
    while mine * n + me <= round_end:
        mine += 1
    return mine


@given(held_lists)
def test_frontier_matches_enumeration(held: list[int]) -> None:
    assert frontier(held) == naive_frontier(held)


@given(st.integers(0, 10_000), st.integers(1, 9))
def test_seq_and_turn_are_inverse(seq: int, n: int) -> None:
    turn, k = turn_of(seq, n)
    assert seq_of(turn, k, n) == seq and 0 <= k < n


@given(st.lists(held_lists, min_size=1, max_size=5))
def test_stable_limit_is_held_everywhere(members: list[list[int]]) -> None:
    width = len(members[0])
    rows = [(h + [0] * width)[:width] for h in members]
    limit = stable_limit(frontier(h) for h in rows)
    n = width
    for h in rows:
        have = {i * n + k for k, c in enumerate(h) for i in range(c)}
        assert all(s in have for s in range(limit))


@given(held_lists, st.data())
def test_turns_needed_matches_enumeration(seen: list[int], data: st.DataObject) -> None:
    me = data.draw(st.integers(0, len(seen) - 1))
    need = turns_needed(me, seen)
    # Covered: every seq below the latest other turn is mine or theirs, my turn of that round
    # too; and no turn more than that round.
    n = len(seen)
    last = max((((t - 1) * n + j) for j, t in enumerate(seen) if j != me and t), default=-1)
    assert need == naive_needed(me, seen)
    assert need * n + me > last
    if last >= 0:
        assert need > last // n  # my turn in the latest round is covered
    if need:
        assert (need - 1) * n + me < (last // n + 1) * n
