"""The CUDA IPC plane's pure parts, on the CPU: the pool allocator, the wire formats and the
polling settings."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import derecho_async as da
from derecho_async.core import Layout
from derecho_async.errors import ConfigError, ProtocolViolation
from derecho_async.runtime.driver import Driver, Host
from derecho_async.runtime.gpu.completions import Completions, Lane
from derecho_async.runtime.gpu.descriptor import ArraySpec, Descriptor
from derecho_async.runtime.gpu.ipc import IpcPlane
from derecho_async.runtime.gpu.pool import ALIGN, PoolAnnouncement, RangeAllocator
from derecho_async.transport.loopback import LoopbackFabric
from tests.runtime.descriptor_bytes import raw_descriptor as _raw

H = bytes(range(64))
ANN = PoolAnnouncement("0000:19:00.0", ((1 << 20, H), (4 << 20, H)), (H, H, H))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40_000)), max_size=120))
def test_allocator_never_overlaps_and_returns_to_one_free_range(ops: list[tuple[bool, int]]) -> None:
    size = 256 * ALIGN
    a = RangeAllocator(size)
    live: dict[int, int] = {}
    for is_alloc, n in ops:
        if is_alloc or not live:
            off = a.alloc(n)
            need = max(ALIGN, -(-n // ALIGN) * ALIGN)
            if off is None:
                # first fit refused: then no gap of `need` bytes may exist
                edges = sorted((o, o + ln) for o, ln in live.items())
                gaps = [b[0] - a_[1] for a_, b in zip([(0, 0), *edges], [*edges, (size, size)], strict=True)]
                assert max(gaps) < need
                continue
            assert off % ALIGN == 0 and off + need <= size
            for o, ln in live.items():
                assert off + need <= o or o + ln <= off, "ranges overlap"
            live[off] = need
        else:
            off = sorted(live)[n % len(live)]
            a.free(off)
            del live[off]
        assert a.in_use == sum(live.values())
    for off in list(live):
        a.free(off)
    assert a.in_use == 0 and a.alloc(size) == 0  # everything merged back into one range


def test_allocator_rejects_double_free_and_bad_sizes() -> None:
    a = RangeAllocator(4 * ALIGN)
    off = a.alloc(1)
    assert off == 0
    a.free(off)
    with pytest.raises(ValueError):
        a.free(off)
    with pytest.raises(ValueError):
        RangeAllocator(100)
    assert a.alloc(5 * ALIGN) is None


def test_descriptor_round_trips_device_and_inline_arrays() -> None:
    d = Descriptor(b"call", 2, (
        ArraySpec("cupy", "float32", (4, 8), 128, 1, 512),
        ArraySpec("numpy", "int16", (3,), 6, inline=b"abcdef"),
        ArraySpec("torch", "uint8", (0,), 0, 0, 0),
    ))
    assert Descriptor.decode(d.encode(), ANN) == d


def test_a_large_byte_string_in_a_device_call_rides_inline_and_decodes_as_bytes() -> None:
    """Host arrays of a device call ride inline in the descriptor: a large byte string's
    read-only uint8 view among them too, and the receiver's copy decodes as bytes."""
    from derecho_async import wire
    from derecho_async.runtime.dataplane import array_info
    from derecho_async.runtime.gpu.descriptor import inline_array, inline_spec

    blob = bytes(range(256)) * ((wire.LARGE_BYTES >> 8) + 1)
    buffers: list[object] = []
    call = wire.encode_call("W.put", (blob,), {}, buffers)
    (view,) = buffers
    spec = inline_spec(view, array_info(view))
    d = Descriptor(call, 2, (spec,))
    got = Descriptor.decode(d.encode(), ANN)
    (arrived,) = [inline_array(s) for s in got.arrays]
    assert wire.decode_call(got.call, [arrived]) == ("W.put", (blob,), {})


_OK = ["cupy", "float32", [4], 0, 0, 16]


