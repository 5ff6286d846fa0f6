# Theory of operation
# -------------------
# What one work completion of an endpoint's CQ means, pure: :func:`classify_wc` turns status,
# opcode, wr_id, immediate value and flags into a :class:`WcEvent` (a send done, a doorbell, a
# credit return, a no-op, a flushed request or an error with its verbs name), using the verbs
# constants gathered in :class:`WcCodes`. See docs/DESIGN.md §5.4 (completions).
"""The rdma completion codes: classify work completions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from derecho_async.transport.rdma.rings import IMM_CREDIT, IMM_FLAG, IMM_MASK

__all__ = ["RECV_WR", "WcCodes", "WcEvent", "classify_wc"]

RECV_WR = 1 << 63  # wr_id bit of posted receives


@dataclass(frozen=True)
class WcCodes:
    """The verbs constants completion handling needs (from pyverbs, or fakes in tests)."""

    success: int
    flush_err: int
    op_recv: int
    op_recv_rdma_imm: int
    with_imm: int
    names: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def from_enums(cls, e: Any) -> WcCodes:
        names = {}
        for n in dir(e):
            if (n.startswith("IBV_WC_") and n.endswith("_ERR")) or n == "IBV_WC_SUCCESS":
                names[int(getattr(e, n))] = n
        return cls(
            success=int(e.IBV_WC_SUCCESS),
            flush_err=int(e.IBV_WC_WR_FLUSH_ERR),
            op_recv=int(e.IBV_WC_RECV),
            op_recv_rdma_imm=int(e.IBV_WC_RECV_RDMA_WITH_IMM),
            with_imm=int(e.IBV_WC_WITH_IMM),
            names=names,
        )


@dataclass(frozen=True)
class WcEvent:
    """What one completion means. kind: send_done, doorbell, credit, noop, flushed, error."""

    kind: str
    wr_id: int = 0
    units: int = 0
    flag: bool = False
    detail: str = ""


def classify_wc(
    codes: WcCodes, *, status: int, opcode: int, wr_id: int, imm: int, byte_len: int, flags: int
) -> WcEvent:
    """Decode one work completion. ``imm`` is in host order (already ``ntohl``-ed)."""
    is_recv = bool(wr_id & RECV_WR)
    if status != codes.success:
        if status == codes.flush_err:
            return WcEvent("flushed", wr_id)
        name = codes.names.get(status, f"status {status}")
        side = "receive" if is_recv else "send"
        return WcEvent("error", wr_id, detail=f"{side} completion error {name}")
    if not is_recv:
        return WcEvent("send_done", wr_id)
    if not flags & codes.with_imm:
        return WcEvent("error", wr_id, detail="receive completion without immediate data")
    if opcode == codes.op_recv_rdma_imm:
        if imm & IMM_CREDIT:
            return WcEvent("error", wr_id, detail="RDMA write carrying a credit value")
        return WcEvent("doorbell", wr_id, units=imm & IMM_MASK, flag=bool(imm & IMM_FLAG))
    if opcode == codes.op_recv:
        if byte_len:
            return WcEvent("error", wr_id, detail=f"unexpected SEND of {byte_len} bytes")
        if not imm & IMM_CREDIT:
            return WcEvent("error", wr_id, detail="SEND carrying a doorbell value")
        if imm & IMM_FLAG:
            return WcEvent("noop", wr_id)
        return WcEvent("credit", wr_id, units=imm & IMM_MASK)
    return WcEvent("error", wr_id, detail=f"unexpected receive opcode {opcode}")
