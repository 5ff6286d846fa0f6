# Theory of operation
# -------------------
# Starts N replicas of ``server.py`` on this host as child processes (member ids 0..N-1 form the
# group's first view; HTTP ports PORT..PORT+N-1), waits until every one answers ``GET /health``,
# and then either keeps them running until Ctrl-C (default) or runs a short demonstration
# (``--demo``): concurrent updates through every replica, the same input inferred at each, and
# (with ``--late K``) K more replicas started afterwards that catch up by state transfer.
#
# Over tcp the launcher picks free loopback ports for the members and hands every replica the
# peers table; the shared secret travels in the environment ($INFERENCE_SECRET), not argv.
# On exit the children get SIGTERM (they leave the group), stragglers SIGKILL, and the group's
# shared memory is removed.

"""Start N inference-server replicas on this host (and optionally demonstrate them).

python examples/inference_server/launch.py --replicas 3 --port 8080          # serve
python examples/inference_server/launch.py --replicas 3 --demo --late 1      # demo, exit
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from derecho_async.launch import free_ports

SERVER = Path(__file__).with_name("server.py")



class Replicas:
    """The replica processes of one group on this host."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.group = args.group or f"inference-{os.getpid()}-{secrets.token_hex(3)}"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        total = args.replicas + args.late
        self.member_ports = free_ports(total) if args.transport == "tcp" else []
        self.env = dict(os.environ, INFERENCE_SECRET=secrets.token_hex(16))

    def url(self, replica: int) -> str:
        return f"http://127.0.0.1:{self.args.port + replica}"

    def start(self, replica: int) -> None:
        a = self.args
        cmd = [
            sys.executable,
            str(SERVER),
            f"--replica={replica}",
            f"--replicas={a.replicas}",
            f"--group={self.group}",
            f"--port={a.port + replica}",
            f"--transport={a.transport}",
            f"--device={a.device}",
        ]
        if a.transport == "tcp":
            peers = ",".join(f"{i}=127.0.0.1:{self.member_ports[i]}" for i in range(a.replicas))
            cmd += [f"--listen=127.0.0.1:{self.member_ports[replica]}", f"--peers={peers}"]
        self.procs[replica] = subprocess.Popen(cmd, env=self.env)

    async def wait_healthy(
        self, session: aiohttp.ClientSession, replica: int, timeout: float = 60.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[replica]
            if proc.poll() is not None:
                raise RuntimeError(f"replica {replica} exited with code {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(self.url(replica) + "/health") as r:
                    if r.status == 200:
                        health: dict[str, Any] = await r.json()
                        return health
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica} did not become healthy in {timeout} s")
            await asyncio.sleep(0.2)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
        if self.args.transport == "shm":
            from derecho_async.transport.shm import ShmTransport

            ShmTransport.cleanup_group(self.group)


async def demo(reps: Replicas, session: aiohttp.ClientSession) -> None:
    n = reps.args.replicas
    shapes = (await reps.wait_healthy(session, 0))["shapes"]
    names = sorted(shapes)

    async def post(replica: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with session.post(reps.url(replica) + path, json=body) as r:
            r.raise_for_status()
            out: dict[str, Any] = await r.json()
            return out

    count = 10 * n
    print(f"\n{count} concurrent updates, spread over replicas 0..{n - 1}:")
    bodies = [{"name": names[i % len(names)], "seed": i, "scale": 0.05} for i in range(count)]
    results = await asyncio.gather(*(post(i % n, "/update", b) for i, b in enumerate(bodies)))
    versions = sorted(r["version"] for r in results)
    agreed = all(set(r["replies"].values()) == {r["version"]} for r in results)
    print(
        f"  versions returned: {versions[0]}..{versions[-1]} (a permutation: "
        f"{versions == list(range(1, count + 1))}); every member agreed on each: {agreed}"
    )

    x = [0.25 * j - 1.0 for j in range(shapes["w1"][0])]
    print("\nthe same input at every replica:")
    outs = [await post(i, "/infer", {"x": x}) for i in range(n)]
    for o in outs:
        print(f"  replica {o['replica']}: version {o['version']}  y = {o['y']}")
    print(f"  identical everywhere: {all(o['y'] == outs[0]['y'] for o in outs)}")

    for k in range(n, n + reps.args.late):
        print(f"\nstarting replica {k}, which joins the running group (state transfer)...")
        reps.start(k)
        h = await reps.wait_healthy(session, k)
        o = await post(k, "/infer", {"x": x})
        print(f"  replica {k}: view {h['view']}, version {o['version']}  y = {o['y']}")
        print(f"  identical to replica 0: {o['y'] == outs[0]['y']}")


async def run(args: argparse.Namespace) -> None:
    reps = Replicas(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        for i in range(args.replicas):
            reps.start(i)
        async with aiohttp.ClientSession() as session:
            for i in range(args.replicas):
                await reps.wait_healthy(session, i)
            print(f"group {reps.group!r} over {args.transport}: replicas at")
            for i in range(args.replicas):
                print(f"  {reps.url(i)}")
            if args.demo:
                await demo(reps, session)
                return
            for k in range(args.replicas, args.replicas + args.late):
                await asyncio.sleep(args.late_after)
                reps.start(k)
                await reps.wait_healthy(session, k)
                print(f"  {reps.url(k)}  (joined later)")
            print("Ctrl-C stops them.")
            await stop.wait()
    finally:
        reps.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, default=3, help="replicas that form the group")
    p.add_argument("--port", type=int, default=8080, help="HTTP port of replica 0 (i: PORT+i)")
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--group", help="group name (default: a fresh one)")
    p.add_argument("--late", type=int, default=0, help="replicas to start after the group formed")
    p.add_argument("--late-after", type=float, default=5.0, help="seconds before each late one")
    p.add_argument("--demo", action="store_true", help="run the demonstration, then stop")
    args = p.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
