"""Golden scenario scripts (see tests/scenario_runner.py); re-record with
DERECHO_ASYNC_RERECORD=1."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.scenario_runner import SEPARATOR, run_script, split

SCRIPTS = sorted((Path(__file__).parent / "scenarios").glob("*.txt"))


def test_the_required_scenarios_exist() -> None:
    names = {p.stem for p in SCRIPTS}
    assert {
        "follower_crash",
        "leader_crash_mid_proposal",
        "crash_during_ragged_trim",
        "two_concurrent_crashes",
        "join_during_traffic",
        "partition_3_2_minority_wedges",
        "voluntary_leave",
        "idle_sender_nulls",
    } <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_scenario(path: Path) -> None:
    script, expected = split(path)
    actual = run_script(script)
    if os.environ.get("DERECHO_ASYNC_RERECORD") == "1" or expected is None:
        path.write_text(script + SEPARATOR + "\n" + actual)
        if expected is None:
            pytest.skip(f"recorded {path.name}; run again to compare")
        return
    assert actual == expected
