# Theory of operation
# -------------------
# Call arguments and results cross the wire as msgpack, never pickle: decoding a message can only
# ever build plain data (None, bool, int, float, str, bytes, list, tuple, dict, numpy arrays and
# numpy scalars), so a hostile peer cannot make us run code.
#
# Encoding is two steps. ``_Encoder`` walks the value once and turns it into something msgpack
# packs natively: containers are rebuilt (subclasses become their base type), and the types
# msgpack lacks become ``ExtType`` records whose payload is itself msgpack or raw bytes:
#
#   ext 1  tuple          payload = msgpack array of the items
#   ext 2  numpy array    payload = msgpack(dtype name) msgpack([shape...]) raw C-order bytes
#   ext 3  numpy scalar   payload = msgpack(dtype name) raw bytes of one item
#   ext 4  buffer ref     payload = msgpack([index, dtype name, [shape...], kind])
#
# A buffer reference's kind (``BUFFER_KINDS``) says how the sender exposed the buffer: "numpy",
# "cuda" (``__cuda_array_interface__``), "dlpack", or "bytes": a bytes, bytearray or memoryview
# value longer than ``LARGE_BYTES`` in a call encoded with ``buffers`` travels out of band as a
# read-only uint8 numpy view of its memory (no copy), referenced as ["uint8", [length], "bytes"],
# and decodes as bytes again (one copy, by ``hotpath.bytes_copy``: off the GIL where native).
# So sizing or sending a call of a large byte string copies nothing at the sender. Without numpy
# such values stay inline.
#
# Raw array bytes are always little-endian. Only plain numeric dtypes are allowed (``DTYPES``).
# When the caller passes ``buffers=[]`` to :func:`encode`, arrays (numpy, and anything with
# ``__cuda_array_interface__`` or ``__dlpack__``) are not copied inline: they are appended to the
# list and referenced by index, so a data plane (CUDA IPC, NCCL, RDMA) can move their bytes.
# ``encode_call(..., inline_bytes=n)`` still copies numpy arrays inline while they total at most
# n bytes: a small array costs less in the message than beside it (the group passes a slot).
# :func:`decode` resolves references against the list the receiver supplies.
#
# The walk checks types, the 64-bit int range and the nesting depth, and reports the path of the
# offending element ("args[1]['w']"). Errors carry their path upward by exception (no string work
# on the success path).
#
# Decoding is the mirror image and is defensive: ``msgpack.unpackb`` runs with every size limit
# bound to the input length, ext records are decoded by ``_Decoder`` (which counts ext nesting, so
# nested tuples cannot recurse without bound), and a final walk enforces the depth limit, checks
# dict keys and rejects anything else msgpack can produce (e.g. its Timestamp ext). Every failure
# on malformed input is a ProtocolViolation; msgpack's own exceptions never escape.
#
# The same few calls recur, so both sides remember what they checked once, in bounded tables:
# inline array headers and buffer reference records by (dtype, shape) when encoding; buffer
# references by their bytes when decoding; and whole calls with out-of-band arrays whose other
# arguments are scalars, by their bytes (``_OOB_CALLS``): a repeated one is rebuilt from the memo
# with the receiver's new arrays, each still checked against its reference's dtype and shape.
#
# numpy is imported lazily: the encoder only looks for numpy types when numpy is already in
# ``sys.modules`` (no numpy object can exist otherwise), and the decoder imports it only when the
# message holds an array.

