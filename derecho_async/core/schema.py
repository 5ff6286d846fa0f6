"""The shared-state table's row schema, declared once.

Theory of operation: a row is a sequence of little-endian u64 words. Every column is a run of
words with a name, a meaning and an invariant, written only by the row's owner. Byte offsets are
computed once, when a :class:`RowSchema` is built for a view (the number of members, shards,
window and slot size fix the row's shape); the native code and every transport use the same
offsets. Aligned 8-byte words are the unit of atomicity the transports guarantee, so every column
starts on a word boundary and no value spans two columns.

Row layout (``n`` members, ``S`` shards, ``W`` window slots, ``P`` payload words per slot)::

    membership   heartbeat, suspected, wedged,
                 prop_removed, prop_njoin, prop_joiners[MAX_JOINS], prop_trim[S], prop_ballot,
                 commit_ballot
    per shard    sent_records, recv_frontier, delivered, slots[W * (HEADER_WORDS + P)]
    durability   persisted[S]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BATCH_ENTRY",
    "HEADER_WORDS",
    "KIND_BATCH",
    "KIND_DESCRIPTOR",
    "KIND_MESSAGE",
    "KIND_NULL",
    "MAX_JOINS",
    "MAX_MEMBERS",
    "WORD",
    "Column",
    "RowSchema",
    "ShardColumns",
]

WORD = 8
MAX_MEMBERS = 64
"""Suspicion and removal sets are u64 bitmasks over ranks, so a view holds at most 64 members."""
MAX_JOINS = 8
"""At most this many joiners are admitted by one view change; the rest wait for the next."""

HEADER_WORDS = 4
"""A slot record's header: first_turn, kind | n_turns << 8, nbytes, msg_no."""
KIND_MESSAGE = 1
"""A message whose payload sits inline in the slot."""
KIND_DESCRIPTOR = 2
"""A large message: the slot holds its size; the bytes travel on the data plane."""
KIND_NULL = 3
"""A null record standing for ``n_turns`` skipped turns of an idle sender; never delivered."""
KIND_BATCH = 4
"""Several inline messages of consecutive turns (``n_turns`` of them, at least 2) in one slot:
``nbytes`` bytes of entries, each a (nbytes, msg_no) header of 2 words and its payload padded to
a word. Receivers read it as that many message records."""
BATCH_ENTRY = 16
"""Bytes of a batch entry's header."""


@dataclass(frozen=True, slots=True)
class Column:
    """``words`` consecutive u64 words at byte ``offset`` of every row."""

    name: str
    offset: int
    words: int
    doc: str

    @property
    def nbytes(self) -> int:
        return self.words * WORD


@dataclass(frozen=True, slots=True)
class ShardColumns:
    """The columns of one shard's ordered-multicast area."""

    sent_records: Column
    recv_frontier: Column
    delivered: Column
    slots: Column
    window: int
    slot_words: int

    def __post_init__(self) -> None:
        # the multicast pass publishes these three in one push (ShardState.publish_progress)
        if not (self.recv_frontier.offset == self.sent_records.offset + WORD
                and self.delivered.offset == self.sent_records.offset + 2 * WORD):
            raise ValueError("sent_records, recv_frontier and delivered must be adjacent words")

    def slot_offset(self, record_no: int) -> int:
        """Row offset of the slot that holds record ``record_no`` (a ring of ``window`` slots)."""
        return self.slots.offset + (record_no % self.window) * self.slot_words * WORD


class RowSchema:
    """The row shape of one view's table, with every column's offset computed once."""

    def __init__(self, n_members: int, n_shards: int, window: int, max_payload: int) -> None:
        if not 1 <= n_members <= MAX_MEMBERS:
            raise ValueError(f"a view holds 1..{MAX_MEMBERS} members, not {n_members}")
        if window < 1:
            raise ValueError("window must be at least 1")
        if max_payload < 0:
            raise ValueError("max_payload must not be negative")
        self.n_members = n_members
        self.n_shards = n_shards
        self.window = window
        self.max_payload = max_payload
        self.payload_words = (max_payload + WORD - 1) // WORD
        self.slot_words = HEADER_WORDS + self.payload_words
        self.columns: dict[str, Column] = {}
        self._next = 0

        self.heartbeat = self._col(
            "heartbeat", 1, "Owner's liveness counter, bumped every heartbeat period. Monotone."
        )
        self.suspected = self._col(
            "suspected",
            1,
            "Bitmask over ranks of the members the owner suspects (ORed with every row it reads). "
            "Bits are only ever set within a view.",
        )
        self.wedged = self._col(
            "wedged",
            1,
            "1 once the owner stopped sending, receiving and delivering in this view; published "
            "after the owner's final recv_frontier. Monotone 0 -> 1.",
        )
        self.prop_removed = self._col(
            "prop_removed", 1, "Bitmask of ranks removed by the proposal the owner accepted."
        )
        self.prop_njoin = self._col(
            "prop_njoin", 1, f"Number of joiners in that proposal (0..{MAX_JOINS})."
        )
        self.prop_joiners = self._col(
            "prop_joiners", MAX_JOINS, "Member ids of the proposal's joiners, in admission order."
        )
        self.prop_trim = self._col(
            "prop_trim",
            n_shards,
            "Per shard, the ragged trim of the proposal: every seq below it is delivered in this "
            "view, nothing at or above it.",
        )
        self.prop_ballot = self._col(
            "prop_ballot",
            1,
            "Ballot of the accepted proposal (proposer's rank + 1; 0 = none), pushed after the "
            "proposal's fields. Monotone non-decreasing.",
        )
        self.commit_ballot = self._col(
            "commit_ballot",
            1,
            "Ballot of the proposal the owner saw committed (0 = none); set once, after "
            "prop_ballot equals it.",
        )
        self.shards: list[ShardColumns] = []
        for s in range(n_shards):
            sent = self._col(
                f"s{s}.sent_records",
                1,
                "Records the owner published in its slot ring for this shard; pushed after the "
                "slots it counts. Monotone within a view.",
            )
            frontier = self._col(
                f"s{s}.recv_frontier",
                1,
                "Lowest seq the owner does not hold (every lower seq received, payload landed). "
                "Monotone; frozen once the owner wedges.",
            )
            delivered = self._col(
                f"s{s}.delivered",
                1,
                "Next seq the owner will deliver, as of its last push of this range (it travels "
                "with sent_records and recv_frontier, never alone). Monotone within a view.",
            )
            slots = self._col(
                f"s{s}.slots",
                window * self.slot_words,
                "Ring of `window` slot records: header (first_turn, kind | n_turns << 8, nbytes, "
                "msg_no) then the inline payload. A slot is rewritten only after every shard "
                "member's recv_frontier passed the record it held.",
            )
            self.shards.append(
                ShardColumns(sent, frontier, delivered, slots, window, self.slot_words)
            )
        self.persisted = self._col(
            "persisted",
            n_shards,
            "Per shard, how far the owner's log of it is durable: 0 = not yet everything the "
            "owner delivered (or was given by state transfer) before this view; k + 1 = that, "
            "and every seq below k of this view. Monotone within a view; written only by "
            "members with durable storage (it stays 0 without). At the end of the row, so no "
            "other column moves.",
        )
        self.row_bytes = self._next

    def _col(self, name: str, words: int, doc: str) -> Column:
        col = Column(name, self._next, words, doc)
        self.columns[name] = col
        self._next += words * WORD
        return col

    @property
    def membership_bytes(self) -> int:
        """Bytes of the membership section at the start of the row."""
        return self.commit_ballot.offset + WORD
