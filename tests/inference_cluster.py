"""Replica processes of examples/inference_server for its tests (CPU here, GPU in tests/gpu):
each replica is ``server.py --config <file>`` with a file made by the launcher's
``replica_toml``, logging to a file the failure message shows."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp

from derecho_async.transport.shm import ShmTransport

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "inference_server"
SERVER = EXAMPLE / "server.py"


def load_example(name: str) -> ModuleType:
    """Module ``name`` of the example (its directory goes on sys.path: server imports model)."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


class Cluster:
    """Replica processes of one group, with their logs and HTTP ports."""

    def __init__(self, tmp: Path, group: str, initial: int, *, device: str = "cpu",
                 init_seed: int = 11, layers: tuple[int, ...] = (8, 32, 32, 4),
                 suspect_after_ms: float = 3000.0, extra: str = "") -> None:
        self.tmp = tmp
        self.group = group
        self.initial = initial
        self.device = device
        self.init_seed = init_seed
        self.layers = layers
        self.suspect_after_ms = suspect_after_ms
        self.extra = extra
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.ports: dict[int, int] = {}

    def start(self, replica: int) -> None:
        launch = load_example("launch")
        text = launch.replica_toml(
            group=self.group, member=replica, initial=self.initial, transport="shm", peers={},
            http_port=0, device=self.device, init_seed=self.init_seed, layers=self.layers,
            ready_file=str(self.tmp / f"ready{replica}.json"),
            suspect_after_ms=self.suspect_after_ms) + self.extra
        path = self.tmp / f"replica{replica}.toml"
        path.write_text(text)
        with open(self.tmp / f"replica{replica}.log", "wb") as log:  # the child keeps its copy
            self.procs[replica] = subprocess.Popen(
                [sys.executable, str(SERVER), f"--config={path}"],
                stdout=log, stderr=subprocess.STDOUT)

    def url(self, replica: int) -> str:
        return f"http://127.0.0.1:{self.ports[replica]}"

    async def wait_ready(self, session: aiohttp.ClientSession, replica: int,
                         timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the ready file, then for GET /ready; returns GET /health."""
        ready = self.tmp / f"ready{replica}.json"
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[replica]
            if proc.poll() is not None:
                raise AssertionError(
                    f"replica {replica} exited ({proc.returncode}):\n{self.logs()}")
            if replica not in self.ports and ready.exists():
                self.ports[replica] = int(json.loads(ready.read_text())["port"])
            if replica in self.ports:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(self.url(replica) + "/ready") as r:
                        if r.status == 200:
                            return await get_json(session, self.url(replica) + "/health")
            if time.monotonic() > deadline:
                raise AssertionError(f"replica {replica} not ready in {timeout} s:\n{self.logs()}")
            await asyncio.sleep(0.1)

    def logs(self) -> str:
        parts = []
        for replica in sorted(self.procs):
            path = self.tmp / f"replica{replica}.log"
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(f"--- replica {replica}\n{text[-3000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        load_example("launch").stop_replicas(self.procs.values())
        ShmTransport.cleanup_group(self.group)

    @contextlib.contextmanager
    def stopped_after(self) -> Iterator[None]:
        """Stop the replicas on the way out; on a failure, print their logs first."""
        try:
            yield
        except BaseException:
            print(self.logs())
            raise
        finally:
            self.stop()


async def get_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as r:
        out: dict[str, Any] = await r.json()
        return out


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as r:
        text = await r.text()
        assert r.status == 200, f"POST {url} {body}: {r.status} {text}"
        out: dict[str, Any] = json.loads(text)
        return out