"""Serialization of call arguments and results (msgpack with a few ext types; never pickle).

Public API: :func:`encode`, :func:`decode`, :func:`encode_call`, :func:`decode_call`, the limit
constants and :data:`DTYPES`.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import msgpack  # type: ignore[import-untyped]

from derecho_async import hotpath
from derecho_async.errors import DerechoError, ProtocolViolation, UsageError

if TYPE_CHECKING:
    import numpy

__all__ = [
    "BUFFER_KINDS",
    "DTYPES",
    "LARGE_BYTES",
    "MAX_DECODE_SIZE",
    "MAX_DEPTH",
    "MAX_NDIM",
    "TYPESTRS",
    "decode",
    "decode_call",
    "encode",
    "encode_call",
    "pack",
]

MAX_DEPTH: Final = 64
"""Deepest nesting of containers (list, tuple, dict) allowed in a value, the value itself being 1."""

MAX_NDIM: Final = 32
"""Most dimensions an array may have (numpy's own limit is 64)."""

MAX_DECODE_SIZE: Final = 1 << 30
"""Default bound on the size of an encoded message that :func:`decode` accepts (1 GiB)."""

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

BUFFER_KINDS: Final = frozenset({"numpy", "cuda", "dlpack", "bytes"})
"""How an out-of-band buffer was exposed by the sender: a numpy array, an object with
``__cuda_array_interface__``, an object with ``__dlpack__``, or a byte string (bytes, bytearray,
memoryview) that decodes as bytes."""

LARGE_BYTES: Final = 1 << 20
"""Byte strings (bytes, bytearray, memoryview) longer than this travel out of band, as "bytes"
buffers, when :func:`encode_call` or :func:`encode` is given ``buffers``."""

_EXT_TUPLE: Final = 1
_EXT_NDARRAY: Final = 2
_EXT_NPSCALAR: Final = 3
_EXT_BUFREF: Final = 4

_INT_MIN: Final = -(1 << 63)
_INT_MAX: Final = (1 << 64) - 1

# __cuda_array_interface__ / __array_interface__ typestr → dtype name (little-endian or no order).
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

_KEY_TYPES_TEXT: Final = "str, int, bytes, or a tuple of those"


# --------------------------------------------------------------------------------------- encode


class _EncodeFailure(Exception):
    """Internal: an element cannot be encoded; ``path`` grows as the error unwinds."""

    def __init__(self, exc_type: type[Exception], message: str) -> None:
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message
        self.path: list[str] = []

    def build(self, root: str) -> Exception:
        where = root + "".join(reversed(self.path))
        return self.exc_type(f"{where}: {self.message}")


def _check_utf8(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _EncodeFailure(
            ValueError, f"str is not valid Unicode (lone surrogate at index {e.start})"
        ) from None


def _numpy_module() -> Any:
    """numpy if it has been imported by anyone, else None (then no numpy object can exist)."""
    return sys.modules.get("numpy")


_NO_NUMPY: list[bool] = []  # holds True once importing numpy failed (not tried again)


def _numpy_for_bytes() -> Any:
    """numpy, imported if need be, for a large byte string to travel out of band; None if it
    is not installed."""
    np = sys.modules.get("numpy")
    if np is None and not _NO_NUMPY:
        try:
            import numpy as np
        except ImportError:
            _NO_NUMPY.append(True)
            return None
    return np


_CUPY_TYPES: dict[type, bool] = {}


def is_cupy_array(obj: object) -> bool:
    """Whether ``obj`` is a CuPy ndarray (exactly that type). Its dtype, shape and pointer are
    then read directly: CuPy builds ``__cuda_array_interface__`` anew on every access (a dict,
    a stream query), and ``hasattr`` on it builds one too; a sent array needed about seven."""
    t = type(obj)
    fast = _CUPY_TYPES.get(t)
    if fast is None:
        fast = _CUPY_TYPES[t] = t.__name__ == "ndarray" and t.__module__.split(".")[0] == "cupy"
    return fast


def _check_shape(shape: tuple[int, ...]) -> list[int]:
    if len(shape) > MAX_NDIM:
        raise _EncodeFailure(ValueError, f"array has {len(shape)} dimensions, more than {MAX_NDIM}")
    return [int(n) for n in shape]


# Inline array headers (msgpack dtype name and shape) by (dtype, shape): checked once, then
# reused; the same few shapes recur. Bounded, like the decoder's reference cache.
_ARRAY_HEADS: dict[tuple[Any, tuple[int, ...]], bytes] = {}
_ARRAY_HEADS_MAX = 4096


class _Encoder:
    __slots__ = ("buffer_ids", "buffers", "inline_left")

    def __init__(self, buffers: list[object] | None, inline_bytes: int = 0) -> None:
        self.buffers = buffers
        self.buffer_ids: dict[int, int] = {}
        self.inline_left = inline_bytes  # numpy bytes that may still be copied inline

    def value(self, obj: object, depth: int) -> object:
        t = type(obj)
        if obj is None or t is bool or t is float:
            return obj
        if t is bytes:
            if self.buffers is not None and len(obj) > LARGE_BYTES:  # type: ignore[arg-type]
                return self.bytes_reference(obj)  # type: ignore[arg-type]
            return obj
        if t is str and isinstance(obj, str):
            if not obj.isascii():
                _check_utf8(obj)
            return obj
        if t is int and isinstance(obj, int):
            if not _INT_MIN <= obj <= _INT_MAX:
                raise _EncodeFailure(
                    OverflowError, f"int {obj} is outside the 64-bit range [-2**63, 2**64-1]"
                )
            return obj
        if t is list or t is tuple or t is dict:
            return self.container(obj, depth)
        return self.other(obj, depth)

    def container(self, obj: object, depth: int) -> object:
        if depth >= MAX_DEPTH:
            raise _EncodeFailure(
                ValueError, f"nesting is deeper than {MAX_DEPTH} levels (or the value is cyclic)"
            )
        depth += 1
        if isinstance(obj, dict):
            out_map: dict[object, object] = {}
            for k, v in obj.items():
                try:
                    key = self.key(k, depth)
                    out_map[key] = self.value(v, depth)
                except _EncodeFailure as e:
                    e.path.append(f"[{k!r}]")
                    raise
            return out_map
        assert isinstance(obj, list | tuple)
        items: list[object] = []
        for i, v in enumerate(obj):
            try:
                items.append(self.value(v, depth))
            except _EncodeFailure as e:
                e.path.append(f"[{i}]")
                raise
        if isinstance(obj, tuple):
            return msgpack.ExtType(_EXT_TUPLE, pack(items))
        return items

    def key(self, k: object, depth: int) -> object:
        if isinstance(k, str):
            return self.value(str.__str__(k), depth)
        if isinstance(k, bytes | bool):
            return k
        if isinstance(k, int):
            return self.value(int(k), depth)
        if isinstance(k, tuple):
            if depth >= MAX_DEPTH:
                raise _EncodeFailure(ValueError, f"dict key nested deeper than {MAX_DEPTH} levels")
            return msgpack.ExtType(_EXT_TUPLE, pack([self.key(part, depth + 1) for part in k]))
        raise _EncodeFailure(
            TypeError,
            f"dict key of type {type(k).__name__} is not allowed; keys must be {_KEY_TYPES_TEXT}",
        )

    def other(self, obj: object, depth: int) -> object:
        np = _numpy_module()
        if is_cupy_array(obj):  # the device hot path first (it is none of the types below)
            return self.device_reference(obj, np)
        if np is not None:
            if isinstance(obj, np.ndarray):
                return self.ndarray(obj, np)
            if isinstance(obj, np.generic):
                return self.npscalar(obj, np)
        if isinstance(obj, int):
            return self.value(int(obj), depth)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, str):
            return self.value(str.__str__(obj), depth)
        if isinstance(obj, bytes | bytearray | memoryview):
            if self.buffers is not None and memoryview(obj).nbytes > LARGE_BYTES:
                return self.bytes_reference(obj)
            return obj.tobytes() if isinstance(obj, memoryview) else bytes(obj)
        if isinstance(obj, list | tuple | dict):
            return self.container(obj, depth)
        if hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__dlpack__"):
            return self.device_reference(obj, np)
        raise _EncodeFailure(TypeError, f"cannot encode object of type {type(obj).__qualname__}")

    def bytes_reference(self, obj: bytes | bytearray | memoryview) -> object:
        """A large byte string: out of band, as a read-only uint8 view of its memory (inline
        where numpy is missing or the memory is not contiguous)."""
        assert self.buffers is not None
        index = self.buffer_ids.get(id(obj))
        if index is None:
            np = _numpy_for_bytes()
            try:
                if np is None:
                    raise ValueError("no numpy")
                view = np.frombuffer(obj, np.uint8)
            except (ValueError, BufferError):  # not C-contiguous: copied inline, as before
                return obj.tobytes() if isinstance(obj, memoryview) else bytes(obj)
            if view.flags.writeable:
                view.flags.writeable = False
            index = len(self.buffers)
            self.buffers.append(view)
            self.buffer_ids[id(obj)] = index
        n = memoryview(obj).nbytes
        return msgpack.ExtType(_EXT_BUFREF, pack([index, "uint8", [n], "bytes"]))

    def device_reference(self, obj: object, np: Any) -> object:
        """A device or DLPack array: only by reference (out of band)."""
        if self.buffers is None:
            raise _EncodeFailure(
                TypeError,
                f"cannot encode device/DLPack array of type {type(obj).__name__} inline; "
                "pass buffers=[] to send it out of band",
            )
        return self.reference(obj, np)

    def ndarray(self, arr: numpy.ndarray[Any, Any], np: Any) -> object:
        if type(arr).__module__.startswith("numpy.ma"):
            raise _EncodeFailure(
                TypeError,
                "cannot encode a masked array (its mask would be lost); send .data and .mask",
            )
        key = (arr.dtype, arr.shape)
        head = _ARRAY_HEADS.get(key)
        if head is None:  # checked once per dtype and shape (a cached one passed)
            head = pack(self.dtype_name(arr.dtype)) + pack(_check_shape(arr.shape))
            if len(_ARRAY_HEADS) < _ARRAY_HEADS_MAX:
                _ARRAY_HEADS[key] = head
        if arr.flags.c_contiguous and arr.dtype.str[0] in _LITTLE_OR_NONE:
            little = arr  # already what travels (astype with copy=False costs microseconds)
        else:
            little = arr.astype(arr.dtype.newbyteorder("<"), order="C", copy=False)
        if self.buffers is not None:
            if arr.nbytes > self.inline_left:
                return self.reference(arr, np, little)
            self.inline_left -= arr.nbytes
        raw = memoryview(little.reshape(-1).view(np.uint8))
        return msgpack.ExtType(_EXT_NDARRAY, b"".join((head, raw)))

    def npscalar(self, value: numpy.generic[Any], np: Any) -> object:
        name = self.dtype_name(value.dtype)
        raw = np.asarray(value).astype(value.dtype.newbyteorder("<")).tobytes()
        return msgpack.ExtType(_EXT_NPSCALAR, pack(name) + raw)

    @staticmethod
    def dtype_name(dtype: numpy.dtype[Any]) -> str:
        name = numpy_dtype_name(dtype)
        if name not in DTYPES or dtype.fields is not None:
            raise _EncodeFailure(
                TypeError,
                f"cannot encode numpy data of dtype {dtype.str!r} ({name}); "
                f"allowed: {', '.join(DTYPES)}",
            )
        return name

    def reference(self, obj: object, np: Any, replacement: object | None = None) -> object:
        assert self.buffers is not None
        index = self.buffer_ids.get(id(obj))
        fresh = index is None
        if index is None:
            index = len(self.buffers)
        # numpy and CuPy arrays: the record by (index, type, dtype, shape), checked once
        cls = type(obj)
        key = None
        record = None
        if (np is not None and cls is np.ndarray) or is_cupy_array(obj):
            a: Any = obj
            if a.dtype.fields is None:  # a structured dtype may share a plain one's str
                key = (index, cls, a.dtype.str, a.shape)
                record = _REF_RECORDS.get(key)
        if record is None:
            try:
                name, shape, kind = _buffer_meta(obj, np)
            except ValueError as e:
                raise _EncodeFailure(TypeError, str(e)) from None
            record = msgpack.ExtType(_EXT_BUFREF, pack([index, name, shape, kind]))
            if key is not None and len(_REF_RECORDS) < _REF_RECORDS_MAX:
                _REF_RECORDS[key] = record
        if fresh:
            self.buffers.append(obj if replacement is None else replacement)
            self.buffer_ids[id(obj)] = index
        return record


# Buffer reference records of numpy and CuPy arrays by (index, type, dtype.str, shape): a
# sender references the same few shapes again and again. Bounded like the decoder's caches.
_REF_RECORDS: dict[tuple[int, type, str, tuple[int, ...]], object] = {}
_REF_RECORDS_MAX = 4096

_LITTLE_OR_NONE: Final = ("<", "|")  # numpy dtype.str byte orders that need no swap

_NAME_BY_STR: dict[str, str] = {}  # numpy dtype.str ('<f4', '>i8', '|b1') -> dtype.name


def numpy_dtype_name(dtype: Any) -> str:
    """``dtype.name`` of a numpy dtype, fast for the dtypes that travel (``dtype.str`` is read in
    0.2 µs, ``dtype.name`` is built in about 3 µs; each traveling array needs it several times)."""
    key = dtype.str
    name = _NAME_BY_STR.get(key)
    if name is None:
        name = str(dtype.name)
        if name in DTYPES and dtype.fields is None:
            _NAME_BY_STR[key] = name
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


def _buffer_meta(obj: object, np: Any) -> tuple[str, list[int], str]:
    """(dtype name, shape, kind) of an array-like, or ValueError saying why it is unsupported."""
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


_packers = threading.local()


def pack(obj: object) -> bytes:
    """msgpack bytes of ``obj`` (bin type for bytes), by a Packer reused per thread."""
    # One Packer per thread, reused: msgpack.packb builds a new one (and its buffer) per call,
    # which costs as much as packing a 1 KB call. A Packer resets itself after a failed pack.
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True, datetime=False)
    data: bytes = packer.pack(obj)
    return data


