# Theory of operation
# -------------------
# One replica of the replicated inference service: a process that is both an HTTP server
# (aiohttp) and a member of a derecho_async group hosting the ``Model`` actor (model.py).
#
# Settings come from one TOML file: its ``[derecho_async]`` table through ``da.Config.load``
# (so ``DERECHO_ASYNC_<KEY>`` variables override it, e.g. the secret), its ``[inference]`` table
# for the server's own (HTTP address, layer widths, device, batching, ...).
#
# Lifecycle. The HTTP server starts first, then the member joins. ``/health`` (liveness) answers
# 200 while the member is joining or in the group and 503 once it is out (it left, was removed,
# or wedged when its view lost a majority: ``group.closed`` says which). ``/ready`` answers 200
# only while the replica serves: joined, state restored, in the group. A task follows
# ``group.views()`` (logged, counted) and ``group.closed``: when the member is gone the replica
# stops taking requests, keeps answering 503 for ``exit_grace_s`` (so a load balancer sees it)
# and exits with code 3, for a supervisor to restart it; SIGTERM makes it leave and exit 0.
#
# Requests. ``POST /update`` makes the delta concrete at this replica, puts it where the weights
# live (a device array on a GPU replica: it travels on the GPU plane) and multicasts
# ``Model.update``. ``POST /infer`` requests are batched: the first waits up to
# ``batch_wait_ms`` for others, up to ``batch_rows`` rows go through one forward pass, and each
# request gets its rows and the version they were computed at. The pass never awaits, so a batch
# sees the weights of exactly one version. ``GET /metrics`` exports ``group.stats()`` and the
# server's counters in the Prometheus text format (the optional ``prometheus_client``).
"""One replica of the replicated inference server: aiohttp + a derecho_async group member.

    python examples/inference_server/server.py --config replica0.toml

``launch.py`` writes such files and starts several replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import numpy.typing as npt
from aiohttp import web
from model import Model, ModelSettings, make_delta, weights_digest

import derecho_async as da

__all__ = ["Batcher", "Replica", "ServerSettings", "build_app", "main", "serve"]

log = logging.getLogger("inference_server")

Array = npt.NDArray[np.float32]

EXIT_GONE = 3
"""The exit code of a replica whose member is out of the group (a supervisor restarts it)."""
EXIT_SETTINGS = 2
"""The exit code of bad settings, or of a join refused for good (restarting will not help)."""


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The ``[inference]`` table of a replica's TOML file."""

    http_host: str = "127.0.0.1"
    http_port: int = 8080  # 0: any free port (written to ready_file)
    layers: tuple[int, ...] = (8, 32, 32, 4)  # widths: input, hidden..., output
    init_seed: int = 0  # the initial weights (the same at every replica of view 0)
    device: str = "cpu"  # "gpu": weights in CuPy arrays, deltas on the GPU plane
    batch_rows: int = 256  # rows of one forward pass, at most
    batch_wait_ms: float = 2.0  # how long the first request of a batch waits for more
    max_request_rows: int = 1024
    exit_grace_s: float = 1.0  # how long a replica whose member is gone answers 503
    ready_file: str | None = None  # {"replica", "port"} written here once serving

    @classmethod
    def load(cls, path: str) -> ServerSettings:
        """The ``[inference]`` table of ``path`` (missing keys take their defaults); raises
        ``ValueError`` naming a bad or unknown key."""
        with open(path, "rb") as f:
            table = tomllib.load(f).get("inference", {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"[inference] in {path}: unknown keys {unknown}")
        if "layers" in table:
            table["layers"] = tuple(table["layers"])
        s = cls(**table)
        s.check()
        return s

    def check(self) -> None:
        """``ValueError`` for the first setting out of its range."""
        if not 0 <= self.http_port <= 65535:
            raise ValueError("http_port must be 0 to 65535")
        if len(self.layers) < 2 or not all(isinstance(w, int) and 1 <= w <= 4096
                                           for w in self.layers):
            raise ValueError("layers must be at least two widths of 1 to 4096")
        if self.device not in ("cpu", "gpu"):
            raise ValueError("device must be 'cpu' or 'gpu'")
        if not 1 <= self.batch_rows <= 65536 or not 1 <= self.max_request_rows <= 65536:
            raise ValueError("batch_rows and max_request_rows must be 1 to 65536")
        if not 0.0 <= self.batch_wait_ms <= 1000.0 or not 0.0 <= self.exit_grace_s <= 600.0:
            raise ValueError("batch_wait_ms must be 0 to 1000, exit_grace_s 0 to 600")


# -- batching ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Waiting:
    rows: Array
    future: asyncio.Future[tuple[Array, int]]


@dataclass(slots=True)
class Batcher:
    """Runs ``/infer`` requests through the model in batches (see the header)."""

    model: Model
    max_rows: int
    wait_s: float
    queue: asyncio.Queue[_Waiting] = field(default_factory=asyncio.Queue)
    batches: int = 0
    rows: int = 0

    async def infer(self, x: Array) -> tuple[Array, int]:
        """The output rows for the rows of ``x`` and the version they were computed at."""
        fut: asyncio.Future[tuple[Array, int]] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(_Waiting(x, fut))
        return await fut

    async def run(self) -> None:
        """Take requests, batch them and answer them, until cancelled."""
        while True:
            first = await self.queue.get()
            if self.wait_s > 0 and first.rows.shape[0] < self.max_rows:
                await asyncio.sleep(self.wait_s)  # let more requests arrive
            batch = [first]
            rows = first.rows.shape[0]
            while not self.queue.empty() and rows < self.max_rows:
                nxt = self.queue.get_nowait()
                batch.append(nxt)
                rows += nxt.rows.shape[0]
            self._answer(batch)

    def _answer(self, batch: list[_Waiting]) -> None:
        live = [w for w in batch if not w.future.done()]  # (a client may have gone)
        if not live:
            return
        try:  # one pass, no await: every row sees the same version
            y = self.model.infer(np.concatenate([w.rows for w in live]))
            version = self.model.version
        except Exception as exc:
            for w in live:
                w.future.set_exception(exc)
            return
        self.batches += 1
        self.rows += y.shape[0]
        at = 0
        for w in live:
            n = w.rows.shape[0]
            w.future.set_result((y[at:at + n], version))
            at += n


# -- HTTP -------------------------------------------------------------------------------------
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
    """One replica's state and HTTP handlers: ``joining`` until :meth:`attach`, ``serving``
    while its member is in the group, ``gone`` (with the reason) once it is out."""

    def __init__(self, me: int, settings: ServerSettings) -> None:
        self.me = me
        self.settings = settings
        self.state = "joining"
        self.reason = ""
        self.group: da.Group | None = None
        self.model: Model | None = None
        self.batcher: Batcher | None = None
        self.views_seen = 0
        self.requests = {"infer": 0, "update": 0}
        self.started = time.time()

    def attach(self, group: da.Group) -> None:
        """The member joined (its state restored): serve."""
        model = group.local(Model)
        self.group, self.model = group, model
        self.batcher = Batcher(model, self.settings.batch_rows,
                               self.settings.batch_wait_ms / 1000)
        self.state = "serving"

    def gone(self, reason: str) -> None:
        """The member is out of the group: stop serving, say why."""
        if self.state != "gone":
            self.state, self.reason = "gone", reason

    def _serving(self) -> tuple[da.Group, Model, Batcher]:
        if self.state != "serving" or self.group is None or self.model is None \
                or self.batcher is None:
            why = self.reason or "the replica has not joined the group yet"
            raise _error(web.HTTPServiceUnavailable, f"not serving: {why}")
        return self.group, self.model, self.batcher

    # -- lifecycle endpoints -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Liveness: 200 while joining or in the group, 503 once the member is out."""
        body: dict[str, Any] = {"replica": self.me, "status": self.state}
        if self.state == "gone":
            body["reason"] = self.reason
            return web.json_response(body, status=503)
        if self.group is not None and self.model is not None:
            view = self.group.view
            body.update(
                view={"id": view.view_id, "members": list(view.members)},
                version=self.model.version,
                digest=weights_digest(self.model.weights),
                device=self.model.device,
                device_deltas=self.model.device_deltas,
                shapes={k: list(v) for k, v in self.model.shapes().items()},
            )
        return web.json_response(body)

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: 200 only while serving."""
        status = 200 if self.state == "serving" else 503
        return web.json_response({"replica": self.me, "status": self.state,
                                  "reason": self.reason}, status=status)

    async def metrics(self, request: web.Request) -> web.Response:
        """The Prometheus text format (needs ``prometheus_client``)."""
        try:
            from prometheus_client import CollectorRegistry, generate_latest
        except ImportError:
            raise _error(web.HTTPNotImplemented, "/metrics needs prometheus_client "
                         "(pip install 'derecho_async[metrics]')") from None
        registry = CollectorRegistry()
        registry.register(_Collector(self))
        return web.Response(body=generate_latest(registry),
                            content_type="text/plain", charset="utf-8")

    # -- model endpoints -----------------------------------------------------------------------
    async def infer(self, request: web.Request) -> web.Response:
        _, model, batcher = self._serving()
        body = await _json_object(request)
        try:
            x = np.asarray(body.get("x"), dtype=np.float32)
        except (TypeError, ValueError):
            raise _error(web.HTTPBadRequest, "'x' must be a numeric vector or matrix") from None
        in_dim = model.shapes()["w0"][0]
        most = self.settings.max_request_rows
        if x.ndim not in (1, 2) or x.shape[-1] != in_dim or (x.ndim == 2 and len(x) > most):
            raise _error(web.HTTPBadRequest,
                         f"'x' must have shape [{in_dim}] or [n <= {most}, {in_dim}]")
        self.requests["infer"] += 1
        y, version = await batcher.infer(x.reshape(-1, in_dim))
        out = y[0] if x.ndim == 1 else y
        return web.json_response({"y": out.tolist(), "version": version, "replica": self.me})

    async def update(self, request: web.Request) -> web.Response:
        group, model, _ = self._serving()
        body = await _json_object(request)
        name = body.get("name")
        shapes = model.shapes()
        if not isinstance(name, str) or name not in shapes:
            raise _error(web.HTTPBadRequest, f"'name' must be one of {sorted(shapes)}")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise _error(web.HTTPBadRequest, "'seed' must be a non-negative integer")
        try:
            delta = make_delta(shapes[name], delta=body.get("delta"), seed=seed,
                               scale=_number(body, "scale", 1.0))
        except ValueError as exc:
            raise _error(web.HTTPBadRequest, str(exc)) from None
        self.requests["update"] += 1
        try:  # a device array on a GPU replica: the call's payload rides the GPU plane
            replies = await group.subgroup(Model)[Model.update](name, model.on_device(delta))
        except da.DerechoError as exc:  # left, partitioned, not in a view
            raise _error(web.HTTPServiceUnavailable, f"{type(exc).__name__}: {exc}") from None
        mine = replies.get(self.me)
        if not isinstance(mine, int):
            raise _error(web.HTTPInternalServerError, f"update failed here: {mine!r}")
        answers = {str(m): v if isinstance(v, int) else f"{type(v).__name__}: {v}"
                   for m, v in replies.items()}
        return web.json_response({"version": mine, "replies": answers,
                                  "order": list(replies.version)})

    async def cluster(self, request: web.Request) -> web.Response:
        group, _, _ = self._serving()
        members = list(group.view.members)
        handle = group.subgroup(Model)

        async def ask(m: int) -> object:
            try:
                return await asyncio.wait_for(handle[Model.status].at(m)(), 2.0)
            except (da.DerechoError, TimeoutError) as exc:
                return {"error": f"{type(exc).__name__}: {exc}"}

        answers = await asyncio.gather(*(ask(m) for m in members))
        return web.json_response({str(m): a for m, a in zip(members, answers, strict=True)})


class _Collector:
    """Reads a replica's figures when Prometheus scrapes (``prometheus_client`` collector)."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r = self.replica
        up = GaugeMetricFamily("inference_serving", "1 while this replica serves",
                               labels=["replica"])
        up.add_metric([str(r.me)], 1.0 if r.state == "serving" else 0.0)
        yield up
        for kind, n in r.requests.items():
            c = CounterMetricFamily(f"inference_{kind}_requests", f"/{kind} requests taken",
                                    labels=["replica"])
            c.add_metric([str(r.me)], n)
            yield c
        if r.batcher is not None:
            for what, n in (("batches", r.batcher.batches), ("batch_rows", r.batcher.rows)):
                c = CounterMetricFamily(f"inference_{what}", f"forward passes' {what}",
                                        labels=["replica"])
                c.add_metric([str(r.me)], n)
                yield c
        if r.model is not None:
            g = GaugeMetricFamily("inference_model_version", "updates applied here",
                                  labels=["replica"])
            g.add_metric([str(r.me)], r.model.version)
            yield g
        if r.group is None or r.state != "serving":
            return
        stats = r.group.stats()
        for key in ("delivered", "sent"):
            c = CounterMetricFamily(f"derecho_async_{key}", _HELP[key], labels=["member"])
            c.add_metric([str(r.me)], stats[key])
            yield c
        c = CounterMetricFamily("derecho_async_views", _HELP["views"], labels=["member"])
        c.add_metric([str(r.me)], stats["views"])
        yield c
        for key in ("view_id", "members", "in_flight_calls", "queued_calls", "pool_bytes"):
            g = GaugeMetricFamily(f"derecho_async_{key}", _HELP[key], labels=["member"])
            g.add_metric([str(r.me)], stats[key])
            yield g


_HELP = {
    "delivered": "messages delivered at this member",
    "sent": "ordered calls this member multicast",
    "views": "views installed at this member",
    "view_id": "the current view's id",
    "members": "members of the current view",
    "in_flight_calls": "this member's calls not completed",
    "queued_calls": "delivered calls waiting for handlers",
    "pool_bytes": "device memory held by the GPU plane's pool",
}


def build_app(replica: Replica) -> web.Application:
    """The aiohttp application of one replica."""
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_get("/health", replica.health)
    app.router.add_get("/ready", replica.ready)
    app.router.add_get("/metrics", replica.metrics)
    app.router.add_get("/cluster", replica.cluster)
    app.router.add_post("/infer", replica.infer)
    app.router.add_post("/update", replica.update)
    return app


# -- process entry point ------------------------------------------------------------------------
async def _follow(group: da.Group, replica: Replica, gone: asyncio.Event) -> None:
    """Log every view; when the member is out, say why and set ``gone``."""
    async def views() -> None:
        async for view in group.views():
            replica.views_seen += 1
            log.info("view %d: members %s", view.view_id, list(view.members))

    watcher = asyncio.ensure_future(views())
    try:
        await group.closed
        reason = "the member left the group"
    except da.DerechoError as exc:
        reason = f"{type(exc).__name__}: {exc}"
    finally:
        watcher.cancel()
    replica.gone(reason)
    gone.set()


async def serve(config: da.Config, settings: ServerSettings,
                on_ready: Callable[[int], None] | None = None) -> int:
    """Serve HTTP, join the group, serve until SIGTERM (leave, 0) or until the member is out
    (503 for ``exit_grace_s``, then ``EXIT_GONE``); returns the exit code."""
    Model.settings = ModelSettings(settings.init_seed, settings.layers, settings.device)
    replica = Replica(config.member_id, settings)
    runner = web.AppRunner(build_app(replica), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.http_host, settings.http_port)
    await site.start()
    port = int(runner.addresses[0][1])
    stop, gone = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    group: da.Group | None = None
    tasks: list[asyncio.Future[Any]] = []
    try:
        log.info("http://%s:%d/ up; joining group %r over %s as member %d", settings.http_host,
                 port, config.group, config.transport, config.member_id)
        try:
            group = await da.Group.join(config, actors=[Model])
        except da.DerechoError as exc:
            log.error("could not join: %s: %s", type(exc).__name__, exc)
            replica.gone(f"could not join: {type(exc).__name__}: {exc}")
            # a refusal or a bad setting will not pass by itself: no point restarting
            permanent = (da.AuthenticationError, da.JoinRefused, da.ConfigError)
            return EXIT_SETTINGS if isinstance(exc, permanent) else EXIT_GONE
        replica.attach(group)
        assert replica.batcher is not None and replica.model is not None
        tasks = [asyncio.ensure_future(replica.batcher.run()),
                 asyncio.ensure_future(_follow(group, replica, gone))]
        log.info("serving (view %d %s, version %d, weights on %s)", group.view.view_id,
                 list(group.view.members), replica.model.version, replica.model.device)
        if on_ready is not None:
            on_ready(port)
        ended = asyncio.ensure_future(stop.wait())
        lost = asyncio.ensure_future(gone.wait())
        await asyncio.wait([ended, lost], return_when=asyncio.FIRST_COMPLETED)
        ended.cancel()
        lost.cancel()
        if gone.is_set():
            log.error("the member is out of the group (%s); exiting with code %d in %.1f s",
                      replica.reason, EXIT_GONE, settings.exit_grace_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), settings.exit_grace_s)
            return EXIT_GONE
        log.info("stopping: leaving the group")
        return 0
    finally:
        replica.gone(replica.reason or "stopping")
        for t in tasks:
            t.cancel()
        if group is not None:
            with contextlib.suppress(da.DerechoError):
                await group.leave()
        await runner.cleanup()


def _write_ready(path: str, replica: int, port: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"replica": replica, "port": port}, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True,
                   help="TOML file: a [derecho_async] table (da.Config; DERECHO_ASYNC_* "
                        "variables override it) and an [inference] table")
    p.add_argument("--no-uvloop", action="store_true", help="run on stock asyncio")
    args = p.parse_args(argv)
    try:
        config = da.Config.load(args.config)
        settings = ServerSettings.load(args.config)
    except (da.ConfigError, ValueError, OSError, tomllib.TOMLDecodeError) as exc:
        print(f"server.py: {exc}", file=sys.stderr)
        return EXIT_SETTINGS
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s replica {config.member_id} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)

    def ready(port: int) -> None:
        if settings.ready_file:
            _write_ready(settings.ready_file, config.member_id, port)

    coro = serve(config, settings, ready)
    if args.no_uvloop:
        return asyncio.run(coro)
    import uvloop

    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
