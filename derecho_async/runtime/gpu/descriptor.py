"""Array specs and device descriptors: what a GPU plane sends a receiver per message.

Theory of operation (DESIGN.md §6.6, §6.7). A :class:`Descriptor` holds the encoded call, an
event index and per array an :class:`ArraySpec`: in the sender's pool (the CUDA IPC plane),
inline host bytes, or arriving by an NCCL broadcast. Its wire format is fixed little-endian
fields, decoded without a general-purpose decoder and checked field by field against what the
sender announced; a descriptor that breaks a rule is a ProtocolViolation. The helpers at the
end turn host arrays into inline specs and back, and received CuPy arrays into the sender's
kind. Nothing here needs CuPy.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.dataplane import ArrayInfo
from derecho_async.runtime.gpu.pool import PoolAnnouncement
from derecho_async.wire import DTYPES

__all__ = [
    "BROADCAST",
    "MAX_BROADCAST_BYTES",
    "ArraySpec",
    "Descriptor",
    "as_lib",
    "inline_array",
    "inline_spec",
    "new_spec",
]

log = logging.getLogger("derecho_async.gpuplane")

_MAX_ARRAYS = 4096  # arrays in one descriptor, at most
BROADCAST = -2  # ArraySpec.segment of an array that arrives by an NCCL broadcast (.nccl)
MAX_BROADCAST_BYTES = 1 << 40  # device bytes one NCCL descriptor may announce, all arrays together


class ArraySpec(NamedTuple):
    """One array of a descriptor: in the sender's pool (segment >= 0), inline host bytes
    (segment -1), or arriving by an NCCL broadcast (segment :data:`BROADCAST`). A named tuple,
    like :class:`Descriptor`: both are made per message on both sides of the hot path."""

    lib: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    segment: int = -1
    offset: int = 0
    inline: bytes | None = None


class Descriptor(NamedTuple):
    """What a receiver needs to copy one message's arrays out of the sender's pool.

    Wire format (fixed little-endian fields, no general-purpose decoder on the hot path): a
    12-byte head ``<BBHiI`` (magic, 0, array count, event, call length); per array a 24-byte
    head ``<BBBBIQQ`` (lib code, dtype code, dimensions, kind, segment, offset, byte count),
    its dimensions as signed 64-bit integers, and for an inline array its bytes; then the
    encoded call, which ends the descriptor exactly. Kind 0: in the sender's pool at (segment,
    offset); 1: inline host bytes; 2: arriving by an NCCL broadcast."""

    call: bytes
    event: int
    arrays: tuple[ArraySpec, ...] = ()

    def encode(self) -> bytes:
        parts = [_DESC_HEAD.pack(_DESC_MAGIC, 0, len(self.arrays), self.event, len(self.call))]
        for a in self.arrays:
            inline = b""
            if a.segment >= 0:
                kind, seg, off, length = _KIND_POOL, a.segment, a.offset, a.nbytes
            elif a.segment == BROADCAST:
                kind, seg, off, length = _KIND_BROADCAST, 0, 0, a.nbytes
            else:
                inline = a.inline or b""
                kind, seg, off, length = _KIND_INLINE, 0, 0, len(inline)
            ndim = len(a.shape)
            parts.append(_SPEC_HEAD.pack(_LIB_CODES[a.lib], _DTYPE_CODES[a.dtype], ndim, kind,
                                         seg, off, length))
            parts.append(_DIMS[ndim].pack(*a.shape))
            if inline:
                parts.append(inline)
        parts.append(self.call)
        return b"".join(parts)

    @classmethod
    def decode(cls, raw: bytes, announced: PoolAnnouncement | None, *,
               broadcast: bool = False) -> Descriptor:
        """Parse and check ``raw`` against the sender's announced pool (None: none known).

        With ``broadcast`` (the NCCL plane) device arrays are of the broadcast kind (no pool:
        they arrive by broadcast), at most :data:`MAX_BROADCAST_BYTES` in all, and the event
        must be -1; pool arrays are refused, and broadcast arrays are refused without it."""
        end = len(raw)
        if end < _DESC_HEAD.size:
            raise ProtocolViolation(f"device descriptor of {end} bytes is truncated")
        magic, zero, count, event, call_len = _DESC_HEAD.unpack_from(raw, 0)
        if magic != _DESC_MAGIC or zero != 0:
            raise ProtocolViolation("not a device descriptor (bad magic)")
        if count > _MAX_ARRAYS:
            raise ProtocolViolation(f"device descriptor with {count} arrays")
        pos = _DESC_HEAD.size
        device_arrays = False
        broadcast_bytes = 0
        specs: list[ArraySpec] = []
        spec_head = _SPEC_HEAD.unpack_from
        for _ in range(count):
            if pos + _SPEC_HEAD.size > end:
                raise ProtocolViolation("device descriptor is truncated in an array spec")
            lib_code, dtype_code, ndim, kind, seg, off, length = spec_head(raw, pos)
            pos += _SPEC_HEAD.size
            if lib_code >= len(_LIB_NAMES) or dtype_code >= len(_DTYPE_NAMES):
                raise ProtocolViolation(f"array of lib code {lib_code} dtype code {dtype_code}")
            lib = _LIB_NAMES[lib_code]
            dtype = _DTYPE_NAMES[dtype_code]
            if ndim > 32 or pos + 8 * ndim > end:
                raise ProtocolViolation(f"bad array shape: {ndim} dimensions")
            shape: tuple[int, ...] = _DIMS[ndim].unpack_from(raw, pos)
            pos += 8 * ndim
            n = DTYPES[dtype]
            for d in shape:
                if not 0 <= d < _MAX_DIM:
                    raise ProtocolViolation(f"bad array shape {shape!r}")
                n *= d
            if kind == _KIND_POOL and not broadcast:
                if announced is None:
                    raise ProtocolViolation("device array from a member that announced no pool")
                if seg >= len(announced.segments):
                    raise ProtocolViolation(f"device array in unknown segment {seg}")
                size = announced.segments[seg][0]
                if length != n or off + length > size:
                    raise ProtocolViolation(
                        f"device array [{off}, +{length}) outside segment of {size} bytes "
                        f"({n} bytes by its shape)")
                device_arrays = True
                specs.append(new_spec(ArraySpec, (lib, dtype, shape, n, seg, off, None)))
            elif seg or off:  # one encoding per descriptor: unused fields are zero
                raise ProtocolViolation(
                    f"array spec of kind {kind} with segment {seg} offset {off}")
            elif kind == _KIND_INLINE:
                if length != n or pos + n > end:
                    raise ProtocolViolation(
                        f"inline array of {length} bytes ({n} by its shape, "
                        f"{end - pos} left in the descriptor)")
                specs.append(new_spec(ArraySpec, (lib, dtype, shape, n, -1, 0,
                                                  bytes(raw[pos:pos + n]))))
                pos += n
            elif kind == _KIND_BROADCAST and broadcast:
                broadcast_bytes += n
                if length != n or lib == "numpy" or broadcast_bytes > MAX_BROADCAST_BYTES:
                    raise ProtocolViolation(
                        f"broadcast array of {length} bytes ({n} by its shape; "
                        f"{broadcast_bytes} in all, lib {lib})")
                specs.append(new_spec(ArraySpec, (lib, dtype, shape, n, BROADCAST, 0, None)))
            else:
                raise ProtocolViolation(
                    f"array spec of kind {kind} in a{' broadcast' if broadcast else 'n IPC'} "
                    "descriptor")
        if pos + call_len != end:
            raise ProtocolViolation(
                f"device descriptor of {end} bytes: {pos} of arrays and a call of {call_len}")
        if broadcast and event != -1:
            raise ProtocolViolation(f"broadcast descriptor names event {event!r}")
        if device_arrays and (announced is None or not -1 <= event < len(announced.events)):
            raise ProtocolViolation(f"device descriptor names unknown event {event!r}")
        desc: Descriptor = new_spec(cls, (bytes(raw[pos:]), event, tuple(specs)))
        return desc


_DESC_MAGIC = 0xD7
_DESC_HEAD = struct.Struct("<BBHiI")  # magic, 0, arrays, event, call length
_SPEC_HEAD = struct.Struct("<BBBBIQQ")  # lib, dtype, dimensions, kind, segment, offset, bytes
_DIMS = tuple(struct.Struct(f"<{n}q") for n in range(33))  # an array's dimensions, by count
_KIND_POOL, _KIND_INLINE, _KIND_BROADCAST = 0, 1, 2
_LIB_NAMES = ("numpy", "cupy", "torch", "cuda")  # lib codes on the wire (the index)
_LIB_CODES = {name: i for i, name in enumerate(_LIB_NAMES)}
# dtype codes on the wire (the index): fixed here, not taken from wire.DTYPES's order, so a
# reordering there cannot change what a code means; append new dtypes at the end
_DTYPE_NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128")
_DTYPE_CODES = {name: i for i, name in enumerate(_DTYPE_NAMES)}
_MAX_DIM = 1 << 48  # one dimension of a traveling array, at most
# A named tuple made from a complete field tuple without its Python-level __new__ (half the
# cost; the receiver makes one spec and one descriptor per message).
new_spec: Callable[..., Any] = tuple.__new__


def inline_spec(arr: object, info: ArrayInfo) -> ArraySpec:
    """The spec of a host array that rides inline in the descriptor (little-endian C order)."""
    import numpy as np

    host = np.ascontiguousarray(arr)
    raw = host.astype(host.dtype.newbyteorder("<"), copy=False).tobytes()
    return ArraySpec("numpy", info.dtype, info.shape, info.nbytes, inline=raw)


def inline_array(spec: ArraySpec) -> Any:
    """The numpy array of an inline (host) array spec, in native byte order."""
    import numpy as np

    assert spec.inline is not None
    host = np.frombuffer(bytearray(spec.inline), dtype=np.dtype(spec.dtype).newbyteorder("<"))
    return host.reshape(spec.shape).astype(np.dtype(spec.dtype), copy=False)


def as_lib(arr: Any, lib: str) -> object:
    """A received CuPy array as the sender's kind: a torch tensor through DLPack when ``lib``
    is torch and torch imports here, else the CuPy array itself."""
    if lib == "torch":
        try:
            import torch

            return torch.from_dlpack(arr)
        except ImportError:
            pass
        except Exception as exc:  # e.g. a torch built without CUDA: the array still lands
            if not _TORCH_FALLBACK_SAID:
                _TORCH_FALLBACK_SAID.append(True)
                log.warning("torch tensors arrive as CuPy arrays here: %r", exc)
    return arr


_TORCH_FALLBACK_SAID: list[bool] = []  # as_lib's warning is given once per process