def _encode_root(obj: object, root: str, encoder: _Encoder) -> object:
    try:
        return encoder.value(obj, 0)
    except _EncodeFailure as e:
        raise e.build(root) from None


_PLAIN_TYPES: Final = frozenset({bool, float, bytes})
_NO_LIMIT: Final = 1 << 62  # no byte string is this long


def encode(obj: object, buffers: list[object] | None = None) -> bytes:
    """Encode a value (call argument or result) as msgpack bytes.

    Supported: None, bool, int (-2**63 .. 2**64-1), float, str, bytes / bytearray / memoryview
    (decoded as bytes), list, tuple (decoded as tuple), dict (keys str, int, bytes or tuples of
    those), numpy arrays and numpy scalars of the :data:`DTYPES` element types. Subclasses are
    encoded as their base type (an IntEnum member arrives as an int).

    With ``buffers`` a list, arrays are not copied into the message: numpy arrays (as
    C-contiguous little-endian arrays) and objects exposing ``__cuda_array_interface__`` or
    ``__dlpack__`` are appended to ``buffers`` and encoded as references (index, dtype, shape,
    kind); the same object appearing twice is appended once. So are byte strings longer than
    :data:`LARGE_BYTES` (where numpy is installed), as read-only uint8 numpy views of their
    memory, without a copy: leave a bytearray or memoryview unchanged until the message is
    sent. They decode as bytes.

    Raises TypeError for an unsupported type, OverflowError for an int out of range, ValueError
    for nesting deeper than :data:`MAX_DEPTH` (e.g. a cyclic value) or an array of more than
    :data:`MAX_NDIM` dimensions; the message starts with the path of the element, as in
    ``obj[1]['w']: cannot encode object of type Foo``.
    """
    if (obj is None or type(obj) in _PLAIN_TYPES) and not (
        buffers is not None and type(obj) is bytes and len(obj) > LARGE_BYTES
    ):  # nothing to walk or check (a common result)
        return pack(obj)
    if type(obj) is int and _INT_MIN <= obj <= _INT_MAX:  # a count, an index: no walk either
        return pack(obj)
    return pack(_encode_root(obj, "obj", _Encoder(buffers)))


