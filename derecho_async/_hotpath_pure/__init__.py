"""The pure-Python twin of :mod:`derecho_async._native` (same API, results and error messages).

Theory of operation: one module per C file of ``native/``, under the same concern names
(``words``, ``ordering``, ``slotring``, ``shmring``, ``plaincall``, ``dispatch``,
``bytescopy``, ``logframe``, ``beacon``); this package is the twin of the extension module as a
whole, as ``module.c`` is there, and gathers their functions. :mod:`derecho_async.hotpath` chooses between the two; the
test suite runs both and checks them against each other (``tests/hotpath/``). Every
offset, length and count read from a buffer that a peer writes is checked before it is used,
exactly as the C code does (docs/DESIGN.md §8).
"""

from __future__ import annotations

from derecho_async._hotpath_pure.beacon import (
    beacon_add,
    beacon_add_peer,
    beacon_count,
    beacon_remove,
    beacon_set_view,
    beacon_start,
    beacon_stop,
    beacon_touch,
    beacon_udp,
    siphash24,
)
from derecho_async._hotpath_pure.bytescopy import bytes_copy
from derecho_async._hotpath_pure.dispatch import dispatch_calls
from derecho_async._hotpath_pure.logframe import frame_log_records, frame_log_runs
from derecho_async._hotpath_pure.ordering import MAX_TURN, frontier, turns_needed
from derecho_async._hotpath_pure.plaincall import PlainCall, decode_plain_call, encode_plain_call
from derecho_async._hotpath_pure.shmring import (
    R_MSG,
    R_PUSH,
    RING_HEADER,
    RingRecord,
    ring_put,
    ring_scan,
)
from derecho_async._hotpath_pure.slotring import (
    BATCH_ENTRY,
    KIND_BATCH,
    KIND_DESCRIPTOR,
    KIND_MESSAGE,
    KIND_NULL,
    MAX_NULL_TURNS,
    SLOT_HEADER,
    SlotRecord,
    deliver_messages,
    scan_slots,
    write_messages,
)
from derecho_async._hotpath_pure.words import WORD, Buffer, fence, load_u64, min_u64, store_u64

__all__ = [
    "BATCH_ENTRY",
    "IMPLEMENTATION",
    "KIND_BATCH",
    "KIND_DESCRIPTOR",
    "KIND_MESSAGE",
    "KIND_NULL",
    "MAX_NULL_TURNS",
    "MAX_TURN",
    "RING_HEADER",
    "R_MSG",
    "R_PUSH",
    "SLOT_HEADER",
    "WORD",
    "Buffer",
    "PlainCall",
    "RingRecord",
    "SlotRecord",
    "beacon_add",
    "beacon_add_peer",
    "beacon_count",
    "beacon_remove",
    "beacon_set_view",
    "beacon_start",
    "beacon_stop",
    "beacon_touch",
    "beacon_udp",
    "bytes_copy",
    "decode_plain_call",
    "deliver_messages",
    "dispatch_calls",
    "encode_plain_call",
    "fence",
    "frame_log_records",
    "frame_log_runs",
    "frontier",
    "load_u64",
    "min_u64",
    "ring_put",
    "ring_scan",
    "scan_slots",
    "siphash24",
    "store_u64",
    "turns_needed",
    "write_messages",
]

IMPLEMENTATION = "pure"
