"""The hot loops, native or pure: one import point for the rest of the package.

Theory of operation: ``derecho_async._native`` (C, built from ``native/*.c`` by the normal
install) and ``derecho_async._hotpath_pure`` (its pure-Python twin, a module per C file) have
the same functions with the same results and error messages. This module binds every name of
``__all__`` but :data:`REQUESTED_PURE` from one of them, chosen once at import:

* the pure twin when the environment sets ``DERECHO_ASYNC_PURE_PYTHON`` to anything but ``""``
  or ``"0"`` (on request: tests, debugging, platforms without a compiler);
* otherwise the native module, or the pure twin when the extension is missing (an install
  without a C compiler still works, only slower).

:data:`IMPLEMENTATION` says which one is active (``"native"`` or ``"pure"``); :data:`REQUESTED_PURE`
whether the pure twin was asked for. The functions are pure computation over the buffers they
are given (no I/O, no clock), so the deterministic core may use them; all but
:func:`dispatch_calls`, the group's loop over delivered calls, which runs the handlers it is given,
and the ``beacon_*`` functions, which run the liveness thread (both the runtime's, never the
core's). :func:`bytes_copy` makes a bytes object of a large received
buffer; the native one copies with the GIL released, so a worker thread may run it while the
event loop goes on. See docs/DESIGN.md §8.

The native boundary: besides buffers, ints and the lists, dicts and deques it is handed, the
native side reads these shapes, by position or by public name, and nothing else of Python
objects (§8.3):

* ``Delivered``: a tuple subclass of 7 items ``(subgroup, shard, view_id, seq, sender, msg_no,
  payload)``; :func:`deliver_messages` builds it (``event_type``) with ``tp_alloc``, and
  :func:`dispatch_calls` reads items 0, 2, 3, 4, 5 and 6.
* A queued slot record: the 6-tuple ``(first_turn, kind, n_turns, nbytes, msg_no, payload)``
  that :func:`scan_slots` and :func:`write_messages` make and :func:`deliver_messages` reads;
  anything else at the head of a deque stops the native loop.
* An outgoing message for :func:`write_messages`: attributes ``large``, ``nbytes``, ``msg_no``
  and ``payload`` (exact ``int`` and ``bytes`` for an inline one).
* ``hosted`` for :func:`dispatch_calls`: subgroup -> a 4-tuple whose item 1 is the runner (its
  ``idle()``) and item 3 the method table, a dict of wire name -> ``(fn, one_way)`` with
  ``one_way`` a bool; ``casts``: msg_no -> future (``done()``, ``set_result()``); ``outbox``:
  caller -> list of ``msg_no, ok, body``; ``finish(ev, one_way, ok, value)`` for the rest.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from types import ModuleType
from typing import TYPE_CHECKING

# The one table of names: each is bound below from the twin chosen at import.
__all__ = [
    "IMPLEMENTATION",
    "REQUESTED_PURE",
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

REQUESTED_PURE: bool = os.environ.get("DERECHO_ASYNC_PURE_PYTHON", "") not in ("", "0")
FALLBACK: str | None = None
"""Why the pure twin runs although nobody asked for it (the extension is missing or out of
date), else None; a group logs it once per process when it starts."""


def _missing(module: ModuleType) -> list[str]:
    """The names of :data:`__all__` that ``module`` lacks (a native module built from older
    sources than the package's: an editable install not rebuilt since a function was added)."""
    return [name for name in __all__ if name != "REQUESTED_PURE" and not hasattr(module, name)]


def _chosen() -> ModuleType:
    """The native module unless the pure twin was asked for or the extension is missing (or out
    of date: then with a warning, since everything would run, only slower)."""
    if not REQUESTED_PURE:
        try:
            native = importlib.import_module("derecho_async._native")
        except ImportError as exc:  # built without a compiler: the twin does the same work
            _fell_back(f"the C extension derecho_async._native is missing ({exc}); the package "
                       "was installed without a C compiler: the pure-Python twin runs, slower")
        else:
            missing = _missing(native)
            if not missing:
                return native
            why = (f"derecho_async._native is older than the package (it lacks "
                   f"{', '.join(missing)}): using the pure-Python twin; reinstall the package "
                   "to rebuild it")
            _fell_back(why)
            warnings.warn(why, RuntimeWarning, stacklevel=2)
    return importlib.import_module("derecho_async._hotpath_pure")


def _fell_back(why: str) -> None:
    global FALLBACK
    FALLBACK = why


_fallback_noted = False


def note_fallback(logger: logging.Logger) -> None:
    """Log :data:`FALLBACK` at WARNING, once per process (a group calls it as it starts: by
    then the application has configured logging)."""
    global _fallback_noted
    if FALLBACK is not None and not _fallback_noted:
        _fallback_noted = True
        logger.warning("%s", FALLBACK)


# For type checkers the names come from the extension's stub, _native.pyi, which types both
# twins; ruff cannot see them there:
# ruff: noqa: F403, F405
if TYPE_CHECKING:
    from derecho_async._native import *
else:
    _twin = _chosen()
    globals().update({name: getattr(_twin, name) for name in __all__ if name != "REQUESTED_PURE"})
