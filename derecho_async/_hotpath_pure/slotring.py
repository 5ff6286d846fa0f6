"""The SST slot ring: the pure twin of ``native/slotring.c`` (see docs/DESIGN.md §4.1, §8).

Each sender's ring is ``window`` slots of ``slot_bytes`` in its row, one record per slot: a
message, a batch of messages, a descriptor, or a null of some turns. :func:`scan_slots`
validates and copies out a peer's new records, :func:`write_messages` writes this member's
queued inline messages into records, and :func:`deliver_messages` runs the delivery loop over
the scanned records in seq order. Every offset, length and count read from a slot is checked
before it is used.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from derecho_async._hotpath_pure.ordering import MAX_TURN
from derecho_async._hotpath_pure.words import U64, WORD, Buffer, arg_u64

__all__ = [
    "BATCH_ENTRY",
    "KIND_BATCH",
    "KIND_DESCRIPTOR",
    "KIND_MESSAGE",
    "KIND_NULL",
    "MAX_NULL_TURNS",
    "SLOT_HEADER",
    "SlotRecord",
    "deliver_messages",
    "scan_slots",
    "write_messages",
]

SlotRecord = tuple[int, int, int, int, int, bytes | None]
"""(first_turn, kind, n_turns, nbytes, msg_no, payload): payload only for inline messages."""

SLOT_HEADER = 32
KIND_MESSAGE = 1
KIND_DESCRIPTOR = 2
KIND_NULL = 3
KIND_BATCH = 4
MAX_NULL_TURNS = 1 << 40
BATCH_ENTRY = 16  # a batch record's per-message header: nbytes, msg_no (then the payload)

_SLOT = struct.Struct("<4Q")
_ENTRY = struct.Struct("<2Q")


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
    base = arg_u64(base, "base")
    window = arg_u64(window, "window")
    slot_bytes = arg_u64(slot_bytes, "slot_bytes")
    lo = arg_u64(lo, "lo")
    hi = arg_u64(hi, "hi")
    turn = arg_u64(turn, "turn")
    max_payload = arg_u64(max_payload, "max_payload")
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
    if len(payload) != nbytes or nbytes > room or not 0 <= msg_no < U64:
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
    base = arg_u64(base, "base")
    window = arg_u64(window, "window")
    slot_bytes = arg_u64(slot_bytes, "slot_bytes")
    rec_no = arg_u64(rec_no, "rec_no")
    turn = arg_u64(turn, "turn")
    free = arg_u64(free, "free")
    limit = arg_u64(limit, "limit")
    n = arg_u64(n, "n")
    k = arg_u64(k, "k")
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
