"""The liveness beacon of both twins (derecho_async/_hotpath_pure/beacon.py): it counts into
every target word, stops counting once the loop has not touched it for the hold time, refuses
bad arguments with the same errors, and pins its buffers until they are removed; the native
one counts while the GIL is held."""

from __future__ import annotations

import mmap
import random
import time
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from derecho_async import _hotpath_pure as pure
from tests.hotpath.twins import SETTINGS, native, needs_native, outcome, same

TWINS = [pytest.param(pure, id="pure"),
         pytest.param(native, id="native", marks=needs_native)]


def _word(buf: Any, offset: int) -> int:
    return int.from_bytes(bytes(buf[offset : offset + 8]), "little")


def _until(pred: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("twin", TWINS)
def test_it_counts_into_every_target_until_removed(twin: ModuleType) -> None:
    a, b = bytearray(64), mmap.mmap(-1, 4096)
    beacon = twin.beacon_start(0.002, 0)
    try:
        twin.beacon_add(beacon, 1, (a, 8))
        twin.beacon_add(beacon, 2, (b, 64))
        _until(lambda: _word(a, 8) >= 5 and _word(b, 64) >= 5)
        with pytest.raises(BufferError):
            b.close()  # pinned while counted into
        assert twin.beacon_remove(beacon, 2) is True
        assert twin.beacon_remove(beacon, 2) is False
        frozen = _word(b, 64)
        _until(lambda: _word(a, 8) >= frozen + 5)
        assert _word(b, 64) == frozen
        b.close()
        assert twin.beacon_count(beacon) >= _word(a, 8) - 1
        assert a[:8] == bytes(8) and a[16:] == bytes(48)  # nothing but the word is written
    finally:
        twin.beacon_stop(beacon)
        twin.beacon_stop(beacon)  # idempotent
    after = _word(a, 8)
    time.sleep(0.02)
    assert _word(a, 8) == after
    a.append(0)  # unpinned: a bytearray with exports could not grow


@pytest.mark.parametrize("twin", TWINS)
def test_it_stops_counting_when_the_loop_is_held_past_the_hold_time(twin: ModuleType) -> None:
    a = bytearray(8)
    beacon = twin.beacon_start(0.002, 0.05)
    try:
        twin.beacon_add(beacon, 0, (a, 0))
        for _ in range(20):  # a loop that runs touches it
            twin.beacon_touch(beacon)
            time.sleep(0.01)
        moving = _word(a, 0)
        assert moving >= 20
        time.sleep(0.3)  # not touched: it stops after 0.05 s
        held = _word(a, 0)
        assert held - moving <= 40
        time.sleep(0.1)
        assert _word(a, 0) == held
        twin.beacon_touch(beacon)  # the loop runs again: so does the count
        _until(lambda: _word(a, 0) > held)
    finally:
        twin.beacon_stop(beacon)


@needs_native
def test_the_native_beacon_counts_while_the_gil_is_held() -> None:
    assert native is not None
    a = bytearray(8)
    data = [random.random() for _ in range(1_000_000)]
    beacon = native.beacon_start(0.002, 0)
    try:
        native.beacon_add(beacon, 0, (a, 0))
        time.sleep(0.01)
        before = _word(a, 0)
        start = time.monotonic()
        sorted(data)  # one C call that keeps the GIL throughout
        took = time.monotonic() - start
        during = _word(a, 0) - before  # read right after the call, before the GIL goes
        assert took > 0.1
        assert during >= took / 0.002 / 4, (during, took)
    finally:
        native.beacon_stop(beacon)


@needs_native
@pytest.mark.parametrize("call", [
    ("beacon_start", 0.0, 0),
    ("beacon_start", 0.01, -1),
    ("beacon_start", 0.01, 4000),
    ("beacon_start", "x", 0),
    ("beacon_start", float("nan"), 0),
    ("beacon_add", "not a beacon", 1, (bytearray(8), 0)),
    ("beacon_touch", 3),
    ("beacon_stop", None),
    ("beacon_count", b""),
    ("beacon_set_view", None, 1),
])
def test_bad_arguments_get_the_same_errors(call: tuple[Any, ...]) -> None:
    assert native is not None
    name, *args = call
    want = outcome(getattr(pure, name), *args)
    got = outcome(getattr(native, name), *args)
    assert want[0] != "ok"
    assert got == want


@needs_native
@pytest.mark.parametrize("target", [
    (bytes(8), 0),  # read-only
    (bytearray(8), 1),  # past the end
    (bytearray(8), -1),
    (bytearray(4), 0),
    (bytearray(16), 9),
])
def test_bad_targets_get_the_same_errors(target: tuple[Any, int]) -> None:
    assert native is not None
    outcomes = []
    for twin in (pure, native):
        beacon = twin.beacon_start(0.01, 0)
        try:
            outcomes.append(outcome(twin.beacon_add, beacon, 1, target))
        finally:
            twin.beacon_stop(beacon)
    assert outcomes[0][0] != "ok"
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("twin", TWINS)
def test_a_stopped_beacon_takes_no_target(twin: ModuleType) -> None:
    beacon = twin.beacon_start(0.01, 0)
    twin.beacon_stop(beacon)
    assert outcome(twin.beacon_add, beacon, 1, (bytearray(8), 0)) == (
        "ValueError", "the beacon is stopped")


@needs_native
@pytest.mark.parametrize("call", [
    ("beacon_add_peer", "127.0.0.1", 0),
    ("beacon_add_peer", "127.0.0.1", 70000),
    ("beacon_add_peer", "localhost", 9),
    ("beacon_add_peer", "::1x", 9),
    ("beacon_add_peer", b"127.0.0.1", 9),
    ("beacon_udp", -1, 1, 1, bytes(16)),
    ("beacon_udp", None, 1, 1, bytes(16)),
])
def test_bad_peers_get_the_same_errors(call: tuple[Any, ...]) -> None:
    assert native is not None
    name, *args = call
    outcomes = []
    for twin in (pure, native):
        beacon = twin.beacon_start(0.01, 0)
        try:
            if name == "beacon_add_peer":
                outcomes.append(outcome(twin.beacon_add_peer, beacon, 1, *args))
            else:
                outcomes.append(outcome(twin.beacon_udp, beacon, *args))
        finally:
            twin.beacon_stop(beacon)
    assert outcomes[0][0] != "ok", outcomes
    assert outcomes[0] == outcomes[1]


@needs_native
@SETTINGS
@given(key=st.binary(min_size=14, max_size=18), data=st.binary(max_size=80))
def test_siphash_of_the_twins_agrees(key: bytes, data: bytes) -> None:
    same("siphash24", key, data)


@pytest.mark.parametrize("twin", TWINS)
def test_a_udp_beacon_sends_signed_datagrams(twin: ModuleType) -> None:
    import socket

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(2)
    key = bytes(range(16))
    beacon = twin.beacon_start(0.005, 0)
    try:
        twin.beacon_udp(beacon, tx, 7, 123, key)
        twin.beacon_set_view(beacon, 9)
        twin.beacon_add_peer(beacon, 1, "127.0.0.1", rx.getsockname()[1])
        counts = []
        for _ in range(3):
            d = rx.recv(100)
            assert len(d) == 48
            assert d[:8] == (0x31624144).to_bytes(8, "little")
            assert int.from_bytes(d[8:16], "little") == 7
            assert int.from_bytes(d[16:24], "little") == 123
            assert int.from_bytes(d[24:32], "little") == 9
            assert int.from_bytes(d[40:], "little") == pure.siphash24(key, d[:40])
            counts.append(int.from_bytes(d[32:40], "little"))
        assert counts == sorted(counts) and len(set(counts)) == 3
        assert twin.beacon_remove(beacon, 1) is True
    finally:
        twin.beacon_stop(beacon)
        tx.close()
        rx.close()


@pytest.mark.parametrize("twin", TWINS)
def test_a_forked_childs_copy_is_stopped_and_the_parents_runs_on(twin: ModuleType) -> None:
    import os

    a = mmap.mmap(-1, 4096)
    beacon = twin.beacon_start(0.001, 0)
    try:
        twin.beacon_add(beacon, 1, (a, 0))
        _until(lambda: _word(a, 0) >= 3)
        pid = os.fork()
        if pid == 0:  # the child: no thread; every call acts as on a stopped beacon
            code = 0
            try:
                if outcome(twin.beacon_add, beacon, 2, (bytearray(8), 0)) != (
                        "ValueError", "the beacon is stopped"):
                    code = 3
                elif twin.beacon_remove(beacon, 1) is not False:
                    code = 4
                else:
                    twin.beacon_set_view(beacon, 5)
                    twin.beacon_touch(beacon)
                    twin.beacon_count(beacon)
                    twin.beacon_stop(beacon)
                    del beacon
            except BaseException:
                code = 5
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        seen = _word(a, 0)
        _until(lambda: _word(a, 0) > seen + 3)  # the parent's thread counts on
    finally:
        twin.beacon_stop(beacon)
        a.close()
