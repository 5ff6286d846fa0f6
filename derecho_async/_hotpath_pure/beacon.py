"""Twin of ``native/beacon.c``: the liveness beacon, as a Python thread, and SipHash-2-4.

The same functions, arguments, checks and error messages. Unlike the C thread it needs the GIL:
it still counts while a handler runs Python (the interpreter hands the GIL over every few
milliseconds), but not while one C call holds the GIL throughout. A forked child has no thread:
its copy of a beacon acts as a stopped one, without touching the lock the parent's thread may
have held at the fork.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import threading
import time

from derecho_async._hotpath_pure.words import WORD, Buffer

__all__ = [
    "DGRAM",
    "DGRAM_MAGIC",
    "Beacon",
    "beacon_add",
    "beacon_add_peer",
    "beacon_count",
    "beacon_remove",
    "beacon_set_view",
    "beacon_start",
    "beacon_stop",
    "beacon_touch",
    "beacon_udp",
    "siphash24",
]

DGRAM = struct.Struct("<IIQQQQQ")  # magic, zero, sender, epoch, view, count, SipHash of the rest
DGRAM_MAGIC = 0x31624144  # "DAb1"
_M64 = (1 << 64) - 1


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _M64


def siphash24(key: object, data: object) -> int:
    """SipHash-2-4 of ``data`` under the 16-byte ``key``."""
    kv = memoryview(key).cast("B")  # type: ignore[arg-type]
    if len(kv) != 16:
        raise ValueError("key must be 16 bytes")
    k0 = int.from_bytes(kv[:8], "little")
    k1 = int.from_bytes(kv[8:], "little")
    msg = bytes(memoryview(data).cast("B"))  # type: ignore[arg-type]
    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573

    def rounds(n: int) -> None:
        nonlocal v0, v1, v2, v3
        for _ in range(n):
            v0 = (v0 + v1) & _M64
            v1 = _rotl(v1, 13) ^ v0
            v0 = _rotl(v0, 32)
            v2 = (v2 + v3) & _M64
            v3 = _rotl(v3, 16) ^ v2
            v0 = (v0 + v3) & _M64
            v3 = _rotl(v3, 21) ^ v0
            v2 = (v2 + v1) & _M64
            v1 = _rotl(v1, 17) ^ v2
            v2 = _rotl(v2, 32)

    whole = len(msg) & ~7
    for i in range(0, whole, 8):
        m = int.from_bytes(msg[i : i + 8], "little")
        v3 ^= m
        rounds(2)
        v0 ^= m
    last = (len(msg) & 0xFF) << 56 | int.from_bytes(msg[whole:], "little")
    v3 ^= last
    rounds(2)
    v0 ^= last
    v2 ^= 0xFF
    rounds(4)
    return v0 ^ v1 ^ v2 ^ v3


class Beacon:
    """A running beacon (the handle :func:`beacon_start` returns)."""

    def __init__(self, period_s: float, hold_s: float) -> None:
        self.period_s = period_s
        self.hold_s = hold_s
        self.touched = time.monotonic()
        self.count = 0
        self.targets: dict[int, tuple[memoryview, int]] = {}
        self.peers: dict[int, tuple[str, int]] = {}
        self.sock: socket.socket | None = None
        self.ident = (0, 0, b"")  # sender, epoch, key
        self.view = 0
        self.cond = threading.Condition()
        self.stopped = False
        self.owner = os.getpid()
        self.thread = threading.Thread(target=self._main, name="derecho-beacon", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        due = time.monotonic()
        with self.cond:
            while not self.stopped:
                now = time.monotonic()
                if self.hold_s == 0 or now - self.touched <= self.hold_s:
                    self.count += 1
                    for view, off in self.targets.values():
                        view[off : off + WORD] = self.count.to_bytes(WORD, "little")
                    if self.sock is not None and self.peers:
                        self._send()
                due += self.period_s
                if due < now:
                    due = now + self.period_s
                while not self.stopped:
                    left = due - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)


    def _send(self) -> None:
        sender, epoch, key = self.ident
        body = DGRAM.pack(DGRAM_MAGIC, 0, sender, epoch, self.view, self.count, 0)[:40]
        dgram = body + siphash24(key, body).to_bytes(8, "little")
        assert self.sock is not None
        for addr in self.peers.values():
            with contextlib.suppress(OSError):  # a full buffer, an unreachable peer: next time
                self.sock.sendto(dgram, addr)


def _seconds(value: object, name: str, lo: float) -> float:
    try:
        s = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(f"must be real number, not {type(value).__name__}") from None
    if not lo <= s <= 3600.0:
        raise ValueError(f"{name} must be a number of seconds in [{lo:g}, 3600]")
    return s


def _beacon(obj: object) -> Beacon:
    if not isinstance(obj, Beacon):
        raise TypeError("expected a beacon from beacon_start")
    if obj.owner != os.getpid() and not obj.stopped:  # a forked child's copy: stopped
        obj.stopped = True
        obj.cond = threading.Condition()  # (the parent's thread may have held the old one)
        obj.targets.clear()
        obj.peers.clear()
        obj.sock = None
    return obj


def beacon_start(period_s: float, hold_s: float) -> Beacon:
    """Start a liveness thread that, every ``period_s``, stores a growing count into its target
    words while the loop touched it within ``hold_s`` (0: always)."""
    return Beacon(_seconds(period_s, "period_s", 0.001), _seconds(hold_s, "hold_s", 0.0))


def beacon_add(beacon: object, key: int, target: tuple[Buffer, int]) -> None:
    """Count into the u64 at ``offset`` of the writable ``buf`` too (``target`` is
    ``(buf, offset)``), replacing the target of the same key."""
    b = _beacon(beacon)
    buf, offset = target
    if b.stopped:
        raise ValueError("the beacon is stopped")
    view = memoryview(buf).cast("B")
    if view.readonly:
        view.release()
        raise BufferError("Object is not writable.")
    if not 0 <= offset <= len(view) - WORD:
        n = len(view)
        view.release()
        raise IndexError(f"word at offset {offset} is outside a buffer of {n} bytes")
    with b.cond:
        view[offset : offset + WORD] = b.count.to_bytes(WORD, "little")
        old = b.targets.pop(key, None)
        b.peers.pop(key, None)
        b.targets[key] = (view, offset)
    if old is not None:
        old[0].release()


def beacon_add_peer(beacon: object, key: int, host: object, port: int) -> None:
    """Send each count to the UDP address (a numeric IPv4 or IPv6 ``host``) too, replacing the
    target of the same key."""
    b = _beacon(beacon)
    if not isinstance(host, str):
        raise TypeError("host must be a str (a numeric IPv4 or IPv6 address)")
    if not 1 <= port <= 65535:
        raise ValueError("port must be an int from 1 to 65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host {host!r} is not a numeric IPv4 or IPv6 address") from None
    if b.stopped:
        raise ValueError("the beacon is stopped")
    with b.cond:
        old = b.targets.pop(key, None)
        b.peers[key] = (host, port)
    if old is not None:
        old[0].release()


def _fd(obj: object) -> int:
    """A file descriptor as the C API's ``PyObject_AsFileDescriptor`` takes it."""
    if isinstance(obj, int):
        num = obj
    elif hasattr(obj, "fileno"):
        num = obj.fileno()
        if not isinstance(num, int):
            raise TypeError("fileno() returned a non-integer")
    else:
        raise TypeError("argument must be an int, or have a fileno() method.")
    if num < 0:
        raise ValueError(f"file descriptor cannot be a negative integer ({num})")
    return num


