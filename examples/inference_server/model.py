# Theory of operation
# -------------------
# The replicated model: a small multi-layer perceptron (dense layers, ReLU between them) whose
# weights live in every replica, on the GPU (CuPy) when the replica runs with device "gpu" and a
# CUDA device is there, in numpy otherwise. It is the group's one actor, ``Model``.
#
# Writes are ordered calls: ``Model.update(name, delta)`` adds a float32 delta to one tensor.
# Every replica applies the same deltas in the same total order and numbers them 1, 2, 3, ...,
# so after version k the weights are bit for bit the same everywhere (float32 additions do not
# commute bit for bit, so the order matters and the digest shows it). A GPU replica sends its
# deltas as CuPy arrays: they travel on the group's GPU plane and arrive in the handler as device
# arrays, never copied through host memory (``device_deltas`` counts them). Reads are local: the
# forward pass runs on this replica's own copy. A replica that joins later gets the weights by
# state transfer (``snapshot`` / ``restore``).
"""The replicated model of the inference server example: an MLP actor and its helpers."""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

import derecho_async as da
from derecho_async import wire

__all__ = [
    "Model",
    "ModelSettings",
    "array_module",
    "forward",
    "init_weights",
    "layer_names",
    "layer_shapes",
    "make_delta",
    "to_numpy",
    "weights_digest",
]

log = logging.getLogger("inference_server")

Array = npt.NDArray[np.float32]


def layer_names(layers: Sequence[int]) -> tuple[str, ...]:
    """The weight tensors of the MLP with these layer widths, in digest order: ``w0``, ``b0``,
    ``w1``, ``b1``, ..."""
    return tuple(f"{kind}{i}" for i in range(len(layers) - 1) for kind in ("w", "b"))


def layer_shapes(layers: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The shape of each weight tensor of the MLP with these layer widths."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(layers)):
        shapes[f"w{i}"] = (fan_in, fan_out)
        shapes[f"b{i}"] = (fan_out,)
    return shapes


def init_weights(seed: int, layers: Sequence[int]) -> dict[str, Array]:
    """Deterministic initial weights (the same seed and widths give the same bits anywhere)."""
    rng = np.random.default_rng(seed)
    out: dict[str, Array] = {}
    for name, shape in layer_shapes(layers).items():
        std = 1.0 / math.sqrt(shape[0]) if len(shape) == 2 else 0.1  # matrices by fan-in
        out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return out


def make_delta(
    shape: tuple[int, ...], *, delta: object = None, seed: int | None = None, scale: float = 1.0
) -> Array:
    """The float32 delta an update request stands for: ``delta * scale`` or
    ``N(0,1)[seed] * scale``. Raises ``ValueError`` when it does not have ``shape`` or is not
    finite."""
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
    """The MLP's output for the rows of ``x``: dense layers with ReLU between them, computed
    with the array module ``xp`` (numpy or CuPy)."""
    h = xp.asarray(x)
    depth = len(weights) // 2
    for i in range(depth):
        h = h @ weights[f"w{i}"] + weights[f"b{i}"]
        if i < depth - 1:
            h = xp.maximum(h, xp.float32(0))
    return h


def to_numpy(a: Any) -> Array:
    """``a`` as a host numpy float32 array (a CuPy array is copied from the device)."""
    if isinstance(a, np.ndarray):
        return a
    get = getattr(a, "get", None)  # cupy.ndarray.get() copies to the host
    return np.asarray(get() if callable(get) else a, dtype=np.float32)


def weights_digest(weights: Mapping[str, Any]) -> str:
    """SHA-256 over the weight tensors (name, shape, little-endian float32 bytes), by name."""
    h = hashlib.sha256()
    for name in sorted(weights, key=lambda n: (int(n[1:]), n[0] != "w")):  # w0, b0, w1, ...
        w = np.ascontiguousarray(to_numpy(weights[name]), dtype="<f4")
        h.update(f"{name}{list(w.shape)}".encode())
        h.update(w.tobytes())
    return h.hexdigest()


def array_module(device: str) -> tuple[Any, str]:
    """``(numpy or cupy, "cpu" or "gpu")`` for ``device``; "gpu" falls back to numpy, saying
    so, when CuPy or a CUDA device is missing."""
    if device != "gpu":
        return np, "cpu"
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:  # ImportError, or CUDA errors when there is no usable device
        log.warning("device gpu: CuPy is not usable (%s); the weights stay in host memory", exc)
        return np, "cpu"
    return cupy, "gpu"


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """How ``Model()`` builds its initial state (a group constructs actors without
    arguments): the seed of the initial weights, the layer widths and the device."""

    seed: int = 0
    layers: tuple[int, ...] = (8, 32, 32, 4)
    device: str = "cpu"


class Model(da.Actor):
    """The replicated model: the MLP's weights and the version (the updates applied)."""

    settings: ClassVar[ModelSettings] = ModelSettings()

    def __init__(self) -> None:
        s = self.settings
        self.xp, self.device = array_module(s.device)
        self.weights: dict[str, Any] = {
            k: self.xp.asarray(v) for k, v in init_weights(s.seed, s.layers).items()
        }
        self.version = 0
        self.device_deltas = 0  # deltas that arrived as device arrays (the GPU plane)

    # -- replicated calls ----------------------------------------------------------------------
    @da.ordered  # multicast; every replica applies the same deltas in the same order
    async def update(self, name: str, delta: Any) -> int:
        w = self.weights.get(name)
        if w is None:
            raise KeyError(f"no weight tensor {name!r}")
        if not hasattr(delta, "shape"):  # (a list, from a caller that sent no array)
            delta = np.asarray(delta, dtype=np.float32)
        if tuple(delta.shape) != tuple(w.shape):
            raise ValueError(f"delta has shape {list(delta.shape)}, {name} has {list(w.shape)}")
        on_device = not isinstance(delta, np.ndarray)
        if on_device and self.xp is np:  # a GPU replica's delta at a CPU replica
            delta = to_numpy(delta)
        w += self.xp.asarray(delta, dtype=self.xp.float32)
        if on_device and self.xp is not np:
            self.device_deltas += 1
        self.version += 1
        return self.version

    @da.p2p  # read-only, at one chosen member
    def status(self) -> dict[str, object]:
        return {"version": self.version, "digest": weights_digest(self.weights)}

    # -- local reads ---------------------------------------------------------------------------
    def infer(self, x: Array) -> Array:
        """The forward pass over the rows of ``x`` on this replica's weights (host result)."""
        return to_numpy(forward(self.weights, x, self.xp))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.weights.items()}

    def on_device(self, a: Array) -> Any:
        """``a`` where this replica's weights live (a CuPy array on a GPU replica): an update
        sent from here then travels on the GPU plane."""
        return self.xp.asarray(a)

    # -- state transfer ------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        weights = {k: to_numpy(v) for k, v in self.weights.items()}
        return wire.encode({"version": self.version, "weights": weights})

    def restore(self, state: bytes) -> None:
        data = wire.decode(state)
        if not isinstance(data, dict) or not isinstance(data.get("version"), int):
            raise da.ProtocolViolation("bad Model snapshot")
        weights = data.get("weights")
        if not isinstance(weights, dict) or set(weights) != set(self.weights):
            raise da.ProtocolViolation("bad Model snapshot: weights")
        # decoded arrays may be read-only views of the message: copy (update adds in place)
        self.weights = {k: self.xp.array(np.asarray(v, np.float32)) for k, v in weights.items()}
        self.version = data["version"]
        log.info("state transfer: restored version %d (weights %s)", self.version,
                 weights_digest(self.weights)[:12])
