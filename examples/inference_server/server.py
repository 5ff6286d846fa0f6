# Theory of operation
# -------------------
# One replica of the replicated inference service: a single process that is both an HTTP server
# (aiohttp) and a member of a derecho_async group. The group hosts one actor, ``Model``: a small
# two-layer MLP whose weights (``w1``, ``b1``, ``w2``, ``b2``, float32) live in every member.
#
# * ``POST /update`` turns the request into a concrete float32 delta *at the receiving replica*
#   (an explicit ``delta`` times ``scale``, or a delta drawn from ``seed`` times ``scale``) and
#   multicasts it as the ordered call ``Model.update(name, delta)``. Ordered calls are delivered
#   at every member in one total order, so every replica applies the same deltas in the same
#   order and numbers them with the same versions 1, 2, 3, ...: after version k the weights are
#   bit-for-bit identical everywhere, no matter which replicas the updates came through.
#   The reply carries every member's answer (the new version there).
# * ``POST /infer`` runs the forward pass on this replica's own copy only (no group traffic).
#   The pass is a few small matrix products and never awaits, so it runs inline on the event
#   loop and sees the weights of exactly one version (ordered handlers run on the same loop).
# * ``GET /health`` reports this replica's view, version and a digest of its weights;
#   ``GET /cluster`` asks every member of the view for the same through ``@p2p`` calls.
# * A replica started after the group formed joins it and receives ``Model.snapshot()`` from the
#   group (state transfer) before it serves anything, so it answers from the current version.
#
# Initial weights come from ``--init-seed``, identical at every replica of view 0 (they start
# from their own copy; only later joiners use state transfer). Call arguments travel as msgpack
# (numpy arrays inline); nothing is pickled. With ``--device gpu`` the weights live in cupy
# arrays when cupy and a CUDA device are available; otherwise the replica logs that it falls
# back to numpy.

