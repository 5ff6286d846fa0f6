"""How much of one GPU's copy bandwidth several processes get when each copies the same source.

Usage (a machine with a GPU and CuPy): python benchmarks/cuda_copy_concurrency.py
    [--sizes 64M 1G] [--processes 1 3]

In a group sharing one GPU every receiver of a CUDA IPC message copies it out of the sender's
pool in its own process, so the receivers' copies run in different CUDA contexts, which a GPU
without MPS time-slices. This measures the ceiling that sets for ``gpu_bandwidth.py``'s
aggregate: first one copy of each size in this process (the raw copy), then N processes that
open this process's buffer through its IPC handle and each copy it ``reps`` times into their own
memory (200 copies below 256 MB, else 12), either *queued* (every copy issued at once on one stream) or *one at a time* (each copy
followed by an event that is polled until it completes before the next is issued, as a receiver
does that copies only what it has been told about). The aggregate is N x reps x size over the
time from the first start to the last finish, and the ratio is that over the raw copy's rate.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from multiprocessing.synchronize import Barrier
from typing import Any

_EVENT_DISABLE_TIMING = 0x2


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def _copier(handle: bytes, size: int, reps: int, one_at_a_time: bool, barrier: Barrier,
            results: Any) -> None:
    import cupy as cp
    from cupy.cuda import runtime as rt

    src = rt.ipcOpenMemHandle(handle)
    dst = cp.empty(size, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    event = rt.eventCreateWithFlags(_EVENT_DISABLE_TIMING)
    rt.memcpyAsync(dst.data.ptr, src, size, rt.memcpyDeviceToDevice, stream.ptr)
    stream.synchronize()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        rt.memcpyAsync(dst.data.ptr, src, size, rt.memcpyDeviceToDevice, stream.ptr)
        if one_at_a_time:
            rt.eventRecord(event, stream.ptr)
            while rt.eventQuery(event) != 0:  # cudaSuccess: the copy is done
                pass
    stream.synchronize()
    results.put((t0, time.perf_counter()))
    barrier.wait()
    rt.eventDestroy(event)
    rt.ipcCloseMemHandle(src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["64M", "1G"])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 3])
    args = parser.parse_args()
    import cupy as cp
    from cupy.cuda import runtime as rt

    ctx = multiprocessing.get_context("spawn")
    for size in map(_parse_size, args.sizes):
        reps = 200 if size < (256 << 20) else 12
        src = cp.ones(size, dtype=cp.uint8)
        dst = cp.empty(size, dtype=cp.uint8)
        stream = cp.cuda.Stream(non_blocking=True)
        rt.memcpyAsync(dst.data.ptr, src.data.ptr, size, rt.memcpyDeviceToDevice, stream.ptr)
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, size, rt.memcpyDeviceToDevice, stream.ptr)
        stream.synchronize()
        raw = reps * size / (time.perf_counter() - t0) / 1e9
        print(f"{size >> 20} MB: raw copy in this process {raw:.0f} GB/s ({reps} copies)",
              flush=True)
        handle = rt.ipcGetMemHandle(src.data.ptr)
        for n in args.processes:
            for one_at_a_time in (False, True):
                barrier = ctx.Barrier(n + 1)
                results = ctx.Queue()
                procs = [
                    ctx.Process(target=_copier,
                                args=(handle, size, reps, one_at_a_time, barrier, results))
                    for _ in range(n)
                ]
                for p in procs:
                    p.start()
                barrier.wait()
                spans = [results.get() for _ in range(n)]
                barrier.wait()
                for p in procs:
                    p.join()
                elapsed = max(s[1] for s in spans) - min(s[0] for s in spans)
                agg = n * reps * size / elapsed / 1e9
                how = "one at a time" if one_at_a_time else "queued"
                print(f"  {n} process(es), {how:13}: aggregate {agg:6.0f} GB/s, "
                      f"ratio {agg / raw:.3f}", flush=True)
        del src, dst


if __name__ == "__main__":
    main()
