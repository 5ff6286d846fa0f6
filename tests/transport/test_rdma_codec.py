"""The rdma connect codec without a device: CONNECT info (its round trip, every field
out of range, garbage) and RESET messages."""

from __future__ import annotations

from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from derecho_async.transport.rdma.codec import (
    CHAN,
    MAX_BULK_BLOCK,
    MAX_BULK_SLOTS,
    MIN_BULK_BLOCK,
    MIN_INBOX,
    PROTOCOL_VERSION,
    ConnectInfo,
    Malformed,
    decode_reset,
    encode_reset,
)


def _info(**over: Any) -> ConnectInfo:
    base: dict[str, Any] = dict(
        ep=7,
        dst=0,
        qpn=17,
        psn=12345,
        gid=bytes(10) + b"\xff\xff\xc0\x00\x02\x01",
        lid=0,
        mtu=5,
        ethernet=True,
        addr=0x7F00_0000_1000,
        rkey=0x1234,
        size=64 << 10,
    )
    base.update(over)
    return ConnectInfo(**base)


def test_connect_info_round_trip() -> None:
    info = _info(dst=99)
    assert ConnectInfo.decode(info.encode()) == info
    bulk = _info(baddr=0x7F00_2000_0000, brkey=77, bblock=1 << 20, bslots=8, bmax=1 << 30)
    assert ConnectInfo.decode(bulk.encode()) == bulk


@pytest.mark.parametrize(
    "bad",
    [
        {"ep": 0},
        {"ep": -5},
        {"qpn": 0},
        {"qpn": 1 << 24},
        {"psn": 1 << 24},
        {"gid": b"short"},
        {"gid": "x" * 16},
        {"mtu": 0},
        {"mtu": 6},
        {"ethernet": 1},
        {"addr": 0},
        {"addr": (1 << 64) - 4096},  # range overflows
        {"rkey": 1 << 32},
        {"rkey": -1},
        {"size": MIN_INBOX - 8},
        {"size": (1 << 30) + 8},
        {"size": (64 << 10) + 4},
        {"lid": True},
        {"bslots": MAX_BULK_SLOTS + 1},
        {"bslots": 4, "bblock": 0},
        {"bslots": 4, "bblock": MIN_BULK_BLOCK + 4},
        {"bslots": 4, "bblock": MAX_BULK_BLOCK + 8},
        {"bslots": 1024, "bblock": 1 << 20},  # region too large
        {"bslots": 4, "baddr": 0},
        {"bslots": 4, "baddr": (1 << 64) - 4096},  # range overflows
        {"bslots": 4, "brkey": 1 << 32},
        {"bslots": 4, "bmax": 0},
        {"bslots": 4, "bmax": True},
        {"bslots": 0, "baddr": 4096},  # no region, yet an address
        {"bslots": -1},
    ],
)
def test_connect_info_rejects_bad_fields(bad: dict[str, Any]) -> None:
    fields = dict(
        _info(bslots=4, bblock=1 << 20, baddr=0x7F00_1000_0000, brkey=9, bmax=1 << 30).__dict__
    )
    if bad.get("bslots") == 0:
        fields.update(bblock=0, baddr=0, brkey=0, bmax=0)
    fields.update(bad)
    raw = msgpack.packb(
        {
            "v": PROTOCOL_VERSION,
            "baddr": fields["baddr"],
            "brkey": fields["brkey"],
            "bblock": fields["bblock"],
            "bslots": fields["bslots"],
            "bmax": fields["bmax"],
            "ep": fields["ep"],
            "dst": fields["dst"],
            "qpn": fields["qpn"],
            "psn": fields["psn"],
            "gid": fields["gid"],
            "lid": fields["lid"],
            "mtu": fields["mtu"],
            "eth": fields["ethernet"],
            "addr": fields["addr"],
            "rkey": fields["rkey"],
            "size": fields["size"],
        }
    )
    with pytest.raises(Malformed):
        ConnectInfo.decode(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 2}),
        msgpack.packb({"v": 1}),
        b"\x00" * 2000,
    ],
)
def test_connect_info_rejects_garbage(raw: bytes) -> None:
    with pytest.raises(Malformed):
        ConnectInfo.decode(raw)


def test_reset_messages() -> None:
    msg = encode_reset(5, 6, "why" * 1000, False)
    kind, ep, count = CHAN.unpack_from(msg)
    assert (kind, ep, count) == (3, 5, 0)
    dst, why, graceful = decode_reset(msg[CHAN.size :])
    assert dst == 6 and len(why) <= 512 and graceful is False
    for body in (b"", msgpack.packb({"dst": -1, "why": "", "graceful": True}), b"\x93"):
        with pytest.raises(Malformed):
            decode_reset(body)