def encode_call(
    method: str,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    buffers: list[object] | None = None,
    inline_bytes: int = 0,
) -> bytes:
    """Encode a method call: the envelope ``[method, [args...], {kwargs}]``.

    ``method`` must be a dotted Python identifier (``"update"``, ``"Weights.update"``), ``args``
    a tuple and ``kwargs`` a dict with identifier keys (UsageError otherwise). Arguments follow
    the rules of :func:`encode`; error paths read ``args[1]['w']`` or ``kwargs['name']``. With
    ``buffers``, numpy arrays are still copied inline, in the order met, while their bytes
    total at most ``inline_bytes``: small arrays are cheaper in the message than beside it.
    Byte strings longer than :data:`LARGE_BYTES` go out of band whatever ``inline_bytes``.
    """
    if (
        _encode_plain is not None
        and type(kwargs) is dict
        and not kwargs
        and type(method) is str
        and method in _VALID_METHODS
    ):
        # the usual call (a known method, scalar args) in one native pass, the same bytes
        data = _encode_plain(method, args)
        if data is not None:
            return data
    if not _valid_method(method):
        raise UsageError(f"method name must be a dotted identifier, got {method!r}")
    if not isinstance(args, tuple):
        raise UsageError(f"args must be a tuple, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise UsageError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"keyword argument names must be identifiers, got {name!r}")
    plain = _PLAIN_TYPES
    large = LARGE_BYTES if buffers is not None else _NO_LIMIT
    if not kwargs:
        for arg in args:
            if (arg is not None and type(arg) not in plain) or (
                type(arg) is bytes and len(arg) > large
            ):
                break
        else:  # nothing to walk or check (a tuple packs as a list)
            return pack([method, args, kwargs])
        if buffers is not None and not buffers:
            device_call = _device_call(method, args, buffers)
            if device_call is not None:
                return device_call
    return _encode_call_walked(method, args, kwargs, buffers, inline_bytes)


def _encode_call_walked(
    method: str,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    buffers: list[object] | None,
    inline_bytes: int,
) -> bytes:
    """:func:`encode_call`'s general path, its arguments checked: every value walked."""
    encoder = _Encoder(buffers, inline_bytes)
    plain = _PLAIN_TYPES
    large = LARGE_BYTES if buffers is not None else _NO_LIMIT
    items: list[object] = []
    for i, arg in enumerate(args):
        if arg is None or (
            type(arg) in plain and not (type(arg) is bytes and len(arg) > large)
        ):  # nothing to walk or check
            items.append(arg)
            continue
        try:
            items.append(encoder.value(arg, 0))
        except _EncodeFailure as e:
            raise e.build(f"args[{i}]") from None
    named: dict[str, object] = {}
    for name, v in kwargs.items():
        try:
            named[name] = encoder.value(v, 0)
        except _EncodeFailure as e:
            raise e.build(f"kwargs[{name!r}]") from None
    return pack([method, items, named])


def _device_call(method: str, args: tuple[object, ...], buffers: list[object]) -> bytes | None:
    """The encoding of a call whose arguments are all distinct CuPy arrays (new weights, a
    batch: the GPU hot path), from a memo, with the arrays appended to the empty ``buffers``;
    None for any other call. Such a call's bytes depend only on the method and each array's
    dtype and shape (each is a reference by index), so the first call of a kind is encoded by
    the general path and its bytes are reused: no encoder, no walk, no pack per message."""
    key: list[object] = [method]
    for a in args:
        if not is_cupy_array(a):
            return None
        c: Any = a
        key.append(c.dtype.str)
        key.append(c.shape)
    if len(args) > 1 and len({id(a) for a in args}) != len(args):
        return None  # one array passed twice travels once: the general path numbers them
    memo_key = tuple(key)
    call = _DEVICE_CALLS.get(memo_key)
    if call is None:
        call = _encode_call_walked(method, args, {}, [], 0)  # checks what it encodes
        if len(_DEVICE_CALLS) < _DEVICE_CALLS_MAX:
            _DEVICE_CALLS[memo_key] = call
            _DEVICE_CALL_METHODS[call] = (method, len(args))
    buffers.extend(args)
    return call


def own_device_call(
    data: bytes, arrays: tuple[object, ...]
) -> tuple[str, tuple[object, ...], dict[str, object]] | None:
    """What :func:`decode_call` would make of ``data`` with ``arrays`` for a call this process
    encoded from distinct CuPy arrays alone (:func:`_device_call`'s memo), without decoding:
    ``(method, arrays, {})``; None for any other bytes. Only for a member's *own* messages,
    delivered back to it: their arrays are the very ones the call was encoded from, so there is
    nothing to check (a peer's arrays are checked against the call's references by decoding)."""
    entry = _DEVICE_CALL_METHODS.get(data)
    if entry is None or entry[1] != len(arrays):
        return None
    return entry[0], arrays, {}


# Encoded calls of distinct CuPy array arguments by (method, dtype.str and shape of each):
# _device_call's memo, and the reverse (bytes -> method and argument count) for
# own_device_call. Bounded like the other caches (the application's calls fill them).
_DEVICE_CALLS: dict[tuple[object, ...], bytes] = {}
_DEVICE_CALL_METHODS: dict[bytes, tuple[str, int]] = {}
_DEVICE_CALLS_MAX = 4096


_unpackb: Final = msgpack.unpackb  # its max_*_len limits default to the input's length

# The usual call in one native pass (hotpath.decode_plain_call / encode_plain_call); the pure
# twins would only repeat what the general paths do, so without the extension those run alone.
_decode_plain: Final = hotpath.decode_plain_call if hotpath.IMPLEMENTATION == "native" else None
_encode_plain: Final = hotpath.encode_plain_call if hotpath.IMPLEMENTATION == "native" else None

_VALID_METHODS: dict[str, bool] = {}
_VALID_METHODS_MAX = 4096  # names remembered as valid (a peer cannot grow this without bound)


def _valid_method(method: object) -> bool:
    if type(method) is str and method in _VALID_METHODS:
        return True
    ok = (
        isinstance(method, str)
        and 0 < len(method) <= 512
        and all(part.isidentifier() for part in method.split("."))
    )
    if ok and type(method) is str and len(_VALID_METHODS) < _VALID_METHODS_MAX:
        _VALID_METHODS[method] = True
    return ok


# --------------------------------------------------------------------------------------- decode


class _Decoder:
    """Unpacks one message; ``ext_hook`` handles our ext records and bounds their nesting."""

    __slots__ = ("buffers", "ext_depth", "resolved")

    def __init__(self, buffers: list[object] | tuple[object, ...] | None) -> None:
        self.buffers = buffers
        self.ext_depth = 0
        self.resolved: set[int] = set()  # ids of the buffer objects the message references

    def unpack(self, data: bytes | bytearray | memoryview) -> object:
        n = len(data)
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,
            timestamp=0,
            ext_hook=self.ext_hook,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=n,
        )

    def ext_hook(self, code: int, payload: bytes) -> object:
        if code == _EXT_TUPLE:
            if self.ext_depth >= MAX_DEPTH:
                raise ProtocolViolation(f"value nested deeper than {MAX_DEPTH} levels")
            self.ext_depth += 1
            try:
                items = self.unpack(payload)
            finally:
                self.ext_depth -= 1
            if not isinstance(items, list):
                raise ProtocolViolation("malformed tuple record")
            return tuple(items)
        if code == _EXT_NDARRAY:
            return _decode_ndarray(payload)
        if code == _EXT_NPSCALAR:
            return _decode_npscalar(payload)
        if code == _EXT_BUFREF:
            return self.reference(payload)
        raise ProtocolViolation(f"unknown msgpack ext type {code}")

    def reference(self, payload: bytes) -> object:
        checked = _REFERENCES.get(payload)
        if checked is None:
            fields = _unpack_plain(payload)
            if not (isinstance(fields, list) and len(fields) == 4):
                raise ProtocolViolation("malformed buffer reference")
            index, name, shape, kind = fields
            _check_dtype_name(name)
            checked_shape = _check_wire_shape(shape)
            if not isinstance(kind, str) or kind not in BUFFER_KINDS:
                raise ProtocolViolation(f"buffer reference of unknown kind {kind!r}")
            if kind == "bytes" and (name != "uint8" or len(checked_shape) != 1):
                raise ProtocolViolation(
                    f"a bytes buffer reference must be uint8 of one dimension, not "
                    f"{name}{tuple(checked_shape)}"
                )
            shape = tuple(checked_shape)
            if len(_REFERENCES) < _REFERENCES_MAX:
                _REFERENCES[payload] = (index, name, shape, kind)
        else:
            index, name, shape, kind = checked
        if self.buffers is None:
            raise ProtocolViolation("message references an out-of-band buffer but none were given")
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise ProtocolViolation(
                f"buffer reference index {index!r} out of range (have {len(self.buffers)})"
            )
        buf = self.buffers[index]
        if kind == "bytes":
            return _bytes_of(index, buf, shape[0])
        if not _buffer_matches(buf, name, shape):
            try:
                have_name, have_shape, _ = _buffer_meta(buf, _numpy_module())
            except ValueError as e:
                raise ProtocolViolation(f"buffer {index}: {e}") from None
            raise ProtocolViolation(
                f"buffer {index} is {have_name}{tuple(have_shape)} but the message says "
                f"{name}{shape}"
            )
        self.resolved.add(id(buf))
        return buf


