"""Arrays on the wire: the dtypes that may travel, what a buffer is, and array records decoded.

Theory of operation (docs/DESIGN.md §7.11): only plain numeric dtypes travel (:data:`DTYPES`),
always little-endian. An out-of-band buffer is described by its dtype name, shape and kind
(:func:`buffer_meta`), read straight from numpy and CuPy arrays and through
``__cuda_array_interface__`` or ``__dlpack__`` otherwise. An inline array record's header is a
msgpack dtype name and shape, then the raw bytes; it is parsed by hand in the form the encoder
writes and by a bounded msgpack reader otherwise, and every field is checked before numpy sees
it. numpy is never imported here unless a message holds an array.
"""

from __future__ import annotations

import sys
from typing import Any, Final

import msgpack  # type: ignore[import-untyped]

from derecho_async.errors import ProtocolViolation, UsageError
from derecho_async.wire.caches import CUPY_TYPES, LITTLE_DTYPES, NAME_BY_STR

__all__ = [
    "DTYPES",
    "MAX_NDIM",
    "TYPESTRS",
    "buffer_matches",
    "buffer_meta",
    "check_dtype_name",
    "check_wire_shape",
    "decode_ndarray",
    "decode_npscalar",
    "is_cupy_array",
    "numpy_dtype_name",
    "numpy_module",
]

MAX_NDIM: Final = 32
"""Most dimensions an array may have (numpy's own limit is 64)."""

DTYPES: Final[dict[str, int]] = {
    "bool": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}
"""The array element types that may cross the wire: dtype name → item size in bytes."""

TYPESTRS: Final[dict[str, str]] = {
    "|b1": "bool",
    "|i1": "int8",
    "|u1": "uint8",
    "<i1": "int8",
    "<u1": "uint8",
    "<i2": "int16",
    "<i4": "int32",
    "<i8": "int64",
    "<u2": "uint16",
    "<u4": "uint32",
    "<u8": "uint64",
    "<f2": "float16",
    "<f4": "float32",
    "<f8": "float64",
    "<c8": "complex64",
    "<c16": "complex128",
}
"""``__cuda_array_interface__`` / ``__array_interface__`` typestr → dtype name (little-endian or
no byte order)."""


def numpy_module() -> Any:
    """numpy if it has been imported by anyone, else None (then no numpy object can exist)."""
    return sys.modules.get("numpy")


_cupy_types: Final = CUPY_TYPES.table  # the caches' dicts, read directly (one get)
_name_by_str: Final = NAME_BY_STR.table
_little_dtypes: Final = LITTLE_DTYPES.table


def is_cupy_array(obj: object) -> bool:
    """Whether ``obj`` is a CuPy ndarray (exactly that type). Its dtype, shape and pointer are
    then read directly: CuPy builds ``__cuda_array_interface__`` anew on every access (a dict,
    a stream query), and ``hasattr`` on it builds one too."""
    t = type(obj)
    fast = _cupy_types.get(t)
    if fast is None:
        fast = t.__name__ == "ndarray" and t.__module__.split(".")[0] == "cupy"
        CUPY_TYPES.put(t, fast)
    return fast


def numpy_dtype_name(dtype: Any) -> str:
    """``dtype.name`` of a numpy dtype, fast for the dtypes that travel (``dtype.str`` is a
    stored string, ``dtype.name`` is built anew on each read; each traveling array needs it
    several times)."""
    key = dtype.str
    name = _name_by_str.get(key)
    if name is None:
        name = str(dtype.name)
        if name in DTYPES and dtype.fields is None:
            NAME_BY_STR.put(key, name)
    return name


def _typestr_name(obj: object, typestr: object) -> str:
    """The dtype name of a device array's typestr, or ValueError if it may not travel."""
    name = TYPESTRS.get(typestr) if isinstance(typestr, str) else None
    if name is None:
        raise ValueError(
            f"cannot send {type(obj).__name__} of typestr {typestr!r}; "
            f"allowed: {', '.join(DTYPES)} (little-endian)"
        )
    return name


