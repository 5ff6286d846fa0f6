"""Validation of a Config: defaults, every key's bad values, the rules across keys, unknown and
missing keys, and a frozen, hashable, picklable value."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

import derecho_async as da
from derecho_async.config import Config
from derecho_async.errors import ConfigError
from tests.config.support import BASE, SECRET, make

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
    assert (c.state_stall_s, c.fence_timeout_s, c.join_timeout_s) == (30.0, 60.0, 60.0)


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
        window=1024,
        max_payload=1 << 12,
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
    ("client_listen", "nohost"),
    ("client_listen", "h:70000"),
    ("client_listen", 7000),
    ("client_secret", "short"),
    ("client_secret", 12345),
    ("max_clients", 0),
    ("max_clients", (1 << 20) + 1),
    ("max_clients", "8"),
    ("max_client_calls", 0),
    ("max_client_calls", 1025),
    ("max_client_calls", 1.5),
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
    ("heartbeat_ms", 1e-9),
    ("heartbeat_ms", 0.999),
    ("heartbeat_ms", float("nan")),
    ("heartbeat_ms", float("inf")),
    ("heartbeat_ms", "20"),
    ("heartbeat_ms", True),
    ("suspect_after_ms", 20.0),
    ("suspect_after_ms", 1),
    ("suspect_after_ms", float("inf")),
    ("suspect_after_ms", "500"),
    ("max_loop_hold_ms", -1),
    ("max_loop_hold_ms", 3_600_001),
    ("max_loop_hold_ms", float("nan")),
    ("max_loop_hold_ms", "60000"),
    ("max_loop_hold_ms", None),
    ("window", 0),
    ("window", 1025),
    ("window", 65536),
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
    ("data_dir", ""),
    ("data_dir", 5),
    ("snapshot_every", 0),
    ("log_batch_ms", -1),
    ("log_batch_ms", 1001),
    ("log_batch_ms", float("nan")),
    ("snapshot_every", 1.5),
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
    ("join_timeout_s", "60"),
    ("join_timeout_s", 0),
    ("join_timeout_s", -1.0),
    ("join_timeout_s", None),
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
    assert "from 1 to 60000" in info.value.expected and "milliseconds" in info.value.expected
    assert isinstance(info.value, ValueError)


def test_tcp_requires_secret() -> None:
    with pytest.raises(ConfigError) as info:
        make(transport="tcp")
    assert info.value.key == "secret"
    assert "tcp" in info.value.expected
    assert make(transport="tcp", secret=SECRET).secret == SECRET


def test_serving_clients_requires_a_client_secret_of_its_own() -> None:
    with pytest.raises(ConfigError) as info:
        make(client_listen="127.0.0.1:0", secret=SECRET)  # the members' secret is not enough
    assert info.value.key == "client_secret"
    assert "client_listen" in info.value.expected
    with pytest.raises(ConfigError) as info:  # a client must not hold what admits a member
        make(client_listen="127.0.0.1:0", secret=SECRET, client_secret=SECRET)
    assert info.value.key == "client_secret"
    assert SECRET not in str(info.value)
    other = da.new_secret()
    c = make(client_listen="127.0.0.1:0", client_secret=other)
    assert c.client_secret == other and other not in repr(c)
    tls = make(client_listen="127.0.0.1:0", tls_cert="c.pem", tls_key="c.key", tls_ca="ca.pem")
    assert tls.client_secret is None  # TLS: client certificates; the secret is optional


def test_secret_is_hidden() -> None:
    c = make(secret=SECRET)
    assert SECRET not in repr(c)
    with pytest.raises(ConfigError) as info:
        make(secret="too-short")
    assert "too-short" not in str(info.value)


@pytest.mark.parametrize(
    ("given", "missing"),
    [
        ({"tls_cert": "c.pem"}, "tls_key"),
        ({"tls_key": "k.pem"}, "tls_cert"),
        ({"tls_ca": "ca.pem"}, "tls_cert"),
        ({"tls_cert": "c.pem", "tls_key": "k.pem"}, "tls_ca"),
    ],
)
def test_tls_files_go_together(given: dict[str, str], missing: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(**given)
    assert info.value.key == missing
    assert "together" in info.value.expected
    full = make(tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem")
    assert (full.tls_cert, full.tls_key, full.tls_ca) == ("c.pem", "k.pem", "ca.pem")


def test_tls_replaces_the_secret_of_a_networked_transport() -> None:
    with pytest.raises(ConfigError) as info:
        Config(group="g", member_id=0, transport="tcp")
    assert info.value.key == "secret"
    assert "unless tls_cert" in info.value.expected
    tls = Config(
        group="g", member_id=0, transport="tcp", tls_cert="c.pem", tls_key="k.pem",
        tls_ca="ca.pem",
    )
    assert tls.secret is None


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
        "one of: check_p2p_reads, client_listen, client_secret, contact, data_dir,"
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
