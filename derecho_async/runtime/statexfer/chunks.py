"""The chunks of a state transfer: what is sent, how it is cut, and how a chunk is checked.

Theory of operation: the encoded state is a *stream* of parts, the msgpack skeleton and then
each out-of-band buffer. :func:`freeze` copies, in the executor, each buffer that someone could
still change once the fence is released (a device array on the device when a GPU plane moves
its chunks, else to little-endian host memory). :class:`Stream` cuts the parts into chunks:
consecutive host parts share chunks, a device part has chunks of its own, each one slice of one
device array. :func:`build_chunk` makes a chunk and its digest: a sha256 of host bytes, or for a
device chunk :func:`checksum`, computed on the GPU by a small CuPy kernel (no copy to the host)
and equal to the same function on the host. CuPy is imported only where a device array is
met. See docs/DESIGN.md §7.7.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import struct
from typing import Any

from derecho_async import wire
from derecho_async.wire import is_cupy_array

__all__ = [
    "CHECKSUM",
    "DIGEST",
    "SHA256",
    "Stream",
    "build_chunk",
    "checksum",
    "copy_into",
    "device_parts",
    "freeze",
    "numpy_module",
]

DIGEST = 32
"""Bytes of a chunk's digest (a sha256, or a :func:`checksum`)."""