"""One replica of the replicated inference server: aiohttp + a derecho_async group member.

Run one replica by hand (``launch.py`` starts several):

    python examples/inference_server/server.py --replica 0 --replicas 3 --group demo --port 8080
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from aiohttp import web

import derecho_async as da
from derecho_async import wire

__all__ = [
    "LAYERS",
    "Model",
    "ModelSettings",
    "build_app",
    "forward",
    "init_weights",
    "layer_shapes",
    "main",
    "make_delta",
    "weights_digest",
]

log = logging.getLogger("inference_server")

Array = npt.NDArray[np.float32]

LAYERS = ("w1", "b1", "w2", "b2")
"""The weight tensors of the model, in digest order."""

MAX_BATCH = 1024
"""Most rows one ``/infer`` request may carry."""


def layer_shapes(in_dim: int, hidden: int, out_dim: int) -> dict[str, tuple[int, ...]]:
    """The shape of each weight tensor of the MLP ``in_dim -> hidden -> out_dim``."""
    return {"w1": (in_dim, hidden), "b1": (hidden,), "w2": (hidden, out_dim), "b2": (out_dim,)}


def init_weights(seed: int, in_dim: int, hidden: int, out_dim: int) -> dict[str, Array]:
    """Deterministic initial weights (the same seed and sizes give the same bits everywhere)."""
    rng = np.random.default_rng(seed)
    out: dict[str, Array] = {}
    for name, shape in layer_shapes(in_dim, hidden, out_dim).items():
        std = 1.0 / math.sqrt(shape[0]) if len(shape) == 2 else 0.1  # matrices by fan-in
        out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return out


def make_delta(
    shape: tuple[int, ...], *, delta: object = None, seed: int | None = None, scale: float = 1.0
) -> Array:
    """The float32 delta an update request stands for: ``delta * scale`` or ``N(0,1)[seed] * scale``.

    Raises ``ValueError`` when the delta does not have ``shape`` or is not finite.
    """
    if delta is not None:
        try:
            d = np.asarray(delta, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"delta is not a numeric array: {exc}") from None
    elif seed is not None:
        d = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    else:
        raise ValueError("an update needs 'delta' or 'seed'")
    if d.shape != shape:
        raise ValueError(f"delta has shape {list(d.shape)}, expected {list(shape)}")
    d = d * np.float32(scale)
    if not np.isfinite(d).all():
        raise ValueError("delta is not finite")
    return d


def forward(weights: Mapping[str, Any], x: Any, xp: Any = np) -> Any:
    """``relu(x @ w1 + b1) @ w2 + b2`` with the array module ``xp`` (numpy or cupy)."""
    h = xp.maximum(xp.asarray(x) @ weights["w1"] + weights["b1"], xp.float32(0))
    return h @ weights["w2"] + weights["b2"]


def weights_digest(weights: Mapping[str, Any]) -> str:
    """SHA-256 over the weight tensors (name, shape, little-endian float32 bytes)."""
    h = hashlib.sha256()
    for name in LAYERS:
        w = np.ascontiguousarray(_to_numpy(weights[name]), dtype="<f4")
        h.update(f"{name}{list(w.shape)}".encode())
        h.update(w.tobytes())
    return h.hexdigest()


def _to_numpy(a: Any) -> Array:
    if isinstance(a, np.ndarray):
        return a
    get = getattr(a, "get", None)  # cupy.ndarray.get() copies to the host
    return np.asarray(get() if callable(get) else a, dtype=np.float32)


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """How ``Model()`` builds its initial state (the group constructs actors without arguments)."""

    seed: int = 0
    in_dim: int = 8
    hidden: int = 16
    out_dim: int = 4
    device: str = "cpu"


def _array_module(device: str) -> tuple[Any, str]:
    """``(numpy or cupy, "cpu" or "gpu")`` for ``--device``; logs a fallback to numpy."""
    if device != "gpu":
        return np, "cpu"
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # ImportError, or CUDA errors when there is no usable device
        log.warning("--device gpu: cupy is not usable (%s); falling back to numpy on the CPU", exc)
        return np, "cpu"
    log.info("--device gpu: weights live in cupy arrays on the GPU")
    return cupy, "gpu"


class Model(da.Actor):
    """The replicated model: an MLP's weights and the version (number of updates applied)."""

    settings: ClassVar[ModelSettings] = ModelSettings()

    def __init__(self) -> None:
        s = self.settings
        self.xp, self.device = _array_module(s.device)
        self.weights: dict[str, Any] = {
            k: self.xp.asarray(v)
            for k, v in init_weights(s.seed, s.in_dim, s.hidden, s.out_dim).items()
        }
        self.version = 0

    # -- replicated calls ----------------------------------------------------------------------
    @da.ordered  # multicast; every member applies the same deltas in the same order
    async def update(self, name: str, delta: Array) -> int:
        w = self.weights.get(name)
        if w is None:
            raise KeyError(f"no weight tensor {name!r}")
        d = np.asarray(delta, dtype=np.float32)
        if d.shape != w.shape:
            raise ValueError(f"delta has shape {list(d.shape)}, {name} has {list(w.shape)}")
        w += self.xp.asarray(d)
        self.version += 1
        return self.version

    @da.p2p  # read-only, at one chosen member
    def get_version(self) -> int:
        return self.version

    @da.p2p
    def status(self) -> dict[str, object]:
        return {"version": self.version, "digest": weights_digest(self.weights)}

    # -- local reads ---------------------------------------------------------------------------
    def infer(self, x: Array) -> Array:
        """The forward pass on this replica's weights, as a numpy array."""
        return _to_numpy(forward(self.weights, x, self.xp))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.weights.items()}

    # -- state transfer ------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        weights = {k: _to_numpy(v) for k, v in self.weights.items()}
        return wire.encode({"version": self.version, "weights": weights})

    def restore(self, state: bytes) -> None:
        data = wire.decode(state)
        if not isinstance(data, dict) or not isinstance(data.get("version"), int):
            raise da.ProtocolViolation("bad Model snapshot")
        weights = data.get("weights")
        if not isinstance(weights, dict) or set(weights) != set(LAYERS):
            raise da.ProtocolViolation("bad Model snapshot: weights")
        # decoded arrays may be read-only views of the message: copy (update adds in place)
        self.weights = {k: self.xp.array(np.asarray(v, np.float32)) for k, v in weights.items()}
        self.version = data["version"]
        log.info(
            "state transfer: restored version %d (weights %s)",
            self.version,
            weights_digest(self.weights)[:12],
        )


