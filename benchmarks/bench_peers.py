"""Peer systems for the comparison benchmarks (see benchmarks/compare.py), each in spawned
processes on this host:

- :func:`zmq_pubsub`: pyzmq PUB -> SUB, one publisher and ``subscribers`` subscriber processes
  over tcp loopback, no ordering or stability; high-water marks off so that nothing is dropped.
  The figure is the slowest subscriber's receive rate (first to last message).
- :func:`syncobj_commits`: PySyncObj (Raft), ``nodes`` processes on loopback, each with a
  ``@replicated`` counter that keeps the last payload; the elected leader is the one writer, with
  at most ``window`` calls outstanding; the figure is commits/s seen by the writer's callbacks.
  With ``journal_dir`` each node keeps its Raft log in a file journal there
  (``SyncObjConf(journalFile=...)``, one file per node) instead of in memory.

Both return ``None`` when the package is missing (see :func:`missing`), and always stop their
processes.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import queue as queue_mod
import threading
import time
from typing import Any

__all__ = ["INSTALL_HINT", "missing", "syncobj_commits", "zmq_pubsub"]

INSTALL_HINT = {"zmq": "pip install pyzmq", "pysyncobj": "pip install pysyncobj"}


def missing(module: str) -> str | None:
    """``"not installed (pip install ...)"`` if ``module`` cannot be imported, else None."""
    try:
        importlib.import_module(module)
    except ImportError:
        return f"not installed ({INSTALL_HINT[module]})"
    return None


# --------------------------------------------------------------------------------- pyzmq


def _zmq_sub(port: int, q: Any, count: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"tcp://127.0.0.1:{port}")
    while sock.recv() != b"w":  # warm-up messages until the subscription is live
        pass
    q.put(("ready",))
    got = 0
    first = last = 0.0
    while True:
        msg = sock.recv()
        if len(msg) == 1:
            if msg == b"e":
                break
            continue  # late warm-up message
        if got == 0:
            first = time.perf_counter()
        got += 1
        last = time.perf_counter()
    q.put(("done", got, last - first))
    sock.close(0)
    ctx.term()


def _zmq_pub(port: int, q: Any, ready: Any, count: int, size: int, subs: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(f"tcp://127.0.0.1:{port}")
    n_ready = 0
    while n_ready < subs:
        sock.send(b"w")
        try:
            ready.get(timeout=0.01)
            n_ready += 1
        except queue_mod.Empty:
            pass
    payload = b"x" * size
    t0 = time.perf_counter()
    for _ in range(count):
        sock.send(payload)
    sent = time.perf_counter() - t0
    for _ in range(10):
        sock.send(b"e")
    q.put(("sent", sent))
    time.sleep(0.5)
    sock.close(linger=2000)
    ctx.term()


def zmq_pubsub(count: int, size: int, subscribers: int = 2, timeout: float = 120.0) -> float:
    """Messages/s of the slowest subscriber (each receives all ``count`` messages)."""
    from derecho_async.launch import free_ports

    ctx = multiprocessing.get_context("spawn")
    q: Any = ctx.Queue()
    ready: Any = ctx.Queue()
    port = free_ports(1)[0]
    subs_q: Any = ctx.Queue()
    procs = [
        ctx.Process(target=_zmq_sub, args=(port, subs_q, count), daemon=True)
        for _ in range(subscribers)
    ]
    pub = ctx.Process(target=_zmq_pub, args=(port, q, ready, count, size, subscribers), daemon=True)
    try:
        for p in procs:
            p.start()
        pub.start()
        rates: list[float] = []
        deadline = time.monotonic() + timeout
        while len(rates) < subscribers and time.monotonic() < deadline:
            try:
                msg = subs_q.get(timeout=0.2)
            except queue_mod.Empty:
                continue
            if msg[0] == "ready":
                ready.put(msg)
            elif msg[0] == "done":
                if msg[1] < count:
                    raise RuntimeError(f"zmq subscriber got {msg[1]} of {count} messages")
                rates.append(msg[1] / max(msg[2], 1e-9))
        if len(rates) < subscribers:
            raise RuntimeError("zmq run timed out")
        return min(rates)
    finally:
        for p in [*procs, pub]:
            p.join(3.0)
            if p.is_alive():
                p.kill()
                p.join()


# ------------------------------------------------------------------------------ PySyncObj


def _syncobj_node(
    me: int,
    addrs: list[str],
    q: Any,
    stop: Any,
    count: int,
    size: int,
    window: int,
    journal: str | None = None,
) -> None:
    from pysyncobj import SyncObj, SyncObjConf, replicated

    class Counter(SyncObj):  # type: ignore[misc]
        def __init__(self, me_addr: str, others: list[str]) -> None:
            conf = SyncObjConf(
                dynamicMembershipChange=False, commandsQueueSize=10 * window, journalFile=journal
            )
            super().__init__(me_addr, others, conf)
            self.n = 0
            self.last = b""

        @replicated  # type: ignore[untyped-decorator]
        def add(self, item: bytes) -> int:
            self.n += 1
            self.last = item
            return self.n

    node = Counter(addrs[me], [a for i, a in enumerate(addrs) if i != me])
    try:
        deadline = time.monotonic() + 30
        while (not node.isReady() or node._getLeader() is None) and time.monotonic() < deadline:
            time.sleep(0.02)
        leader = node._getLeader()
        if leader is None:
            q.put(("error", me, "no leader elected in 30 s"))
            return
        if leader != node.selfNode:
            stop.wait(300)
            return
        payload = b"x" * size
        slots = threading.Semaphore(window)
        finished = threading.Event()
        state = {"ok": 0, "failed": 0, "last": 0.0}

        def on_commit(result: object, error: int) -> None:
            if error == 0:
                state["ok"] += 1
            else:
                state["failed"] += 1
            state["last"] = time.perf_counter()
            slots.release()
            if state["ok"] + state["failed"] >= count:
                finished.set()

        t0 = time.perf_counter()
        for _ in range(count):
            slots.acquire()
            node.add(payload, callback=on_commit)
        finished.wait(120)
        elapsed = max(state["last"] - t0, 1e-9)
        q.put(("done", me, state["ok"], state["failed"], elapsed))
    finally:
        with contextlib.suppress(Exception):
            node.destroy()


def syncobj_commits(
    count: int,
    size: int,
    nodes: int = 3,
    window: int = 1000,
    timeout: float = 180.0,
    journal_dir: str | None = None,
) -> float:
    """Commits/s of one writer (the Raft leader) to a ``nodes``-member PySyncObj cluster; with
    ``journal_dir``, each node journals to the file ``journal_dir/node-<i>.journal``."""
    from derecho_async.launch import free_ports

    ctx = multiprocessing.get_context("spawn")
    q: Any = ctx.Queue()
    stop: Any = ctx.Event()
    addrs = [f"127.0.0.1:{p}" for p in free_ports(nodes)]
    procs = [
        ctx.Process(
            target=_syncobj_node,
            args=(
                i,
                addrs,
                q,
                stop,
                count,
                size,
                window,
                None if journal_dir is None else os.path.join(journal_dir, f"node-{i}.journal"),
            ),
            daemon=True,
        )
        for i in range(nodes)
    ]
    try:
        for p in procs:
            p.start()
        try:
            msg = q.get(timeout=timeout)
        except queue_mod.Empty:
            raise RuntimeError("PySyncObj run timed out") from None
        if msg[0] != "done":
            raise RuntimeError(f"PySyncObj node {msg[1]}: {msg[2]}")
        _, _, ok, failed, elapsed = msg
        if failed:
            raise RuntimeError(f"PySyncObj: {failed} of {count} commands failed")
        return float(ok) / float(elapsed)
    finally:
        stop.set()
        for p in procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()
