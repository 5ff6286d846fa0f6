"""Calls on the wire: ``[method, [args...], {kwargs}]``, encoded and decoded, method names checked.

Theory of operation (docs/DESIGN.md §7.11): a call is a msgpack envelope of a dotted-identifier
method name, the arguments and the keyword arguments, each value following the rules of
:mod:`.values`. The usual call (a known method, scalar arguments, no keyword arguments) is
encoded and decoded in one native pass where the extension is built; calls of CuPy arrays alone
come from the device-call memo, short calls with out-of-band buffers from the decoded-call memo
(:mod:`.call_memos`); anything else takes the general paths, which check every value. Method
names found valid are remembered in a bounded table, so a known name costs one lookup.
"""

from __future__ import annotations

from typing import Any, Final

import msgpack  # type: ignore[import-untyped]

from derecho_async import hotpath
from derecho_async.errors import DerechoError, ProtocolViolation, UsageError
from derecho_async.wire.arrays import numpy_module
from derecho_async.wire.caches import OOB_CALLS, VALID_METHODS
from derecho_async.wire.call_memos import (
    OOB_CALL_BYTES,
    UNMEMOIZABLE,
    device_call,
    from_memo,
    memoize,
)
from derecho_async.wire.values import (
    LARGE_BYTES,
    MAX_DECODE_SIZE,
    NO_LIMIT,
    NOTHING_RESOLVED,
    PLAIN_TYPES,
    SCALAR_TYPES,
    Decoder,
    HasExt,
    check_tree,
    decode_value,
    encode_call_walked,
    no_ext,
    pack,
)

__all__ = ["CLIENT_ID_BYTES", "STAMP_BYTES", "call_time", "client_call", "client_tag",
           "decode_call", "encode_call", "stamp_call", "unstamped", "valid_method"]

_unpackb: Final = msgpack.unpackb  # its max_*_len limits default to the input's length

# The usual call in one native pass (hotpath.decode_plain_call / encode_plain_call); the pure
# twins would only repeat what the general paths do, so without the extension those run alone.
_decode_plain: Final = hotpath.decode_plain_call if hotpath.IMPLEMENTATION == "native" else None
_encode_plain: Final = hotpath.encode_plain_call if hotpath.IMPLEMENTATION == "native" else None

_valid_methods: Final = VALID_METHODS.table  # the caches' dicts, read directly (one lookup)
_oob_calls: Final = OOB_CALLS.table


STAMP_BYTES: Final = 9
"""What :func:`stamp_call` adds to a call: a uint64 in msgpack's fixed 9-byte form."""


def stamp_call(data: bytes, time_ns: int) -> bytes:
    """An encoded call with its sender's clock: the envelope ``[method, args, kwargs]`` becomes
    ``[method, args, kwargs, time_ns]``, the time always as a 9-byte uint64 at the end. Every
    decoder here takes both; :func:`call_time` reads the time back."""
    if data[:1] != b"\x93":
        raise ValueError("not an encoded call")
    return b"".join((b"\x94", memoryview(data)[1:], b"\xcf", time_ns.to_bytes(8, "big")))


CLIENT_ID_BYTES: Final = 16
"""An external client's id: random bytes it draws once (see :func:`client_call`)."""
_TAG_HEAD: Final = b"\xc4\x18"  # msgpack bin8 of 24 bytes: the client id, then its sequence number
_TAG_BYTES: Final = len(_TAG_HEAD) + CLIENT_ID_BYTES + 8
_CLIENT_TAIL: Final = _TAG_BYTES + STAMP_BYTES


