"""Round-robin ordering and stability maths (pure functions).

A shard with ``n`` senders orders turn ``i`` of sender index ``k`` at ``seq = i * n + k``. A
member holding the first ``held[k]`` turns of every sender ``k`` (received, payload landed) holds
every seq below its *frontier* ``min_k(held[k] * n + k)``. A seq is stable once it is below every
member's frontier. An idle sender keeps the order moving by covering, with a null record, the
turns that precede the latest turn any other sender has taken (:func:`turns_needed`).

``tests/test_ordering.py`` checks each function against a naive enumeration twin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["frontier", "seq_of", "stable_limit", "turn_of", "turns_needed"]


def seq_of(turn: int, sender_index: int, n_senders: int) -> int:
    """The global seq of turn ``turn`` of sender index ``sender_index``."""
    return turn * n_senders + sender_index


def turn_of(seq: int, n_senders: int) -> tuple[int, int]:
    """``(turn, sender_index)`` of ``seq``."""
    return divmod(seq, n_senders)


def frontier(held: Sequence[int]) -> int:
    """Lowest seq not held, given the number of leading turns held per sender."""
    n = len(held)
    return min(h * n + k for k, h in enumerate(held))


def stable_limit(frontiers: Iterable[int]) -> int:
    """Every seq below the returned value is held by every member."""
    return min(frontiers)


def turns_needed(my_index: int, seen: Sequence[int]) -> int:
    """Turns sender ``my_index`` must have covered so that the latest turn seen from every other
    sender can be delivered: every turn of mine with a lower seq than theirs."""
    need = 0
    for j, t in enumerate(seen):
        if j == my_index or t == 0:
            continue
        # The last turn of sender j has seq (t-1)*n + j; my turns below it: t if I precede j
        # within a round, t-1 otherwise.
        need = max(need, t if my_index < j else t - 1)
    return need
