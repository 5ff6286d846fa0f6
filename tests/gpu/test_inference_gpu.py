"""The inference server example on a real device (marker ``gpu``): the weights live on the GPU
and every update's delta travels as a device array on the group's GPU plane, arriving in each
replica's handler as a CuPy array; the replicas' weights stay bit-identical and equal the host
replay of the same deltas in version order."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import numpy as np
import pytest

from tests.gpu import need_cupy
from tests.inference_cluster import Cluster, get_json, load_example, post

pytestmark = pytest.mark.gpu

LAYERS = (64, 256, 256, 16)
UPDATES = 24


async def test_device_deltas_on_the_gpu_plane_keep_replicas_identical(tmp_path: Path) -> None:
    need_cupy()
    aiohttp = pytest.importorskip("aiohttp")
    model = load_example("model")
    group = f"infer-gpu-{secrets.token_hex(4)}"
    cluster = Cluster(tmp_path, group, initial=2, device="gpu", init_seed=5, layers=LAYERS)
    with cluster.stopped_after():
        async with asyncio.timeout(120), aiohttp.ClientSession() as session:
            for r in range(2):
                cluster.start(r)
            healths = [await cluster.wait_ready(session, r) for r in range(2)]
            assert [h["device"] for h in healths] == ["gpu", "gpu"], cluster.logs()
            names = sorted(model.layer_shapes(LAYERS))
            bodies = [{"name": names[i % len(names)], "seed": 100 + i, "scale": 0.02}
                      for i in range(UPDATES)]
            results = await asyncio.gather(*(post(session, cluster.url(i % 2) + "/update", b)
                                             for i, b in enumerate(bodies)))
            versions = [r["version"] for r in results]
            assert sorted(versions) == list(range(1, UPDATES + 1))
            healths = [await get_json(session, cluster.url(r) + "/health") for r in range(2)]
            # every delta reached every replica's handler as a device array
            assert [h["device_deltas"] for h in healths] == [UPDATES, UPDATES], healths
            weights = model.init_weights(5, LAYERS)
            for _, body in sorted(zip(versions, bodies, strict=True), key=lambda vb: vb[0]):
                w = weights[body["name"]]
                w += model.make_delta(w.shape, seed=body["seed"], scale=body["scale"])
            assert {h["digest"] for h in healths} == {model.weights_digest(weights)}
            x = np.linspace(-1, 1, 4 * LAYERS[0], dtype=np.float32).reshape(4, LAYERS[0])
            outs = [await post(session, cluster.url(r) + "/infer", {"x": x.tolist()})
                    for r in range(2)]
            assert outs[0]["y"] == outs[1]["y"] and outs[0]["version"] == UPDATES
            assert np.allclose(np.asarray(outs[0]["y"], np.float32), model.forward(weights, x),
                               rtol=1e-3, atol=1e-4)
            print(f"gpu inference example: {UPDATES} device deltas per replica, digest "
                  f"{healths[0]['digest'][:16]}, y[0][:4] {outs[0]['y'][0][:4]}")
