"""Type stub of the C extension ``derecho_async._native`` (source: native/*.c).

Its pure-Python twin, :mod:`derecho_async._hotpath_pure`, documents every function; the two
have the same API, results and error messages. Type checkers see :mod:`derecho_async.hotpath`'s
names through this stub, whichever twin it binds at run time.
"""

from collections.abc import Callable, Sequence
from typing import Any, Final

IMPLEMENTATION: Final[str]

def bytes_copy(buffer: object, /) -> bytes: ...
def beacon_start(period_s: float, hold_s: float, /) -> object: ...
def beacon_add(beacon: object, key: int, target: tuple[object, int], /) -> None: ...
def beacon_add_peer(beacon: object, key: int, host: str, port: int, /) -> None: ...
def beacon_udp(beacon: object, fd: object, sender: int, epoch: int, key: bytes, /) -> None: ...
def siphash24(key: object, data: object, /) -> int: ...
def beacon_set_view(beacon: object, view: int, /) -> None: ...
def beacon_remove(beacon: object, key: int, /) -> bool: ...
def beacon_touch(beacon: object, /) -> None: ...
def beacon_count(beacon: object, /) -> int: ...
def beacon_stop(beacon: object, /) -> None: ...
def frame_log_records(
    records: list[tuple[tuple[int, int], int, bytes]],
    batch: int,
    after: tuple[int, int] | None,
    max_record_bytes: int,
    /,
) -> bytes: ...
def frame_log_runs(
    runs: list[tuple[list[Any], int]],
    batch: int,
    after: tuple[int, int] | None,
    max_record_bytes: int,
    prefix: bytes,
    /,
) -> bytes | None: ...
def decode_plain_call(
    data: object, /
) -> tuple[str, tuple[object, ...], dict[str, object]] | None: ...
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
) -> int: ...
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
) -> int: ...
def encode_plain_call(method: object, args: object, /) -> bytes | None: ...
def load_u64(buf: bytes | bytearray | memoryview, offset: int, /) -> int: ...
def store_u64(buf: bytearray | memoryview, offset: int, value: int, /) -> None: ...
def fence() -> None: ...
def min_u64(buf: bytes | bytearray | memoryview, offsets: Sequence[int], start: int, /) -> int: ...
def frontier(held: Sequence[int], /) -> int: ...
def turns_needed(my_index: int, seen: Sequence[int], /) -> int: ...
def scan_slots(
    buf: bytes | bytearray | memoryview,
    base: int,
    window: int,
    slot_bytes: int,
    lo: int,
    hi: int,
    turn: int,
    max_payload: int,
    /,
) -> tuple[list[tuple[int, int, int, int, int, bytes | None]], int, int, str | None]: ...
def ring_scan(
    data: bytes | bytearray | memoryview, tail: int, head: int, budget: int, /
) -> tuple[list[tuple[int, int, int, bytes]], int, str | None]: ...
def ring_put(
    data: bytearray | memoryview,
    pos: int,
    typ: int,
    a: int,
    b: int,
    payload: bytes | bytearray | memoryview,
    /,
) -> int: ...
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
) -> tuple[int, int, int]: ...
