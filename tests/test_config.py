"""Tests of derecho_async.config: validation, TOML, environment, precedence, unknown keys."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest

from derecho_async.config import Config, parse_hostport
from derecho_async.errors import ConfigError

BASE: dict[str, Any] = {"group": "g", "member_id": 0}
SECRET = "s3cret-s3cret-s3cret"


def make(**changes: Any) -> Config:
    return Config(**{**BASE, **changes})


# ------------------------------------------------------------------------------- validation


def test_defaults() -> None:
    c = Config(group="weights", member_id=3)
    assert c.initial_members == 1
    assert c.transport == "shm"
    assert c.contact is None
    assert c.listen == "127.0.0.1:0"
    assert dict(c.peers) == {}
    assert c.secret is None
    assert (c.tls_cert, c.tls_key, c.tls_ca) == (None, None, None)
    assert c.heartbeat_ms == 50.0 and isinstance(c.heartbeat_ms, float)
    assert c.suspect_after_ms == 500.0
    assert c.window == 64
    assert c.send_batch is None
    assert c.max_payload == 8192
    assert c.partition_safety is True
    assert (c.rdma_device, c.rdma_port, c.rdma_gid_index) == (None, 1, None)
    assert c.log_level == "WARNING"
    assert (c.gpu_busy_poll_us, c.gpu_poll_interval_us) == (2000.0, 80.0)
    assert (c.nccl_setup_s, c.nccl_stall_s) == (60.0, 60.0)
    assert (c.max_call_mb, c.max_queued_calls, c.max_queued_mb) == (1023, 16384, 256)
    assert c.when_queue_full == "wait"
    assert c.check_p2p_reads is False
    assert c.state_chunk_kb == 32768
    assert (c.state_stall_s, c.fence_timeout_s) == (30.0, 60.0)


def test_full_valid_config() -> None:
    c = Config(
        group="a.B_c-9",
        member_id=2**63 - 1,
        initial_members=64,
        transport="tcp",
        contact="[::1]:7000",
        listen="0.0.0.0:7001",
        peers={1: "h1.example:7000", 0: "10.0.0.1:7000", 5: "[fe80::1]:9"},
        secret=SECRET,
        tls_cert="cert.pem",
        tls_key="key.pem",
        tls_ca="ca.pem",
        heartbeat_ms=5,
        suspect_after_ms=5.5,
        window=65536,
        max_payload=1 << 20,
        partition_safety=False,
        rdma_device="rxe0",
        rdma_port=255,
        rdma_gid_index=0,
        log_level="debug",
    )
    assert list(c.peers) == [0, 1, 5]
    assert c.heartbeat_ms == 5.0 and isinstance(c.heartbeat_ms, float)
    assert c.log_level == "DEBUG"


BAD_VALUES: list[tuple[str, object]] = [
    ("group", ""),
    ("group", "x" * 65),
    ("group", "has space"),
    ("group", "a/b"),
    ("group", "g\n"),
    ("group", 5),
    ("member_id", -1),
    ("member_id", 2**63),
    ("member_id", True),
    ("member_id", "1"),
    ("member_id", 1.0),
    ("initial_members", 0),
    ("initial_members", 65),
    ("initial_members", "2"),
    ("transport", "udp"),
    ("transport", "TCP"),
    ("transport", None),
    ("contact", "localhost"),
    ("contact", "localhost:0"),
    ("contact", "h:70000"),
    ("contact", "::1:7000"),
    ("contact", "[nonsense]:7000"),
    ("contact", ":7000"),
    ("contact", 7000),
    ("listen", "nohost"),
    ("listen", "h:-1"),
    ("listen", "h:port"),
    ("listen", None),
    ("peers", {0: "h:0"}),
    ("peers", {-1: "h:1"}),
    ("peers", {"0": "h:1"}),
    ("peers", {True: "h:1"}),
    ("peers", {0: 7000}),
    ("peers", [("0", "h:1")]),
    ("peers", "0=h:1"),
    ("secret", "short"),
    ("secret", 1234567890123456789),
    ("tls_cert", ""),
    ("tls_key", 3),
    ("tls_ca", ""),
    ("heartbeat_ms", -3),
    ("heartbeat_ms", 0),
    ("heartbeat_ms", float("nan")),
    ("heartbeat_ms", float("inf")),
    ("heartbeat_ms", "20"),
    ("heartbeat_ms", True),
    ("suspect_after_ms", 20.0),
    ("suspect_after_ms", 1),
    ("suspect_after_ms", float("inf")),
    ("suspect_after_ms", "500"),
    ("window", 0),
    ("window", 65537),
    ("window", 64.0),
    ("send_batch", -1),
    ("send_batch", 65537),
    ("send_batch", 8.0),
    ("max_payload", 63),
    ("max_payload", 100),
    ("max_payload", (1 << 20) + 8),
    ("max_payload", 56),
    ("partition_safety", 1),
    ("partition_safety", "false"),
    ("partition_safety", None),
    ("max_call_mb", 0),
    ("max_call_mb", 1024),
    ("max_call_mb", 1.0),
    ("max_call_mb", True),
    ("gpu_plane", "rdma"),
    ("gpu_plane", None),
    ("gpu_pool_mb", 0),
    ("gpu_pool_mb", 1.5),
    ("spin_us", -1),
    ("spin_us", float("nan")),
    ("spin_us", "100"),
    ("spin_us", True),
    ("rdma_device", ""),
    ("rdma_port", 0),
    ("rdma_port", 256),
    ("rdma_port", None),
    ("rdma_gid_index", -1),
    ("rdma_gid_index", "0"),
    ("log_level", "verbose"),
    ("log_level", 10),
    ("gpu_busy_poll_us", "100"),
    ("gpu_busy_poll_us", True),
    ("gpu_busy_poll_us", None),
    ("gpu_busy_poll_us", float("nan")),
    ("gpu_busy_poll_us", float("inf")),
    ("gpu_busy_poll_us", float("-inf")),
    ("gpu_busy_poll_us", -1),
    ("gpu_busy_poll_us", -1e-9),
    ("gpu_busy_poll_us", 1e6 + 1),
    ("gpu_poll_interval_us", "100"),
    ("gpu_poll_interval_us", True),
    ("gpu_poll_interval_us", None),
    ("gpu_poll_interval_us", float("nan")),
    ("gpu_poll_interval_us", float("inf")),
    ("gpu_poll_interval_us", float("-inf")),
    ("gpu_poll_interval_us", -1),
    ("gpu_poll_interval_us", -1e-9),
    ("gpu_poll_interval_us", 100_000.5),
    ("nccl_setup_s", "100"),
    ("nccl_setup_s", True),
    ("nccl_setup_s", None),
    ("nccl_setup_s", float("nan")),
    ("nccl_setup_s", float("inf")),
    ("nccl_setup_s", float("-inf")),
    ("nccl_setup_s", 0),
    ("nccl_setup_s", 0.0),
    ("nccl_setup_s", -1),
    ("nccl_setup_s", 86400.001),
    ("nccl_stall_s", "100"),
    ("nccl_stall_s", True),
    ("nccl_stall_s", None),
    ("nccl_stall_s", float("nan")),
    ("nccl_stall_s", float("inf")),
    ("nccl_stall_s", float("-inf")),
    ("nccl_stall_s", 0),
    ("nccl_stall_s", 0.0),
    ("nccl_stall_s", -1),
    ("nccl_stall_s", 86400.001),
    ("max_call_mb", 0),
    ("max_call_mb", -1),
    ("max_call_mb", 1024),
    ("max_call_mb", 1.0),
    ("max_call_mb", "16"),
    ("max_call_mb", True),
    ("max_call_mb", None),
    ("max_call_mb", float("nan")),
    ("max_call_mb", float("inf")),
    ("max_queued_calls", 0),
    ("max_queued_calls", -1),
    ("max_queued_calls", (1 << 24) + 1),
    ("max_queued_calls", 1.0),
    ("max_queued_calls", "16"),
    ("max_queued_calls", True),
    ("max_queued_calls", None),
    ("max_queued_calls", float("nan")),
    ("max_queued_calls", float("inf")),
    ("max_queued_mb", 0),
    ("max_queued_mb", -1),
    ("max_queued_mb", (1 << 20) + 1),
    ("max_queued_mb", 1.0),
    ("max_queued_mb", "16"),
    ("max_queued_mb", True),
    ("max_queued_mb", None),
    ("max_queued_mb", float("nan")),
    ("max_queued_mb", float("inf")),
    ("state_chunk_kb", 3),
    ("state_chunk_kb", -1),
    ("state_chunk_kb", (1 << 20) + 1),
    ("state_chunk_kb", 32.0),
    ("state_chunk_kb", "16"),
    ("state_chunk_kb", True),
    ("state_chunk_kb", None),
    ("state_chunk_kb", float("nan")),
    ("state_chunk_kb", float("inf")),
    ("when_queue_full", "drop"),
    ("when_queue_full", "WAIT"),
    ("when_queue_full", None),
    ("when_queue_full", 1),
    ("check_p2p_reads", 1),
    ("check_p2p_reads", "true"),
    ("check_p2p_reads", None),
    ("state_stall_s", "100"),
    ("state_stall_s", True),
    ("state_stall_s", None),
    ("state_stall_s", float("nan")),
    ("state_stall_s", float("inf")),
    ("state_stall_s", float("-inf")),
    ("state_stall_s", 0),
    ("state_stall_s", 0.0),
    ("state_stall_s", -1),
    ("state_stall_s", 86400.001),
    ("fence_timeout_s", "100"),
    ("fence_timeout_s", True),
    ("fence_timeout_s", None),
    ("fence_timeout_s", float("nan")),
    ("fence_timeout_s", float("inf")),
    ("fence_timeout_s", float("-inf")),
    ("fence_timeout_s", 0),
    ("fence_timeout_s", 0.0),
    ("fence_timeout_s", -1),
    ("fence_timeout_s", 86400.001),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES, ids=lambda v: repr(v)[:30])
def test_bad_value_names_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        make(**{key: value})
    assert info.value.key == key
    assert info.value.expected
    assert f"config key {key!r}: expected " in str(info.value)


def test_every_field_has_a_bad_value_test() -> None:
    fields = {f.name for f in dataclasses.fields(Config)}
    assert fields == {key for key, _ in BAD_VALUES}


def test_error_message_example() -> None:
    with pytest.raises(ConfigError) as info:
        make(heartbeat_ms=-3)
    assert info.value.key == "heartbeat_ms"
    assert info.value.got == -3
    assert "positive" in info.value.expected and "milliseconds" in info.value.expected
    assert isinstance(info.value, ValueError)


def test_tcp_requires_secret() -> None:
    with pytest.raises(ConfigError) as info:
        make(transport="tcp")
    assert info.value.key == "secret"
    assert "tcp" in info.value.expected
    assert make(transport="tcp", secret=SECRET).secret == SECRET


def test_secret_is_hidden() -> None:
    c = make(secret=SECRET)
    assert SECRET not in repr(c)
    with pytest.raises(ConfigError) as info:
        make(secret="too-short")
    assert "too-short" not in str(info.value)


@pytest.mark.parametrize(
    ("given", "missing"), [({"tls_cert": "c.pem"}, "tls_key"), ({"tls_key": "k.pem"}, "tls_cert")]
)
def test_tls_cert_and_key_go_together(given: dict[str, str], missing: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(**given)
    assert info.value.key == missing
    assert "together" in info.value.expected
    assert make(tls_ca="ca.pem").tls_ca == "ca.pem"


def test_suspect_after_must_exceed_heartbeat() -> None:
    with pytest.raises(ConfigError) as info:
        make(heartbeat_ms=600, suspect_after_ms=500)
    assert info.value.key == "suspect_after_ms"
    assert make(heartbeat_ms=600, suspect_after_ms=601).suspect_after_ms == 601.0


def test_unknown_key_in_constructor() -> None:
    with pytest.raises(ConfigError) as info:
        Config(**{**BASE, "heartbeat": 5})
    assert info.value.key == "heartbeat"
    assert info.value.got == 5
    assert info.value.expected.startswith(
        "one of: check_p2p_reads, contact, fence_timeout_s, gpu_busy_poll_us, gpu_plane,"
    )
    assert "heartbeat_ms," in info.value.expected


@pytest.mark.parametrize("required", ["group", "member_id"])
def test_missing_required_key(required: str) -> None:
    fields = {k: v for k, v in BASE.items() if k != required}
    with pytest.raises(ConfigError) as info:
        Config(**fields)
    assert info.value.key == required


def test_positional_arguments_are_refused() -> None:
    with pytest.raises(TypeError):
        Config("g", 0)  # type: ignore[call-arg]


def test_frozen_hashable_picklable() -> None:
    c = make(peers={1: "h:1", 0: "h:2"}, transport="tcp", secret=SECRET)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.window = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        c.peers[2] = "h:3"  # type: ignore[index]
    assert not hasattr(c, "__dict__")
    assert hash(c) == hash(make(peers={0: "h:2", 1: "h:1"}, transport="tcp", secret=SECRET))
    assert c == make(peers={0: "h:2", 1: "h:1"}, transport="tcp", secret=SECRET)
    assert c.peers == {0: "h:2", 1: "h:1"}
    for clone in (pickle.loads(pickle.dumps(c)), copy.copy(c), copy.deepcopy(c)):
        assert clone == c
        assert hash(clone) == hash(c)


def test_peers_is_a_private_copy() -> None:
    peers = {0: "h:1"}
    c = make(peers=peers)
    peers[1] = "h:2"
    assert dict(c.peers) == {0: "h:1"}


def test_replace() -> None:
    c = make(window=8)
    d = c.replace(window=16, log_level="info")
    assert (c.window, d.window, d.log_level) == (8, 16, "INFO")
    assert d.replace(peers={3: "h:3"}).peers == {3: "h:3"}
    with pytest.raises(ConfigError) as info:
        c.replace(window=0)
    assert info.value.key == "window"
    with pytest.raises(ConfigError) as info:
        c.replace(windows=3)
    assert info.value.key == "windows"


# ----------------------------------------------------------------------------- parse_hostport


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("localhost:7000", ("localhost", 7000)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("h-1.example.com:65535", ("h-1.example.com", 65535)),
        ("[::1]:7000", ("::1", 7000)),
        ("[2001:db8::5]:1", ("2001:db8::5", 1)),
    ],
)
def test_parse_hostport(text: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(text, "listen") == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "h",
        "h:",
        ":1",
        "h:65536",
        "h:+1",
        "h: 1",
        "::1:7000",
        "[::1]",
        "[zz]:1",
        "h h:1",
        "h:\uff11",
    ],
)
def test_parse_hostport_rejects(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_hostport(text, "contact")
    assert info.value.key == "contact"
    assert info.value.got == text


def test_parse_hostport_port_zero() -> None:
    with pytest.raises(ConfigError):
        parse_hostport("h:0", "contact", allow_port_zero=False)
    with pytest.raises(ConfigError):
        parse_hostport(None, "contact")


# ------------------------------------------------------------------------------- tuning keys

# key -> (default, accepted values at and inside its bounds)
NUMBER_KEYS: dict[str, tuple[float, list[float]]] = {
    "gpu_busy_poll_us": (2000.0, [0, 0.0, 0.5, 1e6, 1_000_000]),
    "gpu_poll_interval_us": (80.0, [0, 0.0, 40, 1e5]),
    "nccl_setup_s": (60.0, [1e-6, 1, 2.5, 86400, 86400.0]),
    "nccl_stall_s": (60.0, [1e-6, 1, 300.5, 86400]),
    "state_stall_s": (30.0, [1e-6, 1, 86400]),
    "fence_timeout_s": (60.0, [1e-6, 1, 86400]),
}
INT_KEYS: dict[str, tuple[int, list[int]]] = {
    "max_call_mb": (1023, [1, 512, 1023]),
    "max_queued_calls": (16384, [1, 1 << 24]),
    "max_queued_mb": (256, [1, 1 << 20]),
    "state_chunk_kb": (32768, [4, 5, 1 << 20]),
}


@pytest.mark.parametrize("key", sorted(NUMBER_KEYS))
def test_number_keys_accept_their_bounds_and_store_floats(key: str) -> None:
    default, accepted = NUMBER_KEYS[key]
    assert getattr(make(), key) == default
    for value in accepted:
        got = getattr(make(**{key: value}), key)
        assert got == value and type(got) is float


@pytest.mark.parametrize("key", sorted(INT_KEYS))
def test_int_keys_accept_their_bounds(key: str) -> None:
    default, accepted = INT_KEYS[key]
    assert getattr(make(), key) == default
    for value in accepted:
        got = getattr(make(**{key: value}), key)
        assert got == value and type(got) is int


def test_when_queue_full_and_check_p2p_reads() -> None:
    assert make(when_queue_full="error").when_queue_full == "error"
    assert make(when_queue_full="wait").when_queue_full == "wait"
    assert make(check_p2p_reads=True).check_p2p_reads is True


TUNING_ENV: dict[str, tuple[str, object]] = {
    "DERECHO_ASYNC_GPU_BUSY_POLL_US": ("0", 0.0),
    "DERECHO_ASYNC_GPU_POLL_INTERVAL_US": ("40", 40.0),
    "DERECHO_ASYNC_NCCL_SETUP_S": ("2.5", 2.5),
    "DERECHO_ASYNC_NCCL_STALL_S": ("3e2", 300.0),
    "DERECHO_ASYNC_MAX_CALL_MB": ("64", 64),
    "DERECHO_ASYNC_MAX_QUEUED_CALLS": (" 100 ", 100),
    "DERECHO_ASYNC_MAX_QUEUED_MB": ("8", 8),
    "DERECHO_ASYNC_WHEN_QUEUE_FULL": ("error", "error"),
    "DERECHO_ASYNC_CHECK_P2P_READS": ("yes", True),
    "DERECHO_ASYNC_STATE_CHUNK_KB": ("4", 4),
    "DERECHO_ASYNC_STATE_STALL_S": ("5", 5.0),
    "DERECHO_ASYNC_FENCE_TIMEOUT_S": ("0.5", 0.5),
}


def test_tuning_keys_load_from_the_environment() -> None:
    env = {variable: text for variable, (text, _) in TUNING_ENV.items()}
    c = Config.load(environ=env, **BASE)
    for variable, (_, value) in TUNING_ENV.items():
        key = variable.removeprefix("DERECHO_ASYNC_").lower()
        got = getattr(c, key)
        assert got == value and type(got) is type(value), key


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("DERECHO_ASYNC_GPU_BUSY_POLL_US", "soon"),
        ("DERECHO_ASYNC_GPU_BUSY_POLL_US", "nan"),
        ("DERECHO_ASYNC_GPU_POLL_INTERVAL_US", "1e9"),
        ("DERECHO_ASYNC_NCCL_SETUP_S", "0"),
        ("DERECHO_ASYNC_NCCL_STALL_S", "-5"),
        ("DERECHO_ASYNC_NCCL_STALL_S", "inf"),
        ("DERECHO_ASYNC_MAX_CALL_MB", "1.5"),
        ("DERECHO_ASYNC_MAX_CALL_MB", "1024"),
        ("DERECHO_ASYNC_MAX_QUEUED_CALLS", "0"),
        ("DERECHO_ASYNC_MAX_QUEUED_MB", ""),
        ("DERECHO_ASYNC_WHEN_QUEUE_FULL", "drop"),
        ("DERECHO_ASYNC_CHECK_P2P_READS", "maybe"),
        ("DERECHO_ASYNC_STATE_CHUNK_KB", "3"),
        ("DERECHO_ASYNC_STATE_STALL_S", "0"),
        ("DERECHO_ASYNC_FENCE_TIMEOUT_S", "86401"),
    ],
)
def test_tuning_keys_bad_in_the_environment_name_key_and_variable(
    variable: str, text: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({"DERECHO_ASYNC_GROUP": "g", "DERECHO_ASYNC_MEMBER_ID": "0", variable: text})
    assert info.value.key == variable.removeprefix("DERECHO_ASYNC_").lower()
    assert variable in str(info.value)


def test_tuning_keys_load_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "member.toml"
    path.write_text(
        """
