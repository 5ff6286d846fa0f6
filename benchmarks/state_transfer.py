"""State transfer: a joiner receives a large state from a running group, against a raw copy.

Usage: python benchmarks/state_transfer.py [--mb 2048] [--members 3] [--chunk-kb 32768]
                                            [--device] [--out DIR]

``--members`` member processes (shm, one host) found a group and each builds an actor state of
``--mb`` MiB: host bytes, or with ``--device`` one CuPy array on the GPU (moved by the CUDA IPC
plane). One more member then joins; the group streams it the state at the cut (see the README's
contract, items 9 and 10) while the founders keep making ordered calls. Reported per member:
the joiner's time from ``Group.join`` to its return (state restored), each member's peak RSS,
and the worst gap of each founder's event loop during the transfer (heartbeats go on).

In the same command, the parent times the peer this is measured against: the same bytes
written into a POSIX shared-memory segment and copied out by another process (host), or one
device-to-device copy plus a CuPy digest pass (device). The ratio is join time / raw time.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import multiprocessing
import os
import re
import resource
import sys
import tempfile
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import derecho_async as da


class Weights(da.Actor):
    """A replicated state of one large value (bytes or a CuPy array)."""

    def __init__(self) -> None:
        self.value: Any = b""
        self.calls = 0

    @da.ordered
    def touch(self) -> int:
        self.calls += 1
        return self.calls

    def snapshot(self) -> object:
        return [self.calls, self.value]

    def restore(self, state: Any) -> None:
        self.calls, self.value = state[0], state[1]


def _digest(value: Any) -> str:
    if isinstance(value, bytes):
        return hashlib.sha256(value).hexdigest()
    import cupy

    flat = value.ravel().view(cupy.uint64)
    s1 = s2 = 0
    step = 32 << 20  # elements per slice: the temporaries stay small beside the state
    for lo in range(0, flat.size, step):
        part = flat[lo:lo + step]
        s1 += int(part.sum())
        s2 += int((part ^ (part >> 7)).sum())
    return f"{s1 & (2**64 - 1):x}-{s2 & (2**64 - 1):x}-{value.nbytes}"


def _device_state(size: int) -> Any:
    """``size`` bytes of a CuPy uint32 array, made on the GPU (synchronized)."""
    import cupy

    arr = cupy.arange(size // 4, dtype=cupy.uint32)
    arr *= 2654435761
    cupy.cuda.get_current_stream().synchronize()
    return arr


def _pattern_bytes(size: int) -> bytes:
    """``size`` bytes of 0..255 repeated, made by numpy copies that release the GIL."""
    import numpy as np

    from derecho_async import hotpath

    pattern = np.empty(size, np.uint8)
    pattern[:256] = np.arange(min(size, 256), dtype=np.uint8)[:size]
    done = min(size, 256)
    while done < size:
        n = min(done, size - done)
        pattern[done:done + n] = pattern[:n]
        done += n
    return hotpath.bytes_copy(pattern)


def _peak_rss_mb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10


async def bench_member(config: da.Config) -> None:
    out = Path(os.environ["DA_BENCH_OUT"])
    size = int(os.environ["DA_BENCH_MB"]) << 20
    device = os.environ.get("DA_BENCH_DEVICE") == "1"
    founders = config.initial_members
    me = config.member_id
    report: dict[str, Any] = {"member": me}
    logging.basicConfig(stream=sys.stderr,
                        format=f"%(asctime)s member {me} %(name)s %(levelname)s: %(message)s")
    said: list[str] = []  # what state transfer logged here (the sponsor: how chunks moved)

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    xfer_log = logging.getLogger("derecho_async.statexfer")
    xfer_log.addHandler(Keep())
    xfer_log.setLevel(logging.INFO)
    loop = asyncio.get_running_loop()
    worst = 0.0
    gaps_on = True

    async def ticker() -> None:  # this member's worst loop gap until the joiner is in
        nonlocal worst
        last = loop.time()
        while gaps_on:
            await asyncio.sleep(0.01)
            now = loop.time()
            worst = max(worst, now - last - 0.01)
            last = now

    if me == founders:  # the joiner
        while not (out / "ready").exists():
            await asyncio.sleep(0.05)
        ticking = asyncio.ensure_future(ticker())
        began = time.monotonic()
        group = await da.Group.join(config, actors=[Weights], timeout=600)
        report["join_s"] = time.monotonic() - began
        (out / "joined").write_text("1")
    else:
        group = await da.Group.join(config, actors=[Weights], timeout=120)
        state = group.local(Weights)  # built off the loop: heartbeats go on
        build = _device_state if device else _pattern_bytes
        state.value = await loop.run_in_executor(None, build, size)
        await group.subgroup(Weights).touch()
        report["rss_with_state_mb"] = _peak_rss_mb()
        ticking = asyncio.ensure_future(ticker())
        if me == 0:
            (out / "ready").write_text("1")
    try:
        calls = 0
        while not (out / "joined").exists():  # founders: calls and loop gaps meanwhile
            if me == 0:
                await group.subgroup(Weights).touch()
                calls += 1
            await asyncio.sleep(0.01)
        gaps_on = False
        await ticking
        await group.subgroup(Weights).touch()
        if me == 0:  # the sponsor: until it logged its transfer done
            deadline = loop.time() + 120
            while not any(" done: " in line for line in said) and loop.time() < deadline:
                await asyncio.sleep(0.05)
        moved = [line for line in said if "chunks moved by" in line]
        if moved:
            found = re.search(r"(\d+) of (\d+) chunks moved by a GPU plane", moved[0])
            report["chunks_by_gpu"] = [int(found[1]), int(found[2])] if found else None
        value = group.local(Weights).value
        report.update(
            views=[v.view_id for v in group.history],
            digest=await loop.run_in_executor(None, _digest, value),
            peak_rss_mb=_peak_rss_mb(),
            worst_loop_gap_s=round(worst, 4),
            calls_during_transfer=calls,
        )
        (out / f"m{me}.json").write_text(json.dumps(report))
        while len(list(out.glob("m*.json"))) < founders + 1:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        await group.leave()


def _read_segment(name: str, size: int, q: Any) -> None:
    seg = shared_memory.SharedMemory(name=name)
    began = time.perf_counter()
    buf = seg.buf
    assert buf is not None
    data = bytes(buf[:size])
    hashlib.sha256(data).digest()
    q.put(time.perf_counter() - began)
    del data
    seg.close()


def raw_host_copy(size: int) -> float:
    """Seconds to write ``size`` bytes into shared memory, copy them out in another process and
    hash them there (what a transfer must do at least, less the pipelining)."""
    blob = (bytes(range(256)) * (size // 256 + 1))[:size]
    seg = shared_memory.SharedMemory(create=True, size=size)
    try:
        began = time.perf_counter()
        buf = seg.buf
        assert buf is not None
        buf[:size] = blob
        written = time.perf_counter() - began
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_read_segment, args=(seg.name, size, q))
        p.start()
        read = q.get()
        p.join()
        return written + float(read)
    finally:
        seg.close()
        seg.unlink()


def raw_device_copy(size: int) -> float:
    import cupy

    src = cupy.arange(size // 4, dtype=cupy.uint32)
    dst = cupy.empty_like(src)
    cupy.cuda.Device().synchronize()
    began = time.perf_counter()
    dst[...] = src
    _digest(dst)
    cupy.cuda.Device().synchronize()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=2048, help="state size in MiB")
    parser.add_argument("--members", type=int, default=3, help="founding members")
    parser.add_argument("--chunk-kb", type=int, default=32768, help="Config.state_chunk_kb")
    parser.add_argument("--device", action="store_true", help="a CuPy array state (GPU)")
    parser.add_argument("--log-level", default="WARNING", help="Config.log_level of the members")
    parser.add_argument("--out", type=Path, default=None, help="keep the member reports here")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="state-transfer-"))
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("m*.json"), out / "ready", out / "joined"]:
        stale.unlink(missing_ok=True)
    size = args.mb << 20
    os.environ.update(DA_BENCH_OUT=str(out), DA_BENCH_MB=str(args.mb),
                      DA_BENCH_DEVICE="1" if args.device else "0")
    began = time.monotonic()
    codes = da.launch_local(args.members + 1, bench_member, timeout=900,
                            initial_members=args.members, state_chunk_kb=args.chunk_kb,
                            gpu_plane="ipc" if args.device else "auto",
                            log_level=args.log_level)
    wall = time.monotonic() - began
    reports = {int(p.stem[1:]): json.loads(p.read_text()) for p in out.glob("m*.json")}
    if codes != [0] * (args.members + 1) or len(reports) != args.members + 1:
        print(f"FAILED: exit codes {codes}, reports from {sorted(reports)}", file=sys.stderr)
        sys.exit(1)
    digests = {r["digest"] for r in reports.values()}
    raw = raw_device_copy(size) if args.device else raw_host_copy(size)
    joiner = reports[args.members]
    kind = "CuPy array (CUDA IPC plane)" if args.device else "host bytes (shm)"
    print(f"state {args.mb} MiB of {kind}, {args.members} founders + 1 joiner, "
          f"chunks of {args.chunk_kb} KiB, {os.cpu_count()} cores")
    print(f"  joiner: join {joiner['join_s']:.2f} s, peak RSS {joiner['peak_rss_mb']} MiB, "
          f"worst loop gap during the join {joiner['worst_loop_gap_s']} s, "
          f"views {joiner['views']}")
    for m in range(args.members):
        r = reports[m]
        print(f"  member {m}: peak RSS {r['peak_rss_mb']} MiB (with its state, before the join:"
              f" {r['rss_with_state_mb']} MiB), worst loop gap {r['worst_loop_gap_s']} s, "
              f"views {r['views']}")
    if "chunks_by_gpu" in reports[0]:
        by_gpu = reports[0]["chunks_by_gpu"]
        print(f"  chunks moved by a GPU plane (sponsor): {by_gpu[0]} of {by_gpu[1]}")
    print(f"  ordered calls made by member 0 during the transfer: "
          f"{reports[0]['calls_during_transfer']}")
    print(f"  same state everywhere: {len(digests) == 1}")
    print(f"  raw peer ({'device copy + digest' if args.device else 'shm write + copy out + sha256'}"
          f"): {raw:.2f} s; join / raw = {joiner['join_s'] / raw:.1f}x")
    print(f"  whole run {wall:.1f} s; reports in {out}")
    if len(digests) != 1:
        sys.exit(1)


if __name__ == "__main__":
    main()
