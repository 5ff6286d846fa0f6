"""The hot loops, native or pure: one import point for the rest of the package.

Theory of operation: ``derecho_async._native`` (C, built from ``native/_native.c`` by the normal
install) and ``derecho_async._hotpath_pure`` (its pure-Python twin) have the same functions with
the same results and error messages. This module re-exports one of them, chosen once at import:

* the pure twin when the environment sets ``DERECHO_ASYNC_PURE_PYTHON`` to anything but ``""``
  or ``"0"`` (on request: tests, debugging, platforms without a compiler);
* otherwise the native module, or the pure twin when the extension is missing (an install
  without a C compiler still works, only slower).

:data:`IMPLEMENTATION` says which one is active (``"native"`` or ``"pure"``); :data:`REQUESTED_PURE`
whether the pure twin was asked for. The functions are pure computation over the buffers they
are given (no I/O, no clock), so the deterministic core may use them; all but
:func:`dispatch_calls`, the group's loop over delivered calls, which runs the handlers it is given
(the runtime's, never the core's). :func:`bytes_copy` makes a bytes object of a large received
buffer; the native one copies with the GIL released, so a worker thread may run it while the
event loop goes on.
"""

from __future__ import annotations

import os

__all__ = [
    "IMPLEMENTATION",
    "REQUESTED_PURE",
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

REQUESTED_PURE: bool = os.environ.get("DERECHO_ASYNC_PURE_PYTHON", "") not in ("", "0")

if REQUESTED_PURE:
    from derecho_async._hotpath_pure import (
        IMPLEMENTATION,
        bytes_copy,
        decode_plain_call,
        deliver_messages,
        dispatch_calls,
        encode_plain_call,
        fence,
        frontier,
        load_u64,
        min_u64,
        ring_put,
        ring_scan,
        scan_slots,
        store_u64,
        turns_needed,
        write_messages,
    )
else:
    try:
        from derecho_async._native import (
            IMPLEMENTATION,
            bytes_copy,
            decode_plain_call,
            deliver_messages,
            dispatch_calls,
            encode_plain_call,
            fence,
            frontier,
            load_u64,
            min_u64,
            ring_put,
            ring_scan,
            scan_slots,
            store_u64,
            turns_needed,
            write_messages,
        )
    except ImportError:  # built without a compiler: the pure twin does the same work
        from derecho_async._hotpath_pure import (
            IMPLEMENTATION,
            bytes_copy,
            decode_plain_call,
            deliver_messages,
            dispatch_calls,
            encode_plain_call,
            fence,
            frontier,
            load_u64,
            min_u64,
            ring_put,
            ring_scan,
            scan_slots,
            store_u64,
            turns_needed,
            write_messages,
        )
