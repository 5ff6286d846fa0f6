"""Transports by name: how to build one, its bulk data plane, what it can do.

Theory of operation: every value :attr:`Config.transport` accepts names a
:class:`TransportKind` here. A kind points at functions in its transport's own module by
``"module:function"`` strings, imported only when used (a transport whose library is missing,
such as rdma without pyverbs, costs nothing until it is asked for): ``make`` builds the transport
of one member from its :class:`Config`, ``bulk_plane`` the data plane that moves its large
payloads (none: they go by host staging on the channel), ``cleanup`` removes what a crashed
group left behind (shared-memory names). Its flags say what the rest of the runtime may assume:
``one_host`` (every member on one host: the CUDA IPC plane can reach them all, so
``gpu_plane="auto"`` starts it), ``networked`` (members dial listen addresses and authenticate
with the group's ``secret``), ``in_process`` (every member in one process: no command-line
launcher); ``link_bytes`` says what fixed buffers a member holds per peer. Adding a
transport: its package, and one entry in :data:`_BUILTIN` (or :func:`register` at run time).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from derecho_async.errors import UsageError

if TYPE_CHECKING:
    from derecho_async.config import Config
    from derecho_async.runtime.plane import Plane
    from derecho_async.transport.base import Transport

__all__ = ["PlaneWiring", "TransportKind", "kind", "names", "register", "unregister"]


@dataclass(frozen=True, slots=True)
class PlaneWiring:
    """What a bulk plane is given by the driver that routes payloads to it."""

    member_id: int
    transport: Transport
    landed: Callable[[tuple[int, int, int], object], None]
    failed: Callable[[tuple[int, int, int], BaseException], None]
    staging_failed: Callable[[tuple[int, int, int], BaseException], None]


def _resolve(ref: str) -> Callable[..., Any]:
    module, _, name = ref.partition(":")
    fn = getattr(importlib.import_module(module), name)
    assert callable(fn), ref
    return fn  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class TransportKind:
    """One transport (see the module docstring)."""

    name: str
    doc: str
    make: str
    bulk_plane: str | None = None
    cleanup: str | None = None
    one_host: bool = False
    networked: bool = False
    in_process: bool = False
    link_bytes: int = 0
    """Bytes of fixed buffers a member holds per peer, whatever the traffic (the memory check
    of ``config/memory.py`` counts them)."""

    def build(self, config: Config) -> Transport:
        """The transport of the member ``config`` describes."""
        transport: Transport = _resolve(self.make)(config)
        return transport

    def build_bulk_plane(self, wiring: PlaneWiring) -> Plane | None:
        """The bulk data plane for a transport of this kind, or None (host staging)."""
        if self.bulk_plane is None:
            return None
        plane: Plane = _resolve(self.bulk_plane)(wiring)
        return plane

    def clean(self, group: str) -> None:
        """Remove what members of ``group`` that died left behind (nothing for most kinds)."""
        if self.cleanup is not None:
            _resolve(self.cleanup)(group)


_BUILTIN = (
    TransportKind(
        "shm", "members of one host, over shared-memory rings",
        make="derecho_async.transport.shm.transport:from_config",
        bulk_plane="derecho_async.runtime.shmplane:for_transport",
        cleanup="derecho_async.transport.shm.cleanup:cleanup_group",
        one_host=True,
        link_bytes=(4 << 20) + 4096,  # the ring it writes to each peer, and its header page
    ),
    TransportKind(
        "tcp", "members anywhere, over authenticated TCP streams (TLS optional)",
        make="derecho_async.transport.tcp.transport:from_config",
        bulk_plane="derecho_async.runtime.chainplane:for_transport",
        networked=True,
    ),
    TransportKind(
        "rdma", "members on an RDMA fabric (verbs), the channel over authenticated TCP",
        make="derecho_async.transport.rdma:from_config",
        networked=True,
        # the inbox each peer writes and this member's mirror of it, and the bulk region
        # registered for each sender
        link_bytes=2 * (512 << 10) + 8 * (1 << 20),
    ),
    TransportKind(
        "sim", "members of one process on an in-memory fabric (tests, examples)",
        make="derecho_async.transport.loopback:from_config",
        in_process=True,
    ),
)

_KINDS: dict[str, TransportKind] = {k.name: k for k in _BUILTIN}


def names() -> tuple[str, ...]:
    """The transport names :attr:`Config.transport` accepts."""
    return tuple(_KINDS)


def kind(name: str) -> TransportKind:
    """The kind called ``name``; :class:`UsageError` naming the known ones if there is none."""
    found = _KINDS.get(name)
    if found is None:
        raise UsageError(f"no transport {name!r}; known: {', '.join(_KINDS)}")
    return found


def register(new: TransportKind) -> None:
    """Make ``new.name`` a transport name (for transports outside this package); a name that
    is taken is a :class:`UsageError`."""
    if new.name in _KINDS:
        raise UsageError(f"transport {new.name!r} is registered already")
    _KINDS[new.name] = new


def unregister(name: str) -> None:
    """Forget a transport :func:`register` added (the built-in ones stay)."""
    if any(k.name == name for k in _BUILTIN):
        raise UsageError(f"transport {name!r} is built in")
    _KINDS.pop(name, None)
