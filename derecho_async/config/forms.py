"""The forms a setting's value may take: each checks a value, parses it from an environment
variable and describes itself, for error messages and for the README's table.

Theory of operation: a :class:`Form` knows nothing of key names. :meth:`Form.accept` returns the
value as stored (numbers become floats, log levels upper-case, peers a read-only mapping) or
raises :class:`Rejected`; :class:`~derecho_async.config.keys.Key` turns that into the
:class:`ConfigError` that names the key. Bounds are written once, as numbers, and both texts
(:meth:`Form.expected`, :meth:`Form.allowed`) are made from them. See docs/DESIGN.md §7.10.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Iterator, Mapping
from typing import ClassVar, Final

from derecho_async.config import strength
from derecho_async.errors import ConfigError

__all__ = [
    "Choice",
    "Flag",
    "Form",
    "HostPort",
    "Int",
    "Number",
    "PeerTable",
    "Peers",
    "Rejected",
    "Secret",
    "Text",
    "parse_hostport",
    "show_number",
]

HOSTPORT_FORM: Final = "'host:port' (IPv6 hosts in brackets, as '[::1]:7000')"
ID_LIMIT: Final = 1 << 63
"""Member ids are below this (they travel as unsigned 63-bit numbers)."""
INT_RE: Final = re.compile(r"[+-]?[0-9]{1,20}")  # bounded: int() of huge strings raises
_HOST_RE: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


class Rejected(Exception):
    """A value is not of its key's form; ``detail`` is added to the expected form."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(detail)
        self.detail = detail


def show_number(x: float) -> str:
    """A bound as people write it: ``1e6``, ``2**20``, ``2**63 - 1``, ``86400``, ``0.5``."""
    if isinstance(x, float) and not x.is_integer():
        return repr(x)
    n = int(x)
    if isinstance(x, float) and n >= 100_000 and str(n).rstrip("0") == "1":
        return f"1e{len(str(n)) - 1}"
    if isinstance(x, int) and n >= 1 << 20:
        if n & (n - 1) == 0:
            return f"2**{n.bit_length() - 1}"
        if (n + 1) & n == 0:
            return f"2**{n.bit_length()} - 1"
    return str(n)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Form:
    """What one key accepts (see the module docstring)."""

    type_name: ClassVar[str]
    """The key's annotation, ``| None`` left out: the table checks the two agree."""
    hidden: ClassVar[bool] = False
    """Whether an error leaves the value out (secrets)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.allowed()})"

    def expected(self) -> str:
        """The form, for an error message: ``an integer from 1 to 64``."""
        raise NotImplementedError

    def allowed(self) -> str:
        """The form, short, for the README's table: ``1 to 64``."""
        raise NotImplementedError

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        """The value as stored, or :class:`Rejected`. ``seen``: the keys checked before."""
        raise NotImplementedError

    def parse(self, text: str) -> object:
        """The value an environment variable's text stands for (:class:`ValueError` if none);
        validation follows. Text stays text unless a subclass says otherwise."""
        return text


class Text(Form):
    """A non-empty string, matching ``pattern`` if one is given."""

    type_name = "str"

    def __init__(self, form: str, allowed: str, pattern: re.Pattern[str] | None = None) -> None:
        self.form = form
        self.short = allowed
        self.pattern = pattern

    def expected(self) -> str:
        return self.form

    def allowed(self) -> str:
        return self.short

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        if not isinstance(value, str) or not value or (
            self.pattern is not None and not self.pattern.fullmatch(value)
        ):
            raise Rejected
        return value


class Secret(Form):
    """A secret made by :func:`~derecho_async.config.strength.new_secret` (a tagged random
    value, :mod:`.strength`), never shown in errors; a rejection says whether it was not made
    so or was mistyped or cut, and how to make one."""

    type_name = "str"
    hidden = True

    def expected(self) -> str:
        return "a secret made by `derecho-async secret` (or `da.new_secret()`)"

    def allowed(self) -> str:
        return "`derecho-async secret`'s output"

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        if not isinstance(value, str):
            raise Rejected
        why = strength.problem(value)
        if why is not None:
            raise Rejected(f"; {why}")
        return value


class Choice(Form):
    """One of a few words; ``choices`` may be a function (names registered at run time).
    ``upper``: given in any case, stored upper-case."""

    type_name = "str"

    def __init__(self, choices: tuple[str, ...] | Callable[[], tuple[str, ...]], *,
                 upper: bool = False) -> None:
        self._choices = choices
        self.upper = upper

    def choices(self) -> tuple[str, ...]:
        """The words accepted now."""
        return self._choices if isinstance(self._choices, tuple) else self._choices()

    def expected(self) -> str:
        return "one of: " + ", ".join(self.choices())

    def allowed(self) -> str:
        return ", ".join(f"`{c}`" for c in self.choices())

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        if self.upper:
            value = value.upper() if isinstance(value, str) else None
        if value not in self.choices():
            raise Rejected
        return value


class Flag(Form):
    """A boolean (``True``/``False`` exactly; the environment's words are parsed)."""

    type_name = "bool"

    def expected(self) -> str:
        return "a boolean"

    def allowed(self) -> str:
        return "true, false"

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        if not isinstance(value, bool):
            raise Rejected
        return value

    def parse(self, text: str) -> object:
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ValueError(text)