@pytest.mark.parametrize("raw, why", [
    (b"\xd7\x00", "truncated"),
    (b"\x93" + _raw([])[1:], "bad magic"),
    (_raw([_OK], call=b"call")[:-2], "call of"),
    (_raw([_OK]) + b"x", "call of"),
    (_raw([_OK])[:20], "truncated in an array spec"),
    (_raw([_OK], count=2), "truncated in an array spec"),
    (_raw([_OK], count=5000), "5000 arrays"),
    (_raw([["cupy", "float32", [4], 5, 0, 16]]), "unknown segment"),
    (_raw([["cupy", "float32", [4], 0, (1 << 20) - 8, 16]]), "outside segment"),
    (_raw([["cupy", "float32", [4], 0, -256, 16]]), "outside segment"),
    (_raw([["cupy", "float32", [4], 0, 0, 15]]), "outside segment"),
    (_raw([["cupy", "float32", [4], 0, 0, -16]]), "outside segment"),
    (_raw([["cupy", "object", [4], 0, 0, 16]]), "dtype code"),
    (_raw([["pickle", "float32", [4], 0, 0, 16]]), "lib code"),
    (_raw([["cupy", "float32", [-1], 0, 0, 16]]), "shape"),
    (_raw([["cupy", "float32", [1 << 48], 0, 0, 16]]), "shape"),
    (_raw([["cupy", "float32", [2] * 33, 0, 0, 16]]), "33 dimensions"),
    (_raw([["cupy", "float32", [4], 0, 0, 16]], event=3), "unknown event"),
    (_raw([["cupy", "float32", [4], 0, 0, 16]], event=-2), "unknown event"),
    (_raw([["numpy", "float32", [4], -1, b"short"]]), "inline"),
    (_raw([["numpy", "float32", [4], -1, b"x" * 16]])[:-2], "inline"),
    (_raw([["cupy", "float32", [4], 16]]), "kind 2 in an IPC"),
])
def test_hostile_descriptors_are_protocol_violations(raw: bytes, why: str) -> None:
    with pytest.raises(ProtocolViolation, match=why):
        Descriptor.decode(raw, ANN)


def test_every_dtype_that_may_travel_has_a_descriptor_code() -> None:
    from derecho_async.wire import DTYPES

    for name, size in DTYPES.items():
        d = Descriptor(b"c", 0, (ArraySpec("cupy", name, (3,), 3 * size, 0, 0),))
        assert Descriptor.decode(d.encode(), ANN) == d


def test_unused_fields_of_inline_and_broadcast_specs_must_be_zero() -> None:
    for spec in (["numpy", "uint8", [2], -1, b"ab"], ["cupy", "uint8", [2], 2]):
        raw = _raw([spec], event=-1)
        Descriptor.decode(raw, ANN, broadcast=len(spec) == 4)  # as written: accepted
        for at in (16, 20):  # the segment field, then the offset field, of the first spec
            bad = raw[:at] + b"\x01" + raw[at + 1:]
            with pytest.raises(ProtocolViolation, match="with segment"):
                Descriptor.decode(bad, ANN, broadcast=len(spec) == 4)


def test_a_descriptor_may_name_no_event_when_the_arrays_were_final() -> None:
    desc = Descriptor.decode(_raw([["cupy", "float32", [4], 0, 0, 16]], event=-1), ANN)
    assert desc.event == -1 and desc.arrays[0].segment == 0


def test_device_arrays_from_a_member_without_a_pool_are_refused() -> None:
    raw = Descriptor(b"c", 0, (ArraySpec("cupy", "float32", (4,), 16, 0, 0),)).encode()
    with pytest.raises(ProtocolViolation, match="announced no pool"):
        Descriptor.decode(raw, None)


