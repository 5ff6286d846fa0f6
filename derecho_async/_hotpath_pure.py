"""The pure-Python twin of :mod:`derecho_async._native` (same API, results and error messages).

:mod:`derecho_async.hotpath` chooses between the two; the test suite runs both and checks them
against each other (``tests/test_hotpath.py``). Every offset, length and count read from a buffer
that a peer writes is checked before it is used, exactly as the C code does.

Words are little-endian u64. Python has no acquire/release loads: here :func:`load_u64` and
:func:`store_u64` go through a one-item ``"Q"`` memoryview, whose item access is a single 8-byte
copy (one instruction on x86-64 and aarch64), so a peer process never sees half a word.
``struct`` is not used for them: its little-endian packer stores byte by byte, and a concurrent
reader of a ring counter could see a torn value. :func:`fence` is an uncontended lock round
trip, which is a locked read-modify-write instruction (a full barrier) on x86-64.
"""

from __future__ import annotations

import struct
import sys
import threading
from collections.abc import Callable, Sequence
from types import CoroutineType
from typing import Any

import msgpack  # type: ignore[import-untyped]

__all__ = [
    "IMPLEMENTATION",
    "Buffer",
    "PlainCall",
    "RingRecord",
    "SlotRecord",
    "bytes_copy",
    "decode_plain_call",
    "deliver_messages",
    "dispatch_calls",
    "encode_plain_call",
    "fence",
    "frontier",
    "load_u64",
    "min_u64",
    "ring_put",
    "ring_scan",
    "scan_slots",
    "store_u64",
    "turns_needed",
    "write_messages",
]

IMPLEMENTATION = "pure"

Buffer = bytes | bytearray | memoryview
SlotRecord = tuple[int, int, int, int, int, bytes | None]
"""(first_turn, kind, n_turns, nbytes, msg_no, payload): payload only for inline messages."""
RingRecord = tuple[int, int, int, bytes]
"""(type, a, b, payload) of one shm ring record."""
PlainCall = tuple[str, tuple[object, ...], dict[str, object]]
"""(method, args, kwargs) of an ordered call, as :func:`decode_plain_call` gives it."""

WORD = 8
SLOT_HEADER = 32
KIND_MESSAGE = 1
KIND_DESCRIPTOR = 2
KIND_NULL = 3
KIND_BATCH = 4
MAX_NULL_TURNS = 1 << 40
BATCH_ENTRY = 16  # a batch record's per-message header: nbytes, msg_no (then the payload)
MAX_TURN = 1 << 56
RING_HEADER = 32
R_PUSH = 1
R_MSG = 2
_U63 = 1 << 63
_U64 = 1 << 64

_WORD = struct.Struct("<Q")
_SLOT = struct.Struct("<4Q")
_ENTRY = struct.Struct("<2Q")
_RING = struct.Struct("<IIQQQ")
_lock = threading.Lock()
_NATIVE_LE = sys.byteorder == "little"  # a "Q" item is then a little-endian u64


def _offset(buf: Buffer, offset: int) -> int:
    if type(offset) is not int and not isinstance(offset, int):
        raise TypeError("offset must be an int")
    n = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
    if offset < 0 or n < WORD or offset > n - WORD:
        raise IndexError(f"word at offset {offset} is outside a buffer of {n} bytes")
    return offset


def _u64(value: object, name: str) -> int:
    if not isinstance(value, int) or not 0 <= value < _U64:
        raise ValueError(f"{name} must be an int in [0, 2**64)")
    return value


def load_u64(buf: Buffer, offset: int, /) -> int:
    """The little-endian u64 at byte ``offset`` of ``buf`` (IndexError outside the buffer)."""
    off = _offset(buf, offset)
    if _NATIVE_LE:
        word: int = memoryview(buf).cast("B")[off : off + WORD].cast("Q")[0]
        return word
    return int(_WORD.unpack_from(buf, off)[0])


def store_u64(buf: bytearray | memoryview, offset: int, value: int, /) -> None:
    """Store ``value`` (an int in [0, 2**64)) as a little-endian u64 at byte ``offset``."""
    if not isinstance(value, int):
        raise TypeError("value must be an int")
    if not 0 <= value < _U64:
        raise OverflowError("value outside [0, 2**64)")
    mv = memoryview(buf)
    if mv.readonly:
        raise TypeError("buffer is not writable")
    off = _offset(buf, offset)
    if _NATIVE_LE:
        mv.cast("B")[off : off + WORD].cast("Q")[0] = value
    else:
        _WORD.pack_into(buf, off, value)