# Buffer references already checked, by their bytes: a peer sends the same few shapes again and
# again. Bounded, so a peer cannot grow it; the values are never handed out (shapes are compared).
_REFERENCES: dict[bytes, tuple[int, str, tuple[int, ...], str]] = {}
_REFERENCES_MAX = 4096


def _bytes_of(index: int, buf: object, length: int) -> bytes:
    """The bytes a "bytes" buffer reference stands for: ``buf`` must be a one-dimensional uint8
    numpy array of ``length`` items. Copied into a new bytes object (:func:`hotpath.bytes_copy`,
    off the GIL where native), unless it is a whole view of a bytes object (this member's own
    call, delivered back to it): then that object, which nobody can change."""
    np = _numpy_module()
    if (
        np is None
        or type(buf) is not np.ndarray
        or buf.dtype.str != "|u1"  # type: ignore[attr-defined]
        or buf.shape != (length,)  # type: ignore[attr-defined]
    ):
        try:
            have_name, have_shape, _ = _buffer_meta(buf, np)
        except ValueError as e:
            raise ProtocolViolation(f"buffer {index}: {e}") from None
        raise ProtocolViolation(
            f"buffer {index} is {have_name}{tuple(have_shape)} but the message says bytes of "
            f"{length}"
        )
    arr: Any = buf
    base = arr.base
    if (
        type(base) is bytes
        and len(base) == length
        and arr.strides == (1,)
        and arr.__array_interface__["data"][0]
        == np.frombuffer(base, np.uint8).__array_interface__["data"][0]
    ):
        return base
    return hotpath.bytes_copy(arr)


