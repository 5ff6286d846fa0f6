"""The tcp transport's beacon: liveness datagrams from a native thread, over UDP.

Theory of operation (DESIGN.md §4.4, §5.3): each member binds a UDP socket beside its tcp
listener and starts a beacon thread (``hotpath.beacon_start``) that, every period, sends each
peer a 48-byte datagram (magic, sender, epoch, view, count) signed with SipHash-2-4 under a key
this process drew at random. The key, the epoch and the UDP port travel to each peer in a
BEACON frame on the authenticated stream, so only a peer's own process can sign its beacons,
and the count must grow within one epoch, so a replayed datagram proves nothing. A datagram
counts only if its view is the receiver's own: a member that was removed (its peers gone on to
a view without it) must suspect them and wedge as without beacons, not wait on them. Datagrams
wait in the socket's buffer and are read at each tick (no wake-up of their own: an idle group
pays nothing for them); their senders are handed to the core as signs of life. Everything about a datagram is checked (length, magic, the view, a known sender, its
epoch, a growing count, its MAC) before it counts, and nothing is held per datagram: a stranger
can make us read (at most 256 a tick), not keep.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from derecho_async import hotpath
from derecho_async.transport.base import log

__all__ = ["ANNOUNCE", "DGRAM", "DGRAM_MAGIC", "SIGNED", "UdpBeacon"]

DGRAM = struct.Struct("<IIQQQQQ")  # magic, zero, sender, epoch, view, count, SipHash of the 40
SIGNED = 40  # the bytes the MAC covers
DGRAM_MAGIC = 0x31624144  # "DAb1"
ANNOUNCE = struct.Struct("<QQ16s")  # udp port, epoch, key: a BEACON frame's payload
_READS_PER_TICK = 256


class _Peer:
    __slots__ = ("count", "epoch", "key")

    def __init__(self, epoch: int, key: bytes) -> None:
        self.epoch = epoch
        self.key = key
        self.count = 0


class UdpBeacon:
    """One member's beacon over UDP: the socket, the thread and what peers announced."""

    def __init__(self, member_id: int, period_s: float, hold_s: float) -> None:
        self.member_id = member_id
        self.period_s = period_s
        self.hold_s = hold_s
        self.key = os.urandom(16)
        self.epoch = time.time_ns()
        self.port = 0
        self._sock: socket.socket | None = None
        self._handle: object | None = None
        self._peers: dict[int, _Peer] = {}
        self._moved: set[int] = set()
        self.view = 0  # my view: the one datagrams carry, and the only one counted

    def start(self, family: int, host: str, port: int) -> None:
        """Bind the UDP socket to ``host`` (``port`` if free, else any) and start the thread."""
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            try:
                sock.bind((host, port))
            except OSError:
                sock.bind((host, 0))
            self.port = int(sock.getsockname()[1])
            handle = hotpath.beacon_start(self.period_s, self.hold_s)
            hotpath.beacon_udp(handle, sock, self.member_id, self.epoch, self.key)
        except BaseException:
            sock.close()
            raise
        self._sock, self._handle = sock, handle

    def close(self) -> None:
        """Stop the thread, then close the socket (the thread sends on its descriptor)."""
        if self._handle is not None:
            hotpath.beacon_stop(self._handle)
            self._handle = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._peers.clear()

    def set_view(self, view_id: int) -> None:
        """I installed ``view_id``: my datagrams say so, and only peers' datagrams of it
        count."""
        if view_id <= self.view and self.view:
            return
        self.view = view_id
        self._moved.clear()  # (heard in the view before: no sign of life in this one)
        if self._handle is not None:
            hotpath.beacon_set_view(self._handle, view_id)

    def announcement(self) -> bytes:
        """The BEACON frame's payload for a peer: my UDP port, epoch and key."""
        return ANNOUNCE.pack(self.port, self.epoch, self.key)

    def announced(self, peer: int, host: str, payload: bytes) -> str | None:
        """``peer`` sent its BEACON frame on its stream from ``host``: check it, verify its
        datagrams from now on and send it mine. What is wrong with it, else None."""
        if len(payload) != ANNOUNCE.size:
            return f"beacon frame of {len(payload)} bytes"
        port, epoch, key = ANNOUNCE.unpack(payload)
        if not 1 <= port <= 65535:
            return f"beacon port {port}"
        if self._handle is None:
            return None
        known = self._peers.get(peer)
        if known is None or known.epoch != epoch or known.key != key:
            self._peers[peer] = _Peer(epoch, key)
        try:
            hotpath.beacon_add_peer(self._handle, peer, host.partition("%")[0], port)
        except ValueError as exc:  # not a numeric address: its beacons cannot reach us
            log.debug("member %d: no beacon to member %d: %s", self.member_id, peer, exc)
        return None

    def forget(self, peer: int) -> None:
        """``peer`` is gone for good: no more datagrams either way."""
        self._peers.pop(peer, None)
        self._moved.discard(peer)
        if self._handle is not None:
            hotpath.beacon_remove(self._handle, peer)

    def tick(self) -> list[int]:
        """The loop runs (the thread keeps beating for ``hold_s`` from now); the peers whose
        beacon arrived since the last call."""
        if self._handle is not None:
            hotpath.beacon_touch(self._handle)
        self._read()
        moved = sorted(self._moved)
        self._moved.clear()
        return moved

    def _read(self) -> None:
        """Check the datagrams waiting in the socket (a bounded number per tick: the rest wait
        for the next, or the kernel drops them when its buffer is full, and a later beacon of
        the same peer says the same)."""
        sock = self._sock
        if sock is None:
            return
        for _ in range(_READS_PER_TICK):
            try:
                data = sock.recv(DGRAM.size + 1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # an ICMP error of an earlier send: nothing to read here
                continue
            self._check(data)

    def _check(self, data: bytes) -> None:
        if len(data) != DGRAM.size:
            return
        magic, zero, sender, epoch, view, count, mac = DGRAM.unpack(data)
        if magic != DGRAM_MAGIC or zero or view != self.view:
            return
        peer = self._peers.get(sender)
        if peer is None or epoch != peer.epoch or count <= peer.count:
            return
        if hotpath.siphash24(peer.key, data[:SIGNED]) != mac:
            return
        peer.count = count
        self._moved.add(sender)
