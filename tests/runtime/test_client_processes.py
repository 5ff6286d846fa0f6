"""A client in its own process makes 10,000 ordered calls through members over tcp while
members are SIGKILLed and replaced: every call acknowledged to the client is applied exactly
once at every surviving replica, and no call is applied twice anywhere.

``DERECHO_ASYNC_CLIENT_CALLS`` sets the number of calls (default 10,000)."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import socket
import time
from pathlib import Path

import pytest

import derecho_async as da
from derecho_async.launch import run_member
from tests.runtime import client_apps

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

CALLS = int(os.environ.get("DERECHO_ASYNC_CLIENT_CALLS", "10000"))
SECRET = "dasec1.3udV6eyHs_deYIHMcgpFIx-iPkrPCE-0hEYpY66oayw._nFzQO"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear within {timeout} s")
        time.sleep(0.02)


def test_every_acknowledged_client_call_is_applied_once_while_members_die(
        tmp_path: Path) -> None:
    rng = random.Random(11)
    os.environ["DA_CLIENT_OUT"] = str(tmp_path)
    ctx = multiprocessing.get_context("spawn")
    group = f"clients{os.getpid()}"
    listen = {m: f"127.0.0.1:{_free_port()}" for m in range(3)}
    client_secret = da.new_secret()
    common = dict(group=group, transport="tcp", secret=SECRET, initial_members=3,
                  heartbeat_ms=20, suspect_after_ms=600, client_listen="127.0.0.1:0",
                  client_secret=client_secret)
    procs: dict[int, multiprocessing.process.BaseProcess] = {}

    def start(m: int, **fields: object) -> None:
        p = ctx.Process(target=run_member, args=(client_apps.member, {
            **common, "member_id": m, **fields}), name=f"client-trial-member-{m}")
        p.start()
        procs[m] = p

    for m in range(3):
        start(m, listen=listen[m], peers=listen)
    for m in range(3):
        _wait(tmp_path / f"up-{m}", 60)
    peers = {m: (tmp_path / f"up-{m}").read_text() for m in range(3)}
    client = ctx.Process(target=client_apps.run_client,
                         args=(group, peers, client_secret, CALLS, str(tmp_path)))
    client.start()
    killed: list[int] = []
    live = [0, 1, 2]
    next_id = 3
    try:
        _wait(tmp_path / "progress", 60)
        for k in range(3):  # kill a member mid-stream (first the relay), then replace it
            time.sleep(rng.uniform(0.2, 0.6))
            if not client.is_alive():
                break
            relay = int((tmp_path / "progress").read_text().split()[1])
            victim = relay if k == 0 and relay in live else rng.choice(live)
            os.kill(procs[victim].pid, signal.SIGKILL)  # type: ignore[arg-type]
            live.remove(victim)
            killed.append(victim)
            listen[next_id] = f"127.0.0.1:{_free_port()}"  # it asks the live members in
            start(next_id, listen=listen[next_id], peers={m: listen[m] for m in live})
            _wait(tmp_path / f"up-{next_id}", 60)
            live.append(next_id)
            next_id += 1
        client.join(240)
        assert client.exitcode == 0, f"the client exited with {client.exitcode}"
    finally:
        (tmp_path / "stop").write_text("")
        for p in [client, *procs.values()]:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    result = json.loads((tmp_path / "client.json").read_text())
    assert not result["failed"], list(result["failed"].items())[:3]
    acked = result["acked"]
    assert len(acked) == CALLS
    reports = {m: json.loads((tmp_path / f"report-{m}.json").read_text()) for m in live}
    for m, report in reports.items():
        tokens = report["tokens"]
        assert len(tokens) == len(set(tokens)), f"member {m} applied a call twice"
        missing = set(acked) - set(tokens)
        assert not missing, f"member {m} lacks {len(missing)} acknowledged calls"
    assert len({json.dumps(r["tokens"]) for r in reports.values()}) == 1  # the same order
    assert len(killed) == 3 and result["failovers"] >= 1
    print("client trial", json.dumps({"calls": CALLS, "killed": killed,
                                      "failovers": result["failovers"], "live": live}))
