"""What the actor-level schedules record of each call and p2p read (actorsim.py), and what
their checker reads (actorcheck.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CallOutcome", "P2POutcome"]


@dataclass(slots=True)
class CallOutcome:
    """An ordered call a driver made, and what its caller got.

    ``kind`` is "cast" (one-way; ``value`` the version on success), "call" (``value`` the
    Replies), "barrier", or an external client's "client" / "client_cast" (``caller`` is
    then ``-1 - `` the client's index). ``ok`` is False when the call raised at its caller (``value`` the exception)."""

    caller: int
    cid: int
    kind: str
    method: str
    mode: int
    ok: bool | None = None  # None: never finished
    value: object = None
    at: float = 0.0  # virtual time when it finished


@dataclass(slots=True)
class P2POutcome:
    """A p2p read of ``target`` by ``caller``: the state key (and version when versioned)."""

    caller: int
    target: int
    ok: bool | None = None
    value: object = None
    version: tuple[int, int] | None = None
    versioned: bool = False
