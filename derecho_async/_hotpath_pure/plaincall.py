"""The usual ordered call in one pass each way: the pure twin of ``native/plaincall.c``.

msgpack ``[method, [args...], {}]`` whose args are all scalars: :func:`decode_plain_call` and
:func:`encode_plain_call` give None for anything else, and the general codec takes it (see
docs/DESIGN.md §7.2, §8).
"""

from __future__ import annotations

import msgpack  # type: ignore[import-untyped]

__all__ = ["PlainCall", "decode_plain_call", "encode_plain_call"]

PlainCall = tuple[str, tuple[object, ...], dict[str, object]]
"""(method, args, kwargs) of an ordered call, as :func:`decode_plain_call` gives it."""

_PLAIN_ARG_TYPES = frozenset({type(None), bool, int, float, str, bytes})


def _refuse_ext(code: int, data: bytes) -> object:
    raise ValueError("an ext value is not plain")


def decode_plain_call(data: object, /) -> PlainCall | None:
    """Decode the usual ordered call in one pass: msgpack ``[method, [args...], {}]`` whose
    method is a str and whose args are all nil, bool, int, float, str or bin (bytes).

    None for anything else: another type than ``bytes``, another shape, a nested or ext value,
    an envelope not written as a fixarray of 3 or kwargs not as an empty fixmap (the bytes msgpack
    writes for such a call), truncated or trailing bytes, invalid UTF-8. The general decoder
    then takes the message and says what is wrong with it. The method name is not checked. A
    call stamped with its sender's clock (``wire.stamp_call``) decodes as the call without it."""
    if type(data) is bytes and len(data) > 13 and data[0] == 0x94 and data[-9] == 0xcf:
        data = b"\x93" + data[1:-9]
    if type(data) is not bytes or len(data) < 4 or data[0] != 0x93 or data[-1] != 0x80:
        return None
    try:
        method, args, kwargs = msgpack.unpackb(
            data, raw=False, strict_map_key=False, ext_hook=_refuse_ext
        )
    except Exception:
        return None
    # the last byte is 0x80: an empty map there is an empty fixmap (map16 and map32 end in 0)
    if type(method) is not str or type(args) is not list or type(kwargs) is not dict or kwargs:
        return None
    plain = _PLAIN_ARG_TYPES
    for a in args:
        if type(a) not in plain:
            return None
    return method, tuple(args), kwargs


_INT_LO, _INT_HI = -(1 << 63), (1 << 64) - 1
_PLAIN_BYTES_MAX = 1 << 20  # wire.LARGE_BYTES


def encode_plain_call(method: object, args: object, /) -> bytes | None:
    """msgpack ``[method, [args...], {}]`` exactly as ``msgpack.Packer(use_bin_type=True)``
    writes it, for a str ``method`` and a tuple ``args`` whose items are all None, bool, int
    (``-2**63 .. 2**64-1``), float, str or bytes (exact types, no subclasses; bytes of at most
    1 MiB, ``wire.LARGE_BYTES``: a longer one may travel out of band). None for anything else
    (another type, an int out of range, a str that cannot be UTF-8 encoded, longer bytes): the
    general encoder then takes the call (and reports what is wrong). The method name is not
    checked."""
    if type(method) is not str or type(args) is not tuple:
        return None
    for a in args:
        t = type(a)
        if a is None or t is bool or t is float or t is str:
            continue
        if t is bytes:
            if len(a) > _PLAIN_BYTES_MAX:
                return None
            continue
        if t is int and _INT_LO <= a <= _INT_HI:
            continue
        return None
    try:
        return bytes(msgpack.packb([method, list(args), {}], use_bin_type=True))
    except UnicodeEncodeError:  # a lone surrogate
        return None
