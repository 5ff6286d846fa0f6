"""Liveness off the event loop (shm, tcp): a member whose loop a handler holds longer than
``suspect_after_ms`` stays in the group (its beacon thread beats for the process), up to
``max_loop_hold_ms``; a stopped process (SIGSTOP) is still suspected within
``suspect_after_ms``. Real member processes, through the public API."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import derecho_async as da
from derecho_async import hotpath
from tests.runtime import apps

# suspicion well below the hold, heartbeats often enough that the old rule would act at once
FIELDS: dict[str, Any] = {"heartbeat_ms": 20, "suspect_after_ms": 400, "timeout": 90}


TRANSPORTS = pytest.mark.parametrize("transport", ["shm", "tcp"])


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, hold_ms: int,
         **fields: Any) -> dict[int, dict[str, Any]]:
    monkeypatch.setenv("DA_TEST_OUT", str(tmp_path))
    monkeypatch.setenv("DA_TEST_HOLD", how)
    monkeypatch.setenv("DA_TEST_HOLD_MS", str(hold_ms))
    codes = da.launch_local(3, apps.one_holds_its_loop, **{**FIELDS, **fields})
    out = {}
    for m in range(3):
        path = tmp_path / f"m{m}.json"
        if path.exists():
            out[m] = json.loads(path.read_text())
    assert codes[:2] == [0, 0], (codes, out)
    return out


@TRANSPORTS
@pytest.mark.parametrize("how", ["sleep", "gil"])
def test_a_member_whose_loop_is_held_stays_in_the_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], how: str,
    transport: str,
) -> None:
    if how == "gil" and hotpath.IMPLEMENTATION != "native":
        pytest.skip("the pure twin's beacon is a Python thread: it needs the GIL")
    out = _run(tmp_path, monkeypatch, how, 2000, transport=transport)
    # held 5 times the suspicion timeout: nobody removed it, and every append went through
    for m in range(3):
        assert out[m]["views"] == [[0, 1, 2], [0, 1, 2]], (m, out)
        assert out[m]["appended"] is True, (m, out)
    # the held member says so, and what keeps it in the group
    assert ("member 2: the event loop was held for" in (err := capfd.readouterr().err)
            and "(its beacon keeps it in the group until the loop is held for 60000 ms)" in err)


@TRANSPORTS
def test_without_a_beacon_a_held_loop_is_suspected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    out = _run(tmp_path, monkeypatch, "sleep", 2000, max_loop_hold_ms=0, transport=transport)
    for m in (0, 1):
        assert out[m]["views"][-1] == [0, 1], (m, out)
        assert out[m]["appended"] is True, (m, out)


@TRANSPORTS
def test_a_loop_held_past_max_loop_hold_ms_is_suspected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    out = _run(tmp_path, monkeypatch, "sleep", 2500, max_loop_hold_ms=800, transport=transport)
    for m in (0, 1):
        assert out[m]["views"][-1] == [0, 1], (m, out)
    # the removed member learns it soon: its former peers' beacons, of a view without it, do
    # not keep it waiting for them (it suspects them and wedges, as without beacons)
    assert out[2]["appended"] is not True and "Timeout" not in out[2]["appended"], out
    assert out[2]["took"] < 5, out


@TRANSPORTS
def test_a_stopped_process_is_still_suspected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    # SIGSTOP stops the beacon thread with the rest of the process
    out = _run(tmp_path, monkeypatch, "stop", 2000, transport=transport)
    for m in (0, 1):
        assert out[m]["views"][-1] == [0, 1], (m, out)
        assert out[m]["appended"] is True, (m, out)
