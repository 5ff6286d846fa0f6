"""Ordered multicast for one shard of one view (DESIGN.md §4.2-4.3).

Theory of operation. Each sender owns a ring of ``window`` slots in its own row. Sending fills the
next free slots with records (a header, then the inline payload), pushes the filled slot range,
then pushes the ``sent_records`` counter that publishes them: data before counter, as two pushes,
so a receiver that sees the counter sees the slots (sender batching: every ready record goes out
in one pair of pushes). The counter travels with the adjacent ``recv_frontier`` and ``delivered``
words, in the one push that ends the pass. Receivers compare each sender's counter with what they
have read, copy every new record out, and publish their ``recv_frontier`` once per scan (receiver
batching).

A record covers one turn (a message; a descriptor of a large message whose bytes travel on the
data plane) or a run of turns (a null, sent by an idle sender to cover every round in which another
sender took a turn: :func:`derecho_async.core.ordering.turns_needed`; a batch, several small
messages queued together that share one slot, a turn each, which receivers read as separate
messages: a burst of 1 KB messages then fills 8 KB slots instead of taking one each, and its push
moves the messages, not mostly empty slots).
A descriptor counts as held only once its bytes have landed. Seq ``s`` is stable when it is below
every shard member's published frontier; stable messages are delivered in seq order.

Flow control: record ``r`` may reuse the slot of record ``r - window`` only once every shard
member's frontier has passed that record's last seq, i.e. every member has copied it out.

Once the member wedges, the shard stops sending, reading and advancing its frontier; the ragged
trim then delivers everything below the agreed trim (:meth:`ShardState.deliver_until`).
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from derecho_async.core.effects import DataKey, Delivered, Event, Transfer
from derecho_async.core.layout import ShardInfo
from derecho_async.core.schema import (
    KIND_BATCH,
    KIND_DESCRIPTOR,
    KIND_MESSAGE,
    KIND_NULL,
    WORD,
    ShardColumns,
)
from derecho_async.core.table import Table
from derecho_async.errors import ProtocolViolation
from derecho_async.hotpath import deliver_messages as _deliver_messages
from derecho_async.hotpath import frontier as _frontier
from derecho_async.hotpath import load_u64, min_u64, scan_slots
from derecho_async.hotpath import turns_needed as _turns_needed
from derecho_async.hotpath import write_messages as _write_inline

__all__ = ["Outgoing", "Record", "ShardState"]

_HEADER = struct.Struct("<4Q")


class Outgoing(NamedTuple):
    """A message this member submitted and that is not yet delivered.

    A named tuple (immutable, like the events): one is made per submitted message, and
    ``Member.submit`` builds it in one step with ``tuple.__new__``, where a dataclass runs an
    ``__init__`` frame."""

    msg_no: int
    payload: object
    nbytes: int
    large: bool


_Inline = tuple[int, int, int, int, int, bytes | None]
"""An inline message or a null (received and not held back, or one of mine) queued in
``pending`` as the tuple :func:`scan_slots` returns, (first_turn, kind, n_turns, nbytes, msg_no,
payload), instead of as a :class:`Record`: one object fewer per record, and delivery takes both
in its native pass. Always landed; a message is one turn, a null ``n_turns``."""


@dataclass(slots=True)
class Record:
    """A record read from a sender's ring (or written into mine)."""

    first_turn: int
    n_turns: int
    kind: int
    msg_no: int
    nbytes: int
    payload: object
    landed: bool


