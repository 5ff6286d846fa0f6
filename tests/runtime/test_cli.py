"""The command line and the local launcher, as a user runs them."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import derecho_async as da
from derecho_async.transport.shm import ShmTransport
from tests.runtime import apps

pytestmark = pytest.mark.once  # the native half of `make test` only: see pyproject.toml

ROOT = Path(__file__).parents[2]


def _cli(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "derecho_async.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
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


def test_bench_json_is_one_object_on_stdout_and_progress_goes_to_stderr() -> None:
    # fails before issue 29: there was no --json and no progress
    r = _cli("bench", "--members", "2", "--messages", "50", "--json", "--progress", "0.01")
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(r.stdout)  # the whole of stdout: nothing else is printed there
    assert {k: result[k] for k in ("transport", "members", "senders", "messages", "size",
                                   "depth", "ok", "logs_identical")} == {
        "transport": "shm", "members": 2, "senders": 2, "messages": 50, "size": 1024,
        "depth": 32, "ok": True, "logs_identical": True}
    assert result["cores"] == os.cpu_count()
    assert result["delivered"] == 2 * 50 + 2  # the appends and both done markers
    assert result["msgs_per_s"] > 0 and 0 < result["p50_us"] <= result["p999_us"]
    assert [m["member"] for m in result["per_member"]] == [0, 1]
    assert len({m["digest"] for m in result["per_member"]}) == 1
    assert re.search(r"bench: delivered \d+/102 \(\d+%\)", r.stderr), r.stderr


def test_bench_refuses_more_senders_than_members() -> None:
    # fails before issue 29: int("x") or a fourth sender of three members went unchecked
    for senders in ("4", "x", "0"):
        r = _cli("bench", "--senders", senders, timeout=30)
        assert r.returncode == 2
        assert f"--senders must be 'all' or 1 to 3, not '{senders}'" in r.stderr


def test_version_names_the_version_and_the_active_hot_path() -> None:
    # fails before issue 29: there was no --version
    from derecho_async import hotpath

    version = importlib.metadata.version("derecho_async")
    r = _cli("--version", timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"derecho-async {version} (hot path: {hotpath.IMPLEMENTATION}, ")
    assert f"Python {sys.version.split()[0]})" in r.stdout
    pure = _cli("--version", timeout=30, env={**os.environ, "DERECHO_ASYNC_PURE_PYTHON": "1"})
    assert pure.returncode == 0, pure.stderr
    assert f"derecho-async {version} (hot path: pure, " in pure.stdout


_DEFAULTS = {
    "demo": {"--members": "3", "--transport": "shm", "--messages": "10000", "--size": "1024",
             "--depth": "32", "--heartbeat-ms": "50.0", "--suspect-after-ms": "500.0",
             "--timeout": "300.0"},
    "bench": {"--members": "3", "--messages": "20000", "--senders": "all",
              "--progress": "1.0"},
    "member": {"--messages": "1000", "--size": "1024", "--depth": "32"},
    "status": {},
    "secret": {},
    "certs": {"--dir": "certs", "--days": "365"},
    "repair": {},
}


@pytest.mark.parametrize("command", ["", *_DEFAULTS])
def test_help_is_plain_text_with_each_options_default(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # fails before issue 29: --help showed the module docstring's Sphinx markup, and options
    # had neither help nor their defaults
    from derecho_async.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*([command] if command else []), "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for markup in ("``", ":mod:", ":func:", ":class:", ":data:"):
        assert markup not in out, out
    text = " ".join(out.split())  # as if unwrapped
    if not command:
        assert all(f" {c} " in text for c in _DEFAULTS)
        return
    options = text[text.index("options:"):]
    for option, default in _DEFAULTS[command].items():
        # the option's own entry: from its name in the list to the next option
        entry = options[options.index(f" {option} "):]
        end = entry.find(" --", len(option) + 2)
        entry = entry if end < 0 else entry[:end]
        assert f"(default: {default})" in entry, entry
    # every option has a help text: no entry is just a name and a metavar
    for entry in re.split(r" (?=--[a-z])", options)[1:]:
        assert len(entry.split()) > 2, entry


def test_member_prints_readable_lines_with_wall_clock_times(tmp_path: Path) -> None:
    # fails before issue 29: it printed the workload's raw tuples with a monotonic timestamp
    group = f"clim{os.getpid()}"
    procs = []
    for m in range(2):
        toml = tmp_path / f"member-{m}.toml"
        toml.write_text(f'[derecho_async]\ngroup = "{group}"\nmember_id = {m}\n'
                        'initial_members = 2\ntransport = "shm"\n')
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "derecho_async.cli", "member", "--config", str(toml),
             "--messages", "50"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=ROOT))
    outs = [p.communicate(timeout=60) for p in procs]
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"
    for m, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, out + err
        lines = out.splitlines()
        for line in lines:
            assert re.fullmatch(rf"{stamp} member {m}: .+", line), line
        assert lines[0].endswith(f"joining group {group} over shm; 50 appends of 1024 B, at most "
                                 "32 outstanding")
        assert lines[1].endswith("installed view 0: members 0, 1")
        done = next(line for line in lines if ": done: " in line)
        assert "done: delivered 102 in " in done and "views 0; log digest " in done
        assert lines[-1].endswith("left the group")
    assert ShmTransport.segments(group) == []


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
    assert a != b and first.stdout == a + "\n"
    assert a.startswith("dasec1.") and len(a) == len(b) == 57
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


def test_certs_makes_client_certificates_that_name_no_member(tmp_path: Path) -> None:
    from derecho_async.transport.tcp.identity import certified_by_file

    out = tmp_path / "certs"
    made = _cli("certs", "--group", "kv", "--clients", "web,trainer", "--dir", str(out),
                timeout=60)
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.key", "ca.pem", "client-trainer.key", "client-trainer.pem", "client-web.key",
        "client-web.pem"]
    assert 'client web: ctx = ssl.create_default_context(cafile="' in made.stdout
    assert certified_by_file(str(out / "client-web.pem")) == []  # no member URI in it
    nothing = _cli("certs", "--group", "kv", "--dir", str(out), timeout=60)
    assert nothing.returncode == 2 and "--members, --clients" in nothing.stderr
    bad = _cli("certs", "--group", "kv", "--clients", "a b", "--dir", str(out), timeout=60)
    assert bad.returncode == 2 and "not a client name" in bad.stderr
