"""A large call over shm between real processes: delivered, and no member's loop stalls."""

from __future__ import annotations

import json
import pathlib

import pytest

import derecho_async as da
from tests.runtime import apps


def test_a_large_call_is_delivered_without_stalling_any_members_loop(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DA_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("DA_TEST_CALL_MB", "384")
    codes = da.launch_local(3, apps.large_call, timeout=120, heartbeat_ms=50,
                            suspect_after_ms=500)
    assert codes == [0, 0, 0]
    reports = [json.loads((tmp_path / f"m{m}.json").read_text()) for m in range(3)]
    for r in reports:
        assert r["sizes"] == [384 << 20]
        assert r["views"] == [0]  # nobody was suspected or removed
        # heartbeats go on: no stretch the loop could not run anywhere near a suspicion timeout
        assert r["worst_gap_s"] < 0.25, r
