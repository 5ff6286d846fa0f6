# Theory of operation
# -------------------
# End-to-end tests of examples/inference_server with real replica processes (server.py, shm
# transport, settings from TOML files through da.Config.load). Total order is checked three ways:
# the versions the updates got are a permutation of 1..N agreed by every member; every replica
# serves the same version with bit-identical weights (digest) and, for a request alone in its
# batch, bit-identical outputs; and replaying the deltas in version order on a local copy of the
# initial weights reproduces that digest exactly (float32 additions do not commute bit for bit).
# A replica started later catches up by state transfer. The lifecycle tests SIGKILL a peer and
# watch /health, /ready and the survivor's exit code; the batching test reads /metrics.
"""The replicated inference server example: order, state transfer, batching, lifecycle."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip(
    "aiohttp", reason="the inference server example needs aiohttp (pip install aiohttp)"
)
np = pytest.importorskip("numpy", reason="the inference server example needs numpy")

from derecho_async.transport.shm import ShmTransport  # noqa: E402
from tests.inference_cluster import Cluster, get_json, load_example, post  # noqa: E402

model = load_example("model")
UPDATES = 30
INIT_SEED = 11
LAYERS = (8, 32, 32, 4)


def _update_bodies(shapes: dict[str, tuple[int, ...]]) -> list[dict[str, Any]]:
    """Half explicit deltas (with a scale), half seeds the replica expands server-side."""
    rng = np.random.default_rng(5)
    names = sorted(shapes)
    bodies: list[dict[str, Any]] = []
    for i in range(UPDATES):
        name = names[i % len(names)]
        if i % 2 == 0:
            delta = rng.standard_normal(shapes[name]).astype(np.float32)
            bodies.append({"name": name, "delta": delta.tolist(), "scale": 0.03})
        else:
            bodies.append({"name": name, "seed": 1000 + i, "scale": 0.05})
    return bodies


def _replay(bodies: list[dict[str, Any]], versions: list[int]) -> Any:
    """The weights after applying the updates in the order of the versions they were given."""
    weights = model.init_weights(INIT_SEED, LAYERS)
    for _, body in sorted(zip(versions, bodies, strict=True), key=lambda vb: vb[0]):
        name = body["name"]
        weights[name] += model.make_delta(weights[name].shape, delta=body.get("delta"),
                                          seed=body.get("seed"), scale=body["scale"])
    return weights


def _group() -> str:
    return f"infer-test-{secrets.token_hex(4)}"


async def test_replicas_apply_concurrent_updates_in_one_order_and_joiner_catches_up(
    tmp_path: Path,
) -> None:
    group = _group()
    cluster = Cluster(tmp_path, group, initial=3, init_seed=INIT_SEED, layers=LAYERS)
    with cluster.stopped_after():
        async with asyncio.timeout(60), aiohttp.ClientSession() as session:
            for r in range(3):
                cluster.start(r)
            healths = [await cluster.wait_ready(session, r) for r in range(3)]
            assert all(h["version"] == 0 and h["view"]["members"] == [0, 1, 2] for h in healths)
            shapes = {k: tuple(v) for k, v in healths[0]["shapes"].items()}
            assert shapes == model.layer_shapes(LAYERS)

            # Concurrent updates through every replica.
            bodies = _update_bodies(shapes)
            results = await asyncio.gather(
                *(post(session, cluster.url(i % 3) + "/update", b) for i, b in enumerate(bodies)))
            versions = [res["version"] for res in results]
            assert sorted(versions) == list(range(1, UPDATES + 1)), versions
            for res in results:
                assert res["replies"] == {str(m): res["version"] for m in range(3)}, res

            # The same input at every replica, alone in its batch: same version, same bits.
            x = np.linspace(-1.0, 1.0, 3 * LAYERS[0], dtype=np.float32).reshape(3, LAYERS[0])
            outs = [await post(session, cluster.url(r) + "/infer", {"x": x.tolist()})
                    for r in range(3)]
            assert [o["replica"] for o in outs] == [0, 1, 2]
            assert all(o["version"] == UPDATES for o in outs)
            ys = [np.asarray(o["y"], dtype=np.float32) for o in outs]
            assert all(np.array_equal(y, ys[0]) for y in ys), ys
            digests = {(await get_json(session, cluster.url(r) + "/health"))["digest"]
                       for r in range(3)}
            assert len(digests) == 1

            # Replaying the deltas in version order reproduces the replicas' weights exactly.
            expected = _replay(bodies, versions)
            assert digests == {model.weights_digest(expected)}
            assert np.allclose(ys[0], model.forward(expected, x), rtol=1e-5, atol=1e-6)

            # A replica started later receives the weights by state transfer.
            cluster.start(3)
            h3 = await cluster.wait_ready(session, 3)
            assert h3["version"] == UPDATES and h3["view"]["members"] == [0, 1, 2, 3]
            assert {h3["digest"]} == digests
            o3 = await post(session, cluster.url(3) + "/infer", {"x": x.tolist()})
            assert o3["version"] == UPDATES and o3["replica"] == 3
            assert np.array_equal(np.asarray(o3["y"], dtype=np.float32), ys[0])

            # ... and takes part in the next update like everyone else.
            res = await post(session, cluster.url(3) + "/update",
                             {"name": "b2", "seed": 7, "scale": 0.5})
            assert res["version"] == UPDATES + 1
            assert res["replies"] == {str(m): UPDATES + 1 for m in range(4)}
            status = await get_json(session, cluster.url(1) + "/cluster")
            assert sorted(status) == ["0", "1", "2", "3"]
            assert len({(s["version"], s["digest"]) for s in status.values()}) == 1
    assert ShmTransport.segments(group) == []


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


async def test_infer_requests_are_batched_and_metrics_are_exported(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client", reason="/metrics needs prometheus_client")
    group = _group()
    cluster = Cluster(tmp_path, group, initial=1, init_seed=INIT_SEED, layers=LAYERS,
                      extra="batch_wait_ms = 20.0\n")
    with cluster.stopped_after():
        async with asyncio.timeout(30), aiohttp.ClientSession() as session:
            cluster.start(0)
            await cluster.wait_ready(session, 0)
            url = cluster.url(0)
            await post(session, url + "/update", {"name": "w0", "seed": 3, "scale": 0.1})
            rng = np.random.default_rng(9)
            xs = [rng.standard_normal((1 + i % 3, LAYERS[0])).astype(np.float32)
                  for i in range(60)]
            outs = await asyncio.gather(*(post(session, url + "/infer", {"x": x.tolist()})
                                          for x in xs))
            weights = model.init_weights(INIT_SEED, LAYERS)
            weights["w0"] += model.make_delta(weights["w0"].shape, seed=3, scale=0.1)
            for x, o in zip(xs, outs, strict=True):  # each request gets its own rows back
                assert o["version"] == 1
                assert np.allclose(np.asarray(o["y"], np.float32), model.forward(weights, x),
                                   rtol=1e-5, atol=1e-6)
            async with session.get(url + "/metrics") as r:
                assert r.status == 200 and r.content_type == "text/plain"
                text = await r.text()
            batches = _metric(text, "inference_batches_total")
            assert _metric(text, "inference_infer_requests_total") == 60
            assert _metric(text, "inference_batch_rows_total") == sum(len(x) for x in xs)
            assert 1 <= batches < 60  # requests shared forward passes
            assert _metric(text, "derecho_async_sent_total") == 1
            assert _metric(text, "derecho_async_delivered_total") >= 1
            assert _metric(text, "derecho_async_views_total") >= 1
            assert _metric(text, "derecho_async_members") == 1
            assert _metric(text, "derecho_async_in_flight_calls") == 0
            assert _metric(text, "inference_serving") == 1


async def test_a_replica_is_live_but_not_ready_until_it_joined(tmp_path: Path) -> None:
    group = _group()
    cluster = Cluster(tmp_path, group, initial=2, init_seed=INIT_SEED, layers=LAYERS)
    with cluster.stopped_after():
        async with asyncio.timeout(40), aiohttp.ClientSession() as session:
            cluster.start(1)  # waits for member 0, the contact
            ready = tmp_path / "ready1.json"
            while True:  # its HTTP port is known once it serves; until then ask the log
                if cluster.procs[1].poll() is not None:
                    raise AssertionError(cluster.logs())
                line = next((ln for ln in (tmp_path / "replica1.log").read_text().splitlines()
                             if "up; joining group" in ln), None)
                if line is not None:
                    port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
                    break
                await asyncio.sleep(0.05)
            url = f"http://127.0.0.1:{port}"
            health = await get_json(session, url + "/health")
            assert health["status"] == "joining"
            async with session.get(url + "/ready") as r:
                assert r.status == 503
            async with session.post(url + "/infer", json={"x": [0.0] * LAYERS[0]}) as r:
                assert r.status == 503
            assert not ready.exists()
            cluster.start(0)
            await cluster.wait_ready(session, 0)
            await cluster.wait_ready(session, 1)


async def test_the_survivor_goes_unhealthy_and_exits_when_its_peer_is_killed(
    tmp_path: Path,
) -> None:
    # Two replicas: when one is SIGKILLed the other has no majority of its view and wedges.
    # /health and /ready answer 503 with the reason; then the process exits with code 3.
    group = _group()
    cluster = Cluster(tmp_path, group, initial=2, init_seed=INIT_SEED, layers=LAYERS,
                      suspect_after_ms=500.0, extra="exit_grace_s = 1.5\n")
    with cluster.stopped_after():
        async with asyncio.timeout(40), aiohttp.ClientSession() as session:
            for r in range(2):
                cluster.start(r)
            for r in range(2):
                await cluster.wait_ready(session, r)
            await post(session, cluster.url(0) + "/update", {"name": "b0", "seed": 1})
            cluster.procs[1].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            url = cluster.url(0)
            while True:
                async with session.get(url + "/health") as r:
                    if r.status == 503:
                        health = await r.json()
                        break
                    assert (await r.json())["status"] == "serving"
                assert time.monotonic() - killed_at < 15, cluster.logs()
                await asyncio.sleep(0.05)
            assert health["status"] == "gone" and "majority" in health["reason"], health
            async with session.get(url + "/ready") as r:
                assert r.status == 503
            async with session.post(url + "/update", json={"name": "b0", "seed": 2}) as r:
                assert r.status == 503
            code = await asyncio.to_thread(cluster.procs[0].wait, 15)
            assert code == 3, cluster.logs()


async def test_bad_requests_are_rejected_without_touching_the_group(tmp_path: Path) -> None:
    group = _group()
    cluster = Cluster(tmp_path, group, initial=1, init_seed=INIT_SEED, layers=LAYERS)
    with cluster.stopped_after():
        async with asyncio.timeout(30), aiohttp.ClientSession() as session:
            cluster.start(0)
            await cluster.wait_ready(session, 0)
            url = cluster.url(0)
            for path, body in [
                ("/update", {"name": "nope", "seed": 1}),
                ("/update", {"name": "b1", "delta": [1.0, 2.0]}),  # wrong shape
                ("/update", {"name": "b1"}),  # neither delta nor seed
                ("/update", {"name": "b1", "seed": 1, "scale": "big"}),
                ("/infer", {"x": [1.0, 2.0]}),  # wrong width
                ("/infer", {"x": "abc"}),
            ]:
                async with session.post(url + path, json=body) as r:
                    assert r.status == 400, (path, body, await r.text())
                    assert "error" in await r.json()
            async with session.post(url + "/update", data=b"{not json") as r:
                assert r.status == 400
            assert (await get_json(session, url + "/health"))["version"] == 0
    assert ShmTransport.segments(group) == []


def test_bad_settings_are_refused_with_the_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.inference_cluster import SERVER

    path = tmp_path / "bad.toml"
    path.write_text('[derecho_async]\ngroup = "x"\nmember_id = 0\n\n[inference]\nbatchrows = 3\n')
    out = subprocess.run([sys.executable, str(SERVER), f"--config={path}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown keys ['batchrows']" in out.stderr
    path.write_text('[derecho_async]\ngroup = "x"\nmember_id = 0\nwindow = 0\n')
    out = subprocess.run([sys.executable, str(SERVER), f"--config={path}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "'window'" in out.stderr


def test_a_replica_refused_for_good_exits_with_code_2(tmp_path: Path) -> None:
    # Replica 1 has another secret than replica 0: its join is refused at once, and since a
    # restart would not help it exits with 2 (bad settings), not 3 (member gone: restart me).
    import os
    import subprocess
    import sys

    from derecho_async.config.strength import new_secret
    from derecho_async.launch import free_ports
    from tests.inference_cluster import SERVER

    launch = load_example("launch")
    group = _group()
    ports = free_ports(2)
    peers = {i: f"127.0.0.1:{p}" for i, p in enumerate(ports)}
    procs = []
    try:
        for member, secret in ((0, new_secret()), (1, new_secret())):
            path = tmp_path / f"r{member}.toml"
            path.write_text(launch.replica_toml(
                group=group, member=member, initial=1, transport="tcp",
                peers=peers if member == 1 else {0: peers[0]}, http_port=0, device="cpu",
                init_seed=1, layers=LAYERS, ready_file=str(tmp_path / f"ready{member}.json"),
                suspect_after_ms=1000.0))
            env = dict(os.environ, DERECHO_ASYNC_SECRET=secret)
            log = open(tmp_path / f"r{member}.log", "wb")  # noqa: SIM115 (the child keeps it)
            procs.append(subprocess.Popen([sys.executable, str(SERVER), f"--config={path}"],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
            if member == 0:
                deadline = time.monotonic() + 30
                while not (tmp_path / "ready0.json").exists():
                    assert procs[0].poll() is None and time.monotonic() < deadline
                    time.sleep(0.05)
        code = procs[1].wait(30)
        text = (tmp_path / "r1.log").read_text()
        assert code == 2, text
        assert "AuthenticationError" in text
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(10)