[derecho_async]
group = "g"
member_id = 1
gpu_busy_poll_us = 0
gpu_poll_interval_us = 12.5
nccl_setup_s = 20
nccl_stall_s = 30.0
max_call_mb = 16
max_queued_calls = 1000
max_queued_mb = 32
when_queue_full = "error"
check_p2p_reads = true
state_chunk_kb = 1024
state_stall_s = 7
fence_timeout_s = 9.5
""",
        encoding="utf-8",
    )
    c = Config.load(path, environ={})
    assert (c.gpu_busy_poll_us, c.gpu_poll_interval_us) == (0.0, 12.5)
    assert type(c.gpu_busy_poll_us) is float and type(c.nccl_setup_s) is float
    assert (c.nccl_setup_s, c.nccl_stall_s) == (20.0, 30.0)
    assert (c.max_call_mb, c.max_queued_calls, c.max_queued_mb) == (16, 1000, 32)
    assert (c.when_queue_full, c.check_p2p_reads) == ("error", True)
    assert (c.state_chunk_kb, c.state_stall_s, c.fence_timeout_s) == (1024, 7.0, 9.5)
    path.write_text('group = "g"\nmember_id = 1\nnccl_stall_s = "60"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        Config.from_toml(path)
    assert info.value.key == "nccl_stall_s" and str(path) in str(info.value)


# ------------------------------------------------------------------------------------ TOML


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "member.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_toml_top_level(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
group = "weights"
member_id = 2
transport = "tcp"
secret = "0123456789abcdef"
heartbeat_ms = 10
partition_safety = false

[peers]
0 = "h1:7000"
1 = "[::1]:7000"
""",
    )
    c = Config.from_toml(path)
    assert (c.group, c.member_id, c.transport, c.partition_safety) == ("weights", 2, "tcp", False)
    assert c.heartbeat_ms == 10.0
    assert c.peers == {0: "h1:7000", 1: "[::1]:7000"}