def fence() -> None:
    """A full memory barrier (best effort in pure Python: a lock round trip)."""
    _lock.acquire()
    _lock.release()


def min_u64(buf: Buffer, offsets: Sequence[int], start: int, /) -> int:
    """The minimum of ``start`` and the u64 words of ``buf`` at each of ``offsets``."""
    best = _u64(start, "start")
    for off in offsets:
        v = load_u64(buf, off)
        if v < best:
            best = v
    return best


def _turns(values: Sequence[int], what: str) -> list[int]:
    out = []
    for v in values:
        if not isinstance(v, int):
            raise TypeError(what)
        if not 0 <= v <= MAX_TURN:
            raise OverflowError("turn counts must lie in [0, 2**56]")
        out.append(v)
    return out


def frontier(held: Sequence[int], /) -> int:
    """Lowest seq not held: ``min(held[k] * n + k)`` over the ``n`` senders (1..64 of them)."""
    vals = _turns(held, "held must be a sequence of ints")
    n = len(vals)
    if n == 0:
        raise ValueError("frontier of no senders")
    if n > 64:
        raise ValueError("at most 64 senders")
    return min(h * n + k for k, h in enumerate(vals))


def turns_needed(my_index: int, seen: Sequence[int], /) -> int:
    """Turns sender ``my_index`` covers when idle: the most turns seen from any other sender
    (see :func:`derecho_async.core.ordering.turns_needed`)."""
    vals = _turns(seen, "seen must be a sequence of ints")
    need = 0
    for j, t in enumerate(vals):
        if j != my_index and t > need:
            need = t
    return need


def _check_ring(size: int, base: int, window: int, slot_bytes: int) -> None:
    """A slot ring of ``window`` slots of ``slot_bytes`` at ``base`` must lie in ``size`` bytes."""
    if (
        window < 1
        or slot_bytes < SLOT_HEADER
        or slot_bytes % WORD
        or base % WORD
        or window > size // slot_bytes
        or base > size - window * slot_bytes
    ):
        raise ValueError("slot ring does not fit the buffer")


def scan_slots(
    buf: Buffer,
    base: int,
    window: int,
    slot_bytes: int,
    lo: int,
    hi: int,
    turn: int,
    max_payload: int,
    /,
) -> tuple[list[SlotRecord], int, int, str | None]:
    """Copy out and validate the slot records ``lo .. hi-1`` of a sender's ring.

    The ring is ``window`` slots of ``slot_bytes`` at byte ``base`` of ``buf``; record ``r`` is
    in slot ``r % window``. ``turn`` is the first turn the next record must start at. A batch
    record (several inline messages of consecutive turns in one slot: ``nbytes`` bytes of
    entries, each a 16-byte (nbytes, msg_no) header and its payload padded to a word) comes out
    as one message record per entry. Returns the records of the slots that were valid, in
    order, the turn after them, how many slots that was, and the reason the next slot was
    refused (None when all were valid). Arguments that do not describe a ring inside ``buf``
    raise ValueError (a local bug, not remote data).
    """
    base = _u64(base, "base")
    window = _u64(window, "window")
    slot_bytes = _u64(slot_bytes, "slot_bytes")
    lo = _u64(lo, "lo")
    hi = _u64(hi, "hi")
    turn = _u64(turn, "turn")
    max_payload = _u64(max_payload, "max_payload")
    _check_ring(len(buf) if not isinstance(buf, memoryview) else buf.nbytes, base, window,
                slot_bytes)
    if hi < lo or hi - lo > window:
        raise ValueError("records to scan must be 0..window")
    if turn > MAX_TURN:
        raise ValueError("turn must lie in [0, 2**56]")
    records: list[SlotRecord] = []
    unpack = _SLOT.unpack_from
    for rec_no in range(lo, hi):
        slots = rec_no - lo
        off = base + (rec_no % window) * slot_bytes
        first, kind_turns, nbytes, msg_no = unpack(buf, off)
        kind = kind_turns & 0xFF
        n_turns = kind_turns >> 8
        payload: bytes | None = None
        if first != turn:
            return records, turn, slots, f"record {rec_no} starts at turn {first}, expected {turn}"
        if kind == KIND_MESSAGE:
            if n_turns != 1 or nbytes > max_payload or nbytes > slot_bytes - SLOT_HEADER:
                return records, turn, slots, f"bad message record ({n_turns} turns, {nbytes} B)"
            start = off + SLOT_HEADER
            payload = bytes(buf[start : start + nbytes])
        elif kind == KIND_DESCRIPTOR:
            if n_turns != 1:
                return records, turn, slots, "descriptor record must cover one turn"
        elif kind == KIND_NULL:
            if not 1 <= n_turns <= MAX_NULL_TURNS:
                return records, turn, slots, f"null record of {n_turns} turns"
        elif kind == KIND_BATCH:
            if n_turns > MAX_TURN - turn:
                return records, turn, slots, "turn count passed 2**56"
            entries, error = _batch_entries(buf, off, slot_bytes, turn, n_turns, nbytes,
                                            max_payload)
            if error is not None:
                return records, turn, slots, error
            records += entries
            turn += n_turns
            continue
        else:
            return records, turn, slots, f"unknown record kind {kind}"
        if n_turns > MAX_TURN - turn:
            return records, turn, slots, "turn count passed 2**56"
        records.append((first, kind, n_turns, nbytes, msg_no, payload))
        turn += n_turns
    return records, turn, hi - lo, None


