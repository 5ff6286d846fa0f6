"""Device descriptors built by hand, unchecked, as a hostile or broken sender could send them.

The runtime's :meth:`Descriptor.encode` refuses what it cannot represent; this helper writes any
field value into the wire format (``gpu.descriptor.Descriptor``'s docstring, with the module's
own field layouts and code tables) so the decoder's checks can be tested one by one.
"""

from __future__ import annotations

import struct
from typing import Any

from derecho_async.runtime.gpu.descriptor import (
    _DESC_HEAD,
    _DESC_MAGIC,
    _DTYPE_NAMES,
    _KIND_BROADCAST,
    _KIND_INLINE,
    _KIND_POOL,
    _LIB_NAMES,
    _SPEC_HEAD,
)

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
    out = [_DESC_HEAD.pack(_DESC_MAGIC, 0, len(specs) if count is None else count, event,
                           len(call))]
    for spec in specs:
        lib, dtype, shape = spec[0], spec[1], list(spec[2])
        head = (_code(_LIB_NAMES, lib), _code(_DTYPE_NAMES, dtype), len(shape))
        if len(spec) == 6:
            out.append(_SPEC_HEAD.pack(*head, _KIND_POOL, spec[3], spec[4] & _U64,
                                       spec[5] & _U64))
        elif len(spec) == 5:
            out.append(_SPEC_HEAD.pack(*head, _KIND_INLINE, 0, 0, len(spec[4])))
        else:
            out.append(_SPEC_HEAD.pack(*head, _KIND_BROADCAST, 0, 0, spec[3] & _U64))
        out.append(struct.pack(f"<{len(shape)}q", *shape))  # any count, not just the valid ones
        if len(spec) == 5:
            out.append(spec[4])
    out.append(call)
    return b"".join(out)
