"""Group members over ``transport="rdma"`` in spawned processes (for test_rdma_processes.py).

Until ``derecho_async.api.group._make_transport`` builds an :class:`RdmaTransport` itself, the child
installs an equivalent factory (the change proposed for group.py) before starting the group.
"""

from __future__ import annotations

from typing import Any


def rdma_factory(config: Any) -> Any:
    """What ``group._make_transport`` should do for ``config.transport == "rdma"``."""
    from derecho_async.config import parse_hostport
    from derecho_async.errors import ConfigError
    from derecho_async.transport.rdma import RdmaTransport

    if config.secret is None:
        raise ConfigError("secret", "at least 16 characters (required for rdma)", None)
    peers = {m: parse_hostport(a, "peers") for m, a in config.peers.items()}
    return RdmaTransport(
        config.member_id,
        parse_hostport(config.listen, "listen"),
        secret=config.secret.encode(),
        peers=peers,
        device=config.rdma_device,
        port=config.rdma_port,
        gid_index=config.rdma_gid_index,
    )


def install_rdma_factory() -> None:
    """Make ``group._make_transport`` handle "rdma" if it does not yet."""
    from derecho_async.api import group
    from derecho_async.errors import UsageError

    original = group._make_transport
    if getattr(original, "_rdma_patched", False):
        return

    def make(config: Any) -> Any:
        if config.transport == "rdma":
            try:
                return original(config)
            except UsageError as exc:
                if "not available" not in str(exc):
                    raise
            return rdma_factory(config)
        return original(config)

    make._rdma_patched = True  # type: ignore[attr-defined]
    group._make_transport = make


def child(fields: dict[str, Any], q: Any, count: int, size: int, depth: int, sender: bool) -> None:
    """Process target: run the replicated-log workload as one member."""
    import faulthandler
    import logging
    import signal
    import sys

    import uvloop

    import derecho_async as da
    from derecho_async.workload import run_member

    # a test that times out sends SIGUSR1: every thread's stack goes to stderr (pytest shows it)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(
        stream=sys.stderr,
        format=f"[%(levelname)s] %(asctime)s member {fields['member_id']} %(name)s: %(message)s",
    )
    install_rdma_factory()
    config = da.Config(**fields)
    try:
        uvloop.run(run_member(config, q, count, size, depth, sender, 0.3))
    except da.DerechoError as exc:
        q.put(("error", config.member_id, f"{type(exc).__name__}: {exc}"))
        raise SystemExit(3) from exc
    except BaseException as exc:
        q.put(("error", config.member_id, f"{type(exc).__name__}: {exc}"))
        raise


def joiner(fields: dict[str, Any], q: Any, big_size: int) -> None:
    """Process target: join a running group, append a small and a large item (the large one
    travels on the data plane: the rdma bulk path), then report what every member holds."""
    import uvloop

    import derecho_async as da
    from derecho_async.workload import ReplicatedLog, log_digest

    async def go() -> None:
        async with da.Group(da.Config(**fields), actors=[ReplicatedLog]) as g:
            mine = g.local(ReplicatedLog).items
            at_join = len(mine)
            log = g.subgroup(ReplicatedLog)
            r1 = await log.append(b"hello from the joiner")
            big = bytes(range(256)) * (big_size // 256)
            r2 = await log.append(big)
            members = list(g.view.members)
            digests = [await log.digest.at(m)() for m in members]
            t = g._driver.transport if g._driver is not None else None
            conns = getattr(t, "_conns", None)  # the rdma transport's link table
            links = conns.links if conns is not None else {}
            rdma_blocks = {
                m: link.ep.btx.seq
                for m, link in links.items()
                if link.ep is not None and link.ep.btx is not None
            }
            q.put(
                (
                    "joined",
                    fields["member_id"],
                    {
                        "view": members,
                        "at_join": at_join,
                        "items": len(mine),
                        "digest": log_digest(mine),
                        "digests": digests,
                        "replies": [sorted(r1), sorted(r2)],
                        "big_ok": mine[-1] == big,
                        "rdma_blocks": rdma_blocks,
                    },
                )
            )

    try:
        uvloop.run(go())
    except BaseException as exc:
        q.put(("error", fields["member_id"], f"{type(exc).__name__}: {exc}"))
        raise
