"""The command line and the local launcher, as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import derecho_async as da
from derecho_async.transport.shm import ShmTransport
from tests.runtime import apps

ROOT = Path(__file__).parents[2]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "derecho_async.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def test_demo_kills_a_member_and_the_survivors_logs_are_identical() -> None:
    r = _cli("demo", "--messages", "8000", "--size", "256")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SIGKILL member 2" in r.stdout
    assert "installed view 1: members [0, 1]" in r.stdout
    assert "survivors' logs identical: yes" in r.stdout
    assert "view change after the kill" in r.stdout


def test_bench_prints_a_table() -> None:
    r = _cli("bench", "--messages", "200", "--size", "1024", "--transport", "tcp")
    assert r.returncode == 0, r.stdout + r.stderr
    header, _rule, row = r.stdout.splitlines()[:3]
    assert "msgs/s" in header and row.split()[0] == "tcp"
    assert float(row.split()[5]) > 0


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [("--depth", "0", "must be at least 1, not 0"), ("--messages", "many", "not an integer")],
)
def test_bench_refuses_a_count_it_cannot_run(flag: str, value: str, why: str) -> None:
    """A depth of 0 used to wait forever for a free slot; now the command line says why."""
    r = _cli("bench", flag, value, timeout=30)
    assert r.returncode == 2
    assert f"argument {flag}: {why}" in r.stderr


def test_member_with_a_bad_config_names_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "member.toml"
    bad.write_text('[derecho_async]\ngroup = "g"\nmember_id = 0\nheartbeat_ms = -5\n')
    r = _cli("member", "--config", str(bad), timeout=30)
    assert r.returncode != 0
    assert "heartbeat_ms" in r.stderr and "ConfigError" in r.stderr


def test_launch_local_runs_members_and_returns_exit_codes() -> None:
    group = "launch-test"
    assert da.launch_local(
        3, apps.append_and_check, group=group, heartbeat_ms=10, suspect_after_ms=1000
    ) == [0, 0, 0]
    assert ShmTransport.segments(group) == []
    assert da.launch_local(2, apps.fail, group="launch-fail") == [0, 7]


def test_the_readme_example_runs() -> None:
    r = subprocess.run(
        [sys.executable, "examples/replicated_log.py"],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exit codes: [0, 0, 0]" in r.stdout
    assert r.stdout.count("answered by [0, 1, 2]") == 3
    logs = set(re.findall(r"log (\[[^\]]*\])", r.stdout))
    assert len(logs) == 1  # the same first three entries, in the same order, everywhere


def test_status_lists_a_groups_shared_memory_segments(capsys: pytest.CaptureFixture[str]) -> None:
    from multiprocessing import shared_memory

    from derecho_async.cli import main
    from derecho_async.transport.shm.files import PREFIX

    group = f"statustest{os.getpid()}"
    seg = shared_memory.SharedMemory(name=f"{PREFIX}{group}.0.1", create=True, size=8192)
    try:
        assert main(["status"]) == 0
        out = capsys.readouterr().out
        assert f"group {group}: 1 segments" in out
        assert f"{PREFIX}{group}.0.1" in out
    finally:
        seg.close()
        seg.unlink()
    assert main(["status"]) == 0
    assert group not in capsys.readouterr().out


def test_secret_prints_a_fresh_secret_that_config_accepts() -> None:
    first, second = _cli("secret", timeout=30), _cli("secret", timeout=30)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    a, b = first.stdout.strip(), second.stdout.strip()
    assert a != b and len(a) == 43 and first.stdout == a + "\n"
    for text in (a, b):
        c = da.Config(group="g", member_id=0, transport="tcp", secret=text)
        assert c.secret == text


def test_certs_makes_a_ca_once_and_member_files_config_can_use(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    made = _cli("certs", "--group", "kv", "--members", "0-2", "--dir", str(out), timeout=60)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.key", "ca.pem", *[f"member-{m}.{x}" for m in range(3) for x in ("key", "pem")]
    ]
    for key in out.glob("*.key"):
        assert key.stat().st_mode & 0o777 == 0o600
    assert f'member 1: tls_cert = "{out}/member-1.pem"' in made.stdout
    ca = (out / "ca.pem").read_bytes()
    # a joiner's certificate later: the CA is reused, existing members are not overwritten
    again = _cli("certs", "--group", "kv", "--members", "2,3", "--dir", str(out), timeout=60)
    assert again.returncode == 2 and "member-2.pem" in again.stderr and "--force" in again.stderr
    assert not (out / "member-3.pem").exists()
    joiner = _cli("certs", "--group", "kv", "--members", "3", "--dir", str(out), timeout=60)
    assert joiner.returncode == 0, joiner.stderr
    assert (out / "ca.pem").read_bytes() == ca
    config = da.Config(
        group="kv", member_id=3, transport="tcp", tls_cert=str(out / "member-3.pem"),
        tls_key=str(out / "member-3.key"), tls_ca=str(out / "ca.pem"),
    )
    from derecho_async.transport import registry

    registry.kind("tcp").build(config)  # its certificate names it: no ConfigError
    for bad in (["--members", "2-1"], ["--members", "x"], ["--group", "a b"]):
        args = {"--group": "kv", "--members": "9", **dict(zip(bad[::2], bad[1::2], strict=True))}
        r = _cli("certs", "--dir", str(out), *[x for kv in args.items() for x in kv], timeout=60)
        assert r.returncode == 2 and "derecho-async certs:" in r.stderr, (bad, r.stderr)