def _inline_fields(out: Any, room: int, turn: int) -> tuple[int, int, bytes] | None:
    """(nbytes, msg_no, payload) of an outgoing message to write at ``turn`` (see
    :func:`write_messages`); None when it is large. Raises when it cannot be written."""
    if out.large:
        return None
    nbytes, msg_no, payload = out.nbytes, out.msg_no, out.payload
    if type(payload) is not bytes or type(nbytes) is not int or type(msg_no) is not int:
        raise TypeError("write_messages: an inline message needs int nbytes and msg_no and a "
                        "bytes payload")
    if len(payload) != nbytes or nbytes > room or not 0 <= msg_no < _U64:
        raise ValueError(f"write_messages: an inline message of {len(payload)} B (nbytes "
                         f"{nbytes}) does not fit a slot")
    if turn >= MAX_TURN:
        raise ValueError("write_messages: turn count passed 2**56")
    return nbytes, msg_no, payload


def write_messages(
    buf: bytearray | memoryview,
    base: int,
    window: int,
    slot_bytes: int,
    rec_no: int,
    turn: int,
    queue: Any,
    free: int,
    limit: int,
    pending: Any,
    own: Any,
    inflight: Any,
    n: int,
    k: int,
    /,
) -> tuple[int, int, int]:
    """Write inline messages from the head of the deque ``queue`` into a sender's slot ring;
    the inverse of :func:`scan_slots`.

    The ring is as in :func:`scan_slots` (its bytes: any writable buffer); the next record is
    ``rec_no``, starting at turn ``turn``. A queued message has ``msg_no``, ``payload``,
    ``nbytes`` and ``large``. Each record takes the next inline message and those after it that
    fit the same slot with it (a batch record of 16-byte entry headers and word-padded
    payloads; a lone one is a message record). For each message, in order: pop it, append
    ``(turn, KIND_MESSAGE, 1, nbytes, msg_no, payload)`` to the deque ``pending`` and ``(turn *
    n + k, message)`` to ``own``; for each record append the seq of its last turn (``last * n +
    k``) to ``inflight``. Stops after ``free`` records or ``limit`` messages, at an empty queue
    or a large message (left queued). Returns (records written, messages written, the turn
    after them).

    A message that cannot be written (not an inline message that fits a slot, or its turn
    would pass 2**56) ends the call before it is popped: with what was written before it
    returned, or, when that is nothing, raised (a local bug; the arguments the same way: a ring
    that does not fit the buffer, ``free`` above ``window``, ``n`` outside 1..256, ``k`` not
    below ``n``)."""
    base = _u64(base, "base")
    window = _u64(window, "window")
    slot_bytes = _u64(slot_bytes, "slot_bytes")
    rec_no = _u64(rec_no, "rec_no")
    turn = _u64(turn, "turn")
    free = _u64(free, "free")
    limit = _u64(limit, "limit")
    n = _u64(n, "n")
    k = _u64(k, "k")
    view = memoryview(buf)
    if view.readonly:
        raise TypeError("write_messages: buf must be writable")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    _check_ring(view.nbytes, base, window, slot_bytes)
    if not 1 <= n <= 256 or k >= n or free > window or turn > MAX_TURN:
        raise ValueError("write_messages: n must lie in 1..256, k below n, free at most window "
                         "and turn at most 2**56")
    room = slot_bytes - SLOT_HEADER
    records = written = 0
    while records < free and written < limit and queue:
        head = queue[0]
        try:
            fields = _inline_fields(head, room, turn)
        except Exception:
            if records:
                break  # returned: the next call raises it, with nothing written
            raise
        if fields is None:
            break
        queue.popleft()
        group = [(head, fields)]
        left = room - BATCH_ENTRY - (fields[0] + WORD - 1) // WORD * WORD
        while queue and written + len(group) < limit:
            nxt = queue[0]
            try:
                f = _inline_fields(nxt, room, turn + len(group))
            except Exception:
                break  # left queued: the next record stops at it
            if f is None or BATCH_ENTRY + (f[0] + WORD - 1) // WORD * WORD > left:
                break
            queue.popleft()
            group.append((nxt, f))
            left -= BATCH_ENTRY + (f[0] + WORD - 1) // WORD * WORD
        off = base + (rec_no % window) * slot_bytes
        first = turn
        pos = off + SLOT_HEADER
        for m, (nbytes, msg_no, payload) in group:
            if len(group) > 1:
                _ENTRY.pack_into(view, pos, nbytes, msg_no)
                view[pos + BATCH_ENTRY : pos + BATCH_ENTRY + nbytes] = payload
                pos += BATCH_ENTRY + (nbytes + WORD - 1) // WORD * WORD
            else:
                _SLOT.pack_into(view, off, first, KIND_MESSAGE | (1 << 8), nbytes, msg_no)
                view[pos : pos + nbytes] = payload
            pending.append((turn, KIND_MESSAGE, 1, nbytes, msg_no, payload))
            own.append((turn * n + k, m))
            turn += 1
        if len(group) > 1:
            _SLOT.pack_into(view, off, first, KIND_BATCH | (len(group) << 8),
                            pos - off - SLOT_HEADER, 0)
        inflight.append((turn - 1) * n + k)
        rec_no += 1
        records += 1
        written += len(group)
    return records, written, turn


