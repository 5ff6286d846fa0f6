"""Device arrays through ordered calls between real processes sharing a GPU (marker ``gpu``).

Run on the accelerator machine: ``pytest -m gpu tests/gpu``. Skipped, with the reason, where
CuPy, torch or a CUDA device is missing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

import derecho_async as da
from tests.gpu import need_cupy

pytestmark = pytest.mark.gpu


def _need_gpu() -> None:
    need_cupy()
    try:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA device")
    except ImportError:
        pytest.skip("torch is not installed")


@pytest.mark.parametrize("members", [2, 4, 8])
def test_cupy_and_torch_payloads_arrive_as_device_arrays_in_total_order(
    members: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_gpu()
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    monkeypatch.setenv("DA_GPU_COUNT", "20")
    codes = da.launch_local(members, gpu_apps.sends_device_arrays, group=f"gpu{os.getpid()}-{members}",
                            timeout=180)
    assert codes == [0] * members
    results = [json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(members)]
    assert all(r["plane"] for r in results), "device arrays did not take the CUDA IPC plane"
    assert len({r["digest"] for r in results}) == 1, "members saw different sequences"
    assert all(r["seen"] == members * (20 + gpu_apps.SENT_BESIDE_COUNT) for r in results)
    expected = sum(256 * 256 * float(m * 1000 + i) for m in range(members) for i in range(21))
    assert all(abs(r["total"] - expected) / expected < 1e-6 for r in results)


@pytest.mark.parametrize("busy_poll_us, count", [(None, 10000), (0.0, 2000)])
def test_device_pools_drain_after_ten_thousand_messages(
    busy_poll_us: float | None, count: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10,000 messages (half sent in place) over 3 members; then 2,000 with completions always
    noticed by the waiter threads (no busy polling) while handlers synchronize on the GPU."""
    _need_gpu()
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    monkeypatch.setenv("DA_GPU_COUNT", str(count))
    polling = {} if busy_poll_us is None else {"gpu_busy_poll_us": busy_poll_us}
    codes = da.launch_local(3, gpu_apps.pool_soak, group=f"gpusoak{os.getpid()}-{count}",
                            timeout=400, **polling)
    assert codes == [0, 0, 0]
    results = [json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(3)]
    assert len({r["digest"] for r in results}) == 1
    assert all(r["seen"] == count and r["bad"] == 0 for r in results)
    for r in results:
        assert r["stats"]["in_use_bytes"] == 0, r["stats"]
        assert r["stats"]["sending"] == 0, r["stats"]
        assert r["stats"]["segments"] == 1, r["stats"]  # reused, never grown


