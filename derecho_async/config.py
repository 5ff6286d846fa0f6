# Theory of operation
# -------------------
# ``Config`` is the one settings object of a group member: a frozen, slotted dataclass whose
# ``__post_init__`` validates every field strictly (exact types, ranges, forms) and raises
# ConfigError(key, expected form, value) on the first defect. A Config that exists is valid, so
# nothing downstream re-checks settings.
#
# Settings come from three sources, merged as plain dicts before one validated construction:
#   1. a TOML file (``from_toml``): values keep their TOML types (no str → int coercion); the
#      settings sit at top level, or under a ``[derecho_async]`` table, in which case the rest of
#      the file is ignored (so the table can live in a file shared with other programs);
#   2. the environment (``from_env``): ``DERECHO_ASYNC_<KEY>`` strings, parsed by field type;
#   3. explicit keyword overrides.
# ``load`` applies them in that order, later sources winning. Each merged key remembers where it
# came from, so a ConfigError raised by validation names the file or variable too.
#
# Unknown keys are errors everywhere (a typo must not silently fall back to a default), including
# in ``Config(**fields)``: a small ``__new__`` checks the keyword names before the dataclass
# ``__init__`` runs. ``peers`` is stored as an immutable, hashable, picklable mapping, so a Config
# can be hashed, compared, copied and sent to a child process. ``secret`` is left out of repr().

"""The settings of a group member: :class:`Config` and :func:`parse_hostport`."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Self

from derecho_async.errors import ConfigError
from derecho_async.transport import registry

__all__ = [
    "ENV_PREFIX",
    "ENV_RESERVED",
    "LOG_LEVELS",
    "QUEUE_FULL_ACTIONS",
    "Config",
    "parse_hostport",
]

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

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The values of :attr:`Config.log_level` (given in any case, stored upper-case)."""
QUEUE_FULL_ACTIONS: Final = ("wait", "error")
"""The values of :attr:`Config.when_queue_full`."""

_GROUP_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HOST_RE: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")
_INT_RE: Final = re.compile(r"[+-]?[0-9]{1,20}")  # bounded: int() of huge strings raises
_ID_LIMIT: Final = 1 << 63
_MIN_SECRET: Final = 16

_HOSTPORT_FORM: Final = "'host:port' (IPv6 hosts in brackets, as '[::1]:7000')"

_EXPECTED: Final[dict[str, str]] = {
    "group": "a group name of 1-64 characters from [A-Za-z0-9_.-]",
    "member_id": "an integer member id, 0 <= id < 2**63",
    "initial_members": "an integer from 1 to 64",
    "transport": "one of: " + ", ".join(registry.names()),
    "contact": f"None or {_HOSTPORT_FORM} with a port from 1 to 65535",
    "listen": f"{_HOSTPORT_FORM} with a port from 0 to 65535 (0: any free port)",
    "peers": f"a mapping of member id (0 <= id < 2**63) to {_HOSTPORT_FORM}, port 1-65535",
    "secret": f"None or a shared secret of at least {_MIN_SECRET} characters",
    "tls_cert": "None or the path of a PEM certificate file",
    "tls_key": "None or the path of a PEM private key file",
    "tls_ca": "None or the path of a PEM CA bundle",
    "heartbeat_ms": "a positive, finite number of milliseconds",
    "suspect_after_ms": "a finite number of milliseconds greater than heartbeat_ms",
    "window": "an integer from 1 to 65536",
    "max_payload": "an integer from 64 to 1048576 that is a multiple of 8",
    "partition_safety": "a boolean",
    "gpu_plane": "one of: auto, ipc, nccl, host",
    "gpu_pool_mb": "an integer from 1 to 1048576",
    "gpu_busy_poll_us": "a number of microseconds from 0 to 1e6",
    "gpu_poll_interval_us": "a number of microseconds from 0 to 1e5",
    "nccl_setup_s": "a number of seconds greater than 0 and at most 86400",
    "nccl_stall_s": "a number of seconds greater than 0 and at most 86400",
    "max_call_mb": "an integer number of MiB from 1 to 1023",
    "max_queued_calls": "an integer from 1 to 2**24",
    "max_queued_mb": "an integer number of MiB from 1 to 2**20",
    "when_queue_full": "one of: " + ", ".join(QUEUE_FULL_ACTIONS),
    "check_p2p_reads": "a boolean",
    "state_chunk_kb": "an integer number of KiB from 4 to 1048576",
    "state_stall_s": "a number of seconds greater than 0 and at most 86400",
    "fence_timeout_s": "a number of seconds greater than 0 and at most 86400",
    "spin_us": "None or a number of microseconds from 0 to 1e6",
    "send_batch": "None or an integer from 0 to 65536",
    "rdma_device": "None or the name of an RDMA device (as in ibv_devices)",
    "rdma_port": "an integer port number of the RDMA device, from 1 to 255",
    "rdma_gid_index": "None or a non-negative integer GID table index",
    "log_level": "one of: " + ", ".join(LOG_LEVELS),
}


