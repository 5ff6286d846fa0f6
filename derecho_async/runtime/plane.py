"""The data-plane protocol: what the driver asks of every plane that moves large payloads.

Theory of operation: the driver offers each transfer to its planes in order
(:meth:`derecho_async.runtime.driver.Driver.start_transfer`); the first whose ``start`` takes it
owns it, and host staging (:mod:`.dataplane`) takes what none took. Frames come back by envelope
kind to the plane that listed the kind. See docs/DESIGN.md §6.2.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Plane"]


class Plane(Protocol):
    """A data plane the driver routes payloads to (see :mod:`derecho_async.runtime.driver`).

    ``kinds`` are the envelope kinds it receives. ``start`` ships a payload for data key ``key``
    (view_id, sender, msg_no) to ``targets`` and returns True, or returns False at once, doing
    nothing, when it does not move that payload (the driver offers it to the next plane).
    ``receive`` takes one of its frames, decoded (``raw`` is the encoded frame, for relaying),
    and calls the driver's ``landed(key, payload)`` once the payload is complete here; it raises
    :class:`ProtocolViolation` for a bad frame. ``on_own_delivered`` is told when this member
    delivered its own message ``key`` (stable: it landed everywhere); ``on_event`` sees every
    other core event in order (view installs, leaving); ``close`` releases what it holds.
    """

    kinds: tuple[int, ...]

    def start(self, key: tuple[int, int, int], payload: object, targets: tuple[int, ...]) -> bool:
        ...

    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None: ...

    def on_own_delivered(self, key: tuple[int, int, int]) -> None: ...

    def on_event(self, event: object) -> None: ...

    def close(self) -> None: ...
