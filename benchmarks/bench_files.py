"""Files through which benchmark member processes report to the parent.

The parent polls for a file's existence and then reads it, so a member must never let the file
exist before its content does: :func:`publish` writes a temporary name and renames it (atomic on
one file system), instead of ``Path.write_text``, which creates the file empty first.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["publish"]


def publish(path: Path, text: str) -> None:
    """Make ``path`` appear with ``text`` in it, whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
