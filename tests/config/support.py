"""What the config tests share: the required keys and a secret for tcp."""

from __future__ import annotations

from typing import Any

from derecho_async.config import Config

BASE: dict[str, Any] = {"group": "g", "member_id": 0}
SECRET = "dasec1.prImVf9grxJedW_nyURFIrdMcsj87s5swjZk31wkrrI.P3aEKT"  # made by da.new_secret()


def make(**changes: Any) -> Config:
    """A Config of the required keys, with ``changes`` over them."""
    return Config(**{**BASE, **changes})
