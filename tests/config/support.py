"""What the config tests share: the required keys and a secret strong enough for tcp."""

from __future__ import annotations

from typing import Any

from derecho_async.config import Config

BASE: dict[str, Any] = {"group": "g", "member_id": 0}
SECRET = "Jq4-vX9tLm2Rw7_zKp1Yb6Hn3Gs8Fd0Ce5Ua9Wi2Oy4"  # as `derecho-async secret` prints


def make(**changes: Any) -> Config:
    """A Config of the required keys, with ``changes`` over them."""
    return Config(**{**BASE, **changes})
