"""Where settings come from besides arguments: a TOML file and ``DERECHO_ASYNC_*`` variables.

Theory of operation: each source gives a :class:`Merged` (values, and for each key where it came
from); :meth:`Config.load` merges a file, then the environment, then explicit arguments, later
winning, and validates once, so a ConfigError can name the file or variable of a bad value.
TOML values keep their TOML types (no str → int coercion); the settings sit at top level, or
under a ``[derecho_async]`` table, and then the rest of the file is ignored (it may be shared
with other programs). Environment text is parsed by each key's form (:meth:`Key.parse_env`).
Unknown keys are errors everywhere: a typo must not silently fall back to a default. See
docs/DESIGN.md §7.10.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from derecho_async.config.forms import INT_RE
from derecho_async.config.keys import ENV_PREFIX, ENV_RESERVED, Key
from derecho_async.errors import ConfigError

__all__ = ["EXPLICIT", "Merged", "check_known", "read_env", "read_toml"]

EXPLICIT: Final = "an explicit argument"
"""The source of values given as arguments (errors about them name no file or variable)."""


@dataclass
class Merged:
    """Settings gathered so far, and where each came from."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def update(self, later: Merged) -> None:
        """Let ``later``'s values win."""
        self.values.update(later.values)
        self.sources.update(later.sources)

    def add(self, overrides: Mapping[str, object], keys: Mapping[str, Key]) -> None:
        """Explicit arguments, which win over everything (unknown names raise ConfigError)."""
        check_known(overrides, keys)
        self.values.update(overrides)
        self.sources.update(dict.fromkeys(overrides, EXPLICIT))


def known_text(keys: Mapping[str, Key]) -> str:
    """The expected form of a key name."""
    return "one of: " + ", ".join(sorted(keys))


def check_known(values: Mapping[str, object], keys: Mapping[str, Key]) -> None:
    """ConfigError for the first name in ``values`` that is not one of ``keys``."""
    for name, value in values.items():
        if name not in keys:
            raise ConfigError(name, known_text(keys), value)


# ------------------------------------------------------------------------------------- TOML


def read_toml(path: str | os.PathLike[str], keys: Mapping[str, Key]) -> Merged:
    """The settings of a TOML file (ConfigError with key ``"path"`` if it cannot be read)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            document = tomllib.load(f)
    except OSError as e:
        raise ConfigError("path", f"a readable TOML file ({e.strerror})", name) from e
    except ValueError as e:  # TOMLDecodeError, or UnicodeDecodeError for a file not in UTF-8
        raise ConfigError("path", f"a valid TOML file ({e})", name) from e
    table: object = document.get("derecho_async", document)
    where = f"TOML file {name}"
    if not isinstance(table, dict):
        raise ConfigError("derecho_async", f"a table of settings (in {where})", table)
    values = dict(table)
    try:
        check_known(values, keys)
    except ConfigError as e:
        raise ConfigError(e.key, f"{e.expected} (in {where})", e.got) from None
    if "peers" in values:
        values["peers"] = _toml_peers(values["peers"], keys["peers"], where)
    return Merged(values, dict.fromkeys(values, where))


def _toml_peers(table: object, peers: Key, where: str) -> object:
    if not isinstance(table, dict):
        return table  # validation reports the wrong type
    out: dict[object, object] = {}
    for member, address in table.items():
        if not INT_RE.fullmatch(member):
            raise ConfigError(
                "peers", f"{peers.expected()}; keys are member ids (in {where})", member
            )
        out[int(member)] = address
    return out


# -------------------------------------------------------------------------------- environment


def read_env(environ: Mapping[str, str], keys: Mapping[str, Key]) -> Merged:
    """The settings of ``DERECHO_ASYNC_<KEY>`` variables (the reserved ones skipped)."""
    merged = Merged()
    for variable, text in environ.items():
        if not variable.startswith(ENV_PREFIX) or variable in ENV_RESERVED:
            continue
        where = f"environment variable {variable}"
        name = variable[len(ENV_PREFIX):].lower()
        k = keys.get(name)
        if k is None or k.env is None:
            raise ConfigError(name, f"{known_text(keys)} (from {where})", text)
        merged.values[k.name] = k.parse_env(text, where)
        merged.sources[k.name] = where
    return merged
