"""The tuning keys: their bounds and types, from arguments, the environment and TOML."""

from __future__ import annotations

from pathlib import Path

import pytest

from derecho_async.config import Config
from derecho_async.errors import ConfigError
from tests.config.support import BASE, make

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
