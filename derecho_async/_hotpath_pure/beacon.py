"""Twin of ``native/beacon.c``: the liveness beacon, as a Python thread.

The same functions, arguments, checks and error messages. Unlike the C thread it needs the GIL:
it still counts while a handler runs Python (the interpreter hands the GIL over every few
milliseconds), but not while one C call holds the GIL throughout.
"""

from __future__ import annotations

import threading
import time

from derecho_async._hotpath_pure.words import WORD, Buffer

__all__ = [
    "Beacon",
    "beacon_add",
    "beacon_count",
    "beacon_remove",
    "beacon_start",
    "beacon_stop",
    "beacon_touch",
]


class Beacon:
    """A running beacon (the handle :func:`beacon_start` returns)."""

    def __init__(self, period_s: float, hold_s: float) -> None:
        self.period_s = period_s
        self.hold_s = hold_s
        self.touched = time.monotonic()
        self.count = 0
        self.targets: dict[int, tuple[memoryview, int]] = {}
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._main, name="derecho-beacon", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        due = time.monotonic()
        with self.cond:
            while not self.stopped:
                now = time.monotonic()
                if self.hold_s == 0 or now - self.touched <= self.hold_s:
                    self.count += 1
                    for view, off in self.targets.values():
                        view[off : off + WORD] = self.count.to_bytes(WORD, "little")
                due += self.period_s
                if due < now:
                    due = now + self.period_s
                while not self.stopped:
                    left = due - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)


def _seconds(value: object, name: str, lo: float) -> float:
    try:
        s = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"must be real number, not {type(value).__name__}") from None
    if not lo <= s <= 3600.0:
        raise ValueError(f"{name} must be a number of seconds in [{lo:g}, 3600]")
    return s


def _beacon(obj: object) -> Beacon:
    if not isinstance(obj, Beacon):
        raise TypeError("expected a beacon from beacon_start")
    return obj


def beacon_start(period_s: float, hold_s: float) -> Beacon:
    """Start a liveness thread that, every ``period_s``, stores a growing count into its target
    words while the loop touched it within ``hold_s`` (0: always)."""
    return Beacon(_seconds(period_s, "period_s", 0.001), _seconds(hold_s, "hold_s", 0.0))


def beacon_add(beacon: object, key: int, target: tuple[Buffer, int]) -> None:
    """Count into the u64 at ``offset`` of the writable ``buf`` too (``target`` is
    ``(buf, offset)``), replacing the target of the same key."""
    b = _beacon(beacon)
    buf, offset = target
    if b.stopped:
        raise ValueError("the beacon is stopped")
    view = memoryview(buf).cast("B")
    if view.readonly:
        view.release()
        raise BufferError("Object is not writable.")
    if not 0 <= offset <= len(view) - WORD:
        n = len(view)
        view.release()
        raise IndexError(f"word at offset {offset} is outside a buffer of {n} bytes")
    with b.cond:
        view[offset : offset + WORD] = b.count.to_bytes(WORD, "little")
        old = b.targets.pop(key, None)
        b.targets[key] = (view, offset)
    if old is not None:
        old[0].release()


def beacon_remove(beacon: object, key: int) -> bool:
    """Stop counting into ``key``'s word and unpin its buffer; whether it was there."""
    b = _beacon(beacon)
    with b.cond:
        gone = b.targets.pop(key, None)
    if gone is None:
        return False
    gone[0].release()
    return True


def beacon_touch(beacon: object) -> None:
    """The loop runs (the hold limit counts from now)."""
    _beacon(beacon).touched = time.monotonic()


def beacon_count(beacon: object) -> int:
    """The count last stored."""
    b = _beacon(beacon)
    with b.cond:
        return b.count


def beacon_stop(beacon: object) -> None:
    """End the thread and unpin every buffer (idempotent)."""
    b = _beacon(beacon)
    with b.cond:
        b.stopped = True
        b.cond.notify_all()
    if b.thread.is_alive() and b.thread is not threading.current_thread():
        b.thread.join()
    with b.cond:
        views = [v for v, _ in b.targets.values()]
        b.targets.clear()
    for v in views:
        v.release()