# -- HTTP ------------------------------------------------------------------------------------------
def _error(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=json.dumps({"error": message}), content_type="application/json")


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise _error(web.HTTPBadRequest, f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _error(web.HTTPBadRequest, "body must be a JSON object")
    return body


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _error(web.HTTPBadRequest, f"{key!r} must be a finite number")
    return float(value)


class Replica:
    """The HTTP handlers of one replica, bound to its group member."""

    def __init__(self, group: da.Group) -> None:
        self.group = group
        self.me = group.member_id
        self.handle = group.subgroup(Model)
        self.model = group.local(Model)

    async def health(self, request: web.Request) -> web.Response:
        view = self.group.view
        return web.json_response(
            {
                "replica": self.me,
                "view": {"id": view.view_id, "members": list(view.members)},
                "version": self.model.version,
                "digest": weights_digest(self.model.weights),
                "device": self.model.device,
                "shapes": {k: list(v) for k, v in self.model.shapes().items()},
            }
        )

    async def infer(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        try:
            x = np.asarray(body.get("x"), dtype=np.float32)
        except (TypeError, ValueError):
            raise _error(web.HTTPBadRequest, "'x' must be a numeric vector or matrix") from None
        in_dim = self.model.shapes()["w1"][0]
        if x.ndim not in (1, 2) or x.shape[-1] != in_dim or (x.ndim == 2 and len(x) > MAX_BATCH):
            raise _error(
                web.HTTPBadRequest,
                f"'x' must have shape [{in_dim}] or [n <= {MAX_BATCH}, {in_dim}]",
            )
        # Small and synchronous: no await between reading the version and the weights.
        y = self.model.infer(x)
        version = self.model.version
        return web.json_response({"y": y.tolist(), "version": version, "replica": self.me})

    async def update(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        name = body.get("name")
        shapes = self.model.shapes()
        if not isinstance(name, str) or name not in shapes:
            raise _error(web.HTTPBadRequest, f"'name' must be one of {sorted(shapes)}")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise _error(web.HTTPBadRequest, "'seed' must be a non-negative integer")
        try:
            delta = make_delta(
                shapes[name], delta=body.get("delta"), seed=seed, scale=_number(body, "scale", 1.0)
            )
        except ValueError as exc:
            raise _error(web.HTTPBadRequest, str(exc)) from None
        try:
            replies = await self.handle[Model.update](name, delta)
        except da.DerechoError as exc:  # left, partitioned, not in a view
            raise _error(web.HTTPServiceUnavailable, f"{type(exc).__name__}: {exc}") from None
        mine = replies.get(self.me)
        if not isinstance(mine, int):
            raise _error(web.HTTPInternalServerError, f"update failed here: {mine!r}")
        answers = {
            str(m): v if isinstance(v, int) else f"{type(v).__name__}: {v}"
            for m, v in replies.items()
        }
        return web.json_response(
            {"version": mine, "replies": answers, "order": list(replies.version)}
        )

    async def cluster(self, request: web.Request) -> web.Response:
        members = list(self.group.view.members)

        async def ask(m: int) -> object:
            try:
                return await asyncio.wait_for(self.handle[Model.status].at(m)(), 2.0)
            except (da.DerechoError, TimeoutError) as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}

        answers = await asyncio.gather(*(ask(m) for m in members))
        return web.json_response({str(m): a for m, a in zip(members, answers, strict=True)})


def build_app(group: da.Group) -> web.Application:
    """The aiohttp application of one replica."""
    replica = Replica(group)
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_get("/health", replica.health)
    app.router.add_get("/cluster", replica.cluster)
    app.router.add_post("/infer", replica.infer)
    app.router.add_post("/update", replica.update)
    return app


# -- process entry point ---------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replica", type=int, required=True, help="this replica's member id")
    p.add_argument("--replicas", type=int, default=3, help="members that form the group (view 0)")
    p.add_argument("--group", required=True, help="group name, the same at every replica")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address")
    p.add_argument("--port", type=int, default=8080, help="HTTP port (0: any free port)")
    p.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    p.add_argument("--listen", default="127.0.0.1:0", help="tcp: this member's 'host:port'")
    p.add_argument(
        "--peers", default="", help="tcp: initial members, 'id=host:port,id=host:port,...'"
    )
    p.add_argument(
        "--secret",
        default=os.environ.get("INFERENCE_SECRET"),
        help="tcp: shared secret, 128+ bits: `derecho-async secret` (default: $INFERENCE_SECRET)",
    )
    p.add_argument("--heartbeat-ms", type=float, default=50.0)
    p.add_argument("--suspect-ms", type=float, default=1000.0)
    p.add_argument("--init-seed", type=int, default=0, help="seed of the initial weights")
    p.add_argument("--dims", default="8,16,4", help="in,hidden,out sizes of the MLP")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="gpu needs cupy")
    p.add_argument("--join-timeout", type=float, default=60.0)
    p.add_argument("--ready-file", help="write {'replica', 'port'} as JSON here once serving")
    p.add_argument("--no-uvloop", action="store_true", help="run on stock asyncio")
    return p.parse_args(argv)


def _config(args: argparse.Namespace) -> da.Config:
    fields: dict[str, Any] = {
        "group": args.group,
        "member_id": args.replica,
        "initial_members": args.replicas,
        "transport": args.transport,
        "heartbeat_ms": args.heartbeat_ms,
        "suspect_after_ms": args.suspect_ms,
    }
    if args.transport == "tcp":
        peers: dict[int, str] = {}
        for item in filter(None, args.peers.split(",")):
            mid, _, addr = item.partition("=")
            peers[int(mid)] = addr
        fields.update(peers=peers, listen=args.listen, secret=args.secret)
    return da.Config(**fields)


async def serve(args: argparse.Namespace) -> None:
    """Join the group, serve HTTP until SIGTERM/SIGINT, then leave the group."""
    in_dim, hidden, out_dim = (int(v) for v in args.dims.split(","))
    Model.settings = ModelSettings(args.init_seed, in_dim, hidden, out_dim, args.device)
    config = _config(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("joining group %r over %s as member %d", config.group, config.transport, args.replica)
    group = await da.Group.join(config, actors=[Model], timeout=args.join_timeout)
    runner = web.AppRunner(build_app(group), access_log=None)
    try:
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        port = int(runner.addresses[0][1])
        model = group.local(Model)
        log.info(
            "serving http://%s:%d/ (view %d %s, version %d, %s)",
            args.host,
            port,
            group.view.view_id,
            list(group.view.members),
            model.version,
            model.device,
        )
        if args.ready_file:
            tmp = f"{args.ready_file}.tmp"
            with open(tmp, "w") as f:
                json.dump({"replica": args.replica, "port": port}, f)
            os.replace(tmp, args.ready_file)
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()
        with contextlib.suppress(da.DerechoError):
            await group.leave()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s replica {args.replica} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.no_uvloop:
        asyncio.run(serve(args))
    else:
        import uvloop

        uvloop.run(serve(args))


if __name__ == "__main__":
    main()
