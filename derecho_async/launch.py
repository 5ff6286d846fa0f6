"""``launch_local``: run ``n`` members of a group as processes on this host.

Each member is a fresh Python process (the ``spawn`` start method, so nothing of the parent's
state leaks in) that builds its :class:`Config` from the given fields plus its own ``member_id``
and runs ``await main(config)`` on uvloop. ``main`` must be importable by the child (a function
defined at module level). Over a networked transport (tcp, rdma) the members get free loopback
ports as their ``peers`` table and a fresh secret, unless those are given. The parent waits for
every member and returns their exit codes; shared memory the group left behind (members killed
mid-run) is removed at the end.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import time
from collections.abc import Callable, Coroutine
from typing import Any

from derecho_async.config import Config
from derecho_async.config.strength import new_secret
from derecho_async.logsetup import log_to_stderr

__all__ = ["free_ports", "launch_local", "local_network", "run_member"]

Main = Callable[[Config], Coroutine[Any, Any, Any]]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free tcp ports on the loopback interface (bound together, then released:
    free when asked, for tcp ``listen`` addresses of local members)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def local_network(n: int) -> dict[str, Any]:
    """The fields that let ``n`` local members of a networked transport find each other: free
    loopback ports as ``peers`` (each member listens at its own entry) and a fresh ``secret``."""
    return {"peers": {i: f"127.0.0.1:{p}" for i, p in enumerate(free_ports(n))},
            "secret": new_secret()}


def run_member(main: Main, fields: dict[str, Any], use_uvloop: bool = True) -> None:
    """Child entry point: build the config, log to stderr at its ``log_level`` and run ``main``
    on an event loop."""
    import asyncio

    config = Config(**fields)
    log_to_stderr(config.log_level)
    if use_uvloop:
        import uvloop

        uvloop.run(main(config))
    else:
        asyncio.run(main(config))


def launch_local(
    n: int, main: Main, /, *, timeout: float | None = None, **config_fields: Any
) -> list[int]:
    """Start ``n`` member processes (ids ``0..n-1``) of one group and wait for them.

    ``config_fields`` are :class:`Config` fields shared by every member (``group`` defaults to a
    fresh name, ``initial_members`` to ``n``, ``transport`` to ``shm``; over tcp or rdma,
    ``peers`` to free loopback ports, each member listening at its own, and ``secret`` to a
    fresh one unless ``tls_cert`` is given). Members still running
    after ``timeout`` seconds are killed. Returns the exit codes in member order (a negative code
    is the signal that ended the process).
    """
    if n < 1:
        raise ValueError("launch_local needs n >= 1")
    fields = dict(config_fields)
    fields.setdefault("group", f"local-{os.getpid()}-{secrets.token_hex(4)}")
    fields.setdefault("initial_members", n)
    fields.setdefault("transport", "shm")
    from derecho_async.transport import registry

    if registry.kind(str(fields["transport"])).networked:
        net = local_network(n)
        fields.setdefault("peers", net["peers"])
        if "tls_cert" not in fields:
            fields.setdefault("secret", net["secret"])
    use_uvloop = bool(fields.pop("uvloop", True))
    Config(member_id=0, **fields)  # validate once, in the parent, with a clear error
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for i in range(n):
        p = ctx.Process(
            target=run_member,
            args=(main, {**fields, "member_id": i}, use_uvloop),
            name=f"derecho-member-{i}",
        )
        p.start()
        procs.append(p)
    deadline = None if timeout is None else time.monotonic() + timeout
    codes = []
    for p in procs:
        p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode if p.exitcode is not None else -1)
    registry.kind(str(fields["transport"])).clean(str(fields["group"]))
    return codes
