"""The table of settings: one :class:`Key` per field of :class:`~derecho_async.config.Config`.

Theory of operation: each field of ``Config`` is declared once, as
``name: type = field(default=..., metadata=key(form, doc))``. :func:`table` reads those fields
back as :class:`Key` records (name, annotation, default, form, environment variable, one-line
doc), and everything else is driven by them: validation (:meth:`Key.check`), the environment
(:meth:`Key.parse_env`), the README's table (:mod:`.readme`). See docs/DESIGN.md §7.10.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from derecho_async.config.forms import Form, Rejected, show_number
from derecho_async.errors import ConfigError

__all__ = ["ENV_PREFIX", "ENV_RESERVED", "REQUIRED", "Key", "key", "table"]

ENV_PREFIX: Final = "DERECHO_ASYNC_"
"""Prefix of the environment variables :meth:`Config.from_env` reads."""

ENV_RESERVED: Final = frozenset(
    {
        "DERECHO_ASYNC_LONG_SWEEP",
        "DERECHO_ASYNC_SWEEP_COUNT",
        "DERECHO_ASYNC_ACTOR_SWEEP_COUNT",
        "DERECHO_ASYNC_SEED",
        "DERECHO_ASYNC_RERECORD",
        "DERECHO_ASYNC_PURE_PYTHON",
    }
)
"""Variables with :data:`ENV_PREFIX` that are not settings (test switches); ``from_env`` skips
them instead of rejecting them as unknown keys."""


class _Required:
    __slots__ = ()

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Final = _Required()
"""The default of a key that has none (``group``, ``member_id``)."""

_METADATA: Final = "derecho_async.key"


@dataclass(frozen=True, slots=True)
class _Spec:
    form: Form
    doc: str
    shown: str | None
    env: bool


def key(form: Form, doc: str, *, shown: str | None = None, env: bool = True) -> dict[str, Any]:
    """The ``metadata`` of a ``Config`` field: its ``form``, a one-line ``doc`` (markdown, as
    the README shows it), how the README shows its default if not as the value itself
    (``shown``: ``"auto"`` for a None that means a choice made at run time), and whether
    ``DERECHO_ASYNC_<KEY>`` sets it."""
    return {_METADATA: _Spec(form, doc, shown, env)}


@dataclass(frozen=True, slots=True)
class Key:
    """One setting (see the module docstring)."""

    name: str
    type: str
    """The annotation, as written: ``float``, ``int | None``, ``Mapping[int, str]``."""
    default: object
    """The default value, or :data:`REQUIRED`."""
    form: Form
    doc: str
    """One line, markdown: what the key means (its range is in :attr:`form`)."""
    env: str | None
    """The environment variable that sets it, if any."""
    shown: str | None = None

    @property
    def optional(self) -> bool:
        """Whether None is a value (the annotation ends in ``| None``)."""
        return self.type.endswith(" | None")

    def expected(self) -> str:
        """The form, for an error message."""
        return ("None or " if self.optional else "") + self.form.expected()

    def default_text(self) -> str:
        """The default as the README shows it."""
        value = self.default
        if value is REQUIRED:
            return "(required)"
        if self.shown is not None:
            return self.shown
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str):
            return f"`{value}`"
        if isinstance(value, int | float):
            return show_number(value)
        if isinstance(value, Mapping) and not value:
            return "{}"
        return repr(value)

    def check(self, value: object, seen: Mapping[str, object]) -> object:
        """``value`` as stored; :class:`ConfigError` naming this key if it is not of its form.
        ``seen``: the keys checked before this one, as stored."""
        if value is None and self.optional:
            return None
        try:
            return self.form.accept(value, seen)
        except Rejected as e:
            got = "<hidden>" if self.form.hidden else value
            raise ConfigError(self.name, self.expected() + e.detail, got) from None

    def parse_env(self, text: str, where: str) -> object:
        """The value the text of an environment variable stands for (an empty text unsets an
        optional key); :class:`ConfigError` naming the key and ``where`` if it stands for
        none. The value is checked later, with the others."""
        if self.optional and text.strip() == "":
            return None
        try:
            return self.form.parse(text)
        except ValueError:
            raise ConfigError(self.name, f"{self.expected()} (from {where})", text) from None


def table(cls: type) -> tuple[Key, ...]:
    """The keys of a dataclass whose fields carry :func:`key` metadata, in field order."""
    keys = []
    for f in dataclasses.fields(cls):
        spec = f.metadata[_METADATA]
        assert isinstance(spec, _Spec) and isinstance(f.type, str), f.name
        if f.default is not dataclasses.MISSING:
            default: object = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        if f.type.removesuffix(" | None") != spec.form.type_name:
            raise TypeError(f"{cls.__name__}.{f.name}: {f.type} with a "
                            f"{type(spec.form).__name__} form")
        keys.append(Key(f.name, f.type, default, spec.form, spec.doc,
                        ENV_PREFIX + f.name.upper() if spec.env else None, spec.shown))
    return tuple(keys)
