"""The shm transport: members of one group on one host, over shared-memory rings.

Theory of operation (DESIGN.md §5.2), by module: :mod:`.files` (segment files in /dev/shm:
names, creation, checked mapping), :mod:`.ring` (a link's ring segment: header words, records,
create/attach), :mod:`.doorbell` (datagram wake-ups and liveness), :mod:`.census` (which members
run now), :mod:`.cleanup` (which files are stale and their removal), :mod:`.pool` (the shm data plane's pool segments), :mod:`.beacon`
(the liveness thread's count in each ring) and :mod:`.transport` (:class:`ShmTransport`). The registry (``transport.registry``) names
:func:`from_config` and :func:`cleanup_group`.
"""

from __future__ import annotations

from derecho_async.transport.shm.cleanup import cleanup_group
from derecho_async.transport.shm.doorbell import is_alive
from derecho_async.transport.shm.transport import ShmTransport, from_config

__all__ = ["ShmTransport", "cleanup_group", "from_config", "is_alive"]