class Int(Form):
    """An int (not a bool) from ``low`` to ``high``, a multiple of ``multiple``; ``unit`` names
    what it counts."""

    type_name = "int"

    def __init__(self, low: int, high: int, unit: str = "", *, multiple: int = 1) -> None:
        self.low = low
        self.high = high
        self.unit = unit
        self.multiple = multiple

    def expected(self) -> str:
        what = f"an integer number of {self.unit}" if self.unit else "an integer"
        tail = f" that is a multiple of {self.multiple}" if self.multiple > 1 else ""
        return f"{what} from {show_number(self.low)} to {show_number(self.high)}{tail}"

    def allowed(self) -> str:
        tail = f", a multiple of {self.multiple}" if self.multiple > 1 else ""
        return f"{show_number(self.low)} to {show_number(self.high)}{tail}"

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        if not isinstance(value, int) or isinstance(value, bool) or not (
            self.low <= value <= self.high
        ) or value % self.multiple:
            raise Rejected
        return value

    def parse(self, text: str) -> object:
        if not INT_RE.fullmatch(text.strip()):
            raise ValueError(text)
        return int(text)


class Number(Form):
    """A finite int or float, stored as a float: from ``low`` (excluded if ``low_open``) to
    ``high``, and above the key ``above`` if one is named (checked before this one)."""

    type_name = "float"

    def __init__(self, low: float, high: float, unit: str, *, low_open: bool = False,
                 above: str | None = None) -> None:
        self.low = low
        self.high = high
        self.unit = unit
        self.low_open = low_open
        self.above = above

    def expected(self) -> str:
        high = show_number(self.high)
        if self.above is not None:
            return f"a number of {self.unit} greater than {self.above}, at most {high}"
        if self.low_open and self.low == 0:
            return f"a positive number of {self.unit}, at most {high}"
        if self.low_open:
            return f"a number of {self.unit} greater than {show_number(self.low)}, at most {high}"
        return f"a number of {self.unit} from {show_number(self.low)} to {high}"

    def allowed(self) -> str:
        high = show_number(self.high)
        if self.above is not None:
            return f"> `{self.above}`, at most {high}"
        if self.low_open:
            return f"> {show_number(self.low)}, at most {high}"
        return f"{show_number(self.low)} to {high}"

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(
            value
        ) or not (self.low < value if self.low_open else self.low <= value) or not (
            value <= self.high
        ):
            raise Rejected
        if self.above is not None:
            floor = seen[self.above]
            assert isinstance(floor, float)
            if not value > floor:
                raise Rejected(f" ({self.above} = {floor!r})")
        return float(value)

    def parse(self, text: str) -> object:
        return float(text)


def _split_hostport(text: object, low: int) -> tuple[str, int] | None:
    if not isinstance(text, str):
        return None
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        return None
    port = int(port_text)
    if not low <= port <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    elif not _HOST_RE.fullmatch(host):
        return None
    return host, port


def _hostport_form(low: int) -> str:
    return f"{HOSTPORT_FORM} with a port from {low} to 65535"


def parse_hostport(text: object, key: str, *, allow_port_zero: bool = True) -> tuple[str, int]:
    """Split ``"host:port"`` into ``(host, port)``; ``"[v6addr]:port"`` gives the bare address.

    The host is a hostname, an IPv4 address or a bracketed IPv6 address; the port a decimal
    number from 0 (only if ``allow_port_zero``) or 1 to 65535. Any other input raises
    ``ConfigError(key, ...)``.
    """
    low = 0 if allow_port_zero else 1
    split = _split_hostport(text, low)
    if split is None:
        raise ConfigError(key, _hostport_form(low), text)
    return split


class HostPort(Form):
    """A ``"host:port"`` string (see :func:`parse_hostport`), stored as given."""

    type_name = "str"

    def __init__(self, *, allow_port_zero: bool) -> None:
        self.low = 0 if allow_port_zero else 1

    def expected(self) -> str:
        if self.low == 0:
            return f"{HOSTPORT_FORM} with a port from 0 to 65535 (0: any free port)"
        return _hostport_form(self.low)

    def allowed(self) -> str:
        return f"`host:port`, port {self.low} to 65535"

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        if _split_hostport(value, self.low) is None:
            raise Rejected
        return value


class Peers(Mapping[int, str]):
    """Read-only, hashable, picklable member id → 'host:port' mapping (sorted by id)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[int, str]) -> None:
        self._items: dict[int, str] = dict(sorted(items.items()))

    def __getitem__(self, key: int) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other.items())
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self) -> tuple[type[Peers], tuple[dict[int, str]]]:
        return (Peers, (dict(self._items),))


class PeerTable(Form):
    """Member id → ``"host:port"`` (port 1-65535), stored as :class:`Peers`. From the
    environment: ``"0=h1:7000,1=h2:7000"``."""

    type_name = "Mapping[int, str]"

    def expected(self) -> str:
        return f"a mapping of member id (0 <= id < 2**63) to {HOSTPORT_FORM}, port 1-65535"

    def allowed(self) -> str:
        return "member id -> `host:port`"

    def accept(self, value: object, seen: Mapping[str, object]) -> object:
        if not isinstance(value, Mapping):
            raise Rejected
        for member, address in value.items():
            if not _is_int(member) or not 0 <= member < ID_LIMIT:
                raise Rejected(f" (bad member id {member!r})")
            if _split_hostport(address, 1) is None:
                raise Rejected(f" (bad address {address!r})")
        return value if isinstance(value, Peers) else Peers(value)

    def parse(self, text: str) -> object:
        peers: dict[int, str] = {}
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            member, sep, address = item.partition("=")
            member = member.strip()
            if not sep or not INT_RE.fullmatch(member) or int(member) in peers:
                raise ValueError(item)
            peers[int(member)] = address.strip()
        return peers
