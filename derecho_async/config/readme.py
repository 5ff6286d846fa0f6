"""The README's configuration table, made from :data:`~derecho_async.config.KEYS`.

``python -m derecho_async.config.readme`` prints it; paste it over the table under
"Configuration" in README.md (``tests/test_config_table.py`` checks that the README holds
exactly this table). See docs/DESIGN.md §7.10.
"""

from __future__ import annotations

from collections.abc import Iterable

from derecho_async.config.keys import Key
from derecho_async.config.settings import KEYS

__all__ = ["HEADER", "markdown_table"]

HEADER = "| key | default | allowed | meaning |"
"""The first line of the table."""


def markdown_table(keys: Iterable[Key] = KEYS) -> str:
    """One row per key: its name, default, allowed values and one-line doc."""
    rows = [HEADER, "|---|---|---|---|"]
    for k in keys:
        rows.append(f"| `{k.name}` | {k.default_text()} | {k.form.allowed()} | {k.doc} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    """Print the table."""
    print(markdown_table(), end="")


if __name__ == "__main__":
    main()