def _batch_entries(
    buf: Buffer, off: int, slot_bytes: int, turn: int, n_turns: int, nbytes: int,
    max_payload: int,
) -> tuple[list[SlotRecord], str | None]:
    """The message records of the batch record in the slot at ``off`` (see scan_slots)."""
    if (
        n_turns < 2
        or n_turns > (slot_bytes - SLOT_HEADER) // BATCH_ENTRY
        or nbytes > slot_bytes - SLOT_HEADER
        or nbytes % WORD
    ):
        return [], f"bad batch record ({n_turns} messages, {nbytes} B)"
    pos = off + SLOT_HEADER
    end = pos + nbytes
    entries: list[SlotRecord] = []
    for i in range(n_turns):
        if pos + BATCH_ENTRY > end:
            return [], f"batch entry {i} lies past the record's {nbytes} B"
        size, msg_no = _ENTRY.unpack_from(buf, pos)
        start = pos + BATCH_ENTRY
        if size > max_payload or size > end - start:
            return [], f"batch entry {i} of {size} B does not fit"
        entries.append((turn + i, KIND_MESSAGE, 1, size, msg_no, bytes(buf[start : start + size])))
        pos = start + (size + WORD - 1) // WORD * WORD
    if pos != end:
        return [], f"batch record of {nbytes} B holds {pos - off - SLOT_HEADER} B of entries"
    return entries, None


def _ring_read(data: Buffer, cap: int, pos: int, n: int) -> bytes:
    i = pos % cap
    if i + n <= cap:
        return bytes(data[i : i + n])
    return bytes(data[i:]) + bytes(data[: n - (cap - i)])