def _unpack_plain(payload: bytes) -> object:
    """Unpack an ext header: plain msgpack, no ext records allowed."""
    n = len(payload)
    return msgpack.unpackb(
        payload,
        raw=False,
        use_list=True,
        strict_map_key=True,
        max_str_len=n,
        max_bin_len=n,
        max_array_len=n,
        max_map_len=n // 2,
        max_ext_len=0,
    )


def _check_dtype_name(name: object) -> int:
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolViolation(f"array dtype {name!r} is not allowed")
    return DTYPES[name]


def _check_wire_shape(shape: object) -> list[int]:
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


_LITTLE_DTYPES: dict[str, Any] = {}  # dtype name -> its little-endian numpy dtype


def _little_dtype(np: Any, name: str) -> Any:
    dtype = _LITTLE_DTYPES.get(name)
    if dtype is None:  # name is one of DTYPES (checked): the cache stays that small
        dtype = _LITTLE_DTYPES[name] = np.dtype(name).newbyteorder("<")
    return dtype


def _decode_ndarray(payload: bytes) -> object:
    (name, shape), offset = _read_array_header(payload, 2)
    itemsize = _check_dtype_name(name)
    dims = _check_wire_shape(shape)
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


def _decode_npscalar(payload: bytes) -> object:
    (name,), offset = _read_array_header(payload, 1)
    itemsize = _check_dtype_name(name)
    if len(payload) - offset != itemsize:
        raise ProtocolViolation(f"numpy scalar {name} must have {itemsize} bytes")
    np = _import_numpy()
    dtype = np.dtype(name).newbyteorder("<")
    return np.frombuffer(payload, dtype=dtype, count=1, offset=offset)[0].astype(name)


_SCALAR_TYPES: Final = frozenset({type(None), bool, int, float, str, bytes})
_SCALAR_BYTES: Final = 64  # encodings this short are tried as one scalar first (_decode_value)
_NOT_SCALAR: Final = object()


def _check_tree(obj: object, depth: int, np: Any, resolved: set[int]) -> None:
    """Enforce the depth limit, the dict key rules and the set of value types.

    msgpack only builds exact built-in types, so isinstance() here cannot admit a subclass.
    Scalars are recognised by exact type first (one set lookup, no call), which is what a
    call's arguments mostly are.
    """
    t = type(obj)
    if t in _SCALAR_TYPES:
        return
    if t is list or t is tuple:
        if depth >= MAX_DEPTH:
            raise ProtocolViolation(f"value nested deeper than {MAX_DEPTH} levels")
        scalars = _SCALAR_TYPES
        for v in obj:  # type: ignore[attr-defined]
            if type(v) not in scalars:
                _check_tree(v, depth + 1, np, resolved)
        return
    if np is not None and t is np.ndarray:  # decoded arrays are exactly ndarray
        return
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return
    if isinstance(obj, list | tuple | dict):
        if depth >= MAX_DEPTH:
            raise ProtocolViolation(f"value nested deeper than {MAX_DEPTH} levels")
        if isinstance(obj, dict):
            for k, v in obj.items():
                _check_key(k)
                _check_tree(v, depth + 1, np, resolved)
        else:
            for v in obj:
                _check_tree(v, depth + 1, np, resolved)
        return
    if np is not None and isinstance(obj, np.ndarray | np.generic):
        return
    if id(obj) in resolved:
        return
    raise ProtocolViolation(f"unexpected value of type {type(obj).__name__} in message")


def _check_key(k: object) -> None:
    if isinstance(k, str | int | bytes):
        return
    if isinstance(k, tuple):
        for part in k:
            _check_key(part)
        return
    raise ProtocolViolation(f"dict key of type {type(k).__name__} is not allowed")


