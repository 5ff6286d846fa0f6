# Theory of operation
# -------------------
# End-to-end test of examples/inference_server: three real replica processes (server.py, shm
# transport) on free loopback ports, concurrent POST /update requests spread over all of them,
# then the same POST /infer at every replica. Total order is checked three ways: the versions the
# updates got are a permutation of 1..N and every member reported the same version for each
# update; every replica serves the same version with bit-identical outputs and weight digests;
# and replaying the deltas in version order on a local copy of the initial weights reproduces
# that digest exactly (float32 additions do not commute bit for bit, so a replica that applied
# them in another order would differ). A fourth replica started afterwards must catch up through
# state transfer, answer identically, and take part in a further update.

"""The replicated inference server example: ordered updates, identical inference, state transfer."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

aiohttp = pytest.importorskip(
    "aiohttp", reason="the inference server example needs aiohttp (pip install aiohttp)"
)
np = pytest.importorskip("numpy", reason="the inference server example needs numpy")

from derecho_async.transport.shm import ShmTransport  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "inference_server"
SERVER = EXAMPLE / "server.py"
UPDATES = 30
INIT_SEED = 11


def _load_server() -> ModuleType:
    spec = importlib.util.spec_from_file_location("inference_server_example", SERVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


server = _load_server()


class Cluster:
    """Replica processes of one group, with their logs and HTTP ports."""

    def __init__(self, tmp: Path, group: str, initial: int) -> None:
        self.tmp = tmp
        self.group = group
        self.initial = initial
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.ports: dict[int, int] = {}

    def start(self, replica: int) -> None:
        cmd = [
            sys.executable,
            str(SERVER),
            f"--replica={replica}",
            f"--replicas={self.initial}",
            f"--group={self.group}",
            "--port=0",
            f"--ready-file={self.tmp / f'ready{replica}.json'}",
            f"--init-seed={INIT_SEED}",
            "--suspect-ms=3000",
            "--join-timeout=30",
        ]
        with open(self.tmp / f"replica{replica}.log", "wb") as log:  # the child keeps its copy
            self.procs[replica] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def url(self, replica: int) -> str:
        return f"http://127.0.0.1:{self.ports[replica]}"

    async def wait_ready(self, session: Any, replica: int, timeout: float = 30.0) -> dict[str, Any]:
        """Wait for the ready file, then for GET /health to answer; returns the health."""
        ready = self.tmp / f"ready{replica}.json"
        deadline = time.monotonic() + timeout
        while True:
            proc = self.procs[replica]
            if proc.poll() is not None:
                raise AssertionError(
                    f"replica {replica} exited ({proc.returncode}):\n{self.logs()}"
                )
            if replica not in self.ports and ready.exists():
                self.ports[replica] = int(json.loads(ready.read_text())["port"])
            if replica in self.ports:
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(self.url(replica) + "/health") as r:
                        if r.status == 200:
                            health: dict[str, Any] = await r.json()
                            return health
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
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the replica leaves the group and exits
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
        ShmTransport.cleanup_group(self.group)


async def _post(session: Any, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as r:
        text = await r.text()
        assert r.status == 200, f"POST {url} {body}: {r.status} {text}"
        out: dict[str, Any] = json.loads(text)
        return out


def _update_bodies(shapes: dict[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """Half explicit deltas (with a scale), half seeds the replica expands server-side."""
    rng = np.random.default_rng(5)
    bodies: list[dict[str, Any]] = []
    for i in range(UPDATES):
        name = server.LAYERS[i % len(server.LAYERS)]
        if i % 2 == 0:
            delta = rng.standard_normal(shapes[name]).astype(np.float32)
            bodies.append({"name": name, "delta": delta.tolist(), "scale": 0.03})
        else:
            bodies.append({"name": name, "seed": 1000 + i, "scale": 0.05})
    return bodies


def _replay(bodies: list[dict[str, Any]], versions: list[int], dims: tuple[int, int, int]) -> Any:
    """The weights after applying the updates in the order of the versions they were given."""
    weights = server.init_weights(INIT_SEED, *dims)
    for _, body in sorted(zip(versions, bodies, strict=True), key=lambda vb: vb[0]):
        name = body["name"]
        weights[name] += server.make_delta(
            weights[name].shape, delta=body.get("delta"), seed=body.get("seed"), scale=body["scale"]
        )
    return weights


async def test_replicas_apply_concurrent_updates_in_one_order_and_joiner_catches_up(
    tmp_path: Path,
) -> None:
    group = f"infer-test-{secrets.token_hex(4)}"
    cluster = Cluster(tmp_path, group, initial=3)
    try:
        async with asyncio.timeout(60), aiohttp.ClientSession() as session:
            for r in range(3):
                cluster.start(r)
            healths = [await cluster.wait_ready(session, r) for r in range(3)]
            assert all(h["version"] == 0 and h["view"]["members"] == [0, 1, 2] for h in healths)
            shapes = {k: tuple(v) for k, v in healths[0]["shapes"].items()}
            dims = (shapes["w1"][0], shapes["w1"][1], shapes["w2"][1])

            # Concurrent updates through every replica.
            bodies = _update_bodies(shapes)
            results = await asyncio.gather(
                *(_post(session, cluster.url(i % 3) + "/update", b) for i, b in enumerate(bodies))
            )
            versions = [res["version"] for res in results]
            assert sorted(versions) == list(range(1, UPDATES + 1)), versions
            for res in results:
                assert res["replies"] == {str(m): res["version"] for m in range(3)}, res

            # The same input at every replica: same version, bit-identical outputs and weights.
            x = np.linspace(-1.0, 1.0, 3 * dims[0], dtype=np.float32).reshape(3, dims[0])
            outs = [
                await _post(session, cluster.url(r) + "/infer", {"x": x.tolist()}) for r in range(3)
            ]
            assert [o["replica"] for o in outs] == [0, 1, 2]
            assert all(o["version"] == UPDATES for o in outs)
            ys = [np.asarray(o["y"], dtype=np.float32) for o in outs]
            assert all(np.array_equal(y, ys[0]) for y in ys), ys
            digests = set()
            for r in range(3):
                async with session.get(cluster.url(r) + "/health") as resp:
                    digests.add((await resp.json())["digest"])
            assert len(digests) == 1

            # Replaying the deltas in version order reproduces the replicas' weights exactly.
            expected = _replay(bodies, versions, dims)
            assert digests == {server.weights_digest(expected)}
            assert np.allclose(ys[0], server.forward(expected, x), rtol=1e-6, atol=1e-6)

            # A replica started later receives the weights by state transfer.
            cluster.start(3)
            h3 = await cluster.wait_ready(session, 3)
            assert h3["version"] == UPDATES and h3["view"]["members"] == [0, 1, 2, 3]
            assert {h3["digest"]} == digests
            o3 = await _post(session, cluster.url(3) + "/infer", {"x": x.tolist()})
            assert o3["version"] == UPDATES and o3["replica"] == 3
            assert np.array_equal(np.asarray(o3["y"], dtype=np.float32), ys[0])

            # ... and takes part in the next update like everyone else.
            res = await _post(
                session, cluster.url(3) + "/update", {"name": "b2", "seed": 7, "scale": 0.5}
            )
            assert res["version"] == UPDATES + 1
            assert res["replies"] == {str(m): UPDATES + 1 for m in range(4)}
            outs = [
                await _post(session, cluster.url(r) + "/infer", {"x": x.tolist()}) for r in range(4)
            ]
            assert all(o["version"] == UPDATES + 1 for o in outs)
            assert all(o["y"] == outs[0]["y"] for o in outs)
            async with session.get(cluster.url(1) + "/cluster") as resp:
                status = await resp.json()
            assert sorted(status) == ["0", "1", "2", "3"]
            assert len({(s["version"], s["digest"]) for s in status.values()}) == 1
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop()
    assert ShmTransport.segments(group) == []


async def test_bad_requests_are_rejected_without_touching_the_group(tmp_path: Path) -> None:
    group = f"infer-test-{secrets.token_hex(4)}"
    cluster = Cluster(tmp_path, group, initial=1)
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as session:
            cluster.start(0)
            await cluster.wait_ready(session, 0)
            url = cluster.url(0)
            for path, body in [
                ("/update", {"name": "nope", "seed": 1}),
                ("/update", {"name": "b2", "delta": [1.0, 2.0]}),  # wrong shape
                ("/update", {"name": "b2"}),  # neither delta nor seed
                ("/update", {"name": "b2", "seed": 1, "scale": "big"}),
                ("/infer", {"x": [1.0, 2.0]}),  # wrong width
                ("/infer", {"x": "abc"}),
            ]:
                async with session.post(url + path, json=body) as r:
                    assert r.status == 400, (path, body, await r.text())
                    assert "error" in await r.json()
            async with session.post(url + "/update", data=b"{not json") as r:
                assert r.status == 400
            async with session.get(url + "/health") as r:
                assert (await r.json())["version"] == 0
    finally:
        cluster.stop()
    assert ShmTransport.segments(group) == []
