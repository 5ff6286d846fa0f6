"""Device descriptors built by hand, unchecked, as a hostile or broken sender could send them.

The runtime's :meth:`Descriptor.encode` refuses what it cannot represent; these helpers write any
field value into the wire format (``gpuplane.Descriptor``'s docstring) so the decoder's checks
can be tested one by one.
"""

from __future__ import annotations

import struct
from typing import Any

from derecho_async.codec import DTYPES

_LIBS = ("numpy", "cupy", "torch", "cuda")
_UNKNOWN = 200  # the code of a lib or dtype name the runtime does not have
_U64 = (1 << 64) - 1


def _code(names: tuple[str, ...], name: object) -> int:
    return names.index(name) if name in names else _UNKNOWN


def raw_descriptor(specs: list[list[Any]], event: int = 0, call: bytes = b"c",
                   count: int | None = None) -> bytes:
    """Wire bytes of a descriptor whose array specs are lists:
    ``[lib, dtype, shape, segment, offset, nbytes]`` (in the pool),
    ``[lib, dtype, shape, -1, data]`` (inline) or ``[lib, dtype, shape, nbytes]`` (broadcast).
    Numbers are written as they are (a negative offset wraps to a huge one); ``count`` overrides
    the array count in the head."""
    out = [struct.pack("<BBHiI", 0xD7, 0, len(specs) if count is None else count, event,
                       len(call))]
    for spec in specs:
        lib, dtype, shape = spec[0], spec[1], list(spec[2])
        head = (_code(_LIBS, lib), _code(tuple(DTYPES), dtype), len(shape))
        if len(spec) == 6:
            seg, off, nbytes = spec[3], spec[4], spec[5]
            out.append(struct.pack("<BBBBIQQ", *head, 0, seg, off & _U64, nbytes & _U64))
        elif len(spec) == 5:
            data = spec[4]
            assert isinstance(data, bytes)
            out.append(struct.pack("<BBBBIQQ", *head, 1, 0, 0, len(data)))
        else:
            out.append(struct.pack("<BBBBIQQ", *head, 2, 0, 0, spec[3] & _U64))
        out.append(struct.pack(f"<{len(shape)}q", *shape))
        if len(spec) == 5:
            out.append(spec[4])
    out.append(call)
    return b"".join(out)
