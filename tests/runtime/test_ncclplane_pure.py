"""The NCCL plane's pure parts, on the CPU: selection, frames, the plan, ordering, view state.

What needs CuPy and GPUs (communicators, broadcasts, aborts) is in ``tests/gpu/test_nccl_plane.py``.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from typing import Any, NoReturn, cast

import msgpack  # type: ignore[import-untyped]
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import derecho_async as da
from derecho_async.core import Layout, SubgroupSpec
from derecho_async.errors import ProtocolViolation, UsageError
from derecho_async.runtime.gpu.descriptor import (
    BROADCAST,
    MAX_BROADCAST_BYTES,
    ArraySpec,
    Descriptor,
)
from derecho_async.runtime.gpu.nccl_plan import (
    UID_BYTES,
    Comm,
    CommSpec,
    EarlyUids,
    ViewComms,
    communicator_plan,
    uid_from_frame,
    uid_to_bytes,
    uid_to_tuple,
)
from derecho_async.runtime.gpu.selection import select_gpu_planes
from derecho_async.wire import envelope as env
from tests.runtime.descriptor_bytes import raw_descriptor


def _shards(layout: Layout, members: tuple[int, ...]) -> list[tuple[tuple[int, ...],
                                                                     tuple[int, ...]]]:
    return [(s.members, s.senders) for s in layout.assign(members).shards]


# -- selection ----------------------------------------------------------------------------------
def _never() -> NoReturn:
    raise AssertionError("probed although the mode did not need it")


def test_selection_by_mode_probes_only_what_it_needs() -> None:
    assert select_gpu_planes("host", True, _never, _never) == ()
    assert select_gpu_planes("auto", False, lambda: True, _never) == ()
    assert select_gpu_planes("auto", True, lambda: True, _never) == ("ipc",)
    assert select_gpu_planes("auto", True, lambda: False, _never) == ()
    assert select_gpu_planes("ipc", False, lambda: True, _never) == ("ipc",)
    assert select_gpu_planes("nccl", True, _never, lambda: None) == ("nccl", "ipc")
    assert select_gpu_planes("nccl", False, _never, lambda: None) == ("nccl",)


def test_nccl_or_ipc_asked_for_without_what_they_need_is_a_clear_error() -> None:
    with pytest.raises(UsageError, match=r"gpu_plane='nccl' needs CuPy with NCCL.*no libnccl"):
        select_gpu_planes("nccl", True, _never, lambda: "no libnccl")
    with pytest.raises(UsageError, match="gpu_plane='ipc' needs CuPy and a CUDA device"):
        select_gpu_planes("ipc", True, lambda: False, _never)


def test_config_accepts_nccl() -> None:
    assert da.Config(group="g", member_id=0, gpu_plane="nccl").gpu_plane == "nccl"


async def test_nccl_plane_asked_for_without_nccl_is_a_clear_error() -> None:
    from derecho_async.runtime.gpu.selection import nccl_unavailable

    why = nccl_unavailable()
    if why is None:
        pytest.skip("this machine has CuPy with NCCL and a GPU")
    cfg = da.Config(member_id=0, group="nonccl", initial_members=1, transport="sim",
                    gpu_plane="nccl")
    with pytest.raises(da.UsageError, match="CuPy with NCCL"):
        async with da.Group(cfg):
            pass


# -- unique ids and frames ----------------------------------------------------------------------
@given(st.binary(min_size=UID_BYTES, max_size=UID_BYTES), st.booleans())
def test_unique_ids_round_trip_in_either_char_signedness(raw: bytes, signed: bool) -> None:
    chars = uid_to_tuple(raw, signed)
    assert all((-128 <= c <= 127) if signed else (0 <= c <= 255) for c in chars)
    assert uid_to_bytes(chars) == raw
    assert uid_from_frame(raw) == raw


def test_malformed_unique_ids_are_refused() -> None:
    for bad in (b"x" * 127, b"x" * 129, b"", "x" * 128, None):
        with pytest.raises(ProtocolViolation, match="unique id"):
            uid_from_frame(bad)
    with pytest.raises(ValueError):
        uid_to_bytes((0,) * 127)
    with pytest.raises(ValueError):
        uid_to_bytes((300,) * 128)


def test_nccl_envelopes_round_trip_and_are_validated() -> None:
    uid = bytes(range(128))
    assert env.decode(env.encode(env.NCCL_UID, 3, 1, uid)) == [env.NCCL_UID, 3, 1, uid]
    frame = env.encode(env.NCCL_DATA, 3, 2, 17, 0, 5, b"desc")
    assert env.decode(frame) == [env.NCCL_DATA, 3, 2, 17, 0, 5, b"desc"]
    for bad in (
        [env.NCCL_UID, 3, 1, "text"],
        [env.NCCL_UID, 3, -1, uid],
        [env.NCCL_UID, 3, uid],
        [env.NCCL_DATA, 3, 2, 17, 0, -5, b"d"],
        [env.NCCL_DATA, 3, 2, 17, 0, b"d"],
        [env.NCCL_DATA, 3, 2, 17, 0, 5, [b"d"]],
    ):
        with pytest.raises(ProtocolViolation):
            env.decode(msgpack.packb(bad, use_bin_type=True))


# -- broadcast descriptors ----------------------------------------------------------------------
def test_broadcast_descriptors_round_trip() -> None:
    d = Descriptor(b"call", -1, (
        ArraySpec("cupy", "float32", (4, 8), 128, BROADCAST),
        ArraySpec("numpy", "int16", (3,), 6, inline=b"abcdef"),
        ArraySpec("torch", "bfloat16" if "bfloat16" in _dtypes() else "float16", (0,), 0,
                  BROADCAST),
    ))
    assert Descriptor.decode(d.encode(), None, broadcast=True) == d


def _dtypes() -> set[str]:
    from derecho_async.wire import DTYPES

    return set(DTYPES)


def _raw(specs: list[list[Any]], event: int = -1) -> bytes:
    return raw_descriptor(specs, event=event)


_HUGE = [1 << 20, 1 << 20, 1 << 2]  # 2**42 float32 elements: beyond MAX_BROADCAST_BYTES


@pytest.mark.parametrize("raw, why", [
    (_raw([["cupy", "float32", [4], 15]]), "broadcast array of 15 bytes"),
    (_raw([["cupy", "float32", [4], -16]]), "broadcast array"),
    (_raw([["numpy", "float32", [4], 16]]), "lib numpy"),
    (_raw([["cupy", "float32", _HUGE, 4 << 42]]), "in all"),
    (_raw([["cupy", "float32", [1 << 36], 1 << 38]] * 5), "in all"),  # 5 * 2**38 > 2**40
    (_raw([["cupy", "float32", [4], 16]], event=0), "names event"),
    (_raw([["cupy", "float32", [4], 0, 0, 16]]), "kind 0 in a broadcast"),  # a pool spec
    (_raw([["cupy", "object", [4], 16]]), "dtype code"),
    (_raw([["pickle", "float32", [4], 16]]), "lib code"),
    (_raw([["cupy", "float32", [-4], 16]]), "shape"),
    (_raw([["cupy", "float32", [2] * 33, 16]]), "shape"),
    (_raw([["numpy", "float32", [4], -1, b"short"]]), "inline"),
    (_raw([["cupy", "float32", [4], 16]] * 4097), "arrays"),
])
def test_hostile_broadcast_descriptors_are_protocol_violations(raw: bytes, why: str) -> None:
    with pytest.raises(ProtocolViolation, match=why):
        Descriptor.decode(raw, None, broadcast=True)


def test_broadcast_limit_is_inclusive() -> None:
    n = MAX_BROADCAST_BYTES
    desc = Descriptor.decode(_raw([["cupy", "uint8", [n], n]]), None, broadcast=True)
    assert desc.arrays[0].nbytes == n and desc.arrays[0].segment == BROADCAST


def test_ipc_descriptors_refuse_broadcast_specs() -> None:
    with pytest.raises(ProtocolViolation, match="kind 2 in an IPC"):
        Descriptor.decode(_raw([["cupy", "float32", [4], 16]], event=0), None)


# -- the plan -----------------------------------------------------------------------------------
def test_one_communicator_per_sender_per_distinct_shard() -> None:
    members = (5, 3, 9)
    plan = communicator_plan(_shards(Layout(), members))
    assert plan == {m: (CommSpec(m, 0, members),) for m in members}
    assert plan[3][0].root_rank == 1
    # two subgroups over the same members share each sender's communicator; a subgroup with
    # one sender adds nothing new; a sharded one adds a communicator per shard of 2+ members
    layout = Layout((SubgroupSpec("a"), SubgroupSpec("b", senders=1),
                     SubgroupSpec("c", shards=2)))
    plan = communicator_plan(_shards(layout, members))
    assert plan[5] == (CommSpec(5, 0, members), CommSpec(5, 1, (5, 9)))
    assert plan[9] == (CommSpec(9, 0, members), CommSpec(9, 1, (5, 9)))
    assert plan[3] == (CommSpec(3, 0, members),)  # its shard of "c" has one member


def test_single_member_shards_get_no_communicator_unless_asked() -> None:
    assert communicator_plan(_shards(Layout(), (4,))) == {}
    assert communicator_plan(_shards(Layout(), (4,)), min_ranks=1) == {4: (CommSpec(4, 0, (4,)),)}


_layouts = st.lists(
    st.builds(
        lambda i, shards, senders, cap: SubgroupSpec(f"s{i}", shards=shards, senders=senders,
                                                     max_members=cap),
        st.integers(0, 10**6), st.integers(1, 3), st.none() | st.integers(1, 3),
        st.none() | st.integers(3, 8),
    ),
    min_size=1, max_size=4, unique_by=lambda s: s.name,
).map(lambda subs: Layout(tuple(subs)))


@settings(max_examples=200, deadline=None)
@given(_layouts, st.permutations(list(range(8))), st.integers(2, 8), st.randoms())
def test_joining_in_the_shared_order_never_deadlocks(layout: Layout, perm: list[int], n: int,
                                                     rnd: random.Random) -> None:
    """Every member joins its communicators one after the other in ``ViewComms.order``; a join
    returns once every rank is at it. Simulated with members scheduled at random: all finish."""
    members = tuple(perm[:n])
    plan = communicator_plan(_shards(layout, members))
    views = {m: ViewComms(1, members, plan, m) for m in members}
    # any two members meet their shared communicators in the same relative order
    for a in members:
        for b in members:
            shared_a = [s for s in views[a].order if b in s.members]
            shared_b = [s for s in views[b].order if a in s.members]
            assert shared_a == shared_b
    pos = {m: 0 for m in members}
    at: dict[CommSpec, set[int]] = collections.defaultdict(set)
    done: set[CommSpec] = set()
    for _ in range(10_000):
        pending = [m for m in members if pos[m] < len(views[m].order)]
        if not pending:
            break
        progressed = False
        for m in rnd.sample(pending, len(pending)):
            spec = views[m].order[pos[m]]
            at[spec].add(m)
            if spec in done or at[spec] == set(spec.members):
                done.add(spec)
                pos[m] += 1
                progressed = True
        assert progressed, f"deadlock: {pos}"
    assert all(pos[m] == len(views[m].order) for m in members)


# -- per-view bookkeeping -----------------------------------------------------------------------
def test_view_comms_name_only_communicators_this_member_is_in() -> None:
    members = (0, 1, 2)
    layout = Layout((SubgroupSpec("a"), SubgroupSpec("c", shards=2)))
    plan = communicator_plan(_shards(layout, members))  # shards of c: (0, 2) and (1,)
    vs = ViewComms(7, members, plan, 1)
    assert [(s.root, s.index) for s in vs.order] == [(0, 0), (1, 0), (2, 0)]
    assert vs.comm_for_uid(0, 0).spec == CommSpec(0, 0, members)
    assert vs.comm_for_uid(0, 0).rank == 1
    with pytest.raises(ProtocolViolation, match="does not root or this member is not in"):
        vs.comm_for_uid(0, 1)  # (0, 2): member 1 is not a rank
    with pytest.raises(ProtocolViolation):
        vs.comm_for_data(5, 0)
    assert vs.sending_comm((2, 0)) is vs.comms[(1, 0)]
    assert vs.sending_comm((2,)) is None
    v0 = ViewComms(7, members, plan, 0)
    assert v0.sending_comm((2,)) is v0.comms[(0, 1)]
    assert v0.sending_comm((1, 2)) is v0.comms[(0, 0)]


def test_broadcasts_are_taken_strictly_in_the_roots_order() -> None:
    comm = Comm(spec=CommSpec(3, 0, (3, 4)), rank=1)
    assert [comm.take_send() for _ in range(3)] == [0, 1, 2]
    comm.take_recv(0)
    comm.take_recv(1)
    with pytest.raises(ProtocolViolation, match=r"broadcast 1 .* where 2 was due"):
        comm.take_recv(1)  # a repeat
    with pytest.raises(ProtocolViolation, match=r"broadcast 5 .* where 2 was due"):
        comm.take_recv(5)  # a gap
    comm.take_recv(2)


# one entry of a communicator's ``inflight`` queue: (event, completion callback, regions)
_InFlight = tuple[int, Callable[[], None], list[tuple[int, int]]]


def _watch(comm: Comm, start: float, end: float, limit_s: float = 60.0) -> float | None:
    """Run the watchdog every 0.5 s (as NcclPlane._check_async does) from ``start`` to ``end``:
    the first time it calls ``comm`` stalled, or None."""
    t = start
    while t <= end:
        if comm.stalled(t, limit_s):
            return t
        t += 0.5
    return None


def test_a_communicator_is_stalled_only_when_its_oldest_broadcast_never_moves() -> None:
    """The receivers' watchdog: the same broadcast oldest in flight for the limit is a stall;
    any completion (a new oldest) or an empty queue starts the clock again."""
    comm = Comm(spec=CommSpec(3, 0, (3, 4)), rank=1)
    assert _watch(comm, 0.0, 9.5) is None  # nothing in flight
    first: _InFlight = (1, lambda: None, [])
    second: _InFlight = (2, lambda: None, [])
    comm.inflight.extend([first, second])
    assert _watch(comm, 10.0, 69.5) is None  # the clock starts at the first sight of `first`
    comm.inflight.popleft()  # `first` completed at last: progress
    assert _watch(comm, 70.0, 200.0) == 130.0  # `second` has been oldest for 60 s
    comm.inflight.clear()
    assert _watch(comm, 200.5, 500.0) is None


def test_the_stall_limit_grows_with_the_broadcasts_size() -> None:
    """A large broadcast on a slow network is not a stall: its bytes at 100 MB/s are added."""
    comm = Comm(spec=CommSpec(3, 0, (3, 4)), rank=1)
    big = (1, lambda: None, [(0x1000, 10 << 30), (0x9000, 2 << 30)])  # 12 GiB it writes
    comm.inflight.append(big)
    assert _watch(comm, 0.0, 1000.0) == 60.0 + 129.0  # 60 s + 12 GiB / 100 MB/s, rounded up


def test_a_late_watchdog_check_restarts_the_clock() -> None:
    """A loop blocked past the limit saw no progress it could have seen: no stall then."""
    comm = Comm(spec=CommSpec(3, 0, (3, 4)), rank=1)
    comm.inflight.append((1, lambda: None, []))
    assert not comm.stalled(0.0, 60.0)
    assert not comm.stalled(100.0, 60.0)  # 100 s since the last check: the clock restarts
    assert _watch(comm, 100.5, 200.0) == 160.0


def test_the_driver_gives_the_nccl_plane_the_configured_limits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Config.nccl_setup_s, nccl_stall_s and the GPU polling keys reach the plane (its
    constructor needs CuPy: a stand-in records what the driver passes)."""
    from derecho_async.runtime.driver import Driver, Host
    from derecho_async.transport.loopback import LoopbackFabric

    made: list[dict[str, Any]] = []

    class Recorder:
        kinds: tuple[int, ...] = ()
        device = 0

        def __init__(self, *args: object, **kwargs: Any) -> None:
            made.append(kwargs)

    monkeypatch.setattr("derecho_async.runtime.gpu.nccl.NcclPlane", Recorder)

    def start(config: da.Config) -> dict[str, Any]:
        driver = Driver(config, LoopbackFabric().transport(0), Layout(), cast(Host, object()))
        driver._start_nccl_plane()
        return made[-1]

    chosen = start(da.Config(group="g", member_id=0, nccl_setup_s=2, nccl_stall_s=300.5,
                             gpu_busy_poll_us=0, gpu_poll_interval_us=10))
    assert (chosen["setup_s"], chosen["stall_s"]) == (2.0, 300.5)
    assert (chosen["busy_poll_us"], chosen["poll_interval_us"]) == (0.0, 10.0)
    default = start(da.Config(group="g", member_id=0))
    assert (default["setup_s"], default["stall_s"]) == (60.0, 60.0)
    assert (default["busy_poll_us"], default["poll_interval_us"]) == (2000.0, 80.0)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.integers(1, 30), st.randoms())
