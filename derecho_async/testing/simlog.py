"""SimLog, the test actor of the actor-level schedules (actorsim.py), and what its state is.

Theory of operation (docs/DESIGN.md §9.4): a replicated log of call ids with a running hash
(and, in some schedules, a numpy array of counts). Every choice a handler makes (how long it
sleeps, whether it raises and what) comes from the call's own arguments, so every replica does
the same thing; each replica records the start, end, outcome and resulting state of every
handler for the checker (actorcheck.py). Some exceptions cannot be put into words as they are
(a ``__str__`` that raises, a lone surrogate): a replica records the words the contract
promises for them (:func:`outcome_text`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from derecho_async import wire
from derecho_async.api import Actor, ordered, p2p

_np: Any
try:  # numpy is optional: some schedules keep part of the state in an array when it is there
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is a test dependency
    _np = None

__all__ = [
    "CANCEL_AFTER",
    "OK",
    "RAISE_AFTER",
    "RAISE_BEFORE",
    "STOP_AFTER",
    "SURROGATE_AFTER",
    "WEIRD_AFTER",
    "SimLog",
    "SimLogStop",
    "SimLogWeird",
    "StateKey",
    "mix",
    "numpy_available",
    "outcome_text",
    "state_of",
]


def numpy_available() -> bool:
    """Whether numpy is installed (a replica's state then may hold an array)."""
    return _np is not None


_MASK = (1 << 64) - 1
_FNV = 0x100000001B3

# What a handler does, by its ``mode`` argument (drawn by the caller, so all replicas agree).
OK = 0
RAISE_BEFORE = 1  # ValueError before touching the state
RAISE_AFTER = 2  # ValueError after appending
STOP_AFTER = 3  # SimLogStop (a BaseException that is no Exception) after appending
CANCEL_AFTER = 4  # asyncio.CancelledError after appending
WEIRD_AFTER = 5  # SimLogWeird (an Exception whose __str__ raises) after appending
SURROGATE_AFTER = 6  # ValueError with a lone surrogate in its message after appending

StateKey = tuple[int, int, tuple[int, ...]]
"""What identifies a SimLog replica's state: (length of the log, running hash, array counts)."""


class SimLogStop(BaseException):
    """A BaseException (not an Exception, like CancelledError) that SimLog handlers raise."""


class SimLogWeird(Exception):
    """An exception that cannot be put into words: its ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("SimLogWeird has no text")


def outcome_text(exc: BaseException) -> tuple[str, str]:
    """What a handler's exception must read as at every member (README, contract item 8):
    ``(type name, message)``, the message ``str(exc)`` or ``"<Name: str() raised Other>"``
    when that raises, lone surrogates escaped with backslashreplace. (The checker's own
    statement of the rule, not the runtime's code.)"""
    name = type(exc).__name__.encode("utf-8", "backslashreplace").decode()
    try:
        text = str(exc)
    except Exception as failed:
        text = f"<{name}: str() raised {type(failed).__name__}>"
    return name, text.encode("utf-8", "backslashreplace").decode()


def mix(h: int, cid: int) -> int:
    """The running hash of a log after appending call id ``cid``."""
    return ((h ^ cid) * _FNV) & _MASK


def state_of(blob: object) -> StateKey:
    """The StateKey of a SimLog snapshot (``SimLog.snapshot()``'s bytes)."""
    decoded: Any = wire.decode(bytes(blob)) if isinstance(blob, bytes | bytearray) else blob
    log, h, counts = decoded
    return (len(log), int(h), tuple(int(c) for c in counts) if counts is not None else ())


class SimLog(Actor):
    """The test actor: a replicated log of call ids with a running hash (and, in some schedules,
    a numpy array of counts), recording what each handler did at this replica.

    Ordered handlers take ``(cid, mode, ...)``: they append ``cid`` to the log, update the hash
    and return ``(length, hash)``; ``mode`` says whether and how they raise; the async ones sleep
    the virtual delays they are given before appending and between appending and hashing (a p2p
    read in between would see a half-applied call). ``bind`` tells a replica its member id and
    where to record; until then it records nothing.
    """

    def __init__(self) -> None:
        self.log: list[int] = []
        self.h = 0
        self.counts: Any = None  # a numpy int64 array of 8 counts, in some schedules
        self.member = -1
        self.records: list[tuple[object, ...]] | None = None
        self.skew = False  # a deliberately broken replica (to show the checker catches it)
        self.running = 0  # handlers begun and not ended (the run's end waits for them)

    def bind(self, member: int, records: list[tuple[object, ...]], with_array: bool,
             skew: bool = False) -> None:
        self.member = member
        self.records = records
        self.skew = skew
        if with_array and _np is not None:
            self.counts = _np.zeros(8, dtype=_np.int64)

    # -- state -------------------------------------------------------------------------------
    def key(self) -> StateKey:
        counts = tuple(int(c) for c in self.counts) if self.counts is not None else ()
        return (len(self.log), self.h, counts)

    def snapshot(self) -> bytes:
        return wire.encode((self.log, self.h, self.counts))

    def restore(self, state: bytes) -> None:
        decoded: Any = wire.decode(state)
        log, h, counts = decoded
        self.log = list(log)
        self.h = int(h)
        if counts is not None and _np is not None:
            self.counts = _np.array(counts, dtype=_np.int64)
        else:
            self.counts = None
        if self.records is not None:
            self.records.append(("restore", self.key()))

    # -- handlers ----------------------------------------------------------------------------
    def _begin(self, cid: int) -> None:
        self.running += 1
        if self.records is not None:
            self.records.append(("begin", cid))

    def _end(self, cid: int, ok: bool, value: object) -> None:
        self.running -= 1
        if self.records is not None:
            self.records.append(("end", cid, ok, value, self.key()))

    def _append(self, cid: int) -> None:
        self.log.append(cid)

    def _finish_apply(self, cid: int) -> None:
        self.h = mix(self.h, cid + 1 if self.skew and cid % 5 == 0 else cid)
        if self.counts is not None:
            self.counts[cid % 8] += 1

    @staticmethod
    def _raise(mode: int, cid: int) -> None:
        if mode in (RAISE_BEFORE, RAISE_AFTER):
            raise ValueError(f"call {cid} refused")
        if mode == STOP_AFTER:
            raise SimLogStop(f"call {cid} stopped")
        if mode == CANCEL_AFTER:
            raise asyncio.CancelledError(f"call {cid} cancelled")
        if mode == WEIRD_AFTER:
            raise SimLogWeird(cid)
        if mode == SURROGATE_AFTER:
            raise ValueError(f"call {cid} refused \udc80")

    def _outcome(self, cid: int, exc: BaseException) -> None:
        self._end(cid, False, outcome_text(exc))

    @ordered
    def add(self, cid: int, mode: int) -> tuple[int, int]:
        """A plain handler: appends ``cid`` (unless ``mode`` raises first)."""
        self._begin(cid)
        try:
            if mode == RAISE_BEFORE:
                self._raise(mode, cid)
            self._append(cid)
            self._finish_apply(cid)
            self._raise(mode, cid)
        except BaseException as exc:
            self._outcome(cid, exc)
            raise
        result = (len(self.log), self.h)
        self._end(cid, True, result)
        return result

    @ordered
    async def slow(self, cid: int, mode: int, before_s: float, between_s: float) -> tuple[int, int]:
        """An awaiting handler: sleeps ``before_s``, appends, sleeps ``between_s``, hashes."""
        self._begin(cid)
        try:
            if before_s > 0:
                await asyncio.sleep(before_s)
            if mode == RAISE_BEFORE:
                self._raise(mode, cid)
            self._append(cid)
            if between_s > 0:
                await asyncio.sleep(between_s)
            self._finish_apply(cid)
            self._raise(mode, cid)
        except BaseException as exc:
            self._outcome(cid, exc)
            raise
        result = (len(self.log), self.h)
        self._end(cid, True, result)
        return result

    @p2p
    def read(self) -> StateKey:
        """This replica's state key (a read-only p2p call)."""
        return self.key()
