# Theory of operation
# -------------------
# Starts N replicas of ``server.py`` on this host as child processes. For each it writes a TOML
# file (a [derecho_async] table for da.Config.load and an [inference] table for the server)
# into a scratch directory; member ids 0..N-1 form the group's first view, HTTP ports are
# PORT..PORT+N-1. Over tcp the members get free loopback ports as their peers table and a fresh
# secret, passed in the environment (DERECHO_ASYNC_SECRET), never written to the files.
#
# It waits until every replica answers ``GET /ready``, then serves until Ctrl-C (default) or
# runs a short demonstration (``--demo``). Meanwhile it watches the children: a replica that
# exits is reported at once with its exit code or signal (3: its member was out of the group).
# ``--kill K`` SIGKILLs replica K during the demonstration, to show the others' view change, or,
# with two replicas, the survivor wedging, going unhealthy and exiting. On exit the children
# get SIGTERM (they leave the group), stragglers SIGKILL, and shared memory is removed.
"""Start N inference-server replicas on this host (and optionally demonstrate them).

    python examples/inference_server/launch.py --replicas 3 --port 8080          # serve
    python examples/inference_server/launch.py --replicas 3 --demo --late 1      # demo, exit
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import aiohttp

from derecho_async.config.strength import new_secret
from derecho_async.launch import free_ports

SERVER = Path(__file__).with_name("server.py")


def replica_toml(*, group: str, member: int, initial: int, transport: str,
                 peers: dict[int, str], http_port: int, device: str, init_seed: int,
                 layers: tuple[int, ...], ready_file: str, suspect_after_ms: float) -> str:
    """The TOML file of one replica (the secret comes from the environment)."""
    lines = ["[derecho_async]", f'group = "{group}"', f"member_id = {member}",
             f"initial_members = {initial}", f'transport = "{transport}"',
             f"suspect_after_ms = {suspect_after_ms}"]
    if peers:
        lines.append("peers = { " + ", ".join(f'{m} = "{a}"' for m, a in peers.items()) + " }")
    lines += ["", "[inference]", f"http_port = {http_port}", f'device = "{device}"',
              f"init_seed = {init_seed}", f"layers = {list(layers)}",
              f"ready_file = {json.dumps(ready_file)}"]
    return "\n".join(lines) + "\n"


def describe_exit(code: int) -> str:
    """An exit code as people read it."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    if code == 3:
        return "exit code 3: its member was out of the group"
    if code == 2:
        return "exit code 2: bad settings, or its join was refused for good"
    return f"exit code {code}"