_NIL: Final = b"\xc0"


def _decode_value(
    data: bytes | bytearray | memoryview,
    buffers: list[object] | tuple[object, ...] | None,
    max_size: int,
) -> object:
    if type(data) is bytes and len(data) <= _SCALAR_BYTES:
        if data == _NIL:  # None: the usual result of a handler
            return None
        # The next most usual: one scalar (a count, a flag, a short name), unpacked without a
        # decoder; anything else, or anything the plain unpack refuses, takes the general path
        # (which says what is wrong).
        try:
            scalar = _unpackb(data, raw=False, strict_map_key=False, ext_hook=_no_ext)
        except Exception:
            scalar = _NOT_SCALAR
        if type(scalar) in _SCALAR_TYPES:
            return scalar
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"decode() needs bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise ProtocolViolation(f"message of {len(data)} bytes exceeds the limit of {max_size}")
    try:
        decoder = _Decoder(buffers)
        value = decoder.unpack(data)
        _check_tree(value, 0, _numpy_module(), decoder.resolved)
    except DerechoError:
        raise
    except Exception as e:
        raise ProtocolViolation(f"malformed message: {type(e).__name__}: {e}") from e
    return value


def decode(
    data: bytes | bytearray | memoryview,
    buffers: list[object] | tuple[object, ...] | None = None,
    *,
    max_size: int = MAX_DECODE_SIZE,
) -> object:
    """Decode bytes made by :func:`encode`.

    Byte strings decode as bytes, tuples as tuples, numpy arrays as fresh writable arrays.
    Buffer references resolve to the objects of ``buffers`` (which the caller receives over its
    data plane); each is checked against the dtype and shape the message states.

    Malformed or hostile input (bad msgpack, unknown ext types, disallowed dtypes, inconsistent
    array sizes, nesting deeper than :data:`MAX_DEPTH`, input over ``max_size`` bytes, references
    outside ``buffers``) raises ProtocolViolation, never a msgpack exception. A message holding a
    numpy array decoded where numpy is not installed raises UsageError.
    """
    return _decode_value(data, buffers, max_size)


class _HasExt(Exception):
    """Raised by :func:`_no_ext` to leave the plain decode of a message holding an ext record."""


def _no_ext(code: int, payload: bytes) -> object:
    raise _HasExt


_NOTHING_RESOLVED: Final[set[int]] = set()  # never written: no buffer is resolved without ext


class _BufferSlot(NamedTuple):
    """Where a memoized call (see :data:`_OOB_CALLS`) takes an out-of-band buffer: the buffer's
    position, and the dtype name and shape that the call's reference gave it."""

    position: int
    name: str
    shape: tuple[int, ...]


# Calls with out-of-band buffers whose arguments are all scalars or buffers, decoded once, by
# their bytes: (method, args, kwargs) with a _BufferSlot for each buffer. A sender that sends the
# same method with the same scalars and buffer shapes again (new arrays each time) makes the same
# bytes, and its receivers skip the unpack; each buffer is still checked against its reference.
# Bounded like _REFERENCES; only short calls (the buffers' bytes are not part of them).
_OOB_CALLS: dict[bytes, tuple[str, tuple[object, ...], dict[str, object]]] = {}
_OOB_CALLS_MAX = 1024
_OOB_CALL_BYTES = 512
_UNMEMOIZABLE: Final[tuple[str, tuple[object, ...], dict[str, object]]] = ("", (), {})
"""The memo's entry for bytes whose arguments hold more than scalars and buffers: decoded in full
each time, without trying to memoize them again."""


