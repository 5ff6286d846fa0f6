"""The settings of a group member: :class:`Config` and :func:`parse_hostport`.

Theory of operation: :class:`Config` is a frozen, slotted dataclass whose fields are the one
table of keys (:data:`KEYS`: name, type, default, allowed range or choices, environment
variable, one-line doc). Validation, the environment, TOML files and the README's table are all
driven by it. See docs/DESIGN.md §7.10.

- :mod:`.forms`: what a value may be (ranges, choices, host:port, peers), checked and described;
- :mod:`.strength`: the form of a ``secret`` (a tagged random value) and a fresh one;
- :mod:`.memory`: the memory a configuration implies, against the host's;
- :mod:`.keys`: a field's metadata and the :class:`Key` records read back from it;
- :mod:`.settings`: :class:`Config` itself, and the rules that relate keys;
- :mod:`.sources`: the TOML file and ``DERECHO_ASYNC_*`` variables;
- :mod:`.readme`: the README's table, printed from :data:`KEYS`.
"""

from __future__ import annotations

from derecho_async.config.forms import parse_hostport
from derecho_async.config.keys import ENV_PREFIX, ENV_RESERVED, Key
from derecho_async.config.settings import KEYS, LOG_LEVELS, QUEUE_FULL_ACTIONS, Config

__all__ = [
    "ENV_PREFIX",
    "ENV_RESERVED",
    "KEYS",
    "LOG_LEVELS",
    "QUEUE_FULL_ACTIONS",
    "Config",
    "Key",
    "parse_hostport",
]
