"""The wire: values, calls and channel messages as msgpack bytes (never pickle).

Theory of operation (docs/DESIGN.md §7.11): :mod:`.values` encodes and decodes call arguments
and results (numpy arrays, numpy scalars and out-of-band buffers included) and checks what it
decodes; :mod:`.arrays` holds the dtypes that may travel and describes buffers; :mod:`.calls`
builds and checks call envelopes; :mod:`.call_memos` remembers calls with out-of-band arrays;
:mod:`.envelope` is the runtime's channel messages. This package re-exports the value and call
API.
"""

from __future__ import annotations

from derecho_async.wire.arrays import DTYPES, MAX_NDIM, TYPESTRS, is_cupy_array, numpy_dtype_name
from derecho_async.wire.call_memos import own_device_call
from derecho_async.wire.calls import (
    CLIENT_ID_BYTES,
    call_time,
    client_call,
    client_tag,
    decode_call,
    encode_call,
    stamp_call,
    unstamped,
)
from derecho_async.wire.values import (
    BUFFER_KINDS,
    LARGE_BYTES,
    MAX_DECODE_SIZE,
    MAX_DEPTH,
    decode,
    encode,
    pack,
)

__all__ = [
    "BUFFER_KINDS",
    "CLIENT_ID_BYTES",
    "DTYPES",
    "LARGE_BYTES",
    "MAX_DECODE_SIZE",
    "MAX_DEPTH",
    "MAX_NDIM",
    "TYPESTRS",
    "call_time",
    "client_call",
    "client_tag",
    "decode",
    "decode_call",
    "encode",
    "encode_call",
    "is_cupy_array",
    "numpy_dtype_name",
    "own_device_call",
    "pack",
    "stamp_call",
    "unstamped",
]