@pytest.mark.parametrize("members", [3, 4])
def test_sender_sigkilled_mid_transfer_leaves_survivors_consistent(
    members: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _need_gpu()
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    codes = da.launch_local(members, gpu_apps.killed_mid_transfer,
                            group=f"gpukill{os.getpid()}-{members}", timeout=120)
    assert codes[:-1] == [0] * (members - 1) and codes[-1] == -9, codes
    results = [json.loads((tmp_path / f"member{m}.json").read_text())
               for m in range(members - 1)]
    assert len({r["digest"] for r in results}) == 1, "survivors delivered different sequences"
    assert all(r["bad"] == 0 for r in results), "a delivered array held the wrong bytes"
    # the two calls it completed before the stream are delivered; the rest all-or-nothing
    assert 2 <= results[0]["victim_msgs"] <= 6
    print("victim messages delivered:", results[0]["victim_msgs"], "of the 6 it sent")


def test_a_member_that_cannot_make_a_received_array_leaves_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A completion whose landing raises (here an injected MemoryError in member 2's plane) must
    not hold the group up for good: that member leaves, saying why; the others keep delivering."""
    _need_gpu()
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    codes = da.launch_local(3, gpu_apps.landing_fails, group=f"gpuland{os.getpid()}", timeout=120)
    assert codes == [0, 0, 0], codes
    r0, r1, r2 = (json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(3))
    assert r0["digest"] == r1["digest"] and r0["seen"] == r1["seen"] == 6
    assert r0["bad"] == r1["bad"] == 0 and r0["members"] == r1["members"] == [0, 1]
    assert "could not land here" in r2["closed"] and "MemoryError" in r2["closed"], r2
    assert r2["seen"] == 2, r2


def _one_receiver_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        app: Callable[[da.Config], Coroutine[Any, Any, None]],
                        group: str) -> dict[str, Any]:
    """Run one of the apps of ``gpu_apps._a_receiver_fails``: the sender and the other receiver
    stay and deliver everything; returns what the failing member 2 wrote."""
    _need_gpu()
    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    codes = da.launch_local(3, app, group=f"{group}{os.getpid()}", timeout=120)
    assert codes == [0, 0, 0], codes
    r0, r1, r2 = (json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(3))
    assert r0["seen"] == r1["seen"] == [f"c{i}" for i in range(6)], (r0, r1)
    assert r0["bad"] == r1["bad"] == 0 and r0["members"] == r1["members"] == [0, 1]
    return dict(r2)


def test_a_receiver_that_cannot_take_pool_memory_leaves_and_the_sender_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA IPC plane: a receiver whose pool cannot hold an incoming copy (an injected
    MemoryError in member 2) is the one at fault: it leaves, saying why, and the sender is not
    blamed for it; the sender and the other receiver deliver everything."""
    from tests.gpu import gpu_apps

    r2 = _one_receiver_fails(tmp_path, monkeypatch, gpu_apps.ipc_receiver_cannot_allocate,
                             "gpualloc")
    assert "could not be taken in here" in r2["closed"] and "MemoryError" in r2["closed"], r2
    assert r2["seen"] == ["c0", "c1"], r2


def test_a_receiver_that_cannot_map_the_senders_pool_leaves_and_the_sender_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA IPC plane: when opening a sender's IPC handle fails for want of memory here
    (cudaErrorMemoryAllocation, injected in member 2), the receiver is at fault: it leaves,
    saying why, and the healthy sender is not removed; the others deliver everything."""
    from tests.gpu import gpu_apps

    r2 = _one_receiver_fails(tmp_path, monkeypatch, gpu_apps.ipc_receiver_cannot_map, "gpumap")
    assert "could not be taken in here" in r2["closed"] and "CUDARuntimeError" in r2["closed"], r2
    assert r2["seen"] == [], r2


def test_a_receiver_whose_copy_and_clean_up_both_fail_leaves_for_the_first_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA IPC plane: member 2 cannot issue a copy, nor schedule the freeing of the copy's
    region (both injected). It leaves, giving the copy's error (not the clean-up's), and the
    sender and the other receiver deliver everything."""
    from tests.gpu import gpu_apps

    r2 = _one_receiver_fails(tmp_path, monkeypatch, gpu_apps.ipc_receiver_copy_fails, "gpucopy")
    assert "could not be taken in here" in r2["closed"], r2
    assert "the copy could not be issued" in r2["closed"], r2
    assert r2["seen"] == [], r2


def test_a_sender_that_announces_more_pool_than_it_holds_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA IPC plane checks each announced segment against the allocation its handle
    opens: a sender that overstates a segment (member 0 here) could otherwise make its receivers
    copy past its memory. The receivers refuse it, it is removed, and the others go on."""
    _need_gpu()
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    codes = da.launch_local(3, gpu_apps.ipc_sender_overstates_its_pool,
                            group=f"gpulie{os.getpid()}", timeout=120, gpu_pool_mb=64)
    assert codes == [0, 0, 0], codes
    r0, r1, r2 = (json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(3))
    assert r1["members"] == r2["members"] == [1, 2], (r1, r2)
    assert r1["seen"] == r2["seen"] == ["from-1"] and r1["bad"] == r2["bad"] == 0, (r1, r2)
    assert r0["closed"] != "None", r0  # removed: its group is closed


def test_members_that_cannot_stage_or_rebuild_host_staged_arrays_leave_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host-staging plane (gpu_plane="host") has the same policy as the CUDA IPC plane: a
    sender that cannot stage its own arrays leaves and its message is delivered nowhere; a
    receiver that cannot rebuild a received array on its device leaves; the others go on."""
    _need_gpu()
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    codes = da.launch_local(4, gpu_apps.staging_fails, group=f"gpustage{os.getpid()}",
                            timeout=120, gpu_plane="host")
    assert codes == [0, 0, 0, 0], codes
    r0, r1, r2, r3 = (json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(4))
    assert r0["seen"] == r2["seen"] == [f"c{i}" for i in range(6)], (r0, r2)
    assert r0["bad"] == r2["bad"] == 0 and r0["members"] == r2["members"] == [0, 2]
    assert "could not be sent from here" in r1["closed"] and "MemoryError" in r1["closed"], r1
    assert "from-1" not in r1["seen"] and r1["outcome"] == "GroupClosed", r1
    assert "could not land here" in r3["closed"] and "MemoryError" in r3["closed"], r3
    # member 3 delivered a prefix of the survivors' sequence before it left (which message was
    # its third rebuild depends on whether member 1's departure made member 0 re-send one)
    assert r3["seen"] == r0["seen"][: len(r3["seen"])] and 1 <= len(r3["seen"]) <= 2, r3


def test_a_device_state_joins_over_the_cuda_ipc_plane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A joiner's CuPy state travels device to device in chunks (the CUDA IPC plane), checked
    by the GPU checksum, and arrives as a CuPy array equal to the founders'."""
    need_cupy()
    from tests.gpu import gpu_apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    monkeypatch.setenv("DA_GPU_STATE_MB", "256")
    codes = da.launch_local(3, gpu_apps.device_state_join, group=f"gpustate{os.getpid()}",
                            timeout=180, initial_members=2, gpu_plane="ipc",
                            state_chunk_kb=8192,
                            log_level=os.environ.get("DA_GPU_LOG_LEVEL", "WARNING"))
    assert codes == [0, 0, 0]
    results = [json.loads((tmp_path / f"member{m}.json").read_text()) for m in range(3)]
    assert len({r["digest"] for r in results}) == 1, results
    assert all(r["is_cupy"] for r in results)
    # 256 MiB in 8 MiB chunks: 32 of the array, one of the skeleton (host)
    assert results[0]["by_gpu"] == [32, 33], results[0]  # the sponsor sent them by CUDA IPC
    assert results[2]["on_device"] == [32, 33], results[2]
