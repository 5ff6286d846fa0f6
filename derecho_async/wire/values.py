"""Values on the wire: call arguments and results as msgpack, never pickle.

Theory of operation (docs/DESIGN.md §7.11): encoding walks a value once, checking it, and turns
tuples, numpy arrays, numpy scalars and out-of-band buffers into ext records; given ``buffers``,
arrays and large byte strings travel beside the message, referenced by index. Decoding binds
every msgpack limit to the input and walks the result (:func:`check_tree`), so malformed input
only ever raises ProtocolViolation. Public API: :func:`encode`, :func:`decode`, :func:`pack` and
the limits; the rest is shared with :mod:`.calls` and :mod:`.call_memos`.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, Final

import msgpack  # type: ignore[import-untyped]

from derecho_async import hotpath
from derecho_async.errors import DerechoError, ProtocolViolation
from derecho_async.wire.arrays import (
    DTYPES,
    MAX_NDIM,
    buffer_matches,
    buffer_meta,
    check_dtype_name,
    check_wire_shape,
    decode_ndarray,
    decode_npscalar,
    is_cupy_array,
    numpy_dtype_name,
    numpy_module,
)
from derecho_async.wire.caches import ARRAY_HEADS, REF_RECORDS, REFERENCES

if TYPE_CHECKING:
    import numpy

__all__ = [
    "BUFFER_KINDS",
    "LARGE_BYTES",
    "MAX_DECODE_SIZE",
    "MAX_DEPTH",
    "NOTHING_RESOLVED",
    "NO_LIMIT",
    "PLAIN_TYPES",
    "SCALAR_TYPES",
    "Decoder",
    "HasExt",
    "check_tree",
    "decode",
    "decode_value",
    "encode",
    "encode_call_walked",
    "no_ext",
    "pack",
]

MAX_DEPTH: Final = 64
"""Deepest nesting of containers (list, tuple, dict) allowed in a value, the value itself being 1."""

MAX_DECODE_SIZE: Final = 1 << 30
"""Default bound on the size of an encoded message that :func:`decode` accepts (1 GiB)."""

BUFFER_KINDS: Final = frozenset({"numpy", "cuda", "dlpack", "bytes"})
"""How an out-of-band buffer was exposed by the sender: a numpy array, an object with
``__cuda_array_interface__``, an object with ``__dlpack__``, or a byte string (bytes, bytearray,
memoryview) that decodes as bytes."""

LARGE_BYTES: Final = 1 << 20
"""Byte strings (bytes, bytearray, memoryview) longer than this travel out of band, as "bytes"
buffers, when :func:`.calls.encode_call` or :func:`encode` is given ``buffers``."""

_EXT_TUPLE: Final = 1
_EXT_NDARRAY: Final = 2
_EXT_NPSCALAR: Final = 3
_EXT_BUFREF: Final = 4

_INT_MIN: Final = -(1 << 63)
_INT_MAX: Final = (1 << 64) - 1

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


def _check_shape(shape: tuple[int, ...]) -> list[int]:
    if len(shape) > MAX_NDIM:
        raise _EncodeFailure(ValueError, f"array has {len(shape)} dimensions, more than {MAX_NDIM}")
    return [int(n) for n in shape]


_array_heads: Final = ARRAY_HEADS.table  # the caches' dicts, read directly (one get)
_ref_records: Final = REF_RECORDS.table
_references: Final = REFERENCES.table


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
        np = numpy_module()
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
        head = _array_heads.get(key)
        if head is None:  # checked once per dtype and shape (a cached one passed)
            head = pack(self.dtype_name(arr.dtype)) + pack(_check_shape(arr.shape))
            ARRAY_HEADS.put(key, head)
        if arr.flags.c_contiguous and arr.dtype.str[0] in _LITTLE_OR_NONE:
            little = arr  # already what travels (astype, even with copy=False, is not free)
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
                record = _ref_records.get(key)
        if record is None:
            try:
                name, shape, kind = buffer_meta(obj, np)
            except ValueError as e:
                raise _EncodeFailure(TypeError, str(e)) from None
            record = msgpack.ExtType(_EXT_BUFREF, pack([index, name, shape, kind]))
            if key is not None:
                REF_RECORDS.put(key, record)
        if fresh:
            self.buffers.append(obj if replacement is None else replacement)
            self.buffer_ids[id(obj)] = index
        return record


_LITTLE_OR_NONE: Final = ("<", "|")  # numpy dtype.str byte orders that need no swap

_packers = threading.local()


def pack(obj: object) -> bytes:
    """msgpack bytes of ``obj`` (bin type for bytes), by a Packer reused per thread."""
    # One Packer per thread, reused: msgpack.packb builds a new one (and its buffer) per call,
    # which costs about as much as packing a small call. A Packer resets itself after a failed
    # pack.
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


PLAIN_TYPES: Final = frozenset({bool, float, bytes})
"""Types a value of which needs no walk and no check (bytes only up to :data:`LARGE_BYTES`
where it may travel out of band)."""
NO_LIMIT: Final = 1 << 62  # no byte string is this long


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
    if (obj is None or type(obj) in PLAIN_TYPES) and not (
        buffers is not None and type(obj) is bytes and len(obj) > LARGE_BYTES
    ):  # nothing to walk or check (a common result)
        return pack(obj)
    if type(obj) is int and _INT_MIN <= obj <= _INT_MAX:  # a count, an index: no walk either
        return pack(obj)
    return pack(_encode_root(obj, "obj", _Encoder(buffers)))


def encode_call_walked(
    method: str,
    args: tuple[object, ...],
    kwargs: dict[str, object],
    buffers: list[object] | None,
    inline_bytes: int,
) -> bytes:
    """The call envelope ``[method, [args...], {kwargs}]`` with every value walked:
    :func:`.calls.encode_call`'s general path and the device-call memo's first encoding. The
    arguments are checked already (method name, tuple, dict of identifiers); errors name
    ``args[i]`` or ``kwargs['name']``."""
    encoder = _Encoder(buffers, inline_bytes)
    plain = PLAIN_TYPES
    large = LARGE_BYTES if buffers is not None else NO_LIMIT
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


# --------------------------------------------------------------------------------------- decode


class Decoder:
    """Unpacks one message; ``ext_hook`` handles our ext records and bounds their nesting."""

    __slots__ = ("buffers", "ext_depth", "resolved")

    def __init__(self, buffers: list[object] | tuple[object, ...] | None) -> None:
        self.buffers = buffers
        self.ext_depth = 0
        self.resolved: set[int] = set()  # ids of the buffer objects the message references

    def unpack(self, data: bytes | bytearray | memoryview) -> object:
        """The value of one msgpack message, every size limit bound to its length."""
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
        """The value of one ext record (tuple, array, numpy scalar, buffer reference)."""
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
            return decode_ndarray(payload)
        if code == _EXT_NPSCALAR:
            return decode_npscalar(payload)
        if code == _EXT_BUFREF:
            return self.reference(payload)
        raise ProtocolViolation(f"unknown msgpack ext type {code}")

    def reference(self, payload: bytes) -> object:
        """The buffer a reference record names, checked against its dtype and shape."""
        checked = _references.get(payload)
        if checked is None:
            fields = _unpack_plain(payload)
            if not (isinstance(fields, list) and len(fields) == 4):
                raise ProtocolViolation("malformed buffer reference")
            index, name, shape, kind = fields
            check_dtype_name(name)
            checked_shape = check_wire_shape(shape)
            if not isinstance(kind, str) or kind not in BUFFER_KINDS:
                raise ProtocolViolation(f"buffer reference of unknown kind {kind!r}")
            if kind == "bytes" and (name != "uint8" or len(checked_shape) != 1):
                raise ProtocolViolation(
                    f"a bytes buffer reference must be uint8 of one dimension, not "
                    f"{name}{tuple(checked_shape)}"
                )
            shape = tuple(checked_shape)
            REFERENCES.put(payload, (index, name, shape, kind))
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
        if not buffer_matches(buf, name, shape):
            try:
                have_name, have_shape, _ = buffer_meta(buf, numpy_module())
            except ValueError as e:
                raise ProtocolViolation(f"buffer {index}: {e}") from None
            raise ProtocolViolation(
                f"buffer {index} is {have_name}{tuple(have_shape)} but the message says "
                f"{name}{shape}"
            )
        self.resolved.add(id(buf))
        return buf


def _bytes_of(index: int, buf: object, length: int) -> bytes:
    """The bytes a "bytes" buffer reference stands for: ``buf`` must be a one-dimensional uint8
    numpy array of ``length`` items. Copied into a new bytes object (:func:`hotpath.bytes_copy`,
    off the GIL where native), unless it is a whole view of a bytes object (this member's own
    call, delivered back to it): then that object, which nobody can change."""
    np = numpy_module()
    if (
        np is None
        or type(buf) is not np.ndarray
        or buf.dtype.str != "|u1"  # type: ignore[attr-defined]
        or buf.shape != (length,)  # type: ignore[attr-defined]
    ):
        try:
            have_name, have_shape, _ = buffer_meta(buf, np)
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


SCALAR_TYPES: Final = frozenset({type(None), bool, int, float, str, bytes})
"""The types of a decoded value that need no walk (msgpack builds exactly these)."""
_SCALAR_BYTES: Final = 64  # encodings this short are tried as one scalar first (decode_value)
_NOT_SCALAR: Final = object()


def check_tree(obj: object, depth: int, np: Any, resolved: set[int]) -> None:
    """Enforce the depth limit, the dict key rules and the set of value types.

    msgpack only builds exact built-in types, so isinstance() here cannot admit a subclass.
    Scalars are recognised by exact type first (one set lookup, no call), which is what a
    call's arguments mostly are.
    """
    t = type(obj)
    if t in SCALAR_TYPES:
        return
    if t is list or t is tuple:
        if depth >= MAX_DEPTH:
            raise ProtocolViolation(f"value nested deeper than {MAX_DEPTH} levels")
        scalars = SCALAR_TYPES
        for v in obj:  # type: ignore[attr-defined]
            if type(v) not in scalars:
                check_tree(v, depth + 1, np, resolved)
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
                check_tree(v, depth + 1, np, resolved)
        else:
            for v in obj:
                check_tree(v, depth + 1, np, resolved)
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
_unpackb: Final = msgpack.unpackb  # its max_*_len limits default to the input's length


def decode_value(
    data: bytes | bytearray | memoryview,
    buffers: list[object] | tuple[object, ...] | None,
    max_size: int,
) -> object:
    """:func:`decode` (its ``max_size`` given): also the last resort of
    :func:`.calls.decode_call`, which then checks the envelope."""
    if type(data) is bytes and len(data) <= _SCALAR_BYTES:
        if data == _NIL:  # None: the usual result of a handler
            return None
        # The next most usual: one scalar (a count, a flag, a short name), unpacked without a
        # decoder; anything else, or anything the plain unpack refuses, takes the general path
        # (which says what is wrong).
        try:
            scalar = _unpackb(data, raw=False, strict_map_key=False, ext_hook=no_ext)
        except Exception:
            scalar = _NOT_SCALAR
        if type(scalar) in SCALAR_TYPES:
            return scalar
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"decode() needs bytes, got {type(data).__name__}")
    if len(data) > max_size:
        raise ProtocolViolation(f"message of {len(data)} bytes exceeds the limit of {max_size}")
    try:
        decoder = Decoder(buffers)
        value = decoder.unpack(data)
        check_tree(value, 0, numpy_module(), decoder.resolved)
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
    return decode_value(data, buffers, max_size)


class HasExt(Exception):
    """Raised by :func:`no_ext` to leave the plain decode of a message holding an ext record."""


def no_ext(code: int, payload: bytes) -> object:
    """An ``ext_hook`` for msgpack that refuses every ext record: the first one met abandons a
    plain unpack (:class:`HasExt`)."""
    raise HasExt


NOTHING_RESOLVED: Final[set[int]] = set()
"""The buffers resolved by a message unpacked without a :class:`Decoder`: none (never written)."""

