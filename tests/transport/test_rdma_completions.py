"""The rdma completion codes without a device: each work completion classified, and the
codes read from an enum module."""

from __future__ import annotations

import types
from typing import Any

import pytest

from derecho_async.transport.rdma.completions import WcCodes, classify_wc
from derecho_async.transport.rdma.rings import IMM_NOOP, imm_credit, imm_doorbell

CODES = WcCodes(
    success=0,
    flush_err=5,
    op_recv=128,
    op_recv_rdma_imm=129,
    with_imm=2,
    names={0: "IBV_WC_SUCCESS", 5: "IBV_WC_WR_FLUSH_ERR", 12: "IBV_WC_RETRY_EXC_ERR"},
)
RECV = 1 << 63


@pytest.mark.parametrize(
    "wc,kind,extra",
    [
        (dict(status=0, opcode=1, wr_id=7, imm=0, byte_len=0, flags=0), "send_done", {}),
        (dict(status=12, opcode=0, wr_id=7, imm=0, byte_len=0, flags=0), "error", {}),
        (dict(status=5, opcode=0, wr_id=RECV | 3, imm=0, byte_len=0, flags=0), "flushed", {}),
        (
            dict(status=0, opcode=129, wr_id=RECV, imm=imm_doorbell(80, True), byte_len=0, flags=2),
            "doorbell",
            {"units": 10, "flag": True},
        ),
        (
            dict(status=0, opcode=128, wr_id=RECV, imm=imm_credit(64), byte_len=0, flags=3),
            "credit",
            {"units": 8},
        ),
        (dict(status=0, opcode=128, wr_id=RECV, imm=IMM_NOOP, byte_len=0, flags=2), "noop", {}),
        (dict(status=0, opcode=129, wr_id=RECV, imm=0, byte_len=0, flags=0), "error", {}),
        (
            dict(status=0, opcode=129, wr_id=RECV, imm=imm_credit(8), byte_len=0, flags=2),
            "error",
            {},
        ),
        (
            dict(status=0, opcode=128, wr_id=RECV, imm=imm_credit(8), byte_len=4, flags=2),
            "error",
            {},
        ),
        (dict(status=0, opcode=128, wr_id=RECV, imm=8, byte_len=0, flags=2), "error", {}),
        (dict(status=0, opcode=130, wr_id=RECV, imm=8, byte_len=0, flags=2), "error", {}),
    ],
)
def test_completion_classification(wc: dict[str, int], kind: str, extra: dict[str, Any]) -> None:
    ev = classify_wc(CODES, **wc)
    assert ev.kind == kind, ev
    for k, v in extra.items():
        assert getattr(ev, k) == v
    if wc["status"] == 12:
        assert "RETRY_EXC" in ev.detail and "send" in ev.detail


def test_completion_codes_from_an_enum_module() -> None:
    e = types.SimpleNamespace(
        IBV_WC_SUCCESS=0,
        IBV_WC_WR_FLUSH_ERR=5,
        IBV_WC_RETRY_EXC_ERR=12,
        IBV_WC_RECV=128,
        IBV_WC_RECV_RDMA_WITH_IMM=129,
        IBV_WC_WITH_IMM=2,
    )
    codes = WcCodes.from_enums(e)
    assert codes.names[12] == "IBV_WC_RETRY_EXC_ERR" and codes.op_recv_rdma_imm == 129
