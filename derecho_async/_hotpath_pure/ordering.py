"""The ordering maths over per-sender turn counts: the pure twin of ``native/ordering.c``.

:func:`frontier` is the lowest seq not yet held (seq = turn * n + sender index);
:func:`turns_needed` the turns an idle sender covers with a null (docs/DESIGN.md §4.2, §8).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MAX_TURN", "frontier", "turns_needed"]

MAX_TURN = 1 << 56


def _turns(values: Sequence[int], what: str) -> list[int]:
    out = []
    for v in values:
        if not isinstance(v, int):
            raise TypeError(what)
        if not 0 <= v <= MAX_TURN:
            raise OverflowError("turn counts must lie in [0, 2**56]")
        out.append(v)
    return out


def frontier(held: Sequence[int], /) -> int:
    """Lowest seq not held: ``min(held[k] * n + k)`` over the ``n`` senders (1..64 of them)."""
    vals = _turns(held, "held must be a sequence of ints")
    n = len(vals)
    if n == 0:
        raise ValueError("frontier of no senders")
    if n > 64:
        raise ValueError("at most 64 senders")
    return min(h * n + k for k, h in enumerate(vals))


def turns_needed(my_index: int, seen: Sequence[int], /) -> int:
    """Turns sender ``my_index`` covers when idle: the most turns seen from any other sender
    (see :func:`derecho_async.core.ordering.turns_needed`)."""
    vals = _turns(seen, "seen must be a sequence of ints")
    need = 0
    for j, t in enumerate(vals):
        if j != my_index and t > need:
            need = t
    return need