class _Peers(Mapping[int, str]):
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

    def __reduce__(self) -> tuple[type[_Peers], tuple[dict[int, str]]]:
        return (_Peers, (dict(self._items),))


def parse_hostport(text: object, key: str, *, allow_port_zero: bool = True) -> tuple[str, int]:
    """Split ``"host:port"`` into ``(host, port)``; ``"[v6addr]:port"`` gives the bare address.

    The host is a hostname, an IPv4 address or a bracketed IPv6 address; the port a decimal
    number from 0 (only if ``allow_port_zero``) or 1 to 65535. Any other input raises
    ``ConfigError(key, ...)``.
    """
    low = 0 if allow_port_zero else 1
    expected = f"{_HOSTPORT_FORM} with a port from {low} to 65535"
    if not isinstance(text, str):
        raise ConfigError(key, expected, text)
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit() or len(port_text) > 5:
        raise ConfigError(key, expected, text)
    port = int(port_text)
    if not low <= port <= 65535:
        raise ConfigError(key, expected, text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(key, expected, text) from None
    elif not _HOST_RE.fullmatch(host):
        raise ConfigError(key, expected, text)
    return host, port


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Settings of one group member. Construct with keywords; every field is validated.

    Invalid values raise :class:`~derecho_async.errors.ConfigError` naming the key and the
    expected form; so do unknown keys. Instances are immutable and hashable: derive variants
    with :meth:`replace`. Load from files and the environment with :meth:`from_toml`,
    :meth:`from_env` and :meth:`load`.
    """

    group: str
    """Name of the group: 1-64 characters from [A-Za-z0-9_.-]."""
    member_id: int
    """This member's id, unique in the group: 0 <= id < 2**63."""
    initial_members: int = 1
    """Members the group waits for before installing its first view (1-64)."""
    transport: str = "shm"
    """How members reach each other: shm (one host), tcp, rdma (pyverbs) or sim (testing)."""
    contact: str | None = None
    """'host:port' of a member to join through (tcp); None to start or wait for ``peers``."""
    listen: str = "127.0.0.1:0"
    """'host:port' this member listens on (tcp); port 0 picks a free port."""
    peers: Mapping[int, str] = field(default_factory=dict)
    """Member id → 'host:port' of the initial members (tcp bootstrap). Stored read-only."""
    secret: str | None = field(default=None, repr=False)
    """Shared secret that authenticates joins; required for tcp; >= 16 characters."""
    tls_cert: str | None = None
    """Path of this member's PEM certificate (TLS over tcp); set together with ``tls_key``."""
    tls_key: str | None = None
    """Path of this member's PEM private key; set together with ``tls_cert``."""
    tls_ca: str | None = None
    """Path of the PEM CA bundle peers' certificates are checked against."""
    heartbeat_ms: float = 50.0
    """Period of heartbeats, in milliseconds (> 0)."""
    suspect_after_ms: float = 500.0
    """A peer silent this long (ms) is suspected of failure; must exceed ``heartbeat_ms``."""
    window: int = 64
    """Message slots per sender in the shared-state table (1-65536): bounds unstable messages."""
    max_payload: int = 8192
    """Bytes of payload a slot holds (64 to 1 MiB, multiple of 8); larger messages use the
    data plane."""
    partition_safety: bool = True
    """Install a view only with a majority of the previous one (no split brain)."""
    max_call_mb: int = 1023
    """The largest encoded ordered call, arguments included, in MiB (1-1023), checked when the
    call is made: the channel's 1 GiB frame bound less room for framing."""
    send_batch: int | None = None
    """Messages a sender writes into its slots per protocol step (0: as many as the window
    allows; small ones share a slot). Receivers start on a batch while the sender writes the
    next one: with all of a window written in one go, sender and receivers take turns instead
    of overlapping. That needs a core per member; where members share few cores the extra steps
    only cost. None: 8 on a machine of at least 8 cores, else 0."""
    gpu_plane: str = "auto"
    """How device arrays travel: 'ipc' (pooled CUDA IPC between members of one host), 'nccl'
    (NCCL broadcasts on per-sender communicators, for members on different GPUs, any transport;
    then CUDA IPC over shm for what NCCL does not take), 'host' (staged through host memory), or
    'auto' (ipc when the transport is shm and CuPy sees a GPU; NCCL only when asked for)."""
    gpu_pool_mb: int = 256
    """Size in MiB of each segment of the CUDA IPC device pool (it grows by segments)."""
    gpu_busy_poll_us: float = 2000.0
    """Microseconds the CUDA IPC plane keeps polling its copy events after the last completion
    before it hands the wait to its waiter thread (0 to 1e6; 0: never poll, always the thread).
    The NCCL plane notices its broadcasts the same way."""
    gpu_poll_interval_us: float = 80.0
    """While more than one batch of copies is in flight, the least time in microseconds between
    two polls of the copy events (0 to 1e5; 0: at every turn of the loop). A lone batch is
    polled at every turn. Never longer than ``gpu_busy_poll_us``."""
    nccl_setup_s: float = 60.0
    """Seconds a member waits for a root's NCCL unique id before it marks that communicator
    failed (> 0, at most 86400)."""
    nccl_stall_s: float = 60.0
    """A receiver whose oldest NCCL broadcast makes no progress for this many seconds plus its
    size at 100 MB/s fails that communicator and reports the root (> 0, at most 86400)."""
    spin_us: float | None = None
    """Microseconds a member keeps polling its shared-memory rings after the last arrival before
    it sleeps on its doorbell (shm), when traffic is dense (the last two arrivals within five such
    spans; an idle group's heartbeats never spin): lower latency for a core kept busy meanwhile.
    None: 200 on a machine of at least 8 cores, else 0 (never spin: members share few cores)."""
    max_queued_calls: int = 16384
    """Calls queued at this member (its own calls not yet delivered, and delivered calls waiting
    for their handler) beyond which backpressure applies (1 to 2**24)."""
    max_queued_mb: int = 256
    """MiB of calls queued at this member (as for ``max_queued_calls``) beyond which
    backpressure applies (1 to 2**20)."""
    when_queue_full: str = "wait"
    """What a call does when this member's queues are full: 'wait' for room, or 'error' (raise
    ``QueueFull``)."""
    check_p2p_reads: bool = False
    """Compare an actor's snapshot before and after every p2p handler (a test aid: p2p handlers
    must not change the replica)."""
    state_chunk_kb: int = 32768
    """Size in KiB of the chunks a joiner's state travels in (4 to 1048576)."""
    state_stall_s: float = 30.0
    """A state transfer that makes no progress for this many seconds fails the join (> 0, at
    most 86400)."""
    fence_timeout_s: float = 60.0
    """Seconds a member sending a joiner its state waits for the handlers of calls delivered
    before the joiner's view to finish; past it the join fails (> 0, at most 86400)."""
    rdma_device: str | None = None
    """RDMA device name (rdma transport); None picks the first device."""
    rdma_port: int = 1
    """Port number on the RDMA device (1-255)."""
    rdma_gid_index: int | None = None
    """GID table index (RoCE); None lets the transport choose."""
    log_level: str = "WARNING"
    """Level of the ``derecho_async`` logger: DEBUG, INFO, WARNING, ERROR or CRITICAL."""

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        # Runs before the dataclass __init__, so unknown and missing keys give ConfigError
        # rather than TypeError. Called without arguments by copy and pickle: nothing to check.
        if kwargs:
            _check_known(kwargs)
            for required in ("group", "member_id"):
                if required not in kwargs:
                    raise ConfigError(required, _EXPECTED[required] + " (required)", None)
        return object.__new__(cls)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.group, str) or not _GROUP_RE.fullmatch(self.group):
            raise ConfigError("group", _EXPECTED["group"], self.group)
        if not _is_int(self.member_id) or not 0 <= self.member_id < _ID_LIMIT:
            raise ConfigError("member_id", _EXPECTED["member_id"], self.member_id)
        if not _is_int(self.initial_members) or not 1 <= self.initial_members <= 64:
            raise ConfigError("initial_members", _EXPECTED["initial_members"], self.initial_members)
        if self.transport not in registry.names():  # (transports registered since included)
            raise ConfigError("transport", "one of: " + ", ".join(registry.names()),
                              self.transport)
        if self.contact is not None:
            parse_hostport(self.contact, "contact", allow_port_zero=False)
        parse_hostport(self.listen, "listen")
        set_(self, "peers", _check_peers(self.peers))
        if self.secret is not None and (
            not isinstance(self.secret, str) or len(self.secret) < _MIN_SECRET
        ):
            raise ConfigError("secret", _EXPECTED["secret"], "<hidden>")
        if registry.kind(self.transport).networked and self.secret is None:
            raise ConfigError(
                "secret", _EXPECTED["secret"] + " (required when transport is 'tcp' or 'rdma'"
                " or another networked transport)", None
            )
        for name in ("tls_cert", "tls_key", "tls_ca", "rdma_device"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(name, _EXPECTED[name], value)
        if (self.tls_cert is None) != (self.tls_key is None):
            missing = "tls_key" if self.tls_key is None else "tls_cert"
            raise ConfigError(
                missing, _EXPECTED[missing] + " (tls_cert and tls_key go together)", None
            )
        if (
            not _is_number(self.heartbeat_ms)
            or not math.isfinite(self.heartbeat_ms)
            or self.heartbeat_ms <= 0
        ):
            raise ConfigError("heartbeat_ms", _EXPECTED["heartbeat_ms"], self.heartbeat_ms)
        set_(self, "heartbeat_ms", float(self.heartbeat_ms))
        if (
            not _is_number(self.suspect_after_ms)
            or not math.isfinite(self.suspect_after_ms)
            or self.suspect_after_ms <= self.heartbeat_ms
        ):
            raise ConfigError(
                "suspect_after_ms",
                f"{_EXPECTED['suspect_after_ms']} ({self.heartbeat_ms})",
                self.suspect_after_ms,
            )
        set_(self, "suspect_after_ms", float(self.suspect_after_ms))
        if not _is_int(self.window) or not 1 <= self.window <= 65536:
            raise ConfigError("window", _EXPECTED["window"], self.window)
        if self.send_batch is not None and (
            not _is_int(self.send_batch) or not 0 <= self.send_batch <= 65536
        ):
            raise ConfigError("send_batch", _EXPECTED["send_batch"], self.send_batch)
        if (
            not _is_int(self.max_payload)
            or not 64 <= self.max_payload <= 1 << 20
            or self.max_payload % 8
        ):
            raise ConfigError("max_payload", _EXPECTED["max_payload"], self.max_payload)
        if self.gpu_plane not in ("auto", "ipc", "nccl", "host"):
            raise ConfigError("gpu_plane", _EXPECTED["gpu_plane"], self.gpu_plane)
        if self.spin_us is not None and (
            isinstance(self.spin_us, bool) or not isinstance(self.spin_us, (int, float))
            or not 0.0 <= self.spin_us <= 1e6
        ):
            raise ConfigError("spin_us", _EXPECTED["spin_us"], self.spin_us)
        if not _is_int(self.gpu_pool_mb) or not 1 <= self.gpu_pool_mb <= 1 << 20:
            raise ConfigError("gpu_pool_mb", _EXPECTED["gpu_pool_mb"], self.gpu_pool_mb)
        self._check_number("gpu_busy_poll_us", 0.0, 1e6)
        self._check_number("gpu_poll_interval_us", 0.0, 1e5)
        for name in ("nccl_setup_s", "nccl_stall_s", "state_stall_s", "fence_timeout_s"):
            self._check_number(name, 0.0, 86400.0, low_open=True)
        self._check_int("max_call_mb", 1, 1023)
        self._check_int("max_queued_calls", 1, 1 << 24)
        self._check_int("max_queued_mb", 1, 1 << 20)
        self._check_int("state_chunk_kb", 4, 1 << 20)
        if self.when_queue_full not in QUEUE_FULL_ACTIONS:
            raise ConfigError("when_queue_full", _EXPECTED["when_queue_full"], self.when_queue_full)
        for name in ("partition_safety", "check_p2p_reads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, _EXPECTED[name], getattr(self, name))
        if not _is_int(self.rdma_port) or not 1 <= self.rdma_port <= 255:
            raise ConfigError("rdma_port", _EXPECTED["rdma_port"], self.rdma_port)
        if self.rdma_gid_index is not None and (
            not _is_int(self.rdma_gid_index) or self.rdma_gid_index < 0
        ):
            raise ConfigError("rdma_gid_index", _EXPECTED["rdma_gid_index"], self.rdma_gid_index)
        level = self.log_level.upper() if isinstance(self.log_level, str) else None
        if level not in LOG_LEVELS:
            raise ConfigError("log_level", _EXPECTED["log_level"], self.log_level)
        set_(self, "log_level", level)

    def _check_number(self, name: str, low: float, high: float, *, low_open: bool = False) -> None:
        """Field ``name`` must be a finite int or float from ``low`` (excluded if ``low_open``)
        to ``high``; it is stored as a float."""
        value = getattr(self, name)
        if (
            not _is_number(value)
            or not math.isfinite(value)
            or not (low < value if low_open else low <= value)
            or not value <= high
        ):
            raise ConfigError(name, _EXPECTED[name], value)
        object.__setattr__(self, name, float(value))

    def _check_int(self, name: str, low: int, high: int) -> None:
        """Field ``name`` must be an int (not a bool) from ``low`` to ``high``."""
        value = getattr(self, name)
        if not _is_int(value) or not low <= value <= high:
            raise ConfigError(name, _EXPECTED[name], value)

    # ------------------------------------------------------------------------------ constructors

    def replace(self, **changes: Any) -> Config:
        """A validated copy with ``changes`` applied (unknown keys raise ConfigError)."""
        _check_known(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> Config:
        """Read settings from a TOML file, then apply ``overrides``.

        Keys sit at top level, or under a ``[derecho_async]`` table (then the rest of the file is
        ignored). Values must already have the right TOML type (``member_id = 2``, not ``"2"``);
        ``peers`` is a table whose keys are member ids (``[derecho_async.peers]`` / ``0 =
        "h1:7000"``). An unreadable or malformed file raises ConfigError with key ``"path"``.
        """
        values, sources = _read_toml(path)
        _merge(values, sources, overrides, "an explicit argument")
        return _build(values, sources)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Read settings from ``DERECHO_ASYNC_<KEY>`` variables, then apply ``overrides``.

        ``environ`` defaults to :data:`os.environ`. Values are parsed by field type: integers in
        decimal, numbers as floats, booleans as true/false/1/0/yes/no/on/off, optional settings
        unset by an empty string, ``peers`` as ``"0=h1:7000,1=h2:7000"``. A bad value raises
        ConfigError naming the key and the variable; so does an unknown ``DERECHO_ASYNC_*``
        variable (except :data:`ENV_RESERVED`).
        """
        values, sources = _read_env(os.environ if environ is None else environ)
        _merge(values, sources, overrides, "an explicit argument")
        return _build(values, sources)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Config:
        """Merge a TOML file (if ``path``), the environment and ``overrides``; later wins.

        ``environ`` defaults to :data:`os.environ`. Validation runs once, on the merged settings,
        so a file may leave out what the environment supplies.
        """
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        if path is not None:
            values, sources = _read_toml(path)
        env_values, env_sources = _read_env(os.environ if environ is None else environ)
        values.update(env_values)
        sources.update(env_sources)
        _merge(values, sources, overrides, "an explicit argument")
        return _build(values, sources)


_FIELDS: Final[dict[str, dataclasses.Field[Any]]] = {f.name: f for f in dataclasses.fields(Config)}
_KNOWN_TEXT: Final = "one of: " + ", ".join(sorted(_FIELDS))


def _check_known(values: Mapping[str, object]) -> None:
    for key, value in values.items():
        if key not in _FIELDS:
            raise ConfigError(key, _KNOWN_TEXT, value)


def _check_peers(peers: object) -> _Peers:
    if not isinstance(peers, Mapping):
        raise ConfigError("peers", _EXPECTED["peers"], peers)
    for member, address in peers.items():
        if not _is_int(member) or not 0 <= member < _ID_LIMIT:
            raise ConfigError("peers", _EXPECTED["peers"] + f" (bad member id {member!r})", peers)
        parse_hostport(address, "peers", allow_port_zero=False)
    return peers if isinstance(peers, _Peers) else _Peers(peers)


def _merge(
    values: dict[str, Any],
    sources: dict[str, str],
    overrides: Mapping[str, object],
    source: str,
) -> None:
    _check_known(overrides)
    values.update(overrides)
    sources.update(dict.fromkeys(overrides, source))


def _build(values: dict[str, Any], sources: Mapping[str, str]) -> Config:
    """Construct a Config; a ConfigError also says where the offending value came from."""
    try:
        return Config(**values)
    except ConfigError as e:
        source = sources.get(e.key)
        if source is None or source == "an explicit argument":
            raise
        raise ConfigError(e.key, f"{e.expected} (from {source})", e.got) from e


# ------------------------------------------------------------------------------------- TOML


def _read_toml(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, str]]:
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
        _check_known(values)
    except ConfigError as e:
        raise ConfigError(e.key, f"{e.expected} (in {where})", e.got) from None
    if "peers" in values:
        values["peers"] = _toml_peers(values["peers"], where)
    return values, dict.fromkeys(values, where)


def _toml_peers(table: object, where: str) -> object:
    if not isinstance(table, dict):
        return table  # validation reports the wrong type
    peers: dict[object, object] = {}
    for key, address in table.items():
        if not _INT_RE.fullmatch(key):
            raise ConfigError(
                "peers", f"{_EXPECTED['peers']}; keys are member ids (in {where})", key
            )
        peers[int(key)] = address
    return peers


# -------------------------------------------------------------------------------- environment


_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


def _read_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for variable, text in environ.items():
        if not variable.startswith(ENV_PREFIX) or variable in ENV_RESERVED:
            continue
        key = variable[len(ENV_PREFIX) :].lower()
        where = f"environment variable {variable}"
        if key not in _FIELDS:
            raise ConfigError(key, f"{_KNOWN_TEXT} (from {where})", text)
        values[key] = _parse_env(key, text, where)
        sources[key] = where
    return values, sources


def _parse_env(key: str, text: str, where: str) -> object:
    kind = _FIELDS[key].type  # the annotation as a string (postponed evaluation)
    optional = isinstance(kind, str) and kind.endswith("| None")
    if optional and text.strip() == "":
        return None
    base = kind.removesuffix(" | None") if isinstance(kind, str) else ""
    bad = ConfigError(key, f"{_EXPECTED[key]} (from {where})", text)
    if base == "int":
        if not _INT_RE.fullmatch(text.strip()):
            raise bad
        return int(text)
    if base == "float":
        try:
            return float(text)
        except ValueError:
            raise bad from None
    if base == "bool":
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise bad
    if key == "peers":
        return _env_peers(text, bad)
    return text


def _env_peers(text: str, bad: ConfigError) -> dict[int, str]:
    peers: dict[int, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        member, sep, address = item.partition("=")
        member = member.strip()
        if not sep or not _INT_RE.fullmatch(member) or int(member) in peers:
            raise bad
        peers[int(member)] = address.strip()
    return peers
