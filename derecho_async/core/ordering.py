"""Round-robin ordering and stability maths (pure functions).

A shard with ``n`` senders orders turn ``i`` of sender index ``k`` at ``seq = i * n + k``. A
member holding the first ``held[k]`` turns of every sender ``k`` (received, payload landed) holds
every seq below its *frontier* ``min_k(held[k] * n + k)``. A seq is stable once it is below every
member's frontier. An idle sender keeps the order moving by covering, with a null record, every
round up to the latest turn any other sender has taken, that turn's round included
(:func:`turns_needed`). Covering the whole round, not only the turns before the latest one, is
what keeps a lone sender's message two hops from stable: by the time sender ``j`` takes turn
``i``, every idle sender covered round ``i - 1`` in reply to ``j``'s turn ``i - 1``, so the
members already hold each other's nulls below ``j``'s new message and need only that message to
advance their frontiers past it. Covering only the turns before ``j``'s would leave each idle
sender's turn ``i - 1`` to be sent in reply to turn ``i``, and a member could not pass ``j``'s
message before another member's null for it arrived: a third hop. The price: a sender that
speaks after the group went quiet takes the next round's turn, and may wait for a
lower-indexed member's null for that round. Over random such senders the two rules come out
even (in synchronous rounds, 3.66 rounds to the sender's delivery with 3 members under either;
a lone sender 3 instead of 4).

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
    """Turns sender ``my_index`` covers when idle: every round up to the latest turn seen from
    any other sender, that round included (the most turns seen from another sender).

    This is one turn more than delivery of their latest turn strictly needs when I come after
    that sender within a round; the module docstring says why it is taken."""
    need = 0
    for j, t in enumerate(seen):
        if j != my_index and t > need:
            need = t
    return need
