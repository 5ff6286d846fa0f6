"""The memory a configuration implies, checked against the host's when a Config is made.

Theory of operation: what a member holds grows with its settings in one place, the shared-state
table (``core/schema.py``, ``core/table.py``): one row per member of the view and, in each row,
per shard, ``window`` slots of a 32-byte header and ``max_payload`` bytes. A view change
allocates the new view's table while the old one, and frozen copies of the rows of the members
it removes, are still held, so a member needs about twice its table (:func:`member_bytes`).
Beside it a transport holds a fixed buffer per peer (``TransportKind.link_bytes``: the shm ring
a member writes to each peer, the rdma inbox, mirror and bulk region; none for tcp, whose
streams hold only what is being sent). The members of a one-host transport (shm) or of one
process (sim) all live on this host, so the host needs that many times as much
(:func:`host_bytes`); a networked member is taken to have a host of its own.

:func:`check` refuses a configuration that needs more than half the host's memory
(:func:`host_memory`: the physical memory, or the cgroup's limit where lower) with a
:class:`ConfigError` naming the keys and the figure. ``Config`` runs it for ``initial_members``
members and one shard; ``Group`` runs it again with the shards its actors make. A view that
grows past ``initial_members`` is not checked again: each member beyond adds two rows to every
member's figure (and, on one host, a member's figure more). Tests give the host's memory with
:func:`host_memory_as`; the figure is computed as for a running member. See docs/DESIGN.md
§7.10.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Final

from derecho_async.core.schema import MAX_MEMBERS, RowSchema
from derecho_async.errors import ConfigError
from derecho_async.transport import registry

if TYPE_CHECKING:
    from derecho_async.config.settings import Config

__all__ = [
    "CGROUP_LIMITS",
    "MAX_WINDOW",
    "check",
    "host_bytes",
    "host_memory",
    "host_memory_as",
    "member_bytes",
    "read_host_memory",
]

MAX_WINDOW: Final = 1024
"""The largest ``window``: at the default ``max_payload`` a row's slots take 8 MiB, and every
member allocates a row per member at each view change, on its event loop."""
CGROUP_LIMITS: Final = (
    "/sys/fs/cgroup/memory.max",  # cgroup v2 ("max": no limit)
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1 (a huge number: no limit)
)
"""Files that may hold the memory limit of this process's cgroup."""
_MiB: Final = 1 << 20
_GiB: Final = 1 << 30

_assumed: int | None = None  # host_memory_as


def read_host_memory(limits: Iterable[str] = CGROUP_LIMITS) -> int:
    """The host's memory in bytes: the physical memory, or the smallest cgroup limit among the
    files ``limits`` that exist and hold a number, where lower."""
    found = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in limits:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read(64).strip()
        except (OSError, ValueError):
            continue
        if text.isdigit():
            found = min(found, int(text))
    return found


@functools.cache
def _real_host_memory() -> int:
    return read_host_memory()


def host_memory() -> int:
    """The host's memory the check measures against: :func:`read_host_memory`, read once per
    process, or what :func:`host_memory_as` assumes."""
    return _assumed if _assumed is not None else _real_host_memory()


@contextlib.contextmanager
def host_memory_as(nbytes: int) -> Iterator[None]:
    """Within the block, :func:`check` takes the host to have ``nbytes`` of memory (tests)."""
    global _assumed
    before, _assumed = _assumed, nbytes
    try:
        yield
    finally:
        _assumed = before


def member_bytes(config: Config, members: int | None = None, shards: int = 1) -> int:
    """Bytes one member holds at a view change of a view of ``members`` members (default
    ``initial_members``) over ``shards`` shards: the old and the new table, and the fixed
    buffers of its links to the others."""
    n = config.initial_members if members is None else members
    if not 1 <= n <= MAX_MEMBERS:
        raise ValueError(f"a view holds 1..{MAX_MEMBERS} members, not {n}")
    row = RowSchema(n, shards, config.window, config.max_payload).row_bytes
    return 2 * n * row + (n - 1) * registry.kind(config.transport).link_bytes


def _together(config: Config) -> bool:
    kind = registry.kind(config.transport)
    return kind.one_host or kind.in_process


def host_bytes(config: Config, members: int | None = None, shards: int = 1) -> int:
    """Bytes the host of a member needs: :func:`member_bytes`, times the members where they
    all live on this host (one-host and in-process transports)."""
    n = config.initial_members if members is None else members
    return member_bytes(config, n, shards) * (n if _together(config) else 1)


def _size(nbytes: float) -> str:
    return f"{nbytes / _GiB:.1f} GiB" if nbytes >= _GiB else f"{nbytes / _MiB:.0f} MiB"


def check(config: Config, shards: int = 1) -> None:
    """:class:`ConfigError` (key ``window``) if the host's memory cannot hold what ``config``
    implies for ``initial_members`` members and ``shards`` shards: more than half of
    :func:`host_memory`."""
    host = host_memory()
    need = host_bytes(config, shards=shards)
    if need * 2 <= host:
        return
    n = config.initial_members
    per_member = member_bytes(config, shards=shards)
    where = (f"{_size(per_member)} per member, {_size(need)} for the {n} members that "
             f"{config.transport} puts on this host" if _together(config)
             else f"{_size(per_member)} per member")
    layout = f" and {shards} shards" if shards > 1 else ""
    raise ConfigError(
        "window",
        f"window, max_payload and initial_members whose tables fit in half of this host's "
        f"memory; {n} members{layout} at window {config.window} and max_payload "
        f"{config.max_payload} need about {where} (at a view change a member holds two tables "
        f"of a row per member, each row {config.window} slots of max_payload bytes per "
        f"shard), more than half of the host's {_size(host)}: lower window, max_payload or "
        "initial_members",
        config.window,
    )
