# Theory of operation
# -------------------
# The control messages of the rdma transport, carried by its tcp channel: every payload there
# starts with the ``CHAN`` header (kind, endpoint id, count); CONNECT's body is a
# :class:`ConnectInfo` (what one endpoint grants its peer), RESET's says an endpoint is gone.
# Both are msgpack maps validated field by field on decode; nothing is unpickled or evaluated.
# See docs/DESIGN.md §5.4 (endpoints and the handshake).
"""The rdma connect codec: channel header, CONNECT (ConnectInfo) and RESET messages."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack  # type: ignore[import-untyped]

__all__ = [
    "CHAN",
    "K_CONNECT",
    "K_RESET",
    "K_USER",
    "MAX_BULK_BLOCK",
    "MAX_BULK_MESSAGE",
    "MAX_BULK_REGION",
    "MAX_BULK_SLOTS",
    "MAX_INBOX",
    "MIN_BULK_BLOCK",
    "MIN_INBOX",
    "PROTOCOL_VERSION",
    "ConnectInfo",
    "Malformed",
    "decode_reset",
    "encode_reset",
]

#: Channel message header: kind, endpoint id (0 = none), count (pushes before this message).
CHAN = struct.Struct("<BQQ")
K_USER, K_CONNECT, K_RESET = 1, 2, 3

_U64 = 1 << 64
MIN_INBOX = 16 << 10
MAX_INBOX = 64 << 20  # also bounds the mirror a peer's CONNECT makes us allocate
PROTOCOL_VERSION = 2
#: bounds on the bulk region a peer's CONNECT may describe (and make us mirror for staging)
MIN_BULK_BLOCK = 4 << 10
MAX_BULK_BLOCK = 64 << 20
MAX_BULK_SLOTS = 1024
MAX_BULK_REGION = 256 << 20
MAX_BULK_MESSAGE = 1 << 40
_MAX_CONNECT = 1024
_MAX_REASON = 512


class Malformed(Exception):
    """A control message failed validation."""


@dataclass(frozen=True)
class ConnectInfo:
    """What one endpoint tells its peer (and only that peer) to connect and write to it."""

    ep: int  # this endpoint's id, random, non-zero
    dst: int  # the peer endpoint it pairs with, 0 if none yet
    qpn: int
    psn: int
    gid: bytes
    lid: int
    mtu: int  # IBV_MTU_* enum value, 1..5
    ethernet: bool
    addr: int  # inbox address
    rkey: int  # inbox rkey (remote write, this peer only)
    size: int  # inbox bytes
    # bulk receive region (slots of ``bblock`` bytes; ``bslots == 0``: no bulk path)
    baddr: int = 0
    brkey: int = 0
    bblock: int = 0
    bslots: int = 0
    bmax: int = 0  # largest bulk message this endpoint accepts

    def encode(self) -> bytes:
        """msgpack map (validated again on decode)."""
        packed: bytes = msgpack.packb(
            {
                "v": PROTOCOL_VERSION,
                "ep": self.ep,
                "dst": self.dst,
                "qpn": self.qpn,
                "psn": self.psn,
                "gid": self.gid,
                "lid": self.lid,
                "mtu": self.mtu,
                "eth": self.ethernet,
                "addr": self.addr,
                "rkey": self.rkey,
                "size": self.size,
                "baddr": self.baddr,
                "brkey": self.brkey,
                "bblock": self.bblock,
                "bslots": self.bslots,
                "bmax": self.bmax,
            }
        )
        return packed

    @classmethod
    def decode(cls, raw: bytes) -> ConnectInfo:
        """Parse and validate; raises :class:`Malformed`."""
        if len(raw) > _MAX_CONNECT:
            raise Malformed(f"CONNECT of {len(raw)} bytes")
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=False)
        except Exception as exc:
            raise Malformed(f"undecodable CONNECT: {exc}") from exc
        if not isinstance(obj, dict):
            raise Malformed("CONNECT is not a map")
        if obj.get("v") != PROTOCOL_VERSION:
            raise Malformed(f"CONNECT version {obj.get('v')!r}, expected {PROTOCOL_VERSION}")

        def num(key: str, lo: int, hi: int) -> int:
            v = obj.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
                raise Malformed(f"CONNECT field {key!r} = {v!r} not in [{lo}, {hi})")
            return v

        gid = obj.get("gid")
        if not isinstance(gid, bytes) or len(gid) != 16:
            raise Malformed("CONNECT field 'gid' is not 16 bytes")
        eth = obj.get("eth")
        if not isinstance(eth, bool):
            raise Malformed("CONNECT field 'eth' is not a bool")
        size = num("size", MIN_INBOX, MAX_INBOX + 1)
        if size % 8:
            raise Malformed(f"inbox size {size} is not a multiple of 8")
        addr = num("addr", 1, _U64)
        if addr + size > _U64:
            raise Malformed("inbox address range overflows")
        bslots = num("bslots", 0, MAX_BULK_SLOTS + 1)
        if bslots:
            bblock = num("bblock", MIN_BULK_BLOCK, MAX_BULK_BLOCK + 1)
            if bblock % 8:
                raise Malformed(f"bulk block {bblock} is not a multiple of 8")
            if bblock * bslots > MAX_BULK_REGION:
                raise Malformed(f"bulk region of {bslots} x {bblock} bytes is too large")
            baddr = num("baddr", 1, _U64)
            if baddr + bblock * bslots > _U64:
                raise Malformed("bulk region address range overflows")
            brkey = num("brkey", 0, 1 << 32)
            bmax = num("bmax", 1, MAX_BULK_MESSAGE + 1)
        else:
            bblock = num("bblock", 0, 1)
            baddr = num("baddr", 0, 1)
            brkey = num("brkey", 0, 1)
            bmax = num("bmax", 0, 1)
        return cls(
            ep=num("ep", 1, _U64),
            dst=num("dst", 0, _U64),
            qpn=num("qpn", 1, 1 << 24),
            psn=num("psn", 0, 1 << 24),
            gid=gid,
            lid=num("lid", 0, 1 << 16),
            mtu=num("mtu", 1, 6),
            ethernet=eth,
            addr=addr,
            rkey=num("rkey", 0, 1 << 32),
            size=size,
            baddr=baddr,
            brkey=brkey,
            bblock=bblock,
            bslots=bslots,
            bmax=bmax,
        )


def encode_reset(ep: int, dst: int, why: str, graceful: bool) -> bytes:
    """RESET control message: endpoint ``ep`` (mine) paired with ``dst`` (yours) is gone."""
    body: bytes = msgpack.packb({"dst": dst, "why": why[:_MAX_REASON], "graceful": graceful})
    return CHAN.pack(K_RESET, ep, 0) + body


def decode_reset(body: bytes) -> tuple[int, str, bool]:
    """(dst, why, graceful) of a RESET body; raises :class:`Malformed`."""
    if len(body) > _MAX_CONNECT:
        raise Malformed("RESET too long")
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:
        raise Malformed(f"undecodable RESET: {exc}") from exc
    if not isinstance(obj, dict):
        raise Malformed("RESET is not a map")
    dst, why, graceful = obj.get("dst"), obj.get("why"), obj.get("graceful")
    if isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < _U64:
        raise Malformed("RESET dst")
    if not isinstance(why, str) or not isinstance(graceful, bool):
        raise Malformed("RESET why/graceful")
    return dst, why[:_MAX_REASON], graceful
