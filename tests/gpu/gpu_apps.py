"""Member programs for the GPU tests (spawned by launch_local; need CuPy, torch and a GPU)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

import derecho_async as da


class Accumulator(da.Actor):
    """Receives device arrays in total order and keeps what it saw."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float, int]] = []
        self.total: Any = None

    @da.ordered
    def add(self, x: Any, tag: str) -> str:
        import cupy

        assert isinstance(x, cupy.ndarray), type(x)
        assert x.device.id == cupy.cuda.Device().id
        self.total = x.copy() if self.total is None else self.total + x
        self.seen.append((tag, float(x.ravel()[0]), int(x.size)))
        return tag

    @da.ordered
    def add_pair(self, x: Any, y: Any) -> str:
        """A call of device arrays alone (the sender's memoized encoding, and its own delivery
        without a decode)."""
        import cupy

        assert isinstance(x, cupy.ndarray) and isinstance(y, cupy.ndarray), (type(x), type(y))
        assert x.dtype == cupy.float32 and x.shape == (64,), (x.dtype, x.shape)
        assert y.dtype == cupy.int64 and y.shape == (8, 8), (y.dtype, y.shape)
        tag = f"p{int(x[0].item())}"
        self.seen.append((tag, float(y[7, 7].item()), int(x.size + y.size)))
        return tag

    @da.ordered
    def add_torch(self, t: Any, tag: str) -> str:
        import torch

        assert isinstance(t, torch.Tensor) and t.is_cuda, (type(t), getattr(t, "device", None))
        self.seen.append((tag, float(t[0].item()), int(t.numel())))
        return tag


SENT_BESIDE_COUNT = 4
"""Calls each member of :func:`sends_device_arrays` makes beyond ``DA_GPU_COUNT``: a torch
tensor, two pairs of arrays alone, one array sent in place from the pool."""


def _warm_device() -> None:
    """Make the kernels :class:`Accumulator` and :func:`sends_device_arrays` use, and torch's
    CUDA state, before joining: with a cold kernel cache the first use compiles and can hold
    the loop past ``suspect_after_ms`` (in a view, a peer would suspect this member)."""
    import cupy
    import torch

    x = cupy.full((256, 256), 1.0, dtype=cupy.float32)
    y = cupy.full((8, 8), 1, dtype=cupy.int64)
    float((x.copy() + x).ravel()[0]), float(y[7, 7].item())
    torch.full((8,), 1.0, device="cuda")
    cupy.cuda.Device().synchronize()


async def sends_device_arrays(config: da.Config) -> None:
    import cupy
    import torch

    me = config.member_id
    count = int(os.environ.get("DA_GPU_COUNT", "20"))
    _warm_device()  # not yet in a view: a long first compile here holds nobody up
    async with da.Group(config, actors=[Accumulator]) as group:
        acc = group.subgroup(Accumulator)
        n = len(group.view.members)
        calls = []
        for i in range(count):
            x = cupy.full((256, 256), float(me * 1000 + i), dtype=cupy.float32)
            calls.append(acc.add(x, f"c{me}-{i}"))
        calls.append(acc.add_torch(torch.full((1000,), float(me), device="cuda"), f"t{me}"))
        for j in range(2):  # the second: the encoding comes from the memo the first filled
            calls.append(acc.add_pair(cupy.full((64,), me, dtype=cupy.float32),
                                      cupy.full((8, 8), 10 * me + j, dtype=cupy.int64)))
        inplace = group.device_buffer((256, 256), "float32")  # sent from the pool, no copy
        inplace.fill(float(me * 1000 + count))
        calls.append(acc.add(inplace, f"c{me}-{count}"))
        replies = await asyncio.gather(*calls)
        assert all(set(r) == set(group.view.members) for r in replies)
        local = group.local(Accumulator)
        while len(local.seen) < n * (count + SENT_BESIDE_COUNT):
            await asyncio.sleep(0.01)
        digest = hashlib.sha256(json.dumps(local.seen).encode()).hexdigest()
        total = float(local.total.sum())
        _write(os.environ["DA_GPU_OUT"], me, {
            "digest": digest, "seen": len(local.seen), "total": total,
            "plane": group.device_pool_stats() is not None, "nccl": group.nccl_stats(),
        })
        await asyncio.sleep(1.0)