def ring_scan(
    data: Buffer, tail: int, head: int, budget: int, /
) -> tuple[list[RingRecord], int, str | None]:
    """Parse and validate up to ``budget`` records of a shm ring between ``tail`` and ``head``.

    ``data`` is the ring's data area, used circularly (stream position ``p`` is byte
    ``p % len(data)``). A record is a header (u32 type, u32 flags = 0, u64 a, u64 b, u64 length)
    and ``length`` payload bytes, padded to 8. Returns the valid records (type, a, b, payload),
    the stream position after them, and the reason the next record was refused (None when the
    scan stopped at ``head`` or at ``budget``). A ``tail .. head`` range that is not inside the
    ring raises ValueError (the caller validates the published head first).
    """
    tail = _u64(tail, "tail")
    head = _u64(head, "head")
    budget = _u64(budget, "budget")
    cap = len(data) if not isinstance(data, memoryview) else data.nbytes
    if cap == 0 or cap % WORD or head < tail or head - tail > cap or tail % WORD or head % WORD:
        raise ValueError("published range does not fit the ring")
    records: list[RingRecord] = []
    count = 0
    while tail != head and count < budget:
        avail = head - tail
        if avail < RING_HEADER:
            return records, tail, f"{avail} bytes left, less than a record header"
        typ, flags, a, b, length = _RING.unpack(_ring_read(data, cap, tail, RING_HEADER))
        if flags:
            return records, tail, f"record flags {flags:#x} are not zero"
        padded = (length + 7) & ~7
        if padded > avail - RING_HEADER:
            return records, tail, f"record of {length} bytes overruns published data"
        if typ == R_PUSH:
            if a >= _U63 or b >= _U63:
                return records, tail, f"push view {a} / offset {b} out of range"
        elif typ != R_MSG:
            return records, tail, f"unknown record type {typ}"
        payload = _ring_read(data, cap, tail + RING_HEADER, length) if length else b""
        records.append((typ, a, b, payload))
        tail += RING_HEADER + padded
        count += 1
    return records, tail, None


def _ring_write(data: bytearray | memoryview, cap: int, pos: int, src: Buffer) -> None:
    i = pos % cap
    n = len(src) if not isinstance(src, memoryview) else src.nbytes
    first = min(n, cap - i)
    data[i : i + first] = src[:first]
    if n > first:
        data[: n - first] = src[first:]


def ring_put(
    data: bytearray | memoryview, pos: int, typ: int, a: int, b: int, payload: Buffer, /
) -> int:
    """Write one shm ring record (the header :func:`ring_scan` reads, then ``payload``) at
    stream position ``pos`` of the ring whose data area is ``data``; returns the record's size
    (header and payload padded to 8). The padding bytes are left as they are. The caller checks
    that the ring has room; a record larger than the whole ring, or a position or ring size that
    is not whole words, raises ValueError."""
    pos = _u64(pos, "pos")
    typ = _u64(typ, "typ")
    a = _u64(a, "a")
    b = _u64(b, "b")
    if typ >= 1 << 32:
        raise ValueError("typ must be an int in [0, 2**32)")
    if memoryview(data).readonly:
        raise TypeError("buffer is not writable")
    payload = memoryview(payload).cast("B")
    cap = len(data) if not isinstance(data, memoryview) else data.nbytes
    length = payload.nbytes
    size = RING_HEADER + ((length + 7) & ~7)
    if cap == 0 or cap % WORD or pos % WORD:
        raise ValueError("ring size and position must be whole words")
    if size > cap:
        raise ValueError(f"a record of {size} bytes does not fit a ring of {cap}")
    if pos > _U64 - 1 - size:
        raise ValueError("the record would pass stream position 2**64")
    _ring_write(data, cap, pos, _RING.pack(typ, 0, a, b, length))
    if length:
        _ring_write(data, cap, pos + RING_HEADER, payload)
    return size


_PLAIN_ARG_TYPES = frozenset({type(None), bool, int, float, str, bytes})


def _refuse_ext(code: int, data: bytes) -> object:
    raise ValueError("an ext value is not plain")


def decode_plain_call(data: object, /) -> PlainCall | None:
    """Decode the usual ordered call in one pass: msgpack ``[method, [args...], {}]`` whose
    method is a str and whose args are all nil, bool, int, float, str or bin (bytes).

    None for anything else: another type than ``bytes``, another shape, a nested or ext value,
    an envelope not written as a fixarray of 3 or kwargs not as an empty fixmap (the bytes msgpack
    writes for such a call), truncated or trailing bytes, invalid UTF-8. The general decoder
    then takes the message and says what is wrong with it. The method name is not checked."""
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