def buffer_meta(obj: object, np: Any) -> tuple[str, list[int], str]:
    """(dtype name, shape, kind) of an array-like, or ValueError saying why it is unsupported.
    ``np`` is numpy or None (:func:`numpy_module`)."""
    if is_cupy_array(obj):  # the device hot path: CuPy shapes are tuples of ints >= 0
        c: Any = obj
        cname = _typestr_name(obj, c.dtype.str)
        cshape = list(c.shape)
        if len(cshape) > MAX_NDIM:
            raise ValueError(f"{type(obj).__name__} has an unsupported shape {cshape!r}")
        return cname, cshape, "cuda"
    if np is not None and isinstance(obj, np.ndarray):
        name = numpy_dtype_name(obj.dtype)
        if name not in DTYPES or obj.dtype.fields is not None:
            raise ValueError(f"cannot send numpy data of dtype {obj.dtype.str!r}")
        nshape = list(obj.shape)  # numpy shapes are tuples of ints >= 0
        if len(nshape) > MAX_NDIM:
            raise ValueError(f"{type(obj).__name__} has an unsupported shape {nshape!r}")
        return name, nshape, "numpy"
    if hasattr(obj, "__cuda_array_interface__"):
        cai = getattr(obj, "__cuda_array_interface__", None)
        if not isinstance(cai, dict):
            raise ValueError(f"{type(obj).__name__}.__cuda_array_interface__ is not a dict")
        name = _typestr_name(obj, cai.get("typestr"))
        shape = list(cai.get("shape", ()))
        kind = "cuda"
    elif hasattr(obj, "__dlpack__"):
        dtype = getattr(obj, "dtype", None)
        name = str(dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(
                f"cannot send {type(obj).__name__} of dtype {dtype!r}; allowed: {', '.join(DTYPES)}"
            )
        shape = list(getattr(obj, "shape", ()))
        kind = "dlpack"
    else:
        raise ValueError(f"{type(obj).__name__} is not an array")
    if len(shape) > MAX_NDIM or not all(
        isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 1 << 63 for n in shape
    ):
        raise ValueError(f"{type(obj).__name__} has an unsupported shape {shape!r}")
    return name, [int(n) for n in shape], kind


def buffer_matches(buf: object, name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``buf`` has the dtype name and shape its reference gave (the check of a decoded
    buffer reference and of the memo of calls): CuPy and numpy arrays read directly, anything
    else through :func:`buffer_meta`."""
    if is_cupy_array(buf):
        c: Any = buf
        return bool(c.shape == shape and TYPESTRS.get(c.dtype.str) == name)
    np = numpy_module()
    if np is not None and type(buf) is np.ndarray:
        n: Any = buf
        return bool(n.shape == shape and n.dtype.fields is None
                    and numpy_dtype_name(n.dtype) == name)
    try:
        have_name, have_shape, _ = buffer_meta(buf, np)
    except ValueError:
        return False
    return have_name == name and tuple(have_shape) == shape


# ------------------------------------------------------------------------ array records (decode)


def check_dtype_name(name: object) -> int:
    """The item size of a dtype name read from the wire; ProtocolViolation if it may not
    travel."""
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolViolation(f"array dtype {name!r} is not allowed")
    return DTYPES[name]


def check_wire_shape(shape: object) -> list[int]:
    """A shape read from the wire: a list of at most :data:`MAX_NDIM` ints in [0, 2**63);
    ProtocolViolation otherwise."""
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise ProtocolViolation(f"malformed array shape {shape!r}")
    for n in shape:
        if type(n) is not int or not 0 <= n < 1 << 63:
            raise ProtocolViolation(f"malformed array shape {shape!r}")
    return shape


def _import_numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise UsageError("the message holds a numpy array but numpy is not installed") from None
    return numpy


_HEADER_MAX: Final = 512  # dtype name (<= 64 chars) and <= MAX_NDIM dims of <= 9 bytes each


def _read_array_header(payload: bytes, fields: int) -> tuple[list[object], int]:
    """Unpack the first ``fields`` header values of an array record; return them and the offset
    of the raw bytes. Only a bounded prefix is fed to msgpack, so the data is never copied."""
    fast = _read_header_fast(payload, fields)
    if fast is not None:
        return fast
    unpacker = msgpack.Unpacker(
        raw=False,
        use_list=True,
        max_buffer_size=_HEADER_MAX,
        max_str_len=64,
        max_bin_len=0,
        max_array_len=MAX_NDIM,
        max_map_len=0,
        max_ext_len=0,
    )
    unpacker.feed(memoryview(payload)[:_HEADER_MAX])
    values = [unpacker.unpack() for _ in range(fields)]
    offset: int = unpacker.tell()
    return values, offset


_UINT_WIDTH: Final = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def _read_header_fast(payload: bytes, fields: int) -> tuple[list[object], int] | None:
    """The header as this codec's encoder writes it (a fixstr dtype name, then for arrays a
    fixarray of unsigned ints), parsed by hand; None for any other form, which the general
    reader then decodes or rejects. Values are type-checked later exactly as msgpack's are."""
    n = len(payload)
    if not n or not 0xA0 <= payload[0] <= 0xBF:
        return None
    end = 1 + (payload[0] & 0x1F)
    if end > n:
        return None
    try:
        name = payload[1:end].decode("ascii")
    except UnicodeDecodeError:
        return None
    if fields == 1:
        return [name], end
    if end >= n or not 0x90 <= payload[end] <= 0x9F:
        return None
    dims = payload[end] & 0x0F
    pos = end + 1
    shape: list[int] = []
    for _ in range(dims):
        if pos >= n:
            return None
        b = payload[pos]
        if b < 0x80:
            shape.append(b)
            pos += 1
            continue
        width = _UINT_WIDTH.get(b)
        if width is None or pos + 1 + width > n:
            return None
        shape.append(int.from_bytes(payload[pos + 1 : pos + 1 + width], "big"))
        pos += 1 + width
    return [name, shape], pos


def _little_dtype(np: Any, name: str) -> Any:
    dtype = _little_dtypes.get(name)
    if dtype is None:  # name is one of DTYPES (checked): the cache stays that small
        dtype = np.dtype(name).newbyteorder("<")
        LITTLE_DTYPES.put(name, dtype)
    return dtype


def decode_ndarray(payload: bytes) -> object:
    """A fresh writable numpy array from an inline array record (ext 2); ProtocolViolation if
    the record is malformed, UsageError if numpy is not installed."""
    (name, shape), offset = _read_array_header(payload, 2)
    itemsize = check_dtype_name(name)
    dims = check_wire_shape(shape)
    count = 1
    for n in dims:
        count *= n
    nbytes = len(payload) - offset
    if count * itemsize != nbytes:
        raise ProtocolViolation(
            f"array {name}{tuple(dims)} needs {count * itemsize} bytes, the message has {nbytes}"
        )
    np = _import_numpy()
    flat = np.frombuffer(payload, dtype=_little_dtype(np, str(name)), count=count, offset=offset)
    return flat.reshape(dims).copy()


def decode_npscalar(payload: bytes) -> object:
    """A numpy scalar from its record (ext 3), checked like :func:`decode_ndarray`."""
    (name,), offset = _read_array_header(payload, 1)
    itemsize = check_dtype_name(name)
    if len(payload) - offset != itemsize:
        raise ProtocolViolation(f"numpy scalar {name} must have {itemsize} bytes")
    np = _import_numpy()
    dtype = np.dtype(name).newbyteorder("<")
    return np.frombuffer(payload, dtype=dtype, count=1, offset=offset)[0].astype(name)
