"""The ``secret`` key takes only what ``derecho-async secret`` (``da.new_secret()``) makes: a
tagged random value whose check catches a mistyped or cut copy. Phrases, keyboard walks and
untagged strings are a ConfigError that says how to make one, and never shows the secret (issue
26, finding 1; issue 41, row 11)."""

from __future__ import annotations

import base64
import random

import pytest

import derecho_async as da
from derecho_async.config.strength import PREFIX, new_secret
from derecho_async.errors import ConfigError
from tests.config.support import SECRET, make

NOT_MADE = [
    "the quick brown fox jumps over the lazy dog",  # the phrase
    "qwertyuiopasdfghjklzxcvbnm1234567890QWERTYUIOP",  # the keyboard walk
    "a durable tcp group's secret",
    "bananapineapple!",
    "correct horse battery staple",
    "CorrectHorseBatteryStaple1!",
    "a" * 64,
    "passwordpasswordpasswordpassword",
    "",
    # random, but not made by derecho-async secret: without the tag a string does not say how
    # it was made, so none is taken
    base64.urlsafe_b64encode(random.Random(1).randbytes(32)).decode().rstrip("="),
    random.Random(2).randbytes(32).hex(),
    SECRET.removeprefix(PREFIX),  # a made one with its tag cut off
    "dasec2." + SECRET.removeprefix(PREFIX),  # another format
]


@pytest.mark.parametrize("text", NOT_MADE, ids=[t[:16] or "empty" for t in NOT_MADE])
def test_a_secret_not_made_by_the_command_is_refused_with_how_to_make_one(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(transport="tcp", secret=text)
    message = str(info.value)
    assert info.value.key == "secret"
    assert "derecho-async secret" in message and "da.new_secret()" in message
    assert "not made by" in message
    assert "mistyped" not in message
    assert info.value.got == "<hidden>"
    assert not text or (text not in message and text[:12] not in message)


def _mistyped(text: str, at: int) -> str:
    swap = "A" if text[at] != "A" else "B"
    return text[:at] + swap + text[at + 1:]


def _damaged() -> list[tuple[str, str]]:
    s = new_secret()
    body = len(PREFIX)
    swap = next(i for i in range(body, body + 42) if s[i] != s[i + 1])
    return [
        ("first character of the random part", _mistyped(s, body)),
        ("middle of the random part", _mistyped(s, body + 20)),
        ("the check", _mistyped(s, len(s) - 1)),
        ("cut by one", s[:-1]),
        ("cut before the check", s[: body + 43]),
        ("cut in half", s[: len(s) // 2]),
        ("one character more", s + "x"),
        ("a character left out", s[: body + 5] + s[body + 6:]),
        ("two characters swapped", s[:swap] + s[swap + 1] + s[swap] + s[swap + 2:]),
        ("a space inside", s[: body + 10] + " " + s[body + 10:]),
    ]


DAMAGED = _damaged()


@pytest.mark.parametrize(("how", "text"), DAMAGED, ids=[how for how, _ in DAMAGED])
def test_a_mistyped_or_cut_secret_is_refused_as_such(how: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(transport="tcp", secret=text)
    message = str(info.value)
    assert info.value.key == "secret"
    assert "mistyped or cut" in message
    assert "derecho-async secret" in message
    assert info.value.got == "<hidden>"
    assert text not in message and text[len(PREFIX):][:8] not in message


def test_a_fresh_secret_is_accepted_tagged_and_random() -> None:
    seen = set()
    for _ in range(200):
        fresh = new_secret()
        assert make(transport="tcp", secret=fresh).secret == fresh
        assert fresh.startswith(PREFIX) and fresh.isascii() and fresh.isprintable()
        random_part = fresh[len(PREFIX):].split(".")[0]
        assert len(base64.urlsafe_b64decode(random_part + "=")) == 32  # 256 bits
        seen.add(fresh)
    assert len(seen) == 200
    assert make(transport="tcp", secret=SECRET).secret == SECRET  # the tests' shared one


def test_the_maker_is_public() -> None:
    assert da.new_secret is new_secret
    assert "new_secret" in da.__all__
    assert make(transport="tcp", secret=da.new_secret()).transport == "tcp"