def test_toml_table_ignores_rest_of_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[server]
port = 8080

[derecho_async]
group = "g"
member_id = 1
window = 16

[derecho_async.peers]
1 = "a:1"
""",
    )
    c = Config.from_toml(str(path), window=32)
    assert (c.group, c.member_id, c.window) == ("g", 1, 32)
    assert c.peers == {1: "a:1"}


def test_toml_values_are_not_coerced(tmp_path: Path) -> None:
    path = write(tmp_path, 'group = "g"\nmember_id = "2"\n')
    with pytest.raises(ConfigError) as info:
        Config.from_toml(path)
    assert info.value.key == "member_id"
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("body", "key"),
    [
        ('group = "g"\nmember_id = 1\nwindows = 3\n', "windows"),
        ('[derecho_async]\ngroup = "g"\nmember_id = 1\nbogus = true\n', "bogus"),
        ('group = "g"\nmember_id = 1\n[peers]\nx = "h:1"\n', "peers"),
        ('group = "g"\nmember_id = 1\npeers = ["h:1"]\n', "peers"),
        ("derecho_async = 3\n", "derecho_async"),
        ("member_id = 1\n", "group"),
        ('group = "g"\nmember_id = 1\nheartbeat_ms = 1979-05-27\n', "heartbeat_ms"),
    ],
)
def test_toml_errors(tmp_path: Path, body: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_toml(write(tmp_path, body))
    assert info.value.key == key


def test_toml_unknown_override(tmp_path: Path) -> None:
    path = write(tmp_path, 'group = "g"\nmember_id = 1\n')
    with pytest.raises(ConfigError) as info:
        Config.from_toml(path, nope=1)
    assert info.value.key == "nope"


def test_toml_malformed_and_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_toml(write(tmp_path, "group = \n"))
    assert info.value.key == "path"
    assert "TOML" in info.value.expected
    with pytest.raises(ConfigError) as info:
        Config.from_toml(tmp_path / "absent.toml")
    assert info.value.key == "path"
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'group = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        Config.from_toml(latin1)
    assert info.value.key == "path"


# ----------------------------------------------------------------------------- environment


def test_env_parses_by_type() -> None:
    env = {
        "DERECHO_ASYNC_GROUP": "g",
        "DERECHO_ASYNC_MEMBER_ID": "2",
        "DERECHO_ASYNC_INITIAL_MEMBERS": " 3 ",
        "DERECHO_ASYNC_TRANSPORT": "tcp",
        "DERECHO_ASYNC_SECRET": SECRET,
        "DERECHO_ASYNC_PARTITION_SAFETY": "false",
        "DERECHO_ASYNC_PEERS": "0=h1:7000, 1=h2:7000,2=[::1]:9,",
        "DERECHO_ASYNC_HEARTBEAT_MS": "2.5",
        "DERECHO_ASYNC_SUSPECT_AFTER_MS": "1e2",
        "DERECHO_ASYNC_RDMA_GID_INDEX": "",
        "DERECHO_ASYNC_CONTACT": "",
        "DERECHO_ASYNC_LOG_LEVEL": "error",
        "DERECHO_ASYNC_LONG_SWEEP": "1",
        "PATH": "/usr/bin",
    }
    c = Config.from_env(env)
    assert (c.group, c.member_id, c.initial_members, c.transport) == ("g", 2, 3, "tcp")
    assert c.partition_safety is False
    assert c.peers == {0: "h1:7000", 1: "h2:7000", 2: "[::1]:9"}
    assert (c.heartbeat_ms, c.suspect_after_ms) == (2.5, 100.0)
    assert c.rdma_gid_index is None and c.contact is None
    assert c.log_level == "ERROR"


@pytest.mark.parametrize("word", ["1", "true", "TRUE", "yes", "on", " On "])
def test_env_true_words(word: str) -> None:
    env = {"DERECHO_ASYNC_GROUP": "g", "DERECHO_ASYNC_MEMBER_ID": "0"}
    c = Config.from_env({**env, "DERECHO_ASYNC_PARTITION_SAFETY": word})
    assert c.partition_safety is True
    c = Config.from_env({**env, "DERECHO_ASYNC_PARTITION_SAFETY": "0"}, partition_safety=True)
    assert c.partition_safety is True


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DERECHO_ASYNC_MEMBER_ID", "two"),
        ("DERECHO_ASYNC_MEMBER_ID", "1.0"),
        ("DERECHO_ASYNC_MEMBER_ID", "-1"),
        ("DERECHO_ASYNC_MEMBER_ID", "1" * 5000),
        ("DERECHO_ASYNC_PEERS", "1" * 5000 + "=h:1"),
        ("DERECHO_ASYNC_WINDOW", "0"),
        ("DERECHO_ASYNC_WINDOW", ""),
        ("DERECHO_ASYNC_HEARTBEAT_MS", "fast"),
        ("DERECHO_ASYNC_HEARTBEAT_MS", "nan"),
        ("DERECHO_ASYNC_PARTITION_SAFETY", "maybe"),
        ("DERECHO_ASYNC_PEERS", "0:h:1"),
        ("DERECHO_ASYNC_PEERS", "x=h:1"),
        ("DERECHO_ASYNC_PEERS", "0=h:1,0=h:2"),
        ("DERECHO_ASYNC_PEERS", "0=h"),
        ("DERECHO_ASYNC_RDMA_GID_INDEX", "first"),
        ("DERECHO_ASYNC_GROUP", ""),
        ("DERECHO_ASYNC_LISTEN", "nowhere"),
    ],
)
def test_env_bad_value_names_key_and_variable(variable: str, value: str) -> None:
    env = {"DERECHO_ASYNC_GROUP": "g", "DERECHO_ASYNC_MEMBER_ID": "0", variable: value}
    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    assert info.value.key == variable.removeprefix("DERECHO_ASYNC_").lower()
    assert variable in str(info.value)


def test_env_unknown_variable() -> None:
    env = {"DERECHO_ASYNC_GROUP": "g", "DERECHO_ASYNC_MEMBER_ID": "0", "DERECHO_ASYNC_WINDW": "3"}
    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    assert info.value.key == "windw"
    assert "DERECHO_ASYNC_WINDW" in str(info.value)
    assert "one of: " in info.value.expected


def test_env_missing_required() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({"DERECHO_ASYNC_GROUP": "g"})
    assert info.value.key == "member_id"


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DERECHO_ASYNC_GROUP", "from-env")
    monkeypatch.setenv("DERECHO_ASYNC_MEMBER_ID", "7")
    c = Config.from_env()
    assert (c.group, c.member_id) == ("from-env", 7)


def test_env_override_error_has_no_variable() -> None:
    with pytest.raises(ConfigError) as info:
        Config.from_env({"DERECHO_ASYNC_GROUP": "g"}, member_id=-1)
    assert info.value.key == "member_id"
    assert "environment" not in str(info.value)


# ------------------------------------------------------------------------------------ load


def test_load_precedence(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[derecho_async]\ngroup = "file"\nmember_id = 1\nwindow = 8\nmax_payload = 128\n',
    )
    env = {"DERECHO_ASYNC_WINDOW": "16", "DERECHO_ASYNC_MEMBER_ID": "2"}
    c = Config.load(path, env, member_id=3)
    assert (c.group, c.member_id, c.window, c.max_payload) == ("file", 3, 16, 128)
    c = Config.load(path, {})
    assert (c.member_id, c.window) == (1, 8)


def test_load_merges_before_validating(tmp_path: Path) -> None:
    path = write(tmp_path, 'group = "g"\n')
    c = Config.load(path, {"DERECHO_ASYNC_MEMBER_ID": "4"})
    assert c.member_id == 4
    c = Config.load(environ={}, group="x", member_id=0)
    assert c.group == "x"


def test_load_error_names_the_source(tmp_path: Path) -> None:
    path = write(tmp_path, 'group = "g"\nmember_id = 1\nwindow = 0\n')
    with pytest.raises(ConfigError) as info:
        Config.load(path, {})
    assert info.value.key == "window" and str(path) in str(info.value)
    with pytest.raises(ConfigError) as info:
        Config.load(path, {"DERECHO_ASYNC_WINDOW": "70000"})
    assert "DERECHO_ASYNC_WINDOW" in str(info.value)
    assert Config.load(path, {}, window=2).window == 2


def test_load_unknown_override() -> None:
    with pytest.raises(ConfigError) as info:
        Config.load(environ={}, group="g", member_id=0, colour="blue")
    assert info.value.key == "colour"
