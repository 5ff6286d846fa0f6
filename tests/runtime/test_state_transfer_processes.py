"""State transfer between real processes over shm: a state above the old 1 GiB frame bound."""

from __future__ import annotations

import json
import pathlib

import pytest

import derecho_async as da
from derecho_async import hotpath
from tests.runtime import apps


@pytest.mark.skipif(
    hotpath.IMPLEMENTATION == "pure",
    reason="the pure twin's bytes_copy holds the GIL by design (it is the reference, not the "
    "fast path): copying a GiB stalls the loops of 4 members on few cores",
)
def test_a_state_over_one_gib_joins_over_shm_and_nobody_leaves(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size_mb = 1027  # over the 1 GiB bound on one channel message
    monkeypatch.setenv("DA_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("DA_TEST_STATE_MB", str(size_mb))
    # (the sponsor's loop may be held for a third of a second by the copy on 2 busy cores: its
    # beacon thread keeps it in the group meanwhile, at the default suspicion timeout)
    codes = da.launch_local(4, apps.big_state_join, timeout=240, initial_members=3)
    reports = {m: json.loads((tmp_path / f"m{m}.json").read_text())
               for m in range(4) if (tmp_path / f"m{m}.json").exists()}
    assert sorted(reports) == [0, 1, 2, 3], (codes, reports)
    assert codes == [0, 0, 0, 0]
    digests = {r["digest"] for r in reports.values()}
    assert len(digests) == 1
    for r in reports.values():
        assert r["members"] == [0, 1, 2, 3]
        assert r["size"] == size_mb << 20
        assert set(r["replies"]) == {"0", "1", "2", "3"}
    assert reports[0]["views"] == [0, 1]  # one view change: the join; nobody left