def test_announcements_round_trip_and_reject_malformed_handles() -> None:
    assert PoolAnnouncement.decode(ANN.encode()) == ANN
    for body in (
        ["bus", [[1 << 20, b"short"]], []],
        ["bus", [[100, H]], []],  # not a multiple of ALIGN
        ["bus", [], [b"x" * 63]],
        ["bus", [], [H] * 70_000],
        "nonsense",
    ):
        raw = msgpack.packb(body, use_bin_type=True)
        with pytest.raises(ProtocolViolation):
            PoolAnnouncement.decode(raw)


def test_gpu_plane_settings_are_validated() -> None:
    assert da.Config(group="g", member_id=0, gpu_plane="host", gpu_pool_mb=64).gpu_pool_mb == 64
    with pytest.raises(ConfigError, match="gpu_plane"):
        da.Config(group="g", member_id=0, gpu_plane="gpudirect")
    with pytest.raises(ConfigError, match="gpu_pool_mb"):
        da.Config(group="g", member_id=0, gpu_pool_mb=0)


async def test_ipc_plane_asked_for_without_a_gpu_is_a_clear_error() -> None:
    from derecho_async.runtime.gpu.selection import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    cfg = da.Config(member_id=0, group="nogpu", initial_members=1, transport="sim",
                    gpu_plane="ipc")
    with pytest.raises(da.UsageError, match="CuPy and a CUDA device"):
        async with da.Group(cfg):
            pass


def test_descriptor_batches_round_trip_and_are_validated() -> None:
    from derecho_async.runtime.gpu.ipc import IpcPlane
    from derecho_async.wire import envelope as env

    one = IpcPlane._frames([((4, 1, 7), b"d7")])
    assert [env.decode(f) for f in one] == [[env.GPU_DATA, 4, 1, 7, b"d7"]]
    several = IpcPlane._frames([((4, 1, 7), b"d7"), ((4, 1, 8), b"d8"), ((5, 1, 0), b"e0")])
    assert [env.decode(f) for f in several] == [  # split where the view changes
        [env.GPU_BATCH, 4, 1, [7, b"d7", 8, b"d8"]], [env.GPU_BATCH, 5, 1, [0, b"e0"]]]
    frame = env.encode(env.GPU_BATCH, 4, 1, [7, b"d7", 8, b"d8"])
    assert env.decode(frame) == [env.GPU_BATCH, 4, 1, [7, b"d7", 8, b"d8"]]
    for bad in ([env.GPU_BATCH, 4, 1, b"not a list"], [env.GPU_BATCH, -1, 1, []],
                [env.GPU_BATCH, 4, 1]):
        with pytest.raises(ProtocolViolation):
            env.decode(msgpack.packb(bad, use_bin_type=True))


