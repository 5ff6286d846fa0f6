"""The ``secret`` key: low-entropy secrets are a ConfigError that says how to make one, and the
secrets that random generators print pass (issue 26, finding 1)."""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Callable

import pytest

from derecho_async.config.strength import (
    MIN_BITS,
    estimate_bits,
    new_secret,
    reads_as_text,
    weakness,
)
from derecho_async.errors import ConfigError
from tests.config.support import SECRET, make

WEAK = [
    "bananapineapple!",  # the kind: 16 characters, two dictionary words
    "correct horse battery staple",
    "correcthorsebatterystaple",
    "CorrectHorseBatteryStaple1!",
    "Correct-Horse-Battery-Staple-9",
    "s3cret-s3cret-s3cret",
    "0123456789abcdef",
    "0123456789abcdefghijklmnopqrstuvwxyz",
    "a" * 64,
    "ab" * 32,
    "passwordpasswordpasswordpassword",
    "hunter2hunter2hunter2hunter2hunter2",
    "12345678901234567890123456789012345",
    "qwertyuiopasdfghjklzxcvbnm",
    "ThisIsMyVerySecretPasswordForTheCluster",
    "40d21e45441777e0",  # random, but 64 bits
    "jbUTlajvIQUDnb2F",  # random, but 96 bits
    SECRET[:22] * 2,  # a good start, twice
    "x" + SECRET * 30,  # too long
]


@pytest.mark.parametrize("weak", WEAK, ids=[w if len(w) < 40 else w[:16] + "..." for w in WEAK])
def test_a_low_entropy_secret_is_a_config_error_that_says_how_to_make_one(weak: str) -> None:
    assert weakness(weak) is not None
    with pytest.raises(ConfigError) as info:
        make(transport="tcp", secret=weak)
    assert info.value.key == "secret"
    assert "derecho-async secret" in str(info.value)
    assert f"{MIN_BITS} bits" in str(info.value)
    assert weak not in str(info.value) and weak[:12] not in str(info.value)


RANDOM: dict[str, Callable[[random.Random], str]] = {
    "urlsafe 32 bytes": lambda r: base64.urlsafe_b64encode(r.randbytes(32)).decode().rstrip("="),
    "base64 32 bytes": lambda r: base64.b64encode(r.randbytes(32)).decode(),  # openssl rand
    "hex 16 bytes": lambda r: r.randbytes(16).hex(),  # exactly 128 bits
    "hex 32 bytes": lambda r: r.randbytes(32).hex(),
}


@pytest.mark.parametrize("shape", list(RANDOM))
def test_random_secrets_of_the_usual_shapes_pass(shape: str) -> None:
    rng = random.Random(shape)  # the same strings on every run: the check is deterministic
    for _ in range(5000):
        text = RANDOM[shape](rng)
        assert weakness(text) is None, (text, estimate_bits(text))
        assert not reads_as_text(text) or shape.startswith("hex")


def test_text_is_worth_two_bits_a_letter() -> None:
    assert reads_as_text("correct horse battery staple")
    assert not reads_as_text("xq7Zkj-Vw2pQ")
    assert estimate_bits("correct horse battery staple") == pytest.approx(
        25 * 2 + 3 * math.log2(26 + 32)
    )


def test_the_shared_test_secret_and_a_new_one_pass() -> None:
    assert make(transport="tcp", secret=SECRET).secret == SECRET
    for _ in range(100):
        fresh = new_secret()
        assert len(fresh) == 43 and estimate_bits(fresh) > 200
        assert make(transport="tcp", secret=fresh).secret == fresh
