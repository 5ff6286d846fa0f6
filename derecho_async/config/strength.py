"""The shared secret's form: a tagged random value, made by :func:`new_secret` and nothing else.

Theory of operation (docs/DESIGN.md §5.3, §7.10): the tcp handshake's proofs are HMACs under a
key stretched from the secret, and whoever records one handshake can test guesses offline, so the
secret must be hard to guess. A string does not say how it was made (a phrase or a keyboard walk
can look as varied as random text), so the ``secret`` key takes only what :func:`new_secret`
makes (``derecho-async secret`` prints it), which says so itself:

    ``dasec1.`` + 43 base64url characters (256 random bits) + ``.`` + 6 check characters

The prefix names the format and its version; the check is the first 6 base64url characters of
the SHA-256 of everything before it (36 bits), so a copy that was mistyped, cut short or
lengthened is caught when the Config is made, not as a refused handshake later.
:func:`problem` tells the two refusals apart without repeating any of the text.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import string
from typing import Final

__all__ = ["CHECK_CHARS", "DAMAGED", "LENGTH", "NOT_MADE", "PREFIX", "RANDOM_CHARS", "new_secret",
           "problem"]

PREFIX: Final = "dasec1."
"""What every secret :func:`new_secret` makes starts with: the format, version 1."""
RANDOM_CHARS: Final = 43
"""Base64url characters of the random part: 256 bits (the last character carries 4 of them)."""
CHECK_CHARS: Final = 6
"""Base64url characters of the check."""
LENGTH: Final = len(PREFIX) + RANDOM_CHARS + 1 + CHECK_CHARS
"""Characters of a whole secret."""
_BASE64URL: Final = frozenset(string.ascii_letters + string.digits + "-_")

NOT_MADE: Final = ("this one was not made by them: run `derecho-async secret` and give every "
                   "member its output")
"""Why a secret without the tag is refused."""
DAMAGED: Final = ("this one starts as such a secret but its check fails: it was mistyped or cut "
                  "short (copy it again from where it was made)")
"""Why a secret with the tag and a wrong length, character or check is refused."""


def _check(head: str) -> str:
    digest = hashlib.sha256(head.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii")[:CHECK_CHARS]


def new_secret() -> str:
    """A fresh shared secret for the ``secret`` key: 256 random bits, tagged and checked (see
    the module docstring). Give every member of a group the same one."""
    head = PREFIX + secrets.token_urlsafe(32)
    return f"{head}.{_check(head)}"


def problem(text: str) -> str | None:
    """Why ``text`` is not a secret :func:`new_secret` made (:data:`NOT_MADE` or
    :data:`DAMAGED`; neither repeats the text), or None if it is one."""
    if not text.startswith(PREFIX):
        return NOT_MADE
    if len(text) != LENGTH or not text.isascii():
        return DAMAGED
    head, dot, check = text[:-CHECK_CHARS - 1], text[-CHECK_CHARS - 1], text[-CHECK_CHARS:]
    if (
        dot != "."
        or not set(head[len(PREFIX):]) <= _BASE64URL
        or not secrets.compare_digest(check, _check(head))
    ):
        return DAMAGED
    return None