class Checker(da.Actor):
    """Receives device arrays whose elements all equal ``value``; records whether they did."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    @da.ordered
    def put(self, x: Any, tag: str, value: float) -> bool:
        import cupy

        ok = bool(isinstance(x, cupy.ndarray) and float(x.min()) == value == float(x.max()))
        self.seen.append((tag, ok))
        return ok


def _write(out: str, me: int, record: dict[str, Any]) -> None:
    with open(f"{out}/member{me}.json", "w") as f:
        json.dump(record, f)


async def _wait_left(group: da.Group, timeout: float = 60.0) -> None:
    """Wait until ``group``'s member has left it (its calls would raise GroupClosed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while group._closed is None:
        if loop.time() > deadline:
            raise TimeoutError(f"member {group.member_id} never left")
        await asyncio.sleep(0.01)


async def _wait_pools(group: da.Group, peers: tuple[int, ...], timeout: float = 60.0) -> None:
    """Wait until every one of ``peers`` announced its CUDA IPC pool to this member: device
    arrays sent before that travel by host staging instead (the plane takes a payload only once
    every target can map its pool)."""
    driver = group._driver
    assert driver is not None and driver.gpuplane is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not all(driver.gpuplane.peer_ready(m) for m in peers):
        if loop.time() > deadline:
            raise TimeoutError(f"member {group.member_id}: no pool announced by some of {peers}")
        await asyncio.sleep(0.01)


