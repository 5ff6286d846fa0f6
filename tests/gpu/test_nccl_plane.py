"""The NCCL plane on GPUs (marker ``gpu``): ``pytest -m gpu tests/gpu/test_nccl_plane.py``.

NCCL refuses two ranks on one GPU, so the group tests need one GPU per member and skip, with
that reason, where fewer are visible. On one GPU the plane itself is driven directly: a one-rank
communicator made by its setup code, broadcasts on it, aborts through its view-change path, and
a setup whose other rank never joins (no hang).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import derecho_async as da
from derecho_async.core import View, ViewInstalled
from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.dataplane import OutOfBand
from derecho_async.runtime.gpu.descriptor import BROADCAST, ArraySpec, Descriptor
from derecho_async.wire import envelope as env

pytestmark = pytest.mark.gpu


def _need_nccl(gpus: int = 1) -> int:
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # ImportError, CUDA driver errors
        pytest.skip(f"CuPy with a CUDA device is needed: {exc}")
    from derecho_async.runtime.gpu.selection import nccl_unavailable

    why = nccl_unavailable()
    if why is not None:
        pytest.skip(f"NCCL is not usable here: {why}")
    try:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA device")
    except ImportError:
        pytest.skip("torch is not installed")
    if count < gpus:
        pytest.skip(f"needs {gpus} GPUs: NCCL refuses two ranks on one GPU ({count} visible)")
    return count


# -- one GPU: the plane driven directly ----------------------------------------------------------
class _Probe:
    """What a plane sends, lands and suspects, for a test to look at."""

    def __init__(self) -> None:
        self.frames: list[tuple[int, list[Any]]] = []
        self.landed: list[tuple[tuple[int, int, int], Any]] = []
        self.suspected: list[tuple[int, str]] = []

    def send(self, dst: int, frame: bytes) -> None:
        self.frames.append((dst, env.decode(frame)))

    def land(self, key: tuple[int, int, int], payload: object) -> None:
        self.landed.append((key, payload))

    def suspect(self, member: int, why: str) -> None:
        self.suspected.append((member, why))


def _installed(view_id: int, members: tuple[int, ...]) -> ViewInstalled:
    return ViewInstalled(View(view_id, members), (), (), True)


async def _until(cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


async def test_one_rank_communicator_broadcasts_and_is_aborted_at_the_next_view() -> None:
    _need_nccl()
    import cupy
    import numpy
    import torch

    from derecho_async.runtime.gpu.nccl import NcclPlane

    probe = _Probe()
    plane = NcclPlane(0, lambda members: [(members, members)], probe.send, probe.land,
                      probe.suspect, min_ranks=1)
    try:
        plane.on_event(_installed(1, (0,)))
        await _until(lambda: plane.stats()["ready"] == 1, "the one-rank communicator")
        comm = plane.communicator(0)
        assert comm is not None and comm.handle.size() == 1 and comm.handle.rank_id() == 0

        # sending: an in-place broadcast per device array, held until delivered and broadcast
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        t = torch.ones(1000, device="cuda")
        assert plane.start((1, 0, 0), OutOfBand(b"call", (x, t, numpy.arange(3))), ())
        assert plane.stats()["sending"] == 1 and plane.stats()["sent"] == 1
        plane.on_own_delivered((1, 0, 0))
        await _until(lambda: plane.stats()["sending"] == 0, "the send to be released")
        assert float(x[-1]) == float((1 << 20) - 1)  # in place on the root: unchanged

        # receiving: a validated descriptor, arrays allocated here, landed once complete
        body = Descriptor(b"call", -1, (
            ArraySpec("cupy", "float32", (16, 16), 1024, BROADCAST),
            ArraySpec("torch", "float16", (8,), 16, BROADCAST),
            ArraySpec("numpy", "int32", (2,), 8, inline=b"\x01\0\0\0\x02\0\0\0"),
        )).encode()
        frame = env.encode(env.NCCL_DATA, 1, 0, 7, 0, 0, body)
        plane.receive(0, env.decode(frame), frame)
        await _until(lambda: probe.landed, "the broadcast to land")
        key, payload = probe.landed[0]
        assert key == (1, 0, 7) and isinstance(payload, OutOfBand)
        a, b, c = payload.arrays
        assert isinstance(a, cupy.ndarray) and a.shape == (16, 16) and a.dtype == cupy.float32
        assert isinstance(b, torch.Tensor) and b.is_cuda and b.dtype == torch.float16
        assert isinstance(c, numpy.ndarray) and c.tolist() == [1, 2]
        with pytest.raises(ProtocolViolation, match="arrived where 1 was due"):
            plane.receive(0, env.decode(frame), frame)  # the same sequence number again

        # a new view aborts the old view's communicator and builds its own
        plane.on_event(_installed(2, (0,)))
        assert comm.state == "aborted" and comm.handle is None and plane.stats()["aborted"] == 1
        await _until(lambda: plane.stats()["ready"] == 1, "view 2's communicator")
        assert plane.communicator(0) is not comm
        assert not probe.suspected
    finally:
        plane.close()
    assert plane.stats()["aborted"] == 2


async def test_a_rank_that_never_joins_costs_a_parked_thread_not_a_hang() -> None:
    """View (99, 0) where member 99 does not exist: member 0 sends its unique id, waits 2 s
    for 99's, marks that communicator failed, and blocks joining its own (rank 1 never
    comes). Its sends take another plane; a descriptor from 99 is refused; the next view
    comes up regardless, and closing does not wait for the parked join."""
    _need_nccl()
    import cupy

    from derecho_async.runtime.gpu.nccl import NcclPlane

    probe = _Probe()
    plane = NcclPlane(0, lambda members: [(members, members)], probe.send, probe.land,
                      probe.suspect, min_ranks=1, setup_s=2.0)
    try:
        plane.on_event(_installed(1, (99, 0)))
        await _until(lambda: probe.frames, "member 0's unique id to go out")
        (dst, msg), = probe.frames
        assert dst == 99 and msg[:3] == [env.NCCL_UID, 1, 0] and len(msg[3]) == 128
        theirs = plane.communicator(99)
        assert theirs is not None
        await _until(lambda: theirs.state == "failed", "the missing unique id to time out", 30)
        assert plane.start((1, 0, 0), OutOfBand(b"c", (cupy.zeros(4),)), (99,)) is False
        body = Descriptor(b"c", -1, (ArraySpec("cupy", "float32", (4,), 16, BROADCAST),)).encode()
        frame = env.encode(env.NCCL_DATA, 1, 99, 3, 0, 0, body)
        with pytest.raises(ProtocolViolation, match="failed here"):
            plane.receive(99, env.decode(frame), frame)
        mine = plane.communicator(0)
        assert mine is not None and mine.state == "setup"  # parked in ncclCommInitRank

        plane.on_event(_installed(2, (0,)))
        assert mine.state == "aborted"
        await _until(lambda: plane.stats()["ready"] == 1,
                     "view 2's communicator, beside the parked join")
    finally:
        plane.close()


def test_members_sharing_a_gpu_fall_back_from_nccl_to_cuda_ipc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu_plane="nccl" with three members on one GPU: NCCL refuses every communicator
    (duplicate GPU), nothing hangs, and every message takes the CUDA IPC plane in total order."""
    _need_nccl()
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    monkeypatch.setenv("DA_GPU_COUNT", "20")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)  # all three on one GPU
    codes = da.launch_local(3, gpu_apps.sends_device_arrays, gpu_plane="nccl",
                            group=f"ncclshared{os.getpid()}", timeout=180)
    assert codes == [0, 0, 0]
    results = [json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(3)]
    assert all(r["plane"] for r in results), "the CUDA IPC plane did not run beside NCCL"
    assert len({r["digest"] for r in results}) == 1, "members saw different sequences"
    assert all(r["seen"] == 3 * (20 + gpu_apps.SENT_BESIDE_COUNT) for r in results)
    for r in results:
        assert r["nccl"]["communicators"] == 3, r["nccl"]
        assert r["nccl"]["sent"] == 0 and r["nccl"]["received"] == 0, r["nccl"]
        assert r["nccl"]["ready"] == 0, r["nccl"]


