"""What encoding and decoding an ordered call costs, per call shape (microseconds per call).

Usage: python benchmarks/codec_costs.py [--n 20000]

Times :func:`derecho_async.wire.encode_call` and :func:`~derecho_async.wire.decode_call` for
the calls the runtime makes per message: a plain call with a 1 KB bytes argument, and calls whose
numpy arrays travel out of band (as the data planes send them: ``buffers=[]``), decoded with the
receiver's own arrays. Each figure is the best of 5 batches. No GPU needed: CuPy arrays take the
same path with their own dtype and shape lookups. Run it with ``PYTHONPATH`` on two checkouts to
compare them on one machine.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from derecho_async import wire


def _best_us(fn: Callable[[], object], n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=20000, help="calls per batch")
    args = parser.parse_args()
    x = np.zeros((1024, 1024), dtype=np.float32)
    y = np.zeros(4096, dtype=np.int64)
    payload = b"x" * 1024
    cases: list[tuple[str, Callable[[list[object]], bytes], list[object]]] = [
        ("take(1 KB bytes)", lambda b: wire.encode_call("take", (payload,), {}), []),
        ("take(x), x out of band",
         lambda b: wire.encode_call("take", (x,), {}, buffers=b, inline_bytes=8192),
         [np.zeros_like(x)]),
        ("update('fc1', x, scale=0.5, bias=y), out of band",
         lambda b: wire.encode_call("W.update", ("fc1", x), {"scale": 0.5, "bias": y},
                                     buffers=b, inline_bytes=8192),
         [np.zeros_like(x), np.zeros_like(y)]),
    ]
    print(f"{'call':<50} {'encode µs':>10} {'decode µs':>10}")
    for name, encode, received in cases:
        data = encode([])
        bufs = received or None
        enc = _best_us(lambda encode=encode: encode([]), args.n)  # type: ignore[misc]
        dec = _best_us(lambda data=data, bufs=bufs: wire.decode_call(data, bufs),  # type: ignore[misc]
                       args.n)
        print(f"{name:<50} {enc:>10.2f} {dec:>10.2f}")


if __name__ == "__main__":
    main()