async def _wait_file(path: str, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not os.path.exists(path):
        if loop.time() > deadline:
            raise TimeoutError(f"{path} did not appear")
        await asyncio.sleep(0.01)


async def _wait_seen(local: Any, n: int, timeout: float = 120.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(local.seen) < n:
        if loop.time() > deadline:
            raise TimeoutError(f"saw {len(local.seen)} of {n} messages")
        await asyncio.sleep(0.01)


async def pool_soak(config: da.Config) -> None:
    """Many small device messages, half sent in place from the pool: the pools must drain."""
    import gc

    import cupy

    me = config.member_id
    total = int(os.environ.get("DA_GPU_COUNT", "10000"))
    async with da.Group(config, actors=[Checker]) as group:
        chk = group.subgroup(Checker)
        members = group.view.members
        mine = total // len(members) + (1 if me < total % len(members) else 0)
        expected = total
        batch: list[Any] = []
        for i in range(mine):
            value = float(me * 100000 + i)
            if i % 2:
                x = group.device_buffer((64,), "float32")
                x.fill(value)
            else:
                x = cupy.full((64,), value, dtype=cupy.float32)
            batch.append(chk.put(x, f"{me}-{i}", value))
            if len(batch) >= 64:
                await asyncio.gather(*batch)
                batch.clear()
        await asyncio.gather(*batch)
        local = group.local(Checker)
        await _wait_seen(local, expected)
        del batch, x
        stats: dict[str, int] | None = None
        for _ in range(200):  # replies to the last calls may still be in flight
            gc.collect()
            stats = group.device_pool_stats()
            assert stats is not None, "the CUDA IPC plane is not active"
            if stats["in_use_bytes"] == 0 and stats["sending"] == 0:
                break
            await asyncio.sleep(0.05)
        digest = hashlib.sha256(json.dumps(local.seen).encode()).hexdigest()
        _write(os.environ["DA_GPU_OUT"], me, {
            "digest": digest, "seen": len(local.seen),
            "bad": sum(1 for _, ok in local.seen if not ok), "stats": stats,
        })
        await asyncio.sleep(1.0)


async def killed_mid_transfer(config: da.Config) -> None:
    """The last member streams large device arrays and SIGKILLs itself while they travel."""
    import signal

    import cupy

    me = config.member_id
    size = int(os.environ.get("DA_GPU_BYTES", str(64 << 20))) // 4
    async with da.Group(config, actors=[Checker]) as group:
        chk = group.subgroup(Checker)
        members = group.view.members
        victim = members[-1]
        local = group.local(Checker)
        if me == victim:
            calls = []
            for i in range(8):
                x = cupy.full((size,), float(i + 1), dtype=cupy.float32)
                if i < 2:  # these two complete everywhere before the stream that dies
                    await chk.put(x, f"v-{i}", float(i + 1))
                    continue
                calls.append(asyncio.ensure_future(chk.put(x, f"v-{i}", float(i + 1))))
                if i == 5:
                    await asyncio.sleep(0)  # let descriptors go out, then die mid-stream
                    os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(60)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while victim in group.view.members:
            if loop.time() > deadline:
                raise TimeoutError("the victim was never removed")
            await asyncio.sleep(0.01)
        after = [
            await asyncio.wait_for(  # a survivor that cannot finish fails, it does not hang
                chk.put(cupy.full((1024,), 7.0, dtype=cupy.float32), f"s{me}-{j}", 7.0), 60
            )
            for j in range(5)
        ]
        assert all(all(r.values_ok()) for r in after)
        survivors = [m for m in members if m != victim]
        # every survivor's five calls, whatever of the victim's stream was delivered before
        while sum(1 for t, _ in local.seen if t.startswith("s")) < 5 * len(survivors):
            if loop.time() > deadline + 60:
                raise TimeoutError(f"member {me} saw {len(local.seen)} messages")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        digest = hashlib.sha256(json.dumps(local.seen).encode()).hexdigest()
        _write(os.environ["DA_GPU_OUT"], me, {
            "digest": digest, "seen": len(local.seen),
            "bad": sum(1 for _, ok in local.seen if not ok),
            "victim_msgs": sum(1 for t, _ in local.seen if t.startswith("v")),
        })
        await asyncio.sleep(0.5)


async def landing_fails(config: da.Config) -> None:
    """Member 2's third device array cannot be made (an injected MemoryError where the plane
    builds it): member 2 must leave with the reason, members 0 and 1 go on without it."""
    import cupy

    me = config.member_id
    async with da.Group(config, actors=[Checker]) as group:
        chk = group.subgroup(Checker)
        local = group.local(Checker)
        if me == 2:
            driver = group._driver
            assert driver is not None and driver.gpuplane is not None
            plane = driver.gpuplane
            real = plane._array_over
            made = [0]

            def failing(*args: Any) -> Any:
                made[0] += 1
                if made[0] == 3:
                    raise MemoryError("injected: no room for the array")
                return real(*args)

            plane._array_over = failing  # type: ignore[method-assign,assignment]
            with open(os.path.join(os.environ["DA_GPU_OUT"], "armed"), "w") as f:
                f.write("1")
            await _wait_left(group)
            _write(os.environ["DA_GPU_OUT"], me, {
                "closed": str(group._closed), "seen": len(local.seen)})
            return
        if me == 0:
            # every array must travel by the CUDA IPC plane and meet member 2's injected fault
            await _wait_pools(group, (1, 2))
            await _wait_file(os.path.join(os.environ["DA_GPU_OUT"], "armed"))
            for i in range(6):
                x = cupy.full((4096,), float(i + 1), dtype=cupy.float32)
                r = await asyncio.wait_for(chk.put(x, f"c{i}", float(i + 1)), 60)
                assert r[0] is True and r[1] is True, r
        await _wait_seen(local, 6, 60)
        digest = hashlib.sha256(json.dumps(local.seen).encode()).hexdigest()
        _write(os.environ["DA_GPU_OUT"], me, {
            "digest": digest, "seen": len(local.seen), "members": list(group.view.members),
            "bad": sum(1 for _, ok in local.seen if not ok)})
        await asyncio.sleep(0.5)


async def staging_fails(config: da.Config) -> None:
    """Device arrays staged through host memory (gpu_plane="host"). Member 1 cannot stage its
    own message (an injected MemoryError where it copies the arrays to host): it must leave,
    and its message is delivered nowhere. Member 3 cannot rebuild the third device payload it
    receives (a re-sent one counts again): it must leave too. Members 0 and 2 deliver all six of member 0's messages."""
    import cupy

    me = config.member_id
    async with da.Group(config, actors=[Checker]) as group:
        chk = group.subgroup(Checker)
        local = group.local(Checker)
        driver = group._driver
        assert driver is not None and driver.gpuplane is None and driver.ncclplane is None
        staging = driver.dataplane
        if me in (1, 3):
            if me == 1:
                def no_staging(payload: Any) -> bytes:
                    raise MemoryError("injected: no host memory to stage the arrays")

                staging.pack = no_staging  # type: ignore[method-assign]
                x = cupy.full((4096,), 99.0, dtype=cupy.float32)
                call = asyncio.ensure_future(chk.put(x, "from-1", 99.0))
            else:
                real = staging._unpack
                rebuilt = [0]

                def unpack(msg: object) -> object:
                    job = real(msg)
                    if callable(job):
                        rebuilt[0] += 1
                        if rebuilt[0] == 3:
                            def fail() -> object:
                                raise MemoryError("injected: no room for the device array")

                            return fail
                    return job

                staging._unpack = unpack  # type: ignore[method-assign]
            await _wait_left(group)
            outcome = ""
            if me == 1:
                try:
                    outcome = f"completed: {await asyncio.wait_for(call, 10)!r}"
                except Exception as exc:  # what the caller of the unsendable message got
                    outcome = type(exc).__name__
            _write(os.environ["DA_GPU_OUT"], me, {
                "closed": str(group._closed), "seen": [t for t, _ in local.seen],
                "outcome": outcome})
            return
        if me == 0:
            for i in range(6):
                x = cupy.full((4096,), float(i + 1), dtype=cupy.float32)
                r = await asyncio.wait_for(chk.put(x, f"c{i}", float(i + 1)), 60)
                assert r[0] is True, r
        await _wait_seen(local, 6, 60)
        await asyncio.sleep(0.5)  # a late delivery of member 1's message would show here
        _write(os.environ["DA_GPU_OUT"], me, {
            "seen": [t for t, _ in local.seen], "members": list(group.view.members),
            "bad": sum(1 for _, ok in local.seen if not ok)})
        await asyncio.sleep(0.5)


async def _a_receiver_fails(config: da.Config, break_receiver: Callable[[Any], None],
                            pooled: bool) -> None:
    """The CUDA IPC plane, three members. ``break_receiver`` injects a fault of member 2's own
    into its plane; member 0 sends six device arrays (from its pool when ``pooled``) once every
    peer announced its pool, so all go by CUDA IPC. The fault is member 2's: it leaves, and the
    sender stays; members 0 and 1 deliver all six."""
    import cupy

    me = config.member_id
    async with da.Group(config, actors=[Checker]) as group:
        chk = group.subgroup(Checker)
        local = group.local(Checker)
        driver = group._driver
        assert driver is not None and driver.gpuplane is not None
        if me == 2:
            break_receiver(driver.gpuplane)
            await _wait_left(group)
            _write(os.environ["DA_GPU_OUT"], me, {
                "closed": str(group._closed), "seen": [t for t, _ in local.seen]})
            return
        if me == 0:
            await _wait_pools(group, (1, 2))  # every message by CUDA IPC
            for i in range(6):
                if pooled:
                    x = group.device_buffer((4096,), "float32")
                    x.fill(float(i + 1))
                    cupy.cuda.Device().synchronize()
                else:
                    x = cupy.full((4096,), float(i + 1), dtype=cupy.float32)
                r = await asyncio.wait_for(chk.put(x, f"c{i}", float(i + 1)), 60)
                assert r[0] is True, r
        await _wait_seen(local, 6, 60)
        _write(os.environ["DA_GPU_OUT"], me, {
            "seen": [t for t, _ in local.seen], "members": list(group.view.members),
            "bad": sum(1 for _, ok in local.seen if not ok)})
        await asyncio.sleep(0.5)


class _RuntimeFailing:
    """The CUDA runtime ``real``, except that calling its function ``failing`` raises ``exc``
    (a fault of this process's own, injected into one member's plane)."""

    def __init__(self, real: Any, failing: str, exc: BaseException) -> None:
        self._real = real
        self._failing = failing
        self._exc = exc

    def __getattr__(self, name: str) -> Any:
        if name == self._failing:
            def fail(*_: object) -> Any:
                raise self._exc

            return fail
        return getattr(self._real, name)


async def ipc_receiver_cannot_allocate(config: da.Config) -> None:
    """Member 2 cannot take pool memory for the third device message it receives (an injected
    MemoryError where the plane allocates the copy's region): see :func:`_a_receiver_fails`."""

    def no_third_region(plane: Any) -> None:
        real = plane._alloc
        allocs = [0]

        def alloc(nbytes: int) -> tuple[int, int]:
            allocs[0] += 1
            if allocs[0] == 3:
                raise MemoryError("injected: no device memory for the copy")
            return real(nbytes)  # type: ignore[no-any-return]

        plane._alloc = alloc

    await _a_receiver_fails(config, no_third_region, pooled=False)


async def ipc_receiver_copy_fails(config: da.Config) -> None:
    """Member 2 cannot issue the copy of its first device message, nor the clean-up that would
    free the copy's region once its stream is past (both injected): see
    :func:`_a_receiver_fails`. It leaves for the first error."""

    def copy_and_cleanup_fail(plane: Any) -> None:
        def after_stream(fn: Callable[[], None], lane: Any) -> None:
            raise RuntimeError("injected: nor could its clean-up")

        plane._rt = _RuntimeFailing(plane._rt, "memcpyAsync",
                                    RuntimeError("injected: the copy could not be issued"))
        plane._done.after_stream = after_stream

    await _a_receiver_fails(config, copy_and_cleanup_fail, pooled=True)


async def ipc_receiver_cannot_map(config: da.Config) -> None:
    """Member 2 cannot map member 0's pool segment (opening its IPC handle fails with
    cudaErrorMemoryAllocation, injected): see :func:`_a_receiver_fails`."""

    def no_mapping(plane: Any) -> None:
        import cupy

        plane._rt = _RuntimeFailing(  # 2: cudaErrorMemoryAllocation
            plane._rt, "ipcOpenMemHandle", cupy.cuda.runtime.CUDARuntimeError(2))

    await _a_receiver_fails(config, no_mapping, pooled=True)


async def ipc_sender_overstates_its_pool(config: da.Config) -> None:
    """The CUDA IPC plane. Member 0 announces each pool segment at twice its real size (so its
    descriptors could make receivers copy past its memory) and then sends a device array: the
    receivers refuse the segment when they map it, member 0 is removed, and members 1 and 2 go
    on (member 1 then sends one device array, which member 2 delivers)."""
    import cupy

    me = config.member_id
    async with da.Group(config, actors=[Checker]) as group:
        chk = group.subgroup(Checker)
        local = group.local(Checker)
        driver = group._driver
        assert driver is not None and driver.gpuplane is not None
        plane = driver.gpuplane
        if me == 0:
            real_grow = plane._grow_segments

            def grow(at_least: int) -> int:
                i = real_grow(at_least)
                plane._segments[i].size *= 2  # what the next announcement claims
                return i

            plane._grow_segments = grow  # type: ignore[method-assign]
            x = group.device_buffer((4096,), "float32")
            x.fill(7.0)
            cupy.cuda.Device().synchronize()
            await _wait_pools(group, (1, 2))  # so the array goes by CUDA IPC
            outcome = ""
            try:
                outcome = repr(await asyncio.wait_for(chk.put(x, "from-0", 7.0), 30))
            except Exception as exc:
                outcome = type(exc).__name__
            await _wait_left(group)
            _write(os.environ["DA_GPU_OUT"], me, {"closed": str(group._closed),
                                                  "outcome": outcome})
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while 0 in group.view.members:
            if loop.time() > deadline:
                raise TimeoutError("member 0 was never removed")
            await asyncio.sleep(0.01)
        if me == 1:
            x = cupy.full((4096,), 5.0, dtype=cupy.float32)
            r = await asyncio.wait_for(chk.put(x, "from-1", 5.0), 60)
            assert r[1] is True, r
        await _wait_seen(local, 1, 60)
        await asyncio.sleep(0.3)
        _write(os.environ["DA_GPU_OUT"], me, {
            "seen": [t for t, _ in local.seen], "members": list(group.view.members),
            "bad": sum(1 for _, ok in local.seen if not ok)})
        await asyncio.sleep(0.5)


# -- the NCCL plane: one member per GPU (gpu_plane="nccl") ---------------------------------------
def _use_own_gpu(me: int) -> int:
    """Put member ``me`` on GPU ``me % count`` (CuPy and torch) before its group starts."""
    import cupy

    device = int(me % cupy.cuda.runtime.getDeviceCount())
    cupy.cuda.Device(device).use()
    try:
        import torch

        torch.cuda.set_device(device)
    except ImportError:
        pass
    return device


async def _wait_nccl_ready(group: da.Group, timeout: float = 120.0) -> dict[str, int]:
    """Wait until every communicator of this member's view is up here."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        stats = group.nccl_stats()
        assert stats is not None, "the NCCL plane is not active"
        if stats["communicators"] and stats["ready"] == stats["communicators"]:
            return stats
        if stats["failed"] or loop.time() > deadline:
            raise TimeoutError(f"NCCL communicators not up: {stats}")
        await asyncio.sleep(0.05)


async def nccl_sends_device_arrays(config: da.Config) -> None:
    """Every member (each on its own GPU) sends CuPy arrays and a torch tensor at once."""
    import cupy
    import torch

    me = config.member_id
    device = _use_own_gpu(me)
    count = int(os.environ.get("DA_GPU_COUNT", "20"))
    async with da.Group(config, actors=[Accumulator]) as group:
        await _wait_nccl_ready(group)
        acc = group.subgroup(Accumulator)
        n = len(group.view.members)
        calls = []
        for i in range(count):
            x = cupy.full((256, 256), float(me * 1000 + i), dtype=cupy.float32)
            calls.append(acc.add(x, f"c{me}-{i}"))
        calls.append(acc.add_torch(torch.full((1000,), float(me), device="cuda"), f"t{me}"))
        for j in range(2):  # the second: the encoding comes from the memo the first filled
            calls.append(acc.add_pair(cupy.full((64,), me, dtype=cupy.float32),
                                      cupy.full((8, 8), 10 * me + j, dtype=cupy.int64)))
        replies = await asyncio.gather(*calls)
        assert all(set(r) == set(group.view.members) for r in replies)
        local = group.local(Accumulator)
        await _wait_seen(local, n * (count + 1))
        stats = group.nccl_stats()
        _write(os.environ["DA_GPU_OUT"], me, {
            "digest": hashlib.sha256(json.dumps(local.seen).encode()).hexdigest(),
            "seen": len(local.seen), "total": float(local.total.sum()),
            "device": device, "nccl": stats,
        })
        await asyncio.sleep(1.0)


async def nccl_killed_mid_transfer(config: da.Config) -> None:
    """Like :func:`killed_mid_transfer`, over NCCL once every communicator is up."""
    import signal

    import cupy

    me = config.member_id
    _use_own_gpu(me)
    size = int(os.environ.get("DA_GPU_BYTES", str(64 << 20))) // 4
    async with da.Group(config, actors=[Checker]) as group:
        await _wait_nccl_ready(group)
        chk = group.subgroup(Checker)
        members = group.view.members
        victim = members[-1]
        local = group.local(Checker)
        if me == victim:
            calls = []
            for i in range(8):
                x = cupy.full((size,), float(i + 1), dtype=cupy.float32)
                if i < 2:  # these two complete everywhere before the stream that dies
                    await chk.put(x, f"v-{i}", float(i + 1))
                    continue
                calls.append(asyncio.ensure_future(chk.put(x, f"v-{i}", float(i + 1))))
                if i == 5:
                    await asyncio.sleep(0)  # let descriptors go out, then die mid-stream
                    os.kill(os.getpid(), signal.SIGKILL)
            await asyncio.sleep(60)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while victim in group.view.members:
            if loop.time() > deadline:
                raise TimeoutError("the victim was never removed")
            await asyncio.sleep(0.01)
        # the old view's communicators were aborted: kernels waiting on the victim ended
        stats = group.nccl_stats()
        assert stats is not None and stats["aborted"] >= 1, stats
        after = [
            await asyncio.wait_for(  # a survivor that cannot finish fails, it does not hang
                chk.put(cupy.full((1024,), 7.0, dtype=cupy.float32), f"s{me}-{j}", 7.0), 60
            )
            for j in range(5)
        ]
        assert all(all(r.values_ok()) for r in after)
        survivors = [m for m in members if m != victim]
        expected = 5 * len(survivors)
        if len(survivors) >= 2:  # the new view's communicators come up, and carry traffic
            await _wait_nccl_ready(group)
            await asyncio.wait_for(
                chk.put(cupy.full((1024,), 8.0, dtype=cupy.float32), f"s{me}-n", 8.0), 60)
            expected += len(survivors)
        while sum(1 for t, _ in local.seen if t.startswith("s")) < expected:
            if loop.time() > deadline + 60:
                raise TimeoutError(f"member {me} saw {len(local.seen)} messages")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        _write(os.environ["DA_GPU_OUT"], me, {
            "digest": hashlib.sha256(json.dumps(local.seen).encode()).hexdigest(),
            "seen": len(local.seen),
            "bad": sum(1 for _, ok in local.seen if not ok),
            "victim_msgs": sum(1 for t, _ in local.seen if t.startswith("v")),
            "nccl": group.nccl_stats(),
        })
        await asyncio.sleep(0.5)


class DeviceState(da.Actor):
    """A replicated state of one CuPy array (``DA_GPU_STATE_MB`` MiB); ordered calls count."""

    def __init__(self) -> None:
        self.value: Any = None
        self.calls = 0

    @da.ordered
    def touch(self) -> int:
        self.calls += 1
        return self.calls

    @da.p2p
    def digest(self) -> str:
        return _device_digest(self.value)

    def snapshot(self) -> object:
        return [self.calls, self.value]

    def restore(self, state: Any) -> None:
        self.calls, self.value = state


def _device_digest(value: Any, device: Any = None) -> str:
    import cupy

    with device if device is not None else cupy.cuda.Device():
        flat = value.ravel().view(cupy.uint64)
        return f"{type(value).__name__}-{int(flat.sum()):x}-{int((flat ^ (flat >> 7)).sum()):x}"


async def device_state_join(config: da.Config) -> None:
    """Members 0 and 1 found the group and each builds the same device state; member 2 joins
    once they are ready and gets it by state transfer (device chunks over the CUDA IPC plane),
    while member 0 keeps making ordered calls. Every member reports its state's digest and
    what its state-transfer log said of the chunks (moved by a GPU plane, landed on the
    device)."""
    import logging
    import re

    import cupy

    out = os.environ["DA_GPU_OUT"]
    size = int(os.environ["DA_GPU_STATE_MB"]) << 20
    me = config.member_id
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, rec: logging.LogRecord) -> None:
            lines.append(rec.getMessage())

    # Device work that can take long (a first kernel's compile or load, a pass over 256 MiB)
    # runs off the loop: a member whose loop is held past suspect_after_ms is suspected, and
    # once both founders were, the joiner lost its majority and wedged.
    device = cupy.cuda.Device()
    loop = asyncio.get_running_loop()

    def off_loop(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        return loop.run_in_executor(None, fn, *args)

    xfer_log = logging.getLogger("derecho_async.statexfer")
    xfer_log.addHandler(Keep())
    xfer_log.setLevel(logging.INFO)
    if me == 2:
        while not os.path.exists(f"{out}/ready"):
            await asyncio.sleep(0.02)
        group = await da.Group.join(config, actors=[DeviceState], timeout=120)
    else:
        group = await da.Group.join(config, actors=[DeviceState], timeout=120)
        state = group.local(DeviceState)

        def build() -> Any:
            with device:
                arr = cupy.arange(size // 4, dtype=cupy.uint32)
                arr *= 2654435761
                device.synchronize()
                return arr

        state.value = await off_loop(build)
        await group.subgroup(DeviceState).touch()
        if me == 0:
            await _wait_pools(group, (1,))
            with open(f"{out}/ready", "w") as f:
                f.write("1")
    try:
        handle = group.subgroup(DeviceState)
        while len(group.view.members) < 3:
            if me == 0:
                await handle.touch()
            await asyncio.sleep(0.01)
        await handle.touch()
        if me == 0:  # the sponsor: until its transfer is done
            deadline = asyncio.get_running_loop().time() + 60
            while not any("done:" in ln for ln in lines):
                assert asyncio.get_running_loop().time() < deadline, lines
                await asyncio.sleep(0.05)
        local = group.local(DeviceState)

        def counts(pattern: str) -> list[int] | None:
            for ln in lines:
                found = re.search(pattern, ln)
                if found:
                    return [int(found[1]), int(found[2])]
            return None

        record = {
            "me": me,
            "digest": await off_loop(_device_digest, local.value,
                                     device),
            "is_cupy": isinstance(local.value, cupy.ndarray),
            "views": [v.view_id for v in group.history],
            "by_gpu": counts(r"(\d+) of (\d+) chunks moved by a GPU plane"),
            "on_device": counts(r"(\d+) of (\d+) chunks landed in device memory"),
        }
        _write(out, me, record)
        while len([n for n in os.listdir(out) if n.startswith("member")]) < 3:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    finally:
        await group.leave()
