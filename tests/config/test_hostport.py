"""parse_hostport: the host:port forms a listen, contact or peer address takes."""

from __future__ import annotations

import pytest

from derecho_async.config import parse_hostport
from derecho_async.errors import ConfigError

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
