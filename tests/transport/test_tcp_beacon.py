"""The tcp transport's beacon (derecho_async/transport/tcp/beacon.py) over real UDP sockets:
datagrams signed by a peer's announced key count as signs of life; forged, replayed, foreign,
truncated, stale or other views' ones do not, and a bad BEACON frame is refused."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from derecho_async import hotpath
from derecho_async.transport.tcp.beacon import ANNOUNCE, DGRAM, DGRAM_MAGIC, SIGNED, UdpBeacon
from derecho_async.transport.tcp.framing import F_BEACON, check_header


async def _pair(period: float = 0.01) -> tuple[UdpBeacon, UdpBeacon]:
    a, b = UdpBeacon(1, period, 0), UdpBeacon(2, period, 0)
    a.start(socket.AF_INET, "127.0.0.1", 0)
    b.start(socket.AF_INET, "127.0.0.1", 0)
    return a, b


async def _heard(beacon: UdpBeacon, within: float) -> list[int]:
    seen: set[int] = set()
    end = time.monotonic() + within
    while time.monotonic() < end:
        await asyncio.sleep(0.01)
        seen.update(beacon.tick())
    return sorted(seen)


def _signed(key: bytes, sender: int, epoch: int, count: int, view: int = 0) -> bytes:
    body = DGRAM.pack(DGRAM_MAGIC, 0, sender, epoch, view, count, 0)[:SIGNED]
    return body + hotpath.siphash24(key, body).to_bytes(8, "little")


async def test_announced_peers_hear_each_other() -> None:
    a, b = await _pair()
    try:
        assert await _heard(b, 0.1) == []  # nothing announced yet: nothing counts
        assert b.announced(1, "127.0.0.1", a.announcement()) is None
        assert a.announced(2, "127.0.0.1", b.announcement()) is None
        assert await _heard(b, 0.2) == [1]
        assert await _heard(a, 0.2) == [2]
        b.forget(1)
        await asyncio.sleep(0.05)
        assert await _heard(b, 0.1) == []
    finally:
        a.close()
        b.close()


async def test_forged_replayed_and_foreign_datagrams_do_not_count() -> None:
    a, b = await _pair(period=3600)  # a's own thread stays quiet after its first beat
    try:
        b.announced(1, "127.0.0.1", a.announcement())
        await _heard(b, 0.05)  # whatever a's first beat brought
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dest = ("127.0.0.1", b.port)
        good = _signed(a.key, 1, a.epoch, 10)
        bad = [
            _signed(b"k" * 16, 1, a.epoch, 11),  # another key
            _signed(a.key, 1, a.epoch + 1, 12),  # another epoch
            _signed(a.key, 3, a.epoch, 13),  # a sender nobody announced
            good[:-1],  # truncated
            good + b"\0",  # too long
            bytes(8) + good[8:],  # no magic
            good[:SIGNED] + bytes(8),  # no MAC
            _signed(a.key, 1, a.epoch, 14, view=3),  # another view than the receiver's
        ]
        for d in bad:
            sock.sendto(d, dest)
        assert await _heard(b, 0.1) == []
        sock.sendto(good, dest)
        assert await _heard(b, 0.1) == [1]
        sock.sendto(good, dest)  # the same datagram again: a replay
        sock.sendto(_signed(a.key, 1, a.epoch, 9), dest)  # an older count
        assert await _heard(b, 0.1) == []
        sock.close()
    finally:
        a.close()
        b.close()


async def test_the_thread_stops_beating_once_the_loop_is_held_past_its_limit() -> None:
    a, b = UdpBeacon(1, 0.01, 0.1), UdpBeacon(2, 0.01, 0)
    a.start(socket.AF_INET, "127.0.0.1", 0)
    b.start(socket.AF_INET, "127.0.0.1", 0)
    try:
        b.announced(1, "127.0.0.1", a.announcement())
        a.announced(2, "127.0.0.1", b.announcement())
        a.tick()
        assert await _heard(b, 0.05) == [1]
        await asyncio.sleep(0.2)  # a's loop "held": no a.tick() for twice its limit
        b.tick()
        assert await _heard(b, 0.15) == []
        a.tick()
        assert await _heard(b, 0.1) == [1]
    finally:
        a.close()
        b.close()


def test_announcements_and_frames_are_checked() -> None:
    b = UdpBeacon(2, 0.01, 0)
    assert b.announced(1, "127.0.0.1", b"short") == "beacon frame of 5 bytes"
    assert b.announced(1, "127.0.0.1", ANNOUNCE.pack(0, 1, bytes(16))) == "beacon port 0"
    assert check_header(F_BEACON, 0, 0, 0, 31, 1 << 20) == "beacon frame of 31 bytes"
    assert check_header(F_BEACON, 0, 1, 0, 32, 1 << 20) is not None  # view fields must be 0
    assert check_header(F_BEACON, 0, 0, 0, 32, 1 << 20) is None


@pytest.mark.parametrize("key", [bytes(15), bytes(17)])
def test_siphash_wants_a_16_byte_key(key: bytes) -> None:
    with pytest.raises(ValueError, match="key must be 16 bytes"):
        hotpath.siphash24(key, b"")


def test_siphash_matches_the_reference_vector() -> None:
    # the SipHash paper's test vector: key 00..0f, message 00..0e
    assert hotpath.siphash24(bytes(range(16)), bytes(range(15))) == 0xA129CA6149BE45E5
