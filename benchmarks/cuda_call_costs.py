"""What each CUDA runtime call the CUDA IPC plane makes per message costs on this machine.

Usage (a machine with a GPU and CuPy): python benchmarks/cuda_call_costs.py [--n 2000]

The plane's per-message work is a handful of runtime calls on each side (sender: an optional
staging copy and an event record; receiver: a stream wait on the sender's event, a copy, an event
record, event queries until it is done, and building the CuPy array over the copied region). This
times each call alone, in one process, as microseconds per call (median of 5 batches), so the
message rate that the GPU path can reach is known before any protocol runs.

Then it times the hand-off between two processes that the plane makes per message, as round
trips over a pipe (one process records an interprocess event after a 4 KB copy and writes a byte;
the other makes its stream wait on that event, copies the 4 KB out of the first one's IPC-mapped
buffer, polls its own event until the copy is done and writes a byte back): beside the same round
trip with no GPU work, and with the copy but no event wait (the first process synchronizes
before it signals). The difference is what the GPU costs a message beyond the calls themselves.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection


def _time(fn: Callable[[], object], n: int) -> float:
    batches = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        batches.append((time.perf_counter() - t0) / n)
    return statistics.median(batches) * 1e6


def _peer(conn: Connection, mem_handle: bytes, ev_handle: bytes, mode: str,
          rounds: int) -> None:
    """The second process of the hand-off: wait for a byte, do the receiver's part, answer."""
    import cupy as cp

    rt = cp.cuda.runtime
    base = rt.ipcOpenMemHandle(mem_handle, 1)
    ev = rt.ipcOpenEventHandle(ev_handle)
    dst = cp.empty(1024, dtype=cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    done = rt.eventCreateWithFlags(0x2)
    if mode == "idle-peer":  # the exporter waits idle; time copies out of its buffer alone
        conn.recv_bytes()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            rt.memcpyAsync(dst.data.ptr, base, 4096, 4, stream.ptr)
            rt.eventRecord(done, stream.ptr)
            while rt.eventQuery(done) != 0:
                pass
            times.append(time.perf_counter() - t0)
        times.sort()
        conn.send_bytes(f"{times[len(times) // 2] * 1e6} {times[int(len(times) * .99)] * 1e6}"
                        .encode())
        return
    for _ in range(rounds):
        conn.recv_bytes()
        if mode != "none":
            if mode == "event":
                rt.streamWaitEvent(stream.ptr, ev, 0)
            rt.memcpyAsync(dst.data.ptr, base, 4096, 4, stream.ptr)
            rt.eventRecord(done, stream.ptr)
            while rt.eventQuery(done) != 0:
                pass
        conn.send_bytes(b"x")


def handoff_us(mode: str, rounds: int = 400) -> tuple[float, float]:
    """p50 and p99 round trip (µs) of the two-process hand-off in ``mode``: 'none' (pipe only),
    'sync' (copy, no event wait), 'event' (the plane's way: wait on the interprocess event);
    'idle-peer': the second process's copies out of the first's buffer while the first idles
    (no hand-off: each copy timed alone)."""
    import cupy as cp

    rt = cp.cuda.runtime
    src = cp.ones(1024, dtype=cp.float32)
    buf = cp.empty(1024, dtype=cp.float32)
    ev = rt.eventCreateWithFlags(0x2 | 0x4)
    stream = cp.cuda.Stream(non_blocking=False)
    ctx = multiprocessing.get_context("spawn")
    conn, theirs = ctx.Pipe()
    child = ctx.Process(target=_peer, args=(theirs, bytes(rt.ipcGetMemHandle(buf.data.ptr)),
                                            bytes(rt.ipcGetEventHandle(ev)), mode, rounds + 20))
    child.start()
    if mode == "idle-peer":
        conn.send_bytes(b"x")
        p50, p99 = (float(v) for v in conn.recv_bytes().split())
        child.join()
        return p50, p99
    times = []
    for i in range(rounds + 20):
        t0 = time.perf_counter()
        if mode != "none":
            rt.memcpyAsync(buf.data.ptr, src.data.ptr, 4096, 4, stream.ptr)
            rt.eventRecord(ev, stream.ptr)
            if mode == "sync":
                stream.synchronize()
        conn.send_bytes(b"x")
        conn.recv_bytes()
        if i >= 20:
            times.append(time.perf_counter() - t0)
    child.join()
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000, help="calls per batch")
    args = parser.parse_args()
    import cupy as cp

    rt = cp.cuda.runtime
    n = args.n
    src = cp.ones(1024, dtype=cp.float32)
    dst = cp.empty_like(src)
    s1 = cp.cuda.Stream(non_blocking=True)
    s2 = cp.cuda.Stream(non_blocking=True)
    ev = rt.eventCreateWithFlags(0x2)
    ipc_ev = rt.eventCreateWithFlags(0x2 | 0x4)
    rt.eventRecord(ev, s1.ptr)
    s1.synchronize()

    class Owner:
        __slots__ = ("__weakref__",)

    def copy() -> None:
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, 4096, 4, s1.ptr)

    def record() -> None:
        rt.eventRecord(ev, s1.ptr)

    def record_ipc() -> None:
        rt.eventRecord(ipc_ev, s1.ptr)

    def query() -> None:
        rt.eventQuery(ev)

    def wait() -> None:
        rt.streamWaitEvent(s2.ptr, ev, 0)

    def roundtrip() -> None:  # copy, record, poll until done: one receive's GPU part
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, 4096, 4, s1.ptr)
        rt.eventRecord(ev, s1.ptr)
        while rt.eventQuery(ev) != 0:
            pass

    def array() -> None:
        owner = Owner()
        weakref.finalize(owner, lambda: None)
        mem = cp.cuda.UnownedMemory(dst.data.ptr, 4096, owner, 0)
        cp.ndarray((1024,), dtype="float32", memptr=cp.cuda.MemoryPointer(mem, 0))

    def current() -> None:
        cp.cuda.get_current_stream()

    def small_kernel() -> None:
        dst.fill(1.0)

    rows = [
        ("memcpyAsync 4 KB D2D", copy),
        ("eventRecord", record),
        ("eventRecord (interprocess event)", record_ipc),
        ("eventQuery (completed event)", query),
        ("streamWaitEvent", wait),
        ("copy + record + poll until done", roundtrip),
        ("CuPy array over a pool region", array),
        ("get_current_stream", current),
        ("a small CuPy kernel (fill)", small_kernel),
    ]
    print(f"# python benchmarks/cuda_call_costs.py --n {n}; device {cp.cuda.Device().id}: "
          f"{rt.getDeviceProperties(0)['name'].decode()}")
    print(f"{'call':<36} {'µs/call':>8}")
    for name, fn in rows:
        us = _time(fn, n)
        s1.synchronize()
        s2.synchronize()
        print(f"{name:<36} {us:>8.2f}", flush=True)
    print("\nhand-off between two processes, round trip over a pipe (µs)")
    for mode, what in (("none", "pipe only"), ("sync", "4 KB copy, sender synchronizes"),
                       ("event", "4 KB copy after an interprocess event wait"),
                       ("idle-peer", "4 KB copies out of an idle peer, one by one")):
        p50, p99 = handoff_us(mode)
        print(f"{what:<44} p50 {p50:>7.1f}  p99 {p99:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
