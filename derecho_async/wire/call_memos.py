"""Memos of calls with out-of-band arrays: the device-call memo and the decoded-call memo.

Theory of operation (docs/DESIGN.md §7.11): a call of distinct CuPy arrays alone is encoded once
per method, dtype and shape and its bytes reused (:func:`device_call`), and a member's own such
call is taken back without decoding (:func:`own_device_call`). A receiver remembers a short call
with out-of-band buffers and scalars by its bytes (:func:`memoize`) and rebuilds a repeated one
with the message's own buffers, each still checked (:func:`from_memo`).
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

from derecho_async.wire.arrays import buffer_matches, buffer_meta, is_cupy_array, numpy_module
from derecho_async.wire.caches import DEVICE_CALL_METHODS, DEVICE_CALLS, OOB_CALLS
from derecho_async.wire.values import SCALAR_TYPES, encode_call_walked

__all__ = [
    "OOB_CALL_BYTES",
    "UNMEMOIZABLE",
    "BufferSlot",
    "device_call",
    "from_memo",
    "memoize",
    "own_device_call",
]

# ------------------------------------------------------------------ device calls (encode side)


def device_call(method: str, args: tuple[object, ...], buffers: list[object]) -> bytes | None:
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
    call = _device_calls.get(memo_key)
    if call is None:
        call = encode_call_walked(method, args, {}, [], 0)  # checks what it encodes
        if DEVICE_CALLS.put(memo_key, call):
            DEVICE_CALL_METHODS.put(call, (method, len(args)))
    buffers.extend(args)
    return call


def own_device_call(
    data: bytes, arrays: tuple[object, ...]
) -> tuple[str, tuple[object, ...], dict[str, object]] | None:
    """What :func:`.calls.decode_call` would make of ``data`` with ``arrays`` for a call this process
    encoded from distinct CuPy arrays alone (:func:`device_call`'s memo), without decoding:
    ``(method, arrays, {})``; None for any other bytes. Only for a member's *own* messages,
    delivered back to it: their arrays are the very ones the call was encoded from, so there is
    nothing to check (a peer's arrays are checked against the call's references by decoding)."""
    entry = _device_call_methods.get(data)
    if entry is None or entry[1] != len(arrays):
        return None
    return entry[0], arrays, {}


_device_calls: Final = DEVICE_CALLS.table  # the caches' dicts, read directly (one get)
_device_call_methods: Final = DEVICE_CALL_METHODS.table


# --------------------------------------------------------------- decoded calls (receive side)


class BufferSlot(NamedTuple):
    """Where a memoized call (see :func:`memoize`) takes an out-of-band buffer: the buffer's
    position, and the dtype name and shape that the call's reference gave it."""

    position: int
    name: str
    shape: tuple[int, ...]


# Calls with out-of-band buffers whose arguments are all scalars or buffers, decoded once, by
# their bytes (caches.OOB_CALLS): (method, args, kwargs) with a BufferSlot for each buffer. A
# sender that sends the same method with the same scalars and buffer shapes again (new arrays
# each time) makes the same bytes, and its receivers skip the unpack; each buffer is still
# checked against its reference. Only short calls (the buffers' bytes are not part of them).
OOB_CALL_BYTES: Final = 512
"""The longest call (its bytes) that the decoded-call memo takes."""
UNMEMOIZABLE: Final[tuple[str, tuple[object, ...], dict[str, object]]] = ("", (), {})
"""The memo's entry for bytes whose arguments hold more than scalars and buffers: decoded in full
each time, without trying to memoize them again."""


def from_memo(
    memo: tuple[str, tuple[object, ...], dict[str, object]],
    buffers: list[object] | tuple[object, ...],
) -> tuple[str, tuple[object, ...], dict[str, object]] | None:
    """A memoized call with ``buffers`` in its slots; None if one does not match its reference
    (the full decode then says why)."""
    method, args, kwargs = memo
    out: list[object] = []
    for a in args:
        if type(a) is BufferSlot:
            if a.position >= len(buffers) or not buffer_matches(buffers[a.position], a.name,
                                                                 a.shape):
                return None
            out.append(buffers[a.position])
        else:
            out.append(a)
    kw: dict[str, object] = {}
    for k, v in kwargs.items():
        if type(v) is BufferSlot:
            if v.position >= len(buffers) or not buffer_matches(buffers[v.position], v.name,
                                                                 v.shape):
                return None
            kw[k] = buffers[v.position]
        else:
            kw[k] = v
    return method, tuple(out), kw


def memoize(
    data: bytes, buffers: list[object] | tuple[object, ...],
    call: tuple[str, tuple[object, ...], dict[str, object]],
) -> None:
    """Remember ``call`` (just decoded from ``data``) if its arguments are scalars and buffers
    and the memo has room (once full, it keeps what it has)."""
    if OOB_CALLS.full():
        return
    index = {id(b): i for i, b in enumerate(buffers)}
    if len(index) != len(buffers):  # one object twice: its position would be ambiguous
        return
    np = numpy_module()

    def slot(v: object) -> object:
        t = type(v)
        if t in SCALAR_TYPES:
            return v
        i = index.get(id(v))
        if i is None:
            raise ValueError("not a scalar or a buffer")
        name, shape, _ = buffer_meta(v, np)
        return BufferSlot(i, name, tuple(shape))

    method, args, kwargs = call
    try:
        memo = (method, tuple(slot(a) for a in args), {k: slot(v) for k, v in kwargs.items()})
    except ValueError:
        memo = UNMEMOIZABLE
    else:
        # A buffer in no slot was referenced otherwise (a "bytes" reference decodes to bytes,
        # which the memo would keep as a literal): such a call is decoded in full every time.
        slots = {v.position for v in (*memo[1], *memo[2].values()) if type(v) is BufferSlot}
        if len(slots) != len(buffers):
            memo = UNMEMOIZABLE
    OOB_CALLS.put(data, memo)
