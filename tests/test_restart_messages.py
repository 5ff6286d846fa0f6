"""The restart's channel messages are checked field by field before anyone sees them
(derecho_async/wire/envelope.py): a malformed one is a ProtocolViolation."""

from __future__ import annotations

import pytest

from derecho_async.errors import ProtocolViolation
from derecho_async.wire import envelope as env

GOOD = [
    (env.RECOVER_INFO, 3, [0, 1, 2], [["KV", 3, 8, 3, 5], ["Log", 0, 0, 0, 0]]),
    (env.RECOVER_PLAN, 1, 4, [0, 2], [["KV", 2, 3, 8]]),
    (env.SUFFIX_REQ, 1, "KV", 3, 8),
    (env.SUFFIX, 1, "KV", [], [[3, 7, -5, b"\x00call"]], True),
    (env.SUFFIX, 1, "KV", [3, 0, 12, b"snapshot"], [], False),
    (env.RECOVER_READY, 1),
    (env.RECOVER_LIVE, 4),
    (env.RECOVER_ABORT, "KV: acknowledged up to (3, 9), held up to (3, 4)"),
]

BAD = [
    (env.RECOVER_INFO, 3, [0, -1], []),  # a member id below 0
    (env.RECOVER_INFO, 3, list(range(65)), []),  # more members than a view holds
    (env.RECOVER_INFO, 3, [0], [["KV", 3]]),  # a version without its seq
    (env.RECOVER_INFO, 3, [0], [["KV", 3, 8]]),  # no acknowledged version
    (env.RECOVER_ABORT, "x" * 5000),  # a reason too long
    (env.RECOVER_INFO, 3, [0], [[7, 3, 8]]),  # a subgroup that is no name
    (env.RECOVER_PLAN, 1, 4, [0], [["KV", 2, -3, 8]]),  # a negative view id
    (env.RECOVER_PLAN, 1, 4, [0], ["KV"]),  # a source that is no list
    (env.SUFFIX, 1, "KV", [3, 0, 12], [], False),  # a snapshot without its bytes
    (env.SUFFIX, 1, "KV", [], [[3, 7, 0, "text"]], True),  # a body that is no bytes
    (env.SUFFIX, 1, "KV", [], [[3, 7, 0.5, b""]], True),  # a time that is no int
    (env.SUFFIX_REQ, 1, "KV", -3, 8),  # a negative view id
]


@pytest.mark.parametrize("msg", GOOD, ids=lambda m: str(m[0]))
def test_well_formed_restart_messages_decode_as_sent(msg: tuple[int, ...]) -> None:
    assert env.decode(env.encode(*msg)) == list(msg)


@pytest.mark.parametrize("msg", BAD, ids=lambda m: str(m[0]))
def test_malformed_restart_messages_are_refused(msg: tuple[int, ...]) -> None:
    with pytest.raises(ProtocolViolation):
        env.decode(env.encode(*msg))