# -- one member per GPU: real groups -------------------------------------------------------------
@pytest.mark.parametrize("members", [2, 4, 8])
def test_cupy_and_torch_over_nccl_in_total_order_one_member_per_gpu(
    members: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_nccl(members)
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    monkeypatch.setenv("DA_GPU_COUNT", "20")
    codes = da.launch_local(members, gpu_apps.nccl_sends_device_arrays, gpu_plane="nccl",
                            group=f"nccl{os.getpid()}-{members}", timeout=240)
    assert codes == [0] * members
    results = [json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(members)]
    assert sorted(r["device"] for r in results) == list(range(members))
    assert len({r["digest"] for r in results}) == 1, "members saw different sequences"
    assert all(r["seen"] == members * 21 for r in results)
    expected = sum(256 * 256 * float(m * 1000 + i) for m in range(members) for i in range(20))
    assert all(abs(r["total"] - expected) / expected < 1e-6 for r in results)
    for r in results:  # every message of every other member came by broadcast
        assert r["nccl"]["sent"] == 21, r["nccl"]
        assert r["nccl"]["received"] == (members - 1) * 21, r["nccl"]
        assert r["nccl"]["communicators"] == members and r["nccl"]["failed"] == 0


@pytest.mark.parametrize("members", [2, 3, 4])
def test_member_sigkilled_mid_nccl_transfer_aborts_and_survivors_agree(
    members: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last member streams 64 MiB arrays over NCCL and SIGKILLs itself mid-stream: the
    survivors abort the old view's communicators (no kernel left waiting on it), install a view
    without it, deliver the same sequence, and keep working (over new communicators)."""
    _need_nccl(members)
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    extra = {"partition_safety": False} if members == 2 else {}  # one survivor of two
    codes = da.launch_local(members, gpu_apps.nccl_killed_mid_transfer, gpu_plane="nccl",
                            group=f"ncclkill{os.getpid()}-{members}", timeout=180, **extra)
    assert codes[:-1] == [0] * (members - 1) and codes[-1] == -9, codes
    results = [json.loads((tmp_path / f"member{m}.json").read_text())
               for m in range(members - 1)]
    assert len({r["digest"] for r in results}) == 1, "survivors delivered different sequences"
    assert all(r["bad"] == 0 for r in results), "a delivered array held the wrong bytes"
    assert 2 <= results[0]["victim_msgs"] <= 6
    assert all(r["nccl"]["aborted"] >= members for r in results)
    if members >= 3:  # the survivors' calls once the new communicators were up went by NCCL
        assert all(r["nccl"]["received_this_view"] >= members - 2 for r in results), results
    print("victim messages delivered:", results[0]["victim_msgs"], "of the 6 it sent")
