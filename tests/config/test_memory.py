"""Values that cannot work are refused when the Config is made (issue 41, row 9): a window past
what a view change can allocate in time, a heartbeat period too short to leave the loop time for
anything else, and a window, max_payload and member count whose tables do not fit the host's
memory. The host's memory is given to the check in these tests (``host_memory_as``); the
figure itself is computed as in a running member, and a real group at the largest window shows
it holds."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest

import derecho_async as da
from derecho_async.config import memory
from derecho_async.core.schema import RowSchema
from derecho_async.errors import ConfigError
from derecho_async.transport import registry
from derecho_async.transport.rdma import RdmaTransport
from derecho_async.transport.shm import ShmTransport, ring
from tests.config.memory_member import join_call_and_report
from tests.config.support import SECRET, make

GiB = 1 << 30
MiB = 1 << 20


# -- the ranges ------------------------------------------------------------------------------


def test_the_issues_window_is_refused_and_the_ceiling_taken() -> None:
    with pytest.raises(ConfigError) as info:
        make(window=65536)
    assert info.value.key == "window"
    assert "from 1 to 1024" in info.value.expected
    assert make(window=memory.MAX_WINDOW).window == memory.MAX_WINDOW == 1024
    with pytest.raises(ConfigError):
        make(window=memory.MAX_WINDOW + 1)


@pytest.mark.parametrize("period", [1e-9, 0.001, 0.5, 0.999])
def test_a_heartbeat_period_below_a_millisecond_is_refused(period: float) -> None:
    with pytest.raises(ConfigError) as info:
        make(heartbeat_ms=period)
    assert info.value.key == "heartbeat_ms"
    assert "from 1 to 60000" in info.value.expected


def test_a_heartbeat_of_a_millisecond_is_taken() -> None:
    c = make(heartbeat_ms=1, suspect_after_ms=1.5)
    assert (c.heartbeat_ms, c.suspect_after_ms) == (1.0, 1.5)


# -- the figure ------------------------------------------------------------------------------


def test_the_figure_is_twice_the_table_and_the_links_a_member_holds() -> None:
    # a row (core/schema.py): 16 membership words, then per shard 3 words and 64 slots of a
    # 4-word header and 1024 payload words, then 1 persisted word per shard
    row = (16 + 3 + 64 * (4 + 1024) + 1) * 8
    assert RowSchema(2, 1, 64, 8192).row_bytes == row
    link = 4 * MiB + 4096  # the shm ring a member writes to each peer, its header included
    shm = make(initial_members=2)
    assert memory.member_bytes(shm) == 2 * 2 * row + link
    assert memory.host_bytes(shm) == 2 * memory.member_bytes(shm)  # both on this host
    tcp = make(initial_members=2, transport="tcp", secret=SECRET)
    assert memory.member_bytes(tcp) == 2 * 2 * row  # streams hold what is sent, no more
    assert memory.host_bytes(tcp) == memory.member_bytes(tcp)  # one member per host
    # a larger view: more rows in each table, and a ring to each other member
    assert memory.member_bytes(shm, members=5) == 2 * 5 * RowSchema(5, 1, 64, 8192).row_bytes \
        + 4 * link
    # shards multiply the slots of every row
    assert memory.member_bytes(tcp, shards=3) == 2 * 2 * RowSchema(2, 3, 64, 8192).row_bytes


def test_the_buffers_per_peer_are_the_transports_own() -> None:
    shm = inspect.signature(ShmTransport.__init__).parameters
    assert registry.kind("shm").link_bytes == shm["ring_bytes"].default + ring.HDR
    rdma = inspect.signature(RdmaTransport.__init__).parameters
    assert registry.kind("rdma").link_bytes == (
        2 * rdma["inbox_bytes"].default + rdma["bulk_slots"].default * rdma["bulk_block"].default
    )
    assert registry.kind("tcp").link_bytes == registry.kind("sim").link_bytes == 0


def test_a_table_that_cannot_fit_is_refused_naming_the_keys_and_the_figure() -> None:
    big = {"window": 1024, "max_payload": 1 << 20}
    with memory.host_memory_as(16 * GiB):
        # the issue's MemoryError, as a ConfigError: 3 members of a GiB-long row on one host
        with pytest.raises(ConfigError) as info:
            make(initial_members=3, **big)
        text = str(info.value)
        assert info.value.key == "window"
        for word in ("window", "max_payload", "initial_members", "shm", "18.0 GiB",
                     "half of the host's 16.0 GiB"):
            assert word in text, (word, text)
        # over tcp every member has a host of its own: 3 such members fit, 5 do not
        tcp = {"transport": "tcp", "secret": SECRET, **big}
        assert make(initial_members=3, **tcp).window == 1024
        with pytest.raises(ConfigError) as info:
            make(initial_members=5, **tcp)
        assert "10.0 GiB per member" in str(info.value)
        # and the same on a host twice as large is taken
    with memory.host_memory_as(64 * GiB):
        assert make(initial_members=3, **big).initial_members == 3


def test_the_default_settings_fit_a_small_host() -> None:
    with memory.host_memory_as(1 * GiB):
        assert make().window == 64
        assert make(initial_members=8).initial_members == 8
        make(initial_members=64, transport="tcp", secret=SECRET)


def test_a_group_with_more_shards_is_checked_when_its_layout_is_known() -> None:
    class KV(da.Actor):
        @da.ordered
        def put(self) -> None: ...

        def snapshot(self) -> bytes:
            return b""

        def restore(self, state: bytes) -> None: ...

    config = make(initial_members=4, transport="tcp", secret=SECRET, window=1024,
                  max_payload=1 << 16)
    with memory.host_memory_as(4 * GiB):
        da.Group(config, actors=[da.Sharded(KV, shards=2, replicas=2)])  # 2 x 4 x 2 rows fit
        with pytest.raises(ConfigError) as info:
            da.Group(config, actors=[da.Sharded(KV, shards=8, replicas=2)])
        assert info.value.key == "window" and "8 shards" in str(info.value)


# -- the host's memory -----------------------------------------------------------------------


def test_the_host_memory_is_the_smaller_of_the_physical_and_the_cgroup_limit(
    tmp_path: Path,
) -> None:
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = tmp_path / "memory.max"
    assert memory.read_host_memory((str(tmp_path / "absent"),)) == physical
    limit.write_text("max\n")
    assert memory.read_host_memory((str(limit),)) == physical
    limit.write_text(f"{physical // 4}\n")
    assert memory.read_host_memory((str(limit),)) == physical // 4
    limit.write_text(f"{physical * 4}\n")  # cgroup v1 writes a huge number for none
    assert memory.read_host_memory((str(limit),)) == physical
    assert 0 < memory.host_memory() <= physical


def test_the_assumed_host_memory_is_undone_on_exit() -> None:
    real = memory.host_memory()
    with memory.host_memory_as(123 * MiB):
        assert memory.host_memory() == 123 * MiB
    assert memory.host_memory() == real


# -- a real group at the largest window -------------------------------------------------------


def test_a_group_at_the_largest_window_starts_and_calls_in_a_few_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # member processes of their own: what each one's memory grew by is its own
    monkeypatch.setenv("DA_TEST_OUT", str(tmp_path))
    fields: dict[str, Any] = {"window": memory.MAX_WINDOW, "heartbeat_ms": 10,
                              "suspect_after_ms": 2000}
    codes = da.launch_local(2, join_call_and_report, transport="shm", timeout=60, **fields)
    assert codes == [0, 0]
    figure = memory.member_bytes(da.Config(group="g", member_id=0, initial_members=2, **fields))
    table = 2 * RowSchema(2, 1, memory.MAX_WINDOW, 8192).row_bytes
    for m in range(2):
        report = json.loads((tmp_path / f"m{m}.json").read_text())
        assert report["took"] < 8.0, report
        # it grew by its table, and by no more than the figure (the peak of a view change)
        assert table * 0.9 <= report["grown"] <= figure + 16 * MiB, (report, table, figure)
