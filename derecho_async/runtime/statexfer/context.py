"""What both ends of a member's state transfer share: its driver, actors and runners, the
settings, the view, how to send a STATE_* message, and the logger.

Theory of operation: :class:`StateTransfer` builds one :class:`Context` and hands it to its
:class:`Sponsor` and :class:`Joiner`, so neither knows the other. See docs/DESIGN.md §7.7.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from derecho_async.core import View

if TYPE_CHECKING:
    from derecho_async.api.actor import Actor
    from derecho_async.runtime.driver import Driver
    from derecho_async.runtime.observer import GroupObserver
    from derecho_async.runtime.runner import SerialRunner

__all__ = [
    "CLIENTS_KEY",
    "LOG_EVERY_S",
    "LOG_SUFFIX_KEY",
    "Context",
    "Holder",
    "ReplicatedTable",
    "StateLog",
    "failure",
    "log",
    "restore_reason",
]

log = logging.getLogger("derecho_async.statexfer")
"""The logger of both ends (one name, whichever module logs)."""

LOG_EVERY_S = 2.0
"""Seconds between two progress lines of a running transfer."""


LOG_SUFFIX_KEY = "~log"
"""The state map's entry (no actor's name) for actors whose state travels as a log suffix."""


CLIENTS_KEY = "~clients"
"""The state map's entry for the tables of external clients' calls of the actors sent by
snapshot (actor name -> encoded table; the API layer's ``ClientCalls``)."""


class ReplicatedTable(Protocol):
    """State kept beside an actor's own and sent with its snapshot (the API layer's table of
    external clients' calls)."""

    def __len__(self) -> int: ...

    def encode(self) -> list[object]:
        """The table as the codec carries it."""
        ...

    def restore(self, value: object) -> None:
        """Replace the table with what :meth:`encode` gave at the sponsor (checked)."""
        ...


class StateLog(Protocol):
    """A durable member's log, standing in for snapshots when a joiner's own files hold most of
    the state (the API layer's ``LogSuffixes``)."""

    async def suffixes(self, joiner: int, view_id: int) -> dict[str, object]:
        """At the fenced sponsor: per actor name, what the joiner lacks (encodable), for the
        actors where that can replace a snapshot."""
        ...

    async def apply(self, suffixes: object) -> dict[str, int]:
        """At the joiner: bring those actors forward; the calls run per actor. ValueError
        saying why not."""
        ...


class Holder(Protocol):
    """A transfer that holds the runners (its fence or its restore)."""

    releases: list[Callable[[], None]]


class Context:
    """One member's state-transfer surroundings (see the module docstring)."""

    def __init__(
        self,
        driver: Driver,
        actors: Mapping[str, Actor],
        runners: Mapping[str, SerialRunner],
        observer: GroupObserver | None,
        tick_soon: Callable[[], None],
        state_log: StateLog | None = None,
        tables: Mapping[str, ReplicatedTable] | None = None,
    ) -> None:
        self.driver = driver
        #: per actor name, the state sent and restored beside its snapshot
        self.tables: Mapping[str, ReplicatedTable] = tables or {}
        self.me = driver.member_id
        self.actors = actors
        self.runners = runners
        self.observer = observer
        config = driver.config
        self.chunk_bytes = config.state_chunk_kb << 10
        self.stall_s = config.state_stall_s
        self.fence_s = config.fence_timeout_s
        #: the view installed last (None before the first)
        self.view: View | None = None
        #: starts the stall and progress timer if it is not running
        self.tick_soon = tick_soon
        #: where actors' state can travel as a log suffix (a durable member), or None
        self.state_log = state_log

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop."""
        return asyncio.get_running_loop()

    def now(self) -> float:
        """The loop's clock."""
        return self.loop.time()

    def send(self, to: int, frame: bytes) -> None:
        """Send a STATE_* message; a failure is logged (the view change will say why)."""
        try:
            self.driver.transport.send(to, frame)
        except Exception as exc:  # a departed peer: the view change will say so
            log.warning("member %d: state message to %d not sent: %r", self.me, to, exc)

    def gpu_plane(self) -> bool:
        """Whether a GPU plane runs here (device parts of a state then stay on the device)."""
        return self.driver.gpuplane is not None or self.driver.ncclplane is not None

    @staticmethod
    def release_holds(holder: Holder) -> None:
        """Let the runners ``holder`` holds go on."""
        releases, holder.releases = holder.releases, []
        for release in releases:
            release()


def failure(fut: asyncio.Future[Any]) -> BaseException | None:
    """Why an executor job failed (its exception, or a cancellation), None if it succeeded."""
    return asyncio.CancelledError() if fut.cancelled() else fut.exception()


def restore_reason(name: str, what: str, exc: BaseException) -> str:
    """Why a join failed when ``name``'s ``snapshot`` or ``restore`` raised ``exc``."""
    return f"{name}.{what} raised {type(exc).__name__}: {exc}"