def deliver_messages(
    pending: Sequence[Any],
    sender_ids: Sequence[int],
    own: Any,
    events: list[Any],
    event_type: type[tuple[Any, ...]],
    head: tuple[str, int, int],
    my_index: int,
    d: int,
    limit: int,
    /,
) -> int:
    """The delivery loop of ``ShardState.deliver_until`` for its usual records.

    While ``d < limit``, with ``n = len(pending)`` and ``k = d % n``: if the head of the deque
    ``pending[k]`` is an inline message as :func:`scan_slots` made it (a 6-tuple whose first turn
    is not below ``d // n``), pop it, append ``event_type(*head, d, sender_ids[k], msg_no,
    payload)`` to ``events`` (built as ``tuple.__new__`` builds it), pop the head of the deque
    ``own`` when ``k == my_index`` and that head is ``(d, ...)``, and go on with ``d + 1``. If it
    is a null as :func:`scan_slots` made it (a 6-tuple of kind ``KIND_NULL`` whose ``n_turns``,
    from 1, reach ``d // n``; first turn and turns below ``2**56``), seq ``d`` is empty: nothing
    is delivered, the null is popped at its last turn, and ``d + 1`` goes on. Stops at anything
    else (an empty deque, another kind of record, a turn out of step) and returns the ``d`` it
    stopped at: the caller handles that record."""
    if type(pending) is not list or type(events) is not list or type(head) is not tuple or (
        len(head) != 3 or not isinstance(event_type, type) or not issubclass(event_type, tuple)
    ):
        raise TypeError(
            "deliver_messages: pending and events must be lists, head a 3-tuple and event_type a "
            "tuple subclass"
        )
    n = len(pending)
    if n == 0 or d < 0:
        raise ValueError("deliver_messages: no senders, or d < 0")
    new = tuple.__new__
    sub, shard, view_id = head
    append = events.append
    while d < limit:
        turn, k = divmod(d, n)
        pend = pending[k]
        if not pend:
            break
        rec = pend[0]
        if type(rec) is not tuple or len(rec) != 6:
            break
        first, kind, n_turns = rec[0], rec[1], rec[2]
        if type(kind) is int and kind == KIND_NULL:
            if type(n_turns) is not int or not (1 <= n_turns < MAX_TURN and 0 <= first < MAX_TURN):
                break
            end = first + n_turns
            if turn >= end:
                break
            if turn == end - 1:
                pend.popleft()
            d += 1
            continue
        if turn >= first + 1:
            break
        pend.popleft()
        append(new(event_type, (sub, shard, view_id, d, sender_ids[k], rec[4], rec[5])))
        if k == my_index and own and own[0][0] == d:
            own.popleft()
        d += 1
    return d


_I64_LO, _I64_HI = -(1 << 63), (1 << 63) - 1
_MISSING: Any = object()


