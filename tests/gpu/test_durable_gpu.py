"""Durable groups with device arrays in their calls (marker ``gpu``): arrays are logged by
value (copied to host), read back by ``history()`` as numpy arrays, and replayed at restart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import derecho_async as da
from tests.gpu import need_cupy

pytestmark = pytest.mark.gpu


def test_device_arrays_are_logged_by_value_and_replayed_after_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_cupy()
    from tests.gpu import durable_gpu_apps as apps

    monkeypatch.setenv("DA_GPU_OUT", str(tmp_path))
    group = f"gpudurable{os.getpid()}"
    data = tmp_path / "data"
    codes = da.launch_local(3, apps.log_device_calls, group=group, timeout=180,
                            data_dir=str(data))
    assert codes == [0, 0, 0]
    logs = [json.loads((tmp_path / f"log-{m}.json").read_text()) for m in range(3)]
    expected = sorted(512 * 512 * float(m * 10 + i) for m in range(3) for i in range(apps.COUNT))
    for log in logs:
        assert log["types"] == ["numpy"], "history gives the logged arrays on the host"
        assert sorted(log["sums"]) == expected
        assert log["sums"] == logs[0]["sums"] == log["state"]
    codes = da.launch_local(3, apps.restart_device_log, group=group, timeout=180,
                            data_dir=str(data))
    assert codes == [0, 0, 0]
    for m in range(3):
        back = json.loads((tmp_path / f"restarted-{m}.json").read_text())
        assert back["state"] == logs[0]["state"]
