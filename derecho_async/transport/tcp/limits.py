"""What a stranger may cost a tcp member: caps on connections not yet admitted, rate-limited logs.

Theory of operation (DESIGN.md §5.3, "Strangers"). An accepted connection is *pending* from
accept until its peer is admitted (authenticated, and its id is a peer the owner gave an address,
a member of a recent view, or admitted when a later view names it). :class:`TcpLimits` holds
the bounds: the handshake deadline (TLS included), the caps on pending connections per peer
address and in total, the descriptors kept free, and the frames a pending peer may send.
:class:`PendingTable` decides, at accept time and before anything is read, whether a connection
may be held: a host at its cap is refused; when the total cap or the descriptor reserve is
reached, the oldest connection of the host holding the most is evicted if that host holds more
than the newcomer's would, else the newcomer is refused (so a flood from a few addresses cannot
starve a joiner or a member dialling from another one). :class:`RefusalLog` logs refused and
closed hostile connections: the first few of each interval one by one, the rest as one
summary per interval with counts by reason.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from derecho_async.errors import ConfigError

__all__ = ["PendingTable", "RefusalLog", "TcpLimits", "descriptor_limit"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class TcpLimits:
    """Bounds on what connections that are not (yet) admitted may cost a member.

    ``handshake_s``: seconds from accept to the end of the handshake (the TLS handshake
    included). ``max_pending`` / ``max_pending_per_host``: accepted connections not admitted yet,
    in total and per peer address. ``fd_reserve``: descriptors kept free for the member's own
    links and files (accepting stops once a new descriptor would leave fewer; at most half the
    limit is reserved). ``pre_admission_frame``: the largest frame payload a pending peer may
    announce (a larger length closes the stream before any payload is read);
    ``pre_admission_bytes``: all it may send before admission (frames held meanwhile included).
    ``log_interval_s`` / ``log_detailed``: hostile connections are logged one by one up to
    ``log_detailed`` per interval, the rest as one summary per interval.
    """

    handshake_s: float = 3.0
    max_pending: int = 128
    max_pending_per_host: int = 16
    fd_reserve: int = 128
    pre_admission_frame: int = 4096
    pre_admission_bytes: int = 64 << 10
    log_interval_s: float = 10.0
    log_detailed: int = 3

    def __post_init__(self) -> None:
        for name, low in (
            ("max_pending", 1),
            ("max_pending_per_host", 1),
            ("fd_reserve", 0),
            ("pre_admission_frame", 64),
            ("pre_admission_bytes", 64),
            ("log_detailed", 0),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 1 << 32:
                raise ConfigError(name, f"an int from {low} to 2**32", v)
        for name in ("handshake_s", "log_interval_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 3600:
                raise ConfigError(name, "seconds in (0, 3600]", v)


def descriptor_limit() -> int:
    """This process's soft RLIMIT_NOFILE (read each time: it may be changed at run time)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY and soft > 0 else 1 << 20


class PendingTable(Generic[K]):
    """The accepted connections not admitted yet, by peer host; decides who may be held.

    Pure bookkeeping (no I/O): :meth:`offer` says whether a new connection may be held and
    which one to evict for it, :meth:`add` / :meth:`discard` track the table.
    """

    def __init__(self, limits: TcpLimits) -> None:
        self.limits = limits
        # per host, its pending connections in insertion order (oldest first)
        self._hosts: dict[str, dict[K, None]] = {}
        self._host_of: dict[K, str] = {}

    def __len__(self) -> int:
        return len(self._host_of)

    def __contains__(self, key: object) -> bool:
        return key in self._host_of

    def count(self, host: str) -> int:
        """Pending connections from ``host``."""
        return len(self._hosts.get(host, ()))

    def offer(self, host: str, fd: int, fd_limit: int) -> tuple[str | None, K | None]:
        """May a new connection from ``host`` (descriptor ``fd``) be held?

        Returns (refusal reason, None), or (None, a connection to evict first, or None).
        """
        lim = self.limits
        mine = self.count(host)
        if mine >= lim.max_pending_per_host:
            return "per-address cap", None
        reserve = min(lim.fd_reserve, fd_limit // 2)
        full = len(self._host_of) >= lim.max_pending
        near_fd_limit = fd >= fd_limit - reserve
        if not (full or near_fd_limit):
            return None, None
        victim = self._victim(mine + 1)
        if victim is None:
            return ("descriptor reserve" if near_fd_limit else "connection cap"), None
        return None, victim

    def _victim(self, newcomer: int) -> K | None:
        """The oldest connection of the host holding the most, if it holds more than
        ``newcomer``."""
        best: dict[K, None] | None = None
        for keys in self._hosts.values():
            if best is None or len(keys) > len(best):
                best = keys
        if best is None or len(best) <= newcomer:
            return None
        return next(iter(best))

    def add(self, key: K, host: str) -> None:
        """Hold ``key`` (from ``host``) as pending."""
        self._hosts.setdefault(host, {})[key] = None
        self._host_of[key] = host

    def discard(self, key: K) -> None:
        """Forget ``key`` (admitted or closed); no-op if unknown."""
        host = self._host_of.pop(key, None)
        if host is None:
            return
        keys = self._hosts[host]
        keys.pop(key, None)
        if not keys:
            del self._hosts[host]


class RefusalLog:
    """Rate-limited log of refused or closed hostile connections, with counts by reason.

    :meth:`note` logs the first ``limits.log_detailed`` events of each interval one by one
    (at the level given) and counts the rest; one WARNING per interval then says how many were
    not logged, by reason. :attr:`counts` keeps the totals since start, by reason.
    """

    def __init__(
        self,
        member_id: int,
        logger: logging.Logger,
        limits: TcpLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.member_id = member_id
        self.log = logger
        self.limits = limits
        self.clock = clock
        self.counts: collections.Counter[str] = collections.Counter()
        self._window_start = -float("inf")
        self._detailed = 0
        self._suppressed: collections.Counter[str] = collections.Counter()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that runs the end-of-interval summaries."""
        self._loop = loop

    def note(self, reason: str, detail: str, level: int = logging.WARNING) -> None:
        """Count one hostile connection refused or closed for ``reason``; ``detail`` is the
        one-line message logged if this one is logged one by one."""
        self.counts[reason] += 1
        now = self.clock()
        if now - self._window_start >= self.limits.log_interval_s:
            self.flush()
            self._window_start = now
            self._detailed = 0
        if self._detailed < self.limits.log_detailed:
            self._detailed += 1
            self.log.log(level, "member %d: %s", self.member_id, detail)
            return
        self._suppressed[reason] += 1
        if self._timer is None and self._loop is not None and not self._loop.is_closed():
            delay = max(0.0, self._window_start + self.limits.log_interval_s - now)
            self._timer = self._loop.call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        """Log the summary of what was counted but not logged, now (also at close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._suppressed:
            return
        total = sum(self._suppressed.values())
        reasons = ", ".join(f"{r}: {n}" for r, n in self._suppressed.most_common())
        self._suppressed.clear()
        self.log.warning(
            "member %d: %d more connections refused or closed before admission, not logged"
            " one by one (%s)",
            self.member_id,
            total,
            reasons,
        )