def dispatch_calls(
    events: list[Any],
    start: int,
    me: int,
    hosted: dict[str, Any],
    casts: dict[int, Any],
    outbox: dict[int, list[object]] | None,
    nil: bytes,
    finish: Callable[[Any, bool, bool, object], object],
    /,
) -> int:
    """The usual ordered calls of a run of deliveries, run in order from ``events[start]`` on,
    as ``Group.on_delivered``'s general path runs them; returns the index of the first event it
    does not take (``len(events)`` when it takes them all), before any effect of that event.

    ``events`` holds Delivered 7-tuples ``(subgroup, shard, view_id, seq, sender, msg_no,
    payload)``; ``hosted`` maps a hosted subgroup to a 4-tuple whose item 1 is its runner (with
    ``idle()``) and item 3 its method table (wire name -> ``(fn, one_way)``, one_way a bool);
    ``casts`` maps msg_no of this member's one-way calls to their futures; ``outbox`` maps a
    caller to its batched replies (``[msg_no, ok, body, ...]``), None when no reply may be
    batched. An event is taken when:

    * its sender is not ``me`` and ``hosted`` lacks its subgroup (nothing to run: skipped); or
    * its payload is bytes :func:`decode_plain_call` decodes, whose method is in the table, and
      whose runner is idle (see below); and, for a call of ``me``, ``casts`` holds its msg_no exactly when
      it is one-way; and, for another's call awaiting replies, ``outbox`` is not None.

    Whether a runner is idle is asked (``idle() is True``) at the first call on it and again
    only after a call to ``finish`` or a call on another runner: only ``finish`` may step a
    coroutine on it, nothing else a handler can reach moves a runner. A taken one-way call of
    ``me`` first pops its future from ``casts`` and, unless it is done, sets its result to
    ``(view_id, seq)``. Then ``fn(*args)`` runs. A one-way call's result is
    dropped unless it is a coroutine; another's call awaiting replies that returns None gets
    ``msg_no, True, nil`` appended to ``outbox[sender]`` (a new list for a new sender). The
    other outcomes go to ``finish(ev, one_way, ok, value)``: anything the handler raised
    (``ok`` False, the exception: any ``BaseException``, cancellation and ``SystemExit``
    included), a coroutine (to step on the runner), another result of a call awaiting replies,
    and every result of a call of ``me`` awaiting replies (None included: the caller records
    its own reply). Anything ``finish`` raises propagates."""
    if not isinstance(events, list) or not isinstance(hosted, dict) or (
        not isinstance(casts, dict) or (outbox is not None and not isinstance(outbox, dict))
    ):
        raise TypeError(
            "dispatch_calls: events must be a list, hosted and casts dicts, outbox a dict or None"
        )
    if not isinstance(start, int) or not isinstance(me, int):
        raise TypeError("dispatch_calls: start and me must be ints")
    if not _I64_LO <= start <= _I64_HI or not _I64_LO <= me <= _I64_HI:
        raise OverflowError("dispatch_calls: start or me is not an int64")
    if start < 0:
        raise ValueError("dispatch_calls: start must be at least 0")
    i = start
    idle_runner: Any = None  # the runner last found idle, until a finish call
    while i < len(events):
        ev = events[i]
        if not isinstance(ev, tuple) or len(ev) != 7:
            break
        subgroup, _, view_id, seq, sender, msg_no, payload = ev
        if type(sender) is not int or type(subgroup) is not str:
            break
        if not _I64_LO <= sender <= _I64_HI:
            break
        own = sender == me
        entry = hosted.get(subgroup, _MISSING)
        if entry is _MISSING:
            if own:
                break
            i += 1
            continue
        if not isinstance(entry, tuple) or len(entry) != 4 or not isinstance(entry[3], dict):
            break
        runner, methods = entry[1], entry[3]
        cast: Any = _MISSING
        if own:
            cast = casts.get(msg_no, _MISSING)
        if type(payload) is not bytes:
            break
        plain = decode_plain_call(payload)
        if plain is None:
            break
        fe = methods.get(plain[0], _MISSING)
        if not isinstance(fe, tuple) or len(fe) != 2 or (fe[1] is not True and fe[1] is not False):
            break
        fn, one_way = fe
        if (one_way != (cast is not _MISSING)) if own else (not one_way and outbox is None):
            break
        if runner is not idle_runner:  # asked once until a finish (nothing else changes it)
            if runner.idle() is not True:
                break
            idle_runner = runner
        if cast is not _MISSING:
            del casts[msg_no]
            if not cast.done():
                cast.set_result((view_id, seq))
        try:
            result = fn(*plain[1])
        except BaseException as exc:
            idle_runner = None
            finish(ev, one_way, False, exc)
        else:
            if one_way and type(result) is not CoroutineType:
                pass
            elif not one_way and result is None and not own:
                assert outbox is not None
                out = outbox.get(sender)
                if out is None:
                    out = outbox[sender] = []
                if not isinstance(out, list):
                    raise TypeError("dispatch_calls: an outbox entry is not a list")
                out += (msg_no, True, nil)
            else:
                idle_runner = None
                finish(ev, one_way, True, result)
        i += 1
    return i


_INT_LO, _INT_HI = -(1 << 63), (1 << 64) - 1
_PLAIN_BYTES_MAX = 1 << 20  # codec.LARGE_BYTES


def encode_plain_call(method: object, args: object, /) -> bytes | None:
    """msgpack ``[method, [args...], {}]`` exactly as ``msgpack.Packer(use_bin_type=True)``
    writes it, for a str ``method`` and a tuple ``args`` whose items are all None, bool, int
    (``-2**63 .. 2**64-1``), float, str or bytes (exact types, no subclasses; bytes of at most
    1 MiB, ``codec.LARGE_BYTES``: a longer one may travel out of band). None for anything else
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


def bytes_copy(buffer: object, /) -> bytes:
    """A new bytes object holding the bytes of ``buffer`` (anything with the buffer protocol;
    a non-contiguous one in C order). The native twin copies a large buffer with the GIL
    released, so a worker thread converting hundreds of MiB does not hold up the event loop;
    here the copy holds the GIL."""
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"bytes_copy: a bytes-like object is required, not '{type(buffer).__name__}'"
        ) from None
    return bytes(view)