def client_call(data: bytes, client: bytes, seq: int, time_ns: int) -> bytes:
    """An encoded call made by an external client, as its relay multicasts it: the envelope
    ``[method, args, kwargs]`` becomes ``[method, args, kwargs, tag, time_ns]``, the tag a
    24-byte bin (the client's 16-byte id, then ``seq`` as a big-endian uint64) and the time
    the relay's clock as in :func:`stamp_call`. Members apply a tagged call once per
    ``(client, seq)`` (:mod:`derecho_async.api.once`); every decoder here takes it as the
    plain call."""
    if data[:1] != b"\x93":
        raise ValueError("not an encoded call")
    if len(client) != CLIENT_ID_BYTES or not 0 <= seq < 1 << 64:
        raise ValueError("a client id is 16 bytes and a sequence number a uint64")
    return b"".join((b"\x95", memoryview(data)[1:], _TAG_HEAD, client, seq.to_bytes(8, "big"),
                     b"\xcf", (time_ns & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")))


def client_tag(data: bytes | bytearray | memoryview) -> tuple[bytes, int] | None:
    """The ``(client id, seq)`` of a call :func:`client_call` made, None for any other."""
    n = len(data)
    if (n <= 4 + _CLIENT_TAIL or data[0] != 0x95 or data[-STAMP_BYTES] != 0xcf
            or bytes(data[n - _CLIENT_TAIL : n - _CLIENT_TAIL + 2]) != _TAG_HEAD):
        return None
    start = n - _CLIENT_TAIL + 2
    return (bytes(data[start : start + CLIENT_ID_BYTES]),
            int.from_bytes(data[start + CLIENT_ID_BYTES : start + CLIENT_ID_BYTES + 8], "big"))


def _stamped(data: bytes | bytearray | memoryview) -> bool:
    return (len(data) > 4 + STAMP_BYTES and (data[0] == 0x94 or data[0] == 0x95)
            and data[-STAMP_BYTES] == 0xcf)


def call_time(data: bytes | bytearray | memoryview) -> int | None:
    """The sender's clock a stamped call carries (nanoseconds, as a signed 64-bit int), None
    for a call without one."""
    if not _stamped(data):
        return None
    return int.from_bytes(data[-8:], "big", signed=True)


def unstamped(data: bytes) -> bytes:
    """A call without its stamp, and without a client's tag (:func:`client_call`): the plain
    call (itself when it is one)."""
    if not _stamped(data):
        return data
    if data[0] == 0x95:
        if client_tag(data) is None:
            raise ProtocolViolation("a call of five fields that is not a client's")
        return b"".join((b"\x93", memoryview(data)[1:-_CLIENT_TAIL]))
    return b"".join((b"\x93", memoryview(data)[1:-STAMP_BYTES]))


def valid_method(method: object) -> bool:
    """Whether ``method`` is a method name that may travel: a dotted Python identifier of at
    most 512 characters. A valid str is remembered (while the table has room)."""
    if type(method) is str and method in _valid_methods:
        return True
    ok = (
        isinstance(method, str)
        and 0 < len(method) <= 512
        and all(part.isidentifier() for part in method.split("."))
    )
    if ok and type(method) is str:
        VALID_METHODS.put(method, True)
    return ok


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
    the rules of :func:`.values.encode`; error paths read ``args[1]['w']`` or ``kwargs['name']``. With
    ``buffers``, numpy arrays are still copied inline, in the order met, while their bytes
    total at most ``inline_bytes``: small arrays are cheaper in the message than beside it.
    Byte strings longer than :data:`LARGE_BYTES` go out of band whatever ``inline_bytes``.
    """
    if (
        _encode_plain is not None
        and type(kwargs) is dict
        and not kwargs
        and type(method) is str
        and method in _valid_methods
    ):
        # the usual call (a known method, scalar args) in one native pass, the same bytes
        data = _encode_plain(method, args)
        if data is not None:
            return data
    if not valid_method(method):
        raise UsageError(f"method name must be a dotted identifier, got {method!r}")
    if not isinstance(args, tuple):
        raise UsageError(f"args must be a tuple, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise UsageError(f"kwargs must be a dict, got {type(kwargs).__name__}")
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise UsageError(f"keyword argument names must be identifiers, got {name!r}")
    plain = PLAIN_TYPES
    large = LARGE_BYTES if buffers is not None else NO_LIMIT
    if not kwargs:
        for arg in args:
            if (arg is not None and type(arg) not in plain) or (
                type(arg) is bytes and len(arg) > large
            ):
                break
        else:  # nothing to walk or check (a tuple packs as a list)
            return pack([method, args, kwargs])
        if buffers is not None and not buffers:
            memoized = device_call(method, args, buffers)
            if memoized is not None:
                return memoized
    return encode_call_walked(method, args, kwargs, buffers, inline_bytes)


def _decode_call_fast(
    data: bytes, buffers: list[object] | tuple[object, ...] | None
) -> tuple[str, tuple[object, ...], dict[str, object]] | None:
    """The usual call, checked with less work: a well-formed envelope whose kwargs keys are
    identifiers. Arguments get exactly the checks of the general path (scalars by type, the
    rest by :func:`check_tree` at their depth), and so raise the same errors. None means "not
    the usual shape": the general path then decodes it and reports what is wrong.

    A first attempt unpacks without a :class:`Decoder` (no per-call object): most calls hold
    no ext record (tuple, array, buffer reference). The first ext record met abandons it and
    the message is unpacked again with a decoder, exactly as before; without one, the decoder
    would not have been called and the outcome is the same. A call given out-of-band
    ``buffers`` holds references, so it goes to the decoder at once; a short one is looked up
    in the memo of such calls first (:mod:`.call_memos`)."""
    if not buffers or len(data) > OOB_CALL_BYTES:
        return _decode_call_checked(data, buffers)
    memo = _oob_calls.get(data)
    if memo is None:  # first met: decode, and remember it if it may be
        call = _decode_call_checked(data, buffers)
        if call is not None:
            memoize(data, buffers, call)
        return call
    if memo is not UNMEMOIZABLE:
        hit = from_memo(memo, buffers)
        if hit is not None:
            return hit
    return _decode_call_checked(data, buffers)  # in full (it also says why buffers mismatch)


def _decode_call_checked(
    data: bytes, buffers: list[object] | tuple[object, ...] | None
) -> tuple[str, tuple[object, ...], dict[str, object]] | None:
    """:func:`_decode_call_fast` without the memo of out-of-band calls."""
    resolved = NOTHING_RESOLVED
    try:
        if buffers:  # out-of-band arrays: the message holds references (ext records) for sure
            raise HasExt
        envelope = _unpackb(data, raw=False, strict_map_key=False, ext_hook=no_ext)
    except HasExt:
        decoder = Decoder(buffers)
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
    if not (type(method) is str and method in _valid_methods) and not valid_method(method):
        return None
    scalars = SCALAR_TYPES
    np: Any = None
    for a in args:
        if type(a) not in scalars:
            np = np or numpy_module()
            check_tree(a, 2, np, resolved)
    if kwargs:
        for k, v in kwargs.items():
            if type(k) is not str or not k.isidentifier():
                return None
            if type(v) not in scalars:
                np = np or numpy_module()
                check_tree(v, 2, np, resolved)
    return method, tuple(args), kwargs


def decode_call(
    data: bytes | bytearray | memoryview,
    buffers: list[object] | tuple[object, ...] | None = None,
    *,
    max_size: int = MAX_DECODE_SIZE,
) -> tuple[str, tuple[object, ...], dict[str, object]]:
    """Decode bytes made by :func:`encode_call` into ``(method, args, kwargs)``.

    The envelope is validated (three fields, a dotted-identifier method name, a list of args, a
    map of identifier keys; a fourth, a :func:`stamp_call` time, is dropped); any defect raises
    ProtocolViolation.
    """
    stamped = _stamped(data)
    if type(data) is bytes and len(data) <= max_size:
        if not buffers and _decode_plain is not None:
            plain = _decode_plain(data)  # (it takes a stamped call as it is)
            if plain is not None and (plain[0] in _valid_methods or valid_method(plain[0])):
                return plain
        if stamped:
            data = unstamped(data)
        fast = _decode_call_fast(data, buffers)
        if fast is not None:
            return fast
    elif stamped:
        data = unstamped(bytes(data))
    envelope = decode_value(data, buffers, max_size)
    if not (isinstance(envelope, list) and len(envelope) == 3):
        raise ProtocolViolation("malformed call envelope: expected [method, args, kwargs]")
    method, args, kwargs = envelope
    if not valid_method(method):
        raise ProtocolViolation(f"malformed call envelope: bad method name {method!r}")
    if not isinstance(args, list):
        raise ProtocolViolation("malformed call envelope: args is not an array")
    if not isinstance(kwargs, dict) or not all(
        isinstance(k, str) and k.isidentifier() for k in kwargs
    ):
        raise ProtocolViolation("malformed call envelope: kwargs is not a map of identifiers")
    return method, tuple(args), kwargs