class ShardState:
    """One shard's sender and receiver state within one view."""

    def __init__(
        self,
        info: ShardInfo,
        cols: ShardColumns,
        table: Table,
        view_id: int,
        members: tuple[int, ...],
        my_id: int,
        max_payload: int,
        queue: deque[Outgoing] | None,
        push: Callable[[int, int, tuple[int, ...]], None],
        send_batch: int = 0,
    ) -> None:
        self.info = info
        self.cols = cols
        self.table = table
        self.view_id = view_id
        self.max_payload = max_payload
        self._push = push
        self.send_batch = send_batch  # records written per send() at most (0: no cap)
        self.n = len(info.senders)
        self.sender_ids = info.senders
        self.sender_ranks = tuple(members.index(m) for m in info.senders)
        self.member_ranks = tuple(members.index(m) for m in info.members)
        self.my_rank = members.index(my_id)
        self.my_id = my_id
        self.my_index = info.senders.index(my_id) if my_id in info.senders else None
        self.peer_ids = tuple(m for m in info.members if m != my_id)
        # Table offsets of the other members' recv_frontier words (the stability scan).
        self._frontier_offsets = tuple(
            r * table.row_bytes + cols.recv_frontier.offset
            for r in self.member_ranks
            if r != self.my_rank
        )
        self._slot_bytes = cols.slot_words * WORD
        # Sender side. ``queue`` is the member's queue for this subgroup, shared across views.
        self.queue = queue
        self.sent_records = 0
        self.sent_turns = 0
        self.published_records = 0
        self.inflight_last_seq: deque[int] = deque()
        self.own_undelivered: deque[tuple[int, Outgoing]] = deque()
        # Receiver side, per sender index.
        self.records_read = [0] * self.n
        self.turns_seen = [0] * self.n
        self.turns_held = [0] * self.n
        self.pending: list[deque[Record | _Inline]] = [deque() for _ in range(self.n)]
        self.unheld: list[deque[Record]] = [deque() for _ in range(self.n)]
        self.awaiting_records: dict[DataKey, Record] = {}
        self.frontier = 0
        self.published_frontier = 0
        self.delivered = 0
        self.published_delivered = 0
        self.frozen = False

    # -- sending -------------------------------------------------------------------------------
    def _min_member_frontier(self) -> int:
        t = self.table
        if not t.has_frozen:
            return min_u64(t.buf, self._frontier_offsets, self.frontier)
        col = self.cols.recv_frontier
        low = self.frontier
        for r in self.member_ranks:
            if r != self.my_rank:
                v = t.get(r, col)
                if v < low:
                    low = v
        return low

    def _window_free(self) -> int:
        if len(self.inflight_last_seq) >= self.cols.window:
            low = self._min_member_frontier()
            q = self.inflight_last_seq
            while q and q[0] < low:
                q.popleft()
        return self.cols.window - len(self.inflight_last_seq)

    def send(self, transfers: list[Transfer]) -> int:
        """Fill free slots from the queue (then a null if others are ahead); push them.

        Returns the number of records written.
        """
        if self.frozen or self.my_index is None:
            return 0
        free = self._window_free()
        if free <= 0:
            return 0
        limit = self.send_batch if self.send_batch > 0 else 1 << 62  # messages, this pass
        if limit < free:
            free = limit
        first_record = self.sent_records
        q = self.queue
        if q:
            free = self._write_messages(q, free, limit, transfers)
        if free > 0 and not q:
            need = _turns_needed(self.my_index, self.turns_seen)
            if need > self.sent_turns:
                self._write_null(need - self.sent_turns)
        written = self.sent_records - first_record
        if written:
            self._push_records(first_record, self.sent_records)
            self._recompute_frontier()
        return written

    def _write_messages(
        self, q: deque[Outgoing], free: int, limit: int, transfers: list[Transfer]
    ) -> int:
        """Write at most ``limit`` queued messages into at most ``free`` slots; returns the
        slots left.

        Inline messages (the usual ones) are written by :func:`derecho_async.hotpath.
        write_messages` and queued in ``pending`` as :data:`_Inline` tuples: a lone one as a
        message record (header and payload), and consecutive ones that fit one slot together
        as a batch record, so a burst of small messages fills its slots instead of using one
        slot each (a push then moves about what the messages hold, not whole slots). A large
        one goes out by :meth:`_write_descriptor`.
        """
        k = self.my_index
        assert k is not None
        table = self.table
        slots_base = table.my_rank * table.row_bytes + self.cols.slots.offset
        pend = self.pending[k]
        turns_seen = self.turns_seen
        turns_held = self.turns_held
        written = 0  # messages
        while free > 0 and q and written < limit:
            if q[0].large:
                self._write_descriptor(q.popleft(), transfers)
                free -= 1
                written += 1
                continue
            records, msgs, turn = _write_inline(
                table.buf, slots_base, self.cols.window, self._slot_bytes, self.sent_records,
                self.sent_turns, q, free, limit - written, pend, self.own_undelivered,
                self.inflight_last_seq, self.n, k,
            )
            # (in step after each call: a message it cannot write raises in the next one)
            self.sent_records += records
            self.sent_turns = turn
            turns_seen[k] += msgs
            turns_held[k] += msgs
            free -= records
            written += msgs
        return free

    def _write_record(self, kind: int, n_turns: int, nbytes: int, msg_no: int) -> int:
        """Write one header-only record (a descriptor or a null) of ``n_turns`` turns into my
        next slot; returns its first turn."""
        table = self.table
        rec_no = self.sent_records
        first = self.sent_turns
        _HEADER.pack_into(table.buf, table.table_offset(self.cols.slot_offset(rec_no)), first,
                          kind | (n_turns << 8), nbytes, msg_no)
        self.sent_records = rec_no + 1
        self.sent_turns = first + n_turns
        assert self.my_index is not None
        self.inflight_last_seq.append((first + n_turns - 1) * self.n + self.my_index)
        return first

    def _write_descriptor(self, out: Outgoing, transfers: list[Transfer]) -> None:
        """Write a large message's descriptor record and start its data-plane transfer (inline
        messages are written by :meth:`_write_messages`)."""
        k = self.my_index
        assert k is not None
        msg_no = out.msg_no
        nbytes = out.nbytes
        first = self._write_record(KIND_DESCRIPTOR, 1, nbytes, msg_no)
        transfers.append(Transfer(DataKey(self.view_id, self.my_id, msg_no), out.payload, nbytes,
                                  self.peer_ids))
        self.pending[k].append(Record(first, 1, KIND_DESCRIPTOR, msg_no, nbytes, out.payload,
                                      True))
        self.turns_seen[k] += 1
        self.turns_held[k] += 1
        self.own_undelivered.append((first * self.n + k, out))

    def _write_null(self, n_turns: int) -> None:
        assert self.my_index is not None
        first = self._write_record(KIND_NULL, n_turns, 0, 0)
        self.pending[self.my_index].append((first, KIND_NULL, n_turns, 0, 0, None))  # _Inline
        self.turns_seen[self.my_index] += n_turns
        self.turns_held[self.my_index] += n_turns

    def _push_records(self, lo: int, hi: int) -> None:
        w = self.cols.window
        slot_bytes = self._slot_bytes
        # The slot ring may wrap: push each contiguous run of slots, then the counter. The last
        # record's slot is pushed only as far as it is used (header and inline payload, to a
        # whole word): a null record or a 1 KB message then moves 32 bytes or about 1 KB, not
        # the whole slot (8 KB by default). Receivers read no further than a record's nbytes.
        table = self.table
        last = table.table_offset(self.cols.slot_offset(hi - 1))
        _, kind_turns, size, _ = _HEADER.unpack_from(table.buf, last)
        kind = kind_turns & 0xFF
        used = _HEADER.size + (size if kind in (KIND_MESSAGE, KIND_BATCH) else 0)
        r = lo
        while r < hi:
            start = r % w
            run = min(hi - r, w - start)
            nbytes = run * slot_bytes
            if r + run == hi:
                nbytes -= slot_bytes - (used + WORD - 1) // WORD * WORD
            self._push(self.cols.slot_offset(r), nbytes, self.peer_ids)
            r += run
        # The counter that publishes them goes out with my frontier and delivered counters, in
        # one push after these (publish_progress, at the end of the same pass).

    # -- receiving -----------------------------------------------------------------------------
    def receive(
        self,
        landed_early: dict[DataKey, object],
        awaiting: dict[DataKey, ShardState],
    ) -> None:
        """Copy every newly published record out of the senders' rings (one batch per sender:
        :func:`derecho_async.hotpath.scan_slots` validates and copies the records out)."""
        if self.frozen:
            return
        t = self.table
        cols = self.cols
        sent_off = cols.sent_records.offset
        slots_off = cols.slots.offset
        for k, rank in enumerate(self.sender_ranks):
            if k == self.my_index:
                continue
            src, base = t.row_source(rank)
            published = load_u64(src, base + sent_off)
            read = self.records_read[k]
            if published <= read:
                continue
            if published - read > cols.window:
                raise ProtocolViolation(
                    f"published {published} records with only {read} read and a window of "
                    f"{cols.window}",
                    self.sender_ids[k],
                )
            records, _turn, slots, error = scan_slots(
                src,
                base + slots_off,
                cols.window,
                self._slot_bytes,
                read,
                published,
                self.turns_seen[k],
                self.max_payload,
            )
            # Messages (the usual record, one turn each) and nulls are queued here as
            # _take_record would, as the tuple scan_slots made when nothing is held back (see
            # _Inline).
            pend = self.pending[k]
            unheld = self.unheld[k]
            turns_seen = self.turns_seen
            turns_held = self.turns_held
            held = 0  # turns queued as held since the last _take_record
            for raw in records:
                kind = raw[1]
                if kind != KIND_MESSAGE:
                    if kind == KIND_NULL and not unheld:
                        pend.append(raw)
                        held += raw[2]
                        continue
                    turns_seen[k] += held
                    turns_held[k] += held
                    held = 0
                    self._take_record(k, raw, landed_early, awaiting)
                    continue
                if not unheld:
                    pend.append(raw)
                    held += 1
                    continue
                first, kind, n_turns, nbytes, msg_no, payload = raw
                rec = Record(first, 1, kind, msg_no, nbytes, payload, True)
                turns_seen[k] += n_turns
                pend.append(rec)
                unheld.append(rec)
            turns_seen[k] += held
            turns_held[k] += held
            self.records_read[k] = read + slots
            if error is not None:
                raise ProtocolViolation(error, self.sender_ids[k])
        self._recompute_frontier()

    def _take_record(
        self,
        k: int,
        raw: tuple[int, int, int, int, int, bytes | None],
        landed_early: dict[DataKey, object],
        awaiting: dict[DataKey, ShardState],
    ) -> None:
        """Queue one validated record of sender index ``k``."""
        first, kind, n_turns, nbytes, msg_no, payload = raw
        if kind == KIND_DESCRIPTOR:
            key = DataKey(self.view_id, self.sender_ids[k], msg_no)
            rec = Record(first, 1, kind, msg_no, nbytes, None, False)
            if key in landed_early:
                rec.payload = landed_early.pop(key)
                rec.landed = True
            else:
                awaiting[key] = self
                self.awaiting_records[key] = rec
        elif kind == KIND_NULL:
            rec = Record(first, n_turns, kind, 0, 0, None, True)
        else:
            rec = Record(first, 1, kind, msg_no, nbytes, payload, True)
        self.turns_seen[k] += n_turns
        self.pending[k].append(rec)
        if rec.landed and not self.unheld[k]:
            self.turns_held[k] += n_turns
        else:
            self.unheld[k].append(rec)

    def data_landed(self, key: DataKey, payload: object) -> None:
        """The bytes of descriptor ``key`` landed here."""
        rec = self.awaiting_records.pop(key, None)
        if rec is None or self.frozen:
            return
        rec.payload = payload
        rec.landed = True
        k = self.sender_ids.index(key.sender)
        un = self.unheld[k]
        while un and un[0].landed:
            self.turns_held[k] += un.popleft().n_turns
        self._recompute_frontier()

    def _recompute_frontier(self) -> None:
        if not self.frozen:
            self.frontier = _frontier(self.turns_held)

    def publish_progress(self) -> None:
        """Push my frontier if it moved, with my ``sent_records`` counter if records were
        written since it was last pushed (once per pass). My ``delivered`` counter travels with
        them: no peer's protocol step reads it (stability and flow control follow frontiers),
        so a pass that only delivered pushes nothing, and the next push carries it."""
        t = self.table
        cols = self.cols
        changed = False
        if self.frontier != self.published_frontier:
            t.set(cols.recv_frontier, self.frontier)
            self.published_frontier = self.frontier
            changed = True
        if self.delivered != self.published_delivered:
            t.set(cols.delivered, self.delivered)
            self.published_delivered = self.delivered
        records = self.sent_records != self.published_records
        if records:
            t.set(cols.sent_records, self.sent_records)
            self.published_records = self.sent_records
        # sent_records, recv_frontier and delivered are adjacent words: one push to every view
        # member (the counter is read only by the shard's members, who got the slots it counts
        # in earlier pushes: data before counter).
        if records:
            self._push(cols.sent_records.offset, 3 * WORD, ())
        elif changed:
            self._push(cols.recv_frontier.offset, 2 * WORD, ())

    # -- delivery ------------------------------------------------------------------------------
    def stable(self) -> int:
        """Every seq below this is held by every shard member (as far as this member knows)."""
        return self._min_member_frontier()

    def deliver_until(self, limit: int, events: list[Event]) -> None:
        """Deliver every message with ``delivered <= seq < limit``, in seq order."""
        d = self.delivered
        if limit <= d:
            return
        n = self.n
        sub = self.info.subgroup
        shard = self.info.shard
        view_id = self.view_id
        own = self.own_undelivered
        pending = self.pending
        sender_ids = self.sender_ids
        my_index = self.my_index
        me = -1 if my_index is None else my_index
        head = (sub, shard, view_id)
        append = events.append
        new = tuple.__new__  # Delivered(...) without its Python-level __new__ frame
        while d < limit:
            turn, k = divmod(d, n)
            pend = pending[k]
            if not pend:
                raise AssertionError(f"seq {d} is not held (sender index {k})")
            rec = pend[0]
            if isinstance(rec, tuple):
                # A message or a null as scan_slots gave it (_Inline), the usual records: this
                # and the ones after it go in one call, up to the next record of another kind
                # (hotpath.deliver_messages, the same steps as the rest of this loop).
                nd = _deliver_messages(pending, sender_ids, own, events, Delivered, head, me, d,
                                       limit)
                if nd == d:
                    raise AssertionError(f"seq {d}: record bookkeeping out of step")
                d = nd
                continue
            end = rec.first_turn + rec.n_turns
            if turn >= end:
                raise AssertionError(f"seq {d}: record bookkeeping out of step")
            if rec.kind == KIND_NULL:
                if turn == end - 1:
                    pend.popleft()
                d += 1
                continue
            if not rec.landed:
                raise AssertionError(f"seq {d} delivered before its bytes landed")
            pend.popleft()
            append(
                new(Delivered, (sub, shard, view_id, d, sender_ids[k], rec.msg_no, rec.payload))
            )
            if k == my_index and own and own[0][0] == d:
                own.popleft()
            d += 1
        self.delivered = d

    def deliver_stable(self, events: list[Event]) -> None:
        if not self.frozen:
            self.deliver_until(min(self.stable(), self.frontier), events)

    # -- view change ---------------------------------------------------------------------------
    def freeze(self) -> None:
        """Stop sending, reading and advancing the frontier (the member wedged)."""
        self.frozen = True

    def leftovers(self) -> list[Outgoing]:
        """My messages not delivered in this view, oldest first (to re-send in the next)."""
        return [out for _, out in self.own_undelivered]

    def idle(self) -> bool:
        """True when nothing received is undelivered and nothing of mine is in flight."""
        return (
            not self.own_undelivered
            and self.delivered == self.frontier
            and all(not u for u in self.unheld)
            and self.turns_seen == self.turns_held
        )