def beacon_udp(beacon: object, fd: object, sender: int, epoch: int, key: object) -> None:
    """Send the peers' datagrams on the UDP socket ``fd`` (an int or an object with
    ``fileno()``): magic, 0, sender, epoch, view, count and their SipHash-2-4 under the 16-byte
    ``key``."""
    b = _beacon(beacon)
    num = _fd(fd)
    for name, v in (("sender", sender), ("epoch", epoch)):
        if not isinstance(v, int) or not 0 <= v < 1 << 64:
            raise ValueError(f"{name} must be an int in [0, 2**64)")
    raw = bytes(memoryview(key).cast("B"))  # type: ignore[arg-type]
    if len(raw) != 16:
        raise ValueError("key must be 16 bytes")
    if b.stopped:
        return
    sock = socket.socket(fileno=socket.dup(num))
    with b.cond:
        old, b.sock = b.sock, sock
        b.ident = (sender, epoch, raw)
    if old is not None:
        old.close()


def beacon_set_view(beacon: object, view: int) -> None:
    """The view id the datagrams carry from now on."""
    b = _beacon(beacon)
    if not isinstance(view, int) or not 0 <= view < 1 << 64:
        raise ValueError("view must be an int in [0, 2**64)")
    if b.stopped:
        return
    with b.cond:
        b.view = view


def beacon_remove(beacon: object, key: int) -> bool:
    """Stop counting into ``key``'s word (and unpin its buffer) or sending to ``key``'s peer;
    whether it was there."""
    b = _beacon(beacon)
    with b.cond:
        gone = b.targets.pop(key, None)
        peer = b.peers.pop(key, None)
    if gone is None:
        return peer is not None
    gone[0].release()
    return True


def beacon_touch(beacon: object) -> None:
    """The loop runs (the hold limit counts from now)."""
    _beacon(beacon).touched = time.monotonic()


def beacon_count(beacon: object) -> int:
    """The count last stored."""
    b = _beacon(beacon)
    with b.cond:
        return b.count


def beacon_stop(beacon: object) -> None:
    """End the thread and unpin every buffer (idempotent)."""
    b = _beacon(beacon)
    with b.cond:
        b.stopped = True
        b.cond.notify_all()
    if b.thread.is_alive() and b.thread is not threading.current_thread():
        b.thread.join()
    with b.cond:
        views = [v for v, _ in b.targets.values()]
        b.targets.clear()
        b.peers.clear()
        sock, b.sock = b.sock, None
    for v in views:
        v.release()
    if sock is not None:
        sock.close()