def stop_replicas(procs: Iterable[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM every replica still running (it leaves the group and exits); SIGKILL those not
    gone after ``grace_s``."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.1, deadline - time.monotonic()))
        if p.poll() is None:
            p.kill()
            p.wait()


class Replicas:
    """The replica processes of one group on this host."""

    def __init__(self, args: argparse.Namespace, scratch: Path) -> None:
        self.args = args
        self.scratch = scratch
        self.group = args.group or f"inference-{os.getpid()}-{secrets.token_hex(3)}"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.reported: set[int] = set()
        self.stopping = False
        total = args.replicas + args.late
        self.member_ports = free_ports(total) if args.transport == "tcp" else []
        self.env = dict(os.environ)
        if args.transport == "tcp":
            self.env["DERECHO_ASYNC_SECRET"] = new_secret()

    def url(self, replica: int) -> str:
        return f"http://127.0.0.1:{self.args.port + replica}"

    def start(self, replica: int) -> None:
        a = self.args
        peers = ({i: f"127.0.0.1:{self.member_ports[i]}" for i in range(a.replicas)}
                 if a.transport == "tcp" else {})
        if a.transport == "tcp" and replica not in peers:  # a later replica: its own address
            peers[replica] = f"127.0.0.1:{self.member_ports[replica]}"
        path = self.scratch / f"replica{replica}.toml"
        path.write_text(replica_toml(
            group=self.group, member=replica, initial=a.replicas, transport=a.transport,
            peers=peers, http_port=a.port + replica, device=a.device, init_seed=a.init_seed,
            layers=tuple(a.layers), ready_file=str(self.scratch / f"ready{replica}.json"),
            suspect_after_ms=a.suspect_ms))
        self.procs[replica] = subprocess.Popen(
            [sys.executable, str(SERVER), f"--config={path}"], env=self.env)

    async def wait_ready(self, session: aiohttp.ClientSession, replica: int,
                         timeout: float = 60.0) -> dict[str, Any]:
        """Wait until ``replica`` answers ``/ready``; returns its ``/health``."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[replica]
            if proc.poll() is not None:
                raise RuntimeError(f"replica {replica}: {describe_exit(proc.returncode)}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(self.url(replica) + "/ready") as r:
                    if r.status == 200:
                        async with session.get(self.url(replica) + "/health") as h:
                            health: dict[str, Any] = await h.json()
                            return health
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica} not ready in {timeout} s")
            await asyncio.sleep(0.2)

    async def watch(self) -> None:
        """Report every replica that exits (until stop() begins)."""
        while not self.stopping:
            for replica, proc in list(self.procs.items()):
                code = proc.poll()
                if code is not None and replica not in self.reported:
                    self.reported.add(replica)
                    print(f"launcher: replica {replica} is gone ({describe_exit(code)})",
                          flush=True)
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        self.stopping = True
        stop_replicas(self.procs.values())
        if self.args.transport == "shm":
            from derecho_async.transport.shm import ShmTransport

            ShmTransport.cleanup_group(self.group)


async def demo(reps: Replicas, session: aiohttp.ClientSession) -> None:
    n = reps.args.replicas
    shapes = (await reps.wait_ready(session, 0))["shapes"]
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
    print(f"  versions returned: {versions[0]}..{versions[-1]} (a permutation: "
          f"{versions == list(range(1, count + 1))}); every member agreed on each: {agreed}")
    x = [0.25 * j - 1.0 for j in range(shapes["w0"][0])]
    print("\nthe same input at every replica (40 concurrent requests each, batched):")
    for i in range(n):
        outs = await asyncio.gather(*(post(i, "/infer", {"x": x}) for _ in range(40)))
        print(f"  replica {i}: version {outs[0]['version']}  y = {outs[0]['y']}")
    for k in range(n, n + reps.args.late):
        print(f"\nstarting replica {k}, which joins the running group (state transfer)...")
        reps.start(k)
        h = await reps.wait_ready(session, k)
        o = (await asyncio.gather(*(post(k, "/infer", {"x": x}) for _ in range(40))))[0]
        print(f"  replica {k}: view {h['view']}, version {o['version']}  y = {o['y']}")
    if reps.args.kill is not None:
        k = reps.args.kill
        print(f"\nSIGKILL replica {k}; the others' /health:")
        reps.procs[k].kill()
        for _ in range(30):
            await asyncio.sleep(0.5)
            states = {}
            for i in sorted(reps.procs):
                if i == k:
                    continue
                try:
                    async with session.get(reps.url(i) + "/health") as r:
                        states[i] = f"{r.status} {(await r.json())['status']}"
                except aiohttp.ClientError:
                    states[i] = "no answer (exited)"
            print(f"  {states}")
            if all(s.startswith("200") for s in states.values()):
                async with session.get(reps.url(min(states)) + "/health") as r:
                    view = (await r.json()).get("view", {})
                if k not in view.get("members", [k]):
                    print(f"  view {view}: replica {k} removed, the others serve")
                    break
            if all(s.startswith("no answer") for s in states.values()):
                break


async def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="inference-") as scratch:
        reps = Replicas(args, Path(scratch))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        watcher = asyncio.ensure_future(reps.watch())
        try:
            for i in range(args.replicas):
                reps.start(i)
            async with aiohttp.ClientSession() as session:
                for i in range(args.replicas):
                    await reps.wait_ready(session, i)
                print(f"group {reps.group!r} over {args.transport}: replicas at")
                for i in range(args.replicas):
                    print(f"  {reps.url(i)}")
                if args.demo:
                    await demo(reps, session)
                    await asyncio.sleep(0.3)  # (the watcher reports what the demo ended)
                    return 0
                for k in range(args.replicas, args.replicas + args.late):
                    await asyncio.sleep(args.late_after)
                    reps.start(k)
                    await reps.wait_ready(session, k)
                    print(f"  {reps.url(k)}  (joined later)")
                print("Ctrl-C stops them.")
                await stop.wait()
                return 0
        finally:
            watcher.cancel()
            reps.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=3, help="replicas that form the group")
    p.add_argument("--port", type=int, default=8080, help="HTTP port of replica 0 (i: PORT+i)")
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--layers", type=int, nargs="+", default=[8, 32, 32, 4],
                   help="the MLP's widths: input, hidden..., output")
    p.add_argument("--init-seed", type=int, default=0, help="seed of the initial weights")
    p.add_argument("--suspect-ms", type=float, default=1000.0, help="suspect_after_ms")
    p.add_argument("--group", help="group name (default: a fresh one)")
    p.add_argument("--late", type=int, default=0, help="replicas to start after the group formed")
    p.add_argument("--late-after", type=float, default=5.0, help="seconds before each late one")
    p.add_argument("--demo", action="store_true", help="run the demonstration, then stop")
    p.add_argument("--kill", type=int, help="--demo: SIGKILL this replica at the end")
    args = p.parse_args()
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