def _buffer_matches(buf: object, name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``buf`` has the dtype name and shape its reference gave (the check of
    :meth:`_Decoder.reference` and of the memo of calls): CuPy and numpy arrays read directly,
    anything else through :func:`_buffer_meta`."""
    if is_cupy_array(buf):
        c: Any = buf
        return bool(c.shape == shape and TYPESTRS.get(c.dtype.str) == name)
    np = _numpy_module()
    if np is not None and type(buf) is np.ndarray:
        n: Any = buf
        return bool(n.shape == shape and n.dtype.fields is None
                    and numpy_dtype_name(n.dtype) == name)
    try:
        have_name, have_shape, _ = _buffer_meta(buf, np)
    except ValueError:
        return False
    return have_name == name and tuple(have_shape) == shape


def _from_memo(
    memo: tuple[str, tuple[object, ...], dict[str, object]],
    buffers: list[object] | tuple[object, ...],
) -> tuple[str, tuple[object, ...], dict[str, object]] | None:
    """A memoized call with ``buffers`` in its slots; None if one does not match its reference
    (the full decode then says why)."""
    method, args, kwargs = memo
    out: list[object] = []
    for a in args:
        if type(a) is _BufferSlot:
            if a.position >= len(buffers) or not _buffer_matches(buffers[a.position], a.name,
                                                                 a.shape):
                return None
            out.append(buffers[a.position])
        else:
            out.append(a)
    kw: dict[str, object] = {}
    for k, v in kwargs.items():
        if type(v) is _BufferSlot:
            if v.position >= len(buffers) or not _buffer_matches(buffers[v.position], v.name,
                                                                 v.shape):
                return None
            kw[k] = buffers[v.position]
        else:
            kw[k] = v
    return method, tuple(out), kw


def _memoize(
    data: bytes, buffers: list[object] | tuple[object, ...],
    call: tuple[str, tuple[object, ...], dict[str, object]],
) -> None:
    """Remember ``call`` (just decoded from ``data``) if its arguments are scalars and buffers
    and the memo has room (once full, it keeps what it has)."""
    if len(_OOB_CALLS) >= _OOB_CALLS_MAX:
        return
    index = {id(b): i for i, b in enumerate(buffers)}
    if len(index) != len(buffers):  # one object twice: its position would be ambiguous
        return
    np = _numpy_module()

    def slot(v: object) -> object:
        t = type(v)
        if t in _SCALAR_TYPES:
            return v
        i = index.get(id(v))
        if i is None:
            raise ValueError("not a scalar or a buffer")
        name, shape, _ = _buffer_meta(v, np)
        return _BufferSlot(i, name, tuple(shape))

    method, args, kwargs = call
    try:
        memo = (method, tuple(slot(a) for a in args), {k: slot(v) for k, v in kwargs.items()})
    except ValueError:
        memo = _UNMEMOIZABLE
    else:
        # A buffer in no slot was referenced otherwise (a "bytes" reference decodes to bytes,
        # which the memo would keep as a literal): such a call is decoded in full every time.
        slots = {v.position for v in (*memo[1], *memo[2].values()) if type(v) is _BufferSlot}
        if len(slots) != len(buffers):
            memo = _UNMEMOIZABLE
    _OOB_CALLS[data] = memo


def _decode_call_fast(
    data: bytes, buffers: list[object] | tuple[object, ...] | None
) -> tuple[str, tuple[object, ...], dict[str, object]] | None:
    """The usual call, checked with less work: a well-formed envelope whose kwargs keys are
    identifiers. Arguments get exactly the checks of the general path (scalars by type, the
    rest by :func:`_check_tree` at their depth), and so raise the same errors. None means "not
    the usual shape": the general path then decodes it and reports what is wrong.

    A first attempt unpacks without a :class:`_Decoder` (no per-call object): most calls hold
    no ext record (tuple, array, buffer reference). The first ext record met abandons it and
    the message is unpacked again with a decoder, exactly as before; without one, the decoder
    would not have been called and the outcome is the same. A call given out-of-band
    ``buffers`` holds references, so it goes to the decoder at once; a short one is looked up
    in the memo of such calls first (:data:`_OOB_CALLS`)."""
    if not buffers or len(data) > _OOB_CALL_BYTES:
        return _decode_call_checked(data, buffers)
    memo = _OOB_CALLS.get(data)
    if memo is None:  # first met: decode, and remember it if it may be
        call = _decode_call_checked(data, buffers)
        if call is not None:
            _memoize(data, buffers, call)
        return call
    if memo is not _UNMEMOIZABLE:
        hit = _from_memo(memo, buffers)
        if hit is not None:
            return hit
    return _decode_call_checked(data, buffers)  # in full (it also says why buffers mismatch)


def _decode_call_checked(
    data: bytes, buffers: list[object] | tuple[object, ...] | None
) -> tuple[str, tuple[object, ...], dict[str, object]] | None:
    """:func:`_decode_call_fast` without the memo of out-of-band calls."""
    resolved = _NOTHING_RESOLVED
    try:
        if buffers:  # out-of-band arrays: the message holds references (ext records) for sure
            raise _HasExt
        envelope = _unpackb(data, raw=False, strict_map_key=False, ext_hook=_no_ext)
    except _HasExt:
        decoder = _Decoder(buffers)
        resolved = decoder.resolved
        try:
            envelope = decoder.unpack(data)
        except DerechoError:
            raise
        except Exception as e:
            raise ProtocolViolation(f"malformed message: {type(e).__name__}: {e}") from e
    except DerechoError:
        raise
    except Exception as e:
        raise ProtocolViolation(f"malformed message: {type(e).__name__}: {e}") from e
    if type(envelope) is not list or len(envelope) != 3:
        return None
    method, args, kwargs = envelope
    if type(args) is not list or type(kwargs) is not dict:
        return None
    if not (type(method) is str and method in _VALID_METHODS) and not _valid_method(method):
        return None
    scalars = _SCALAR_TYPES
    np: Any = None
    for a in args:
        if type(a) not in scalars:
            np = np or _numpy_module()
            _check_tree(a, 2, np, resolved)
    if kwargs:
        for k, v in kwargs.items():
            if type(k) is not str or not k.isidentifier():
                return None
            if type(v) not in scalars:
                np = np or _numpy_module()
                _check_tree(v, 2, np, resolved)
    return method, tuple(args), kwargs


def decode_call(
    data: bytes | bytearray | memoryview,
    buffers: list[object] | tuple[object, ...] | None = None,
    *,
    max_size: int = MAX_DECODE_SIZE,
) -> tuple[str, tuple[object, ...], dict[str, object]]:
    """Decode bytes made by :func:`encode_call` into ``(method, args, kwargs)``.

    The envelope is validated (three fields, a dotted-identifier method name, a list of args, a
    map of identifier keys); any defect raises ProtocolViolation.
    """
    if type(data) is bytes and len(data) <= max_size:
        if not buffers and _decode_plain is not None:
            plain = _decode_plain(data)
            if plain is not None and (plain[0] in _VALID_METHODS or _valid_method(plain[0])):
                return plain
        fast = _decode_call_fast(data, buffers)
        if fast is not None:
            return fast
    envelope = _decode_value(data, buffers, max_size)
    if not (isinstance(envelope, list) and len(envelope) == 3):
        raise ProtocolViolation("malformed call envelope: expected [method, args, kwargs]")
    method, args, kwargs = envelope
    if not _valid_method(method):
        raise ProtocolViolation(f"malformed call envelope: bad method name {method!r}")
    if not isinstance(args, list):
        raise ProtocolViolation("malformed call envelope: args is not an array")
    if not isinstance(kwargs, dict) or not all(
        isinstance(k, str) and k.isidentifier() for k in kwargs
    ):
        raise ProtocolViolation("malformed call envelope: kwargs is not a map of identifiers")
    return method, tuple(args), kwargs
