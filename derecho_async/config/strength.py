"""How strong a shared secret is: a conservative estimate of its bits, and a fresh one.

Theory of operation (docs/DESIGN.md §5.3, §7.10): the tcp handshake's proofs are HMACs under a
key stretched from the secret, and whoever records one handshake can test guesses offline, so the
``secret`` key must carry at least :data:`MIN_BITS` bits. A string does not say how it was made;
:func:`weakness` estimates from its shape, generously for random strings and harshly for what
people type:

- each character is worth log2 of the alphabet its classes span: 10 for digits only, 16 for hex
  digits only, otherwise 26 per letter case present, 10 for digits, 32 for anything else;
- if the letters read like English (:func:`reads_as_text`: under English letter frequencies
  they are likelier than under uniform ones, by 0.3 bits a letter plus 6), each letter is worth
  :data:`TEXT_BITS` instead, about what English text carries (hex secrets excepted);
- a secret that repeats itself or runs in sequence (``aaaa``, ``abcd``, ``xyzxyz``) is refused
  outright when such parts make up more than a quarter of it (:func:`tokens`), which a random
  string of any length practically never does.

Random strings of 128 bits or more pass (32+ hex digits; 43+ base64 characters; 32 base64
characters are refused about once in 100,000); :func:`new_secret` (what ``derecho-async secret`` prints) is 43 base64url
characters, 256 random bits. A phrase that avoids common letters can still pass: the estimate
cannot prove a secret random, it only catches the usual weak shapes.
"""

from __future__ import annotations

import math
import secrets
import string
from typing import Final

__all__ = ["MAX_LENGTH", "MIN_BITS", "TEXT_BITS", "estimate_bits", "new_secret", "reads_as_text",
           "tokens", "weakness"]

MIN_BITS: Final = 128
"""The least estimated strength of a secret."""
MAX_LENGTH: Final = 1024
"""The longest secret accepted (the estimate's work is bounded)."""
TEXT_BITS: Final = 2.0
"""Bits a letter is worth in a secret whose letters read like English."""
# English letter frequencies (per cent, a-z); a letter's score is log2(26 * frequency)
_ENGLISH: Final = (8.2, 1.5, 2.8, 4.3, 12.7, 2.2, 2.0, 6.1, 7.0, 0.15, 0.77, 4.0, 2.4, 6.7, 7.5,
                   1.9, 0.095, 6.0, 6.3, 9.1, 2.8, 0.98, 2.4, 0.15, 2.0, 0.074)
_SCORE: Final = {c: math.log2(26 * f / sum(_ENGLISH))
                 for c, f in zip(string.ascii_lowercase, _ENGLISH, strict=True)}
_HEX: Final = frozenset(string.hexdigits)
_DIGITS: Final = frozenset(string.digits)


def _alphabet(text: str) -> int:
    chars = set(text)
    if chars <= _DIGITS:
        return 10
    if chars <= _HEX:
        return 16
    size = 0
    if any(c.islower() and c.isascii() for c in chars):
        size += 26
    if any(c.isupper() and c.isascii() for c in chars):
        size += 26
    if chars & _DIGITS:
        size += 10
    if any(not (c.isascii() and c.isalnum()) for c in chars):
        size += 32
    return size


def tokens(text: str) -> int:
    """``text``'s length once repetition is folded: a run of three or more characters whose
    code points step by -1, 0 or +1 counts 2, a part of three or more characters that already
    occurred (overlap allowed) counts 1, any other character 1."""
    n = len(text)
    i = count = 0
    while i < n:
        if i + 2 < n:
            step = ord(text[i + 1]) - ord(text[i])
            if -1 <= step <= 1 and ord(text[i + 2]) - ord(text[i + 1]) == step:
                j = i + 3
                while j < n and ord(text[j]) - ord(text[j - 1]) == step:
                    j += 1
                count += 2
                i = j
                continue
        size = 0
        if i + 3 <= n and text[i : i + 3] in text[: i + 2]:
            size = 3
            while i + size < n and text[i : i + size + 1] in text[: i + size]:
                size += 1
        count += 1
        i += max(size, 1)
    return count


def reads_as_text(text: str) -> bool:
    """Whether the ASCII letters of ``text`` are likelier English than uniformly random: their
    log-likelihood ratio (English letter frequencies against 1/26 each) is at least 0.3 bits a
    letter plus 6. Random letters score about -0.9 bits a letter, English about +0.5."""
    letters = [c.lower() for c in text if c in string.ascii_letters]
    return bool(letters) and sum(_SCORE[c] for c in letters) >= 0.3 * len(letters) + 6


def estimate_bits(text: str) -> float:
    """The estimated strength of ``text`` in bits (see the module docstring); repetition is
    judged by :func:`weakness`, not here."""
    if not text:
        return 0.0
    per_char = math.log2(_alphabet(text))
    if set(text) <= _HEX or not reads_as_text(text):
        return len(text) * per_char
    letters = sum(c in string.ascii_letters for c in text)
    return (len(text) - letters) * per_char + letters * TEXT_BITS


def weakness(text: str, min_bits: int = MIN_BITS) -> str | None:
    """Why ``text`` is too weak to be a group's secret, or None if it is strong enough."""
    if len(text) > MAX_LENGTH:
        return f"it is longer than {MAX_LENGTH} characters"
    if tokens(text) * 4 < len(text) * 3:
        return "it repeats itself or runs in sequence"
    bits = estimate_bits(text)
    if bits < min_bits:
        return f"it carries about {bits:.0f} bits by the estimate"
    return None


def new_secret() -> str:
    """A fresh random secret: 43 base64url characters (256 bits) that :func:`weakness` passes."""
    while True:
        text = secrets.token_urlsafe(32)
        if weakness(text) is None:
            return text