class _CudaError(RuntimeError):
    """Shaped like CuPy's CUDARuntimeError: the CUDA status code in ``status``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"CUDA error {status}")
        self.status = status


@pytest.mark.parametrize("status", [1, 201, 205, 400, 999])
def test_a_peer_handle_that_does_not_open_is_the_senders_fault(status: int) -> None:
    def opener(*_: object) -> int:
        raise _CudaError(status)

    with pytest.raises(ProtocolViolation, match="cannot map member 7's device memory"):
        IpcPlane._open_peer(7, opener, b"handle")


@pytest.mark.parametrize("exc", [_CudaError(2), _CudaError(46), _CudaError(700), MemoryError()])
def test_opening_a_peer_handle_that_fails_for_want_of_local_resources_is_this_members_fault(
    exc: BaseException,
) -> None:
    """Out of memory or of a working device here: raised as is (the driver makes this member
    leave), not a ProtocolViolation that would have the healthy sender removed."""

    def opener(*_: object) -> int:
        raise exc

    with pytest.raises(type(exc)) as caught:
        IpcPlane._open_peer(7, opener, b"handle")
    assert caught.value is exc


def test_an_opened_peer_handle_gives_its_address() -> None:
    assert IpcPlane._open_peer(7, lambda *_: 0x7F00_0000_0000) == 0x7F00_0000_0000


# -- the polling settings (Config.gpu_busy_poll_us, gpu_poll_interval_us) ----------------------
class _FakeRuntime:
    """The CUDA runtime calls Completions makes; no event ever completes."""

    def __init__(self) -> None:
        self.events = 0
        self.queries = 0

    def eventCreateWithFlags(self, flags: int) -> int:
        self.events += 1
        return self.events

    def eventRecord(self, event: int, stream: int) -> None:
        pass

    def eventQuery(self, event: int) -> int:
        self.queries += 1
        return 600  # cudaErrorNotReady


class _FakeWaiter:
    def __init__(self) -> None:
        self.waits: list[int] = []

    def wait(self, event: int, fn: Callable[[], None], *, destroy: bool = True) -> None:
        self.waits.append(event)


def _lane() -> tuple[Lane, _FakeWaiter]:
    waiter = _FakeWaiter()
    lane = Lane(stream=SimpleNamespace(ptr=0))
    lane.waiter = cast(Any, waiter)  # no thread (a real waiter imports CuPy)
    return lane, waiter


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_completions_poll_for_the_configured_busy_poll_then_hand_over_to_the_waiter() -> None:
    rt = _FakeRuntime()
    done = Completions(rt, 0)  # the defaults: 2000 µs of polling
    lane, waiter = _lane()
    done.track(lane, lambda: None)
    await _turns(5)
    assert rt.queries >= 4 and waiter.waits == []  # polled at every turn, no thread yet
    done.close()

    rt = _FakeRuntime()
    done = Completions(rt, 0, busy_poll_us=0.0)  # never poll: the waiter at once
    lane, waiter = _lane()
    done.track(lane, lambda: None)
    await _turns(5)
    assert rt.queries == 0 and waiter.waits == [1]
    done.close()


@pytest.mark.parametrize("interval_us, most_polls", [(0.0, None), (1e5, 1)])
async def test_completions_poll_a_stream_of_work_at_most_once_per_configured_interval(
    interval_us: float, most_polls: int | None
) -> None:
    rt = _FakeRuntime()
    done = Completions(rt, 0, busy_poll_us=1e6, poll_interval_us=interval_us)
    lane, _ = _lane()
    done.track(lane, lambda: None)
    done.track(lane, lambda: None)  # more than one in flight: the interval applies
    await _turns(20)
    done.close()
    if most_polls is None:
        assert rt.queries >= 19  # 0: at every turn of the loop
    else:
        assert rt.queries == most_polls  # 100 ms apart: once in 20 quick turns


def test_the_driver_gives_the_ipc_plane_the_configured_polling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = _recording_plane(monkeypatch, "derecho_async.runtime.gpu.ipc.IpcPlane")
    driver = _driver(da.Config(group="g", member_id=0, gpu_busy_poll_us=0,
                               gpu_poll_interval_us=40))
    driver._start_ipc_plane()
    assert made[-1]["busy_poll_us"] == 0.0 and made[-1]["poll_interval_us"] == 40.0
    _driver(da.Config(group="g", member_id=0))._start_ipc_plane()
    assert made[-1]["busy_poll_us"] == 2000.0 and made[-1]["poll_interval_us"] == 80.0


def _recording_plane(monkeypatch: pytest.MonkeyPatch, target: str) -> list[dict[str, Any]]:
    """Put a stand-in for the plane class ``target`` that records its keyword arguments."""
    made: list[dict[str, Any]] = []

    class Recorder:
        kinds: tuple[int, ...] = ()
        device = 0
        bus_id = "0000:00:00.0"

        def __init__(self, *args: object, **kwargs: Any) -> None:
            made.append(kwargs)

    monkeypatch.setattr(target, Recorder)
    return made


def _driver(config: da.Config) -> Driver:
    return Driver(config, LoopbackFabric().transport(config.member_id), Layout(),
                  cast(Host, object()))