class Stream:
    """Where the chunks of a stream of parts (skeleton, then buffers) fall. Consecutive host
    parts share chunks; a device part (listed in ``alone``) has chunks of its own, so each of its
    chunks is one slice of one device array and can move on a GPU plane."""

    __slots__ = ("chunk", "count", "firsts", "runs", "sizes", "starts", "total")

    def __init__(self, sizes: list[int], chunk: int, alone: frozenset[int] = frozenset()) -> None:
        self.sizes = sizes
        self.chunk = chunk
        self.starts = list(itertools.accumulate([0, *sizes[:-1]]))
        self.total = sum(sizes)
        runs: list[tuple[int, int, int]] = []  # (first chunk index, stream offset, bytes)
        count = 0

        def close(lo: int, hi: int) -> None:
            nonlocal count
            if hi > lo:
                runs.append((count, lo, hi - lo))
                count += -(-(hi - lo) // chunk)

        lo = 0  # where the open run of host parts begins
        for part in sorted(alone):
            if 0 <= part < len(sizes):
                start = self.starts[part]
                close(lo, start)
                close(start, start + sizes[part])
                lo = start + sizes[part]
        close(lo, self.total)
        if not runs:  # an empty stream: one empty chunk
            runs.append((0, 0, 0))
            count = 1
        self.runs = runs
        self.firsts = [r[0] for r in runs]
        self.count = count

    def _span(self, index: int) -> tuple[int, int]:
        first, start, size = self.runs[bisect.bisect_right(self.firsts, index) - 1]
        lo = start + (index - first) * self.chunk
        return lo, min(self.chunk, start + size - lo)

    def length(self, index: int) -> int:
        return self._span(index)[1]

    def pieces(self, index: int) -> list[tuple[int, int, int, int]]:
        """(part, offset in part, offset in chunk, bytes) of chunk ``index``."""
        lo, n = self._span(index)
        hi = lo + n
        out = []
        part = max(0, bisect.bisect_right(self.starts, lo) - 1)
        pos = lo
        while pos < hi and part < len(self.sizes):
            start = self.starts[part]
            end = start + self.sizes[part]
            if end > pos:
                n = min(end, hi) - pos
                out.append((part, pos - start, pos - lo, n))
                pos += n
            part += 1
        return out


def numpy_module() -> Any:
    import numpy

    return numpy


def freeze(buf: object, on_device: bool) -> tuple[str, str, list[int], Any, object]:
    """(kind, dtype, shape, flat uint8 view, value for decoding) of one buffer of the encoded
    state, copied unless nobody can change it (a view of a ``bytes`` object). Runs in the
    executor. A device array is copied on the device when ``on_device`` (a GPU plane moves its
    chunks), else to host memory; host copies are little-endian."""
    np = numpy_module()
    if is_cupy_array(buf) and on_device:
        import cupy

        c: Any = buf
        dev = cupy.array(c, order="C", copy=True)  # the actor may change ``c`` once released
        cupy.cuda.get_current_stream().synchronize()
        return ("cuda", wire.numpy_dtype_name(dev.dtype), [int(n) for n in dev.shape],
                dev.reshape(-1).view(cupy.uint8), buf)
    if is_cupy_array(buf):
        import cupy

        host = cupy.asnumpy(cupy.ascontiguousarray(buf))
        kind = "cuda"
    elif isinstance(buf, np.ndarray):
        host = buf
        kind = "numpy"
    else:
        from derecho_async.runtime.dataplane import array_info, to_host_bytes

        info = array_info(buf)
        host = np.frombuffer(to_host_bytes(buf), np.dtype(info.dtype).newbyteorder("<"))
        host = host.reshape(info.shape)
        kind = "cuda" if info.is_gpu else "numpy"
    dtype = wire.numpy_dtype_name(host.dtype)
    shape = [int(n) for n in host.shape]
    if not (kind == "numpy" and type(host.base) is bytes and host.flags.c_contiguous
            and host.dtype.itemsize == 1):
        le = host.dtype.newbyteorder("<")
        host = np.array(host, dtype=le, order="C", copy=True)
    flat = host.reshape(-1).view(np.uint8)
    value: object = host.astype(host.dtype.newbyteorder("="), copy=False)
    if kind == "cuda":
        value = buf  # the observer sees what the actor gave
    return kind, dtype, shape, flat, value


SHA256 = 0  # how a chunk's digest was made: sha256 of host bytes
CHECKSUM = 1  # ... or checksum, computed where the chunk lies (a device chunk on the GPU)
_MIX = 2654435761
_MASK64 = (1 << 64) - 1
_CHECKSUM_TAG = 0x64615F7374617465  # marks the last word of a checksum digest


@functools.cache
def _mix_kernel() -> Any:
    import cupy

    return cupy.ElementwiseKernel(
        "uint8 x", "uint64 y, uint64 z",
        "unsigned long long v = ((unsigned long long)x + 1ULL)"
        " * ((unsigned long long)i * 2654435761ULL + 97ULL); y = v; z = v ^ (v >> 29);",
        "derecho_async_state_mix")


def checksum(arr: Any) -> bytes:
    """A 32-byte, position-sensitive checksum of a uint8 array (numpy or CuPy), computed where
    the array lies, so a device chunk is checked without a copy to the host: the sums mod 2**64
    of y_i = (x_i + 1)(i * 2654435761 + 97) and of y_i ^ (y_i >> 29), and the length. It is
    not a cryptographic digest: it catches bytes torn, lost or misplaced by a copy."""
    n = int(arr.shape[0])
    if is_cupy_array(arr):
        y, z = _mix_kernel()(arr)
        s1, s2 = int(y.sum()), int(z.sum())
    else:
        np = numpy_module()
        s1 = s2 = 0
        step = 1 << 20
        for lo in range(0, n, step):
            x = arr[lo:lo + step].astype(np.uint64)
            i = np.arange(lo, lo + x.shape[0], dtype=np.uint64)
            y = (x + np.uint64(1)) * (i * np.uint64(_MIX) + np.uint64(97))
            s1 = (s1 + int(y.sum(dtype=np.uint64))) & _MASK64
            s2 = (s2 + int((y ^ (y >> np.uint64(29))).sum(dtype=np.uint64))) & _MASK64
    return struct.pack("<QQQQ", s1, s2, n, _CHECKSUM_TAG)


def build_chunk(parts: list[Any], stream: Stream, index: int) -> tuple[Any, bytes, int]:
    """In the executor: chunk ``index`` as a flat uint8 array (a slice of a device part stays on
    the device), its digest and how the digest was made."""
    np = numpy_module()
    pieces = stream.pieces(index)
    if len(pieces) == 1:
        part, off, _, n = pieces[0]
        arr = parts[part][off:off + n]
        if is_cupy_array(arr):
            return arr, checksum(arr), CHECKSUM
    else:  # host parts only (a device part has chunks of its own)
        arr = np.empty(stream.length(index), np.uint8)
        for part, off, at, n in pieces:
            arr[at:at + n] = parts[part][off:off + n]
    return arr, hashlib.sha256(memoryview(arr)).digest(), SHA256


def copy_into(dest: Any, off: int, src: Any, at: int, n: int) -> None:
    """``dest[off:off + n] = src[at:at + n]`` between host and device arrays, either way."""
    piece = src[at:at + n]
    if is_cupy_array(dest):
        if is_cupy_array(piece):
            dest[off:off + n] = piece
        else:
            dest[off:off + n].set(piece)
    elif is_cupy_array(piece):
        dest[off:off + n] = piece.get()
    else:
        dest[off:off + n] = piece


def device_parts(manifest: list[list[Any]]) -> frozenset[int]:
    """The parts of a manifest that are device arrays (each has chunks of its own)."""
    return frozenset(i for i, p in enumerate(manifest) if p[0] == "cuda")
