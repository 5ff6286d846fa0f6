"""A real network partition between members in network namespaces (root only; skipped with the
reason where namespaces cannot be made): the minority wedges with PartitionedError, the majority
goes on, and there is never a second primary view."""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import derecho_async as da

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

N = 5
SCRIPT = Path(__file__).with_name("partition_member.py")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def hosts() -> Iterator[tuple[list[str], list[str], list[str]]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = secrets.token_hex(2)
    bridge = f"dab{tag}"
    namespaces = [f"da{tag}n{i}" for i in range(N)]
    host_ends = [f"dv{tag}h{i}" for i in range(N)]
    subnet = 100 + int(tag, 16) % 100
    addrs = [f"10.213.{subnet}.{i + 1}" for i in range(N)]
    try:
        _ip("link", "add", bridge, "type", "bridge")
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot make a bridge here: {exc.stderr.decode().strip()}")
    try:
        _ip("link", "set", bridge, "up")
        for ns, host_end, addr in zip(namespaces, host_ends, addrs, strict=True):
            _ip("netns", "add", ns)
            _ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", host_end, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield namespaces, host_ends, addrs
    finally:
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for host_end in host_ends:
            subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _first_line(fd: int, deadline: float) -> str:
    """One line from a child's stdout, read unbuffered: ``communicate`` reads the rest from the
    same descriptor and would never see what a buffered reader took ahead."""
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 1) if ready else b""
        if not chunk:
            break
        line += chunk
    return line.decode()


def test_minority_wedges_majority_continues_no_second_primary(
    hosts: tuple[list[str], list[str], list[str]],
) -> None:
    namespaces, host_ends, addrs = hosts
    peers = json.dumps({i: f"{a}:7100" for i, a in enumerate(addrs)})
    group = f"part{secrets.token_hex(3)}"
    secret = da.new_secret()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2]))
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                str(SCRIPT),
                str(i),
                peers,
                group,
                secret,
                "8",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        for i, ns in enumerate(namespaces)
    ]
    firsts = [""] * N
    try:
        # Cut only once every member is in view 0 (on a loaded machine forming it can take
        # longer than any fixed pause), then let them append a while.
        deadline = time.monotonic() + 30
        for i, p in enumerate(procs):
            assert p.stdout is not None
            firsts[i] = _first_line(p.stdout.fileno(), deadline)
        time.sleep(1.0)  # appending
        for h in host_ends[3:]:
            _ip("link", "set", h, "down")  # cut members 3 and 4 off
        time.sleep(2.5)
        for h in host_ends[3:]:
            _ip("link", "set", h, "up")  # heal: they must stay wedged
        outs = [p.communicate(timeout=40) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    events = [
        [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        for out in (first + out for first, (out, _err) in zip(firsts, outs, strict=True))
    ]
    for i, evs in enumerate(events):
        assert evs, f"member {i} printed nothing: {outs[i][1][-2000:]}"
    # The minority wedged with PartitionedError and never installed a view without the others.
    for i in (3, 4):
        kinds = [e["event"] for e in events[i]]
        assert "partitioned" in kinds, events[i]
        assert all(e["view"] == 0 for e in events[i] if e["event"] == "view")
    # The majority installed one view of exactly the majority, and kept appending after it.
    views: dict[int, list[int]] = {}
    for i in (0, 1, 2):
        for e in events[i]:
            if e["event"] == "view":
                assert views.setdefault(e["view"], e["members"]) == e["members"]
    assert views[1] == [0, 1, 2]
    # Later views only come from the majority members leaving at the end: never the minority.
    assert all(set(members) <= {0, 1, 2} for v, members in views.items() if v >= 1)
    ends = {e["member"]: e for evs in events for e in evs if e["event"] == "end"}
    for i in (0, 1, 2):
        assert i in ends, f"member {i} never ended: {events[i]}\n{outs[i][1][-3000:]}"
        assert ends[i]["appended"] > 0 and ends[i]["items"] > ends[3]["items"]