def test_concurrent_senders_each_keep_their_own_order(n: int, count: int,
                                                      rnd: random.Random) -> None:
    """Several roots send at once; channels are FIFO per pair but interleave arbitrarily across
    pairs. Each receiver issues every root's broadcasts in that root's order, and no root's
    order depends on another's (no cross-communicator waiting to deadlock on)."""
    members = tuple(range(n))
    plan = communicator_plan(_shards(Layout(), members))
    views = {m: ViewComms(1, members, plan, m) for m in members}
    channels: dict[tuple[int, int], collections.deque[tuple[int, int]]] = {
        (a, b): collections.deque() for a in members for b in members if a != b}
    for i in range(count):
        for root in rnd.sample(members, n):
            comm = views[root].comms[(root, 0)]
            seq = comm.take_send()
            for dst in members:
                if dst != root:
                    channels[(root, dst)].append((seq, i))
    issued: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    while any(channels.values()):
        a, b = rnd.choice([k for k, q in channels.items() if q])
        seq, i = channels[(a, b)].popleft()
        views[b].comm_for_data(a, 0).take_recv(seq)
        issued[(b, a)].append(i)
    assert all(order == list(range(count)) for order in issued.values())


def test_early_unique_ids_are_held_bounded_and_dropped_with_old_views() -> None:
    early = EarlyUids(limit=3)
    uid = bytes(128)
    early.hold(5, 1, 0, uid)
    early.hold(6, 1, 0, uid)
    early.hold(7, 2, 0, uid)
    with pytest.raises(ProtocolViolation, match="more than 3"):
        early.hold(8, 1, 0, uid)
    assert early.take(6) == [(1, 0, uid)]  # view 5's are dropped with it
    assert len(early) == 1
    assert early.take(7) == [(2, 0, uid)] and len(early) == 0
