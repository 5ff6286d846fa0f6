"""The settings of a group member: :class:`Config`, whose fields are the table of keys.

Theory of operation: every key is one field below, with its type, default, form (range or
choices) and one-line doc; :data:`KEYS` reads them back (:mod:`.keys`). ``__post_init__`` checks
each key in field order against its form, stores the normalised value (numbers as floats, log
levels upper-case, peers read-only), then applies the rules that relate keys (:data:`RULES`).
A Config that exists is valid, so nothing downstream re-checks settings. Unknown and missing
keys are ConfigErrors too: a small ``__new__`` checks the keyword names first. The file and
environment sources are in :mod:`.sources`. See docs/DESIGN.md §7.10.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Self

from derecho_async.config import memory, sources
from derecho_async.config.forms import (
    Choice,
    Flag,
    HostPort,
    Int,
    Number,
    PeerTable,
    Secret,
    Text,
)
from derecho_async.config.keys import REQUIRED, Key, key, table
from derecho_async.errors import ConfigError
from derecho_async.transport import registry

__all__ = ["KEYS", "LOG_LEVELS", "QUEUE_FULL_ACTIONS", "RULES", "Config"]

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The values of :attr:`Config.log_level` (given in any case, stored upper-case)."""
QUEUE_FULL_ACTIONS: Final = ("wait", "error")
"""The values of :attr:`Config.when_queue_full`."""
DEFAULT_LISTEN: Final = "127.0.0.1:0"
"""``listen``'s default; a member that ``peers`` names listens at its entry there instead."""

_DAY_S: Final = 86400.0
_SECONDS: Final = Number(0.0, _DAY_S, "seconds", low_open=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """Settings of one group member. Construct with keywords; every field is validated.

    Invalid values raise :class:`~derecho_async.errors.ConfigError` naming the key and the
    expected form; so do unknown keys. Instances are immutable and hashable: derive variants
    with :meth:`replace`. Load from files and the environment with :meth:`from_toml`,
    :meth:`from_env` and :meth:`load`. Each field's form and doc: :data:`KEYS`.
    """

    # -- the group and this member
    group: str = field(metadata=key(
        Text("a group name of 1-64 characters from [A-Za-z0-9_.-]",
             "1-64 of `A-Za-z0-9_.-`", re.compile(r"[A-Za-z0-9_.-]{1,64}")),
        "group name"))
    member_id: int = field(metadata=key(
        Int(0, (1 << 63) - 1), "this member's id, unique in the group"))
    initial_members: int = field(default=1, metadata=key(
        Int(1, 64), "members that form view 0 together (the contact waits for them)"))
    # -- how members reach each other
    transport: str = field(default="shm", metadata=key(
        Choice(registry.names),  # (transports registered at run time included)
        "`shm` (one host), `tcp` (several hosts), `rdma` (pyverbs; see below), `sim` "
        "(in-process)"))
    peers: Mapping[int, str] = field(default_factory=dict, metadata=key(
        PeerTable(),
        "tcp: the addresses of the initial members; the contact is the lowest id"))
    contact: str | None = field(default=None, metadata=key(
        HostPort(allow_port_zero=False),
        "tcp, rdma: the address of any running member to join through (its id is learnt "
        "from it); unset: start, or join through `peers`"))
    listen: str = field(default=DEFAULT_LISTEN, metadata=key(
        HostPort(allow_port_zero=True),
        "tcp: this member's address (port 0: any free port); unset: its own entry in `peers` "
        "when `peers` names it"))
    secret: str | None = field(default=None, repr=False, metadata=key(
        Secret(),
        "tcp, rdma: shared secret, made by `derecho-async secret` or `da.new_secret()` (a "
        "tagged random value: nothing else is taken); required unless TLS is set; a member "
        "without it is refused"))
    tls_cert: str | None = field(default=None, metadata=key(
        Text("the path of a PEM certificate file", "a path"),
        "tcp, rdma: this member's PEM certificate, naming its id (`derecho-async certs`); "
        "turns on mutual TLS with ids bound to certificates"))
    tls_key: str | None = field(default=None, metadata=key(
        Text("the path of a PEM private key file", "a path"),
        "tcp, rdma: this member's PEM private key (set with `tls_cert`)"))
    tls_ca: str | None = field(default=None, metadata=key(
        Text("the path of a PEM CA bundle", "a path"),
        "tcp, rdma: the group CA's PEM certificate, which peers' must chain to (set with "
        "`tls_cert`)"))
    # -- external clients
    client_listen: str | None = field(default=None, metadata=key(
        HostPort(allow_port_zero=True),
        "the address this member serves external clients on (`da.Client`; port 0: any free "
        "port; unset: none), told to clients as given: use one they can reach"))
    client_secret: str | None = field(default=None, repr=False, metadata=key(
        Secret(),
        "the secret external clients prove at `client_listen` (`derecho-async secret`; "
        "another than `secret`, which only members hold); required with `client_listen` "
        "unless TLS is set (then clients present client certificates, and it is a second "
        "factor)"))
    max_clients: int = field(default=1024, metadata=key(
        Int(1, 1 << 20), "client connections this member serves at once, at most"))
    max_client_calls: int = field(default=256, metadata=key(
        Int(1, 1024),
        "calls one client connection may have in flight at this member (past it the member "
        "stops reading from it)"))
    # -- failure detection
    heartbeat_ms: float = field(default=50.0, metadata=key(
        Number(1.0, 60_000.0, "milliseconds"),
        "heartbeat period (the driver's tick; from 1 ms, as a shorter one leaves the event loop "
        "little time for anything but ticks)"))
    suspect_after_ms: float = field(default=500.0, metadata=key(
        Number(0.0, 3_600_000.0, "milliseconds", low_open=True, above="heartbeat_ms"),
        "silence (no heartbeat, no beacon) after which a member is suspected and removed"))
    max_loop_hold_ms: float = field(default=60_000.0, metadata=key(
        Number(0.0, 3_600_000.0, "milliseconds"),
        "how long a handler may hold a member's event loop before peers suspect it (a native "
        "thread beats for the process meanwhile: shared memory, or UDP beside the tcp port; "
        "0: no thread, suspect_after_ms applies)"))
    # -- ordered multicast
    window: int = field(default=64, metadata=key(
        Int(1, memory.MAX_WINDOW),
        "slots per sender (flow control; small messages sent together share a slot); each view "
        "change allocates, on the event loop, a table of a row per member of `window` slots of "
        "`max_payload` bytes, hence the ceiling; with `max_payload` and `initial_members` it "
        "must fit the host's memory (checked, see below)"))
    # Receivers start on a batch while the sender writes the next: with a whole window written
    # in one go, sender and receivers take turns instead of overlapping. That needs a core per
    # member; where members share few cores the extra steps only cost.
    send_batch: int | None = field(default=None, metadata=key(
        Int(0, 65536),
        "messages a sender writes per protocol step (0: a whole window): receivers start on "
        "one batch while the sender writes the next, when members have cores of their own; "
        "auto = 8 on 8+ cores, else 0", shown="auto"))
    max_payload: int = field(default=8192, metadata=key(
        Int(64, 1 << 20, multiple=8),
        "bytes that fit a slot; larger messages travel on the data plane"))
    partition_safety: bool = field(default=True, metadata=key(
        Flag(), "a minority wedges instead of forming a view"))
    # -- device arrays
    gpu_plane: str = field(default="auto", metadata=key(
        Choice(("auto", "ipc", "nccl", "host")),
        "device arrays: `ipc` (pooled CUDA IPC on one host), `nccl` (NCCL broadcasts on "
        "per-sender communicators, members on different GPUs; then ipc over shm), `host` "
        "(staged through host memory); `auto` = ipc over shm when CuPy sees a GPU"))
    gpu_pool_mb: int = field(default=256, metadata=key(
        Int(1, 1 << 20, "MiB"),
        "size of each segment of the CUDA IPC device pool (it grows by segments)"))
    # Dense traffic: the last two arrivals within five such spans; an idle group's heartbeats
    # never spin.
    spin_us: float | None = field(default=None, metadata=key(
        Number(0.0, 1e6, "microseconds"),
        "shm: µs a member keeps polling its rings after the last arrival before sleeping on "
        "its doorbell, in dense traffic only (lower latency, a busy core meanwhile; an idle "
        "group never spins); auto = 200 on 8+ cores, else 0", shown="auto"))
    gpu_busy_poll_us: float = field(default=2000.0, metadata=key(
        Number(0.0, 1e6, "microseconds"),
        "µs the CUDA IPC (and NCCL) plane keeps polling its copy events after the last "
        "completion before its waiter thread takes over (0: never poll)"))
    # Never longer than gpu_busy_poll_us; a lone batch is polled at every turn.
    gpu_poll_interval_us: float = field(default=80.0, metadata=key(
        Number(0.0, 1e5, "microseconds"),
        "while more than one batch of copies is in flight, the least µs between two polls "
        "(0: every turn of the loop)"))
    nccl_setup_s: float = field(default=60.0, metadata=key(
        _SECONDS, "seconds a member waits for a root's NCCL unique id"))
    nccl_stall_s: float = field(default=60.0, metadata=key(
        _SECONDS,
        "a receiver whose oldest NCCL broadcast makes no progress for this many seconds plus "
        "its size at 100 MB/s fails that communicator"))
    # -- calls and backpressure
    # The 1 GiB frame bound of the channel less room for framing.
    max_call_mb: int = field(default=1023, metadata=key(
        Int(1, 1023, "MiB"),
        "the largest encoded ordered call (arguments included), in MiB, checked when the call "
        "is made"))
    max_queued_calls: int = field(default=16384, metadata=key(
        Int(1, 1 << 24),
        "calls queued at this member (its own calls not yet delivered, delivered calls "
        "waiting for their handler) beyond which backpressure applies"))
    max_queued_mb: int = field(default=256, metadata=key(
        Int(1, 1 << 20, "MiB"),
        "MiB of such queued calls beyond which backpressure applies, counted apart for its own "
        "calls not yet completed (each its encoded size, at least 1 KiB; a call over it goes "
        "alone when none other is in flight) and for delivered calls waiting for their "
        "handler; its calls waiting for room have a bound of as many MiB of their own, past "
        "which a call raises `QueueFull`"))
    when_queue_full: str = field(default="wait", metadata=key(
        Choice(QUEUE_FULL_ACTIONS),
        "what a call does when those queues are full: `wait` for room, or `error` (raise "
        "`QueueFull`)"))
    check_p2p_reads: bool = field(default=False, metadata=key(
        Flag(),
        "compare an actor's snapshot before and after every p2p handler (a test aid: p2p "
        "handlers must not change the replica)"))
    # -- state transfer to joiners
    state_chunk_kb: int = field(default=32768, metadata=key(
        Int(4, 1 << 20, "KiB"), "size in KiB of the chunks a joiner's state travels in"))
    join_timeout_s: float = field(default=60.0, metadata=key(
        _SECONDS,
        "seconds `Group.join`, `start` and `async with Group(...)` wait for this member's first "
        "view before they raise GroupClosed with the last cause (a refusal raises at once)"))
    state_stall_s: float = field(default=30.0, metadata=key(
        _SECONDS,
        "a state transfer that makes no progress for this many seconds fails the join"))
    fence_timeout_s: float = field(default=60.0, metadata=key(
        _SECONDS,
        "seconds a member sending a joiner its state waits for the handlers of calls "
        "delivered before the joiner's view; past it the join fails"))
    # -- durability
    data_dir: str | None = field(default=None, metadata=key(
        Text("the path of a directory", "a path"),
        "durable actors: the member keeps its log, snapshots and last view under "
        "`<data_dir>/<group>/member-<id>/` and resumes from them when it restarts; unset: "
        "nothing is written", shown="off"))
    snapshot_every: int = field(default=10000, metadata=key(
        Int(1, 1 << 40, "calls"),
        "durable actors: a snapshot of a subgroup's actor after this many logged calls, and "
        "the log before it trimmed"))
    log_batch_ms: float = field(default=5.0, metadata=key(
        Number(0.0, 1000.0, "milliseconds"),
        "durable actors: under load (a flush of many calls just ended), how long the next flush "
        "waits for more calls to share its fsync; a lone call never waits; 0: never wait"))
    # -- rdma
    rdma_device: str | None = field(default=None, metadata=key(
        Text("the name of an RDMA device (as in ibv_devices)", "a device name"),
        "rdma: the RDMA device; unset: the first one", shown="auto"))
    rdma_port: int = field(default=1, metadata=key(
        Int(1, 255), "rdma: port number on the RDMA device"))
    rdma_gid_index: int | None = field(default=None, metadata=key(
        Int(0, 255), "rdma: GID table index (RoCE); unset: the transport chooses",
        shown="auto"))
    # -- logging
    log_level: str = field(default="WARNING", metadata=key(
        Choice(LOG_LEVELS, upper=True),
        "the level from which the member processes `launch_local` and `derecho-async` start "
        "print `derecho_async` records to stderr; in your own process a Group never sets a "
        "logger's level: configure `logging`"))

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        # Runs before the dataclass __init__, so unknown and missing keys give ConfigError
        # rather than TypeError. Called without arguments by copy and pickle: nothing to check.
        if kwargs:
            check_known(kwargs)
            for k in KEYS:
                if k.default is REQUIRED and k.name not in kwargs:
                    raise ConfigError(k.name, k.expected() + " (required)", None)
        return object.__new__(cls)

    def __post_init__(self) -> None:
        seen: dict[str, object] = {}
        for k in KEYS:
            value = k.check(getattr(self, k.name), seen)
            object.__setattr__(self, k.name, value)
            seen[k.name] = value
        for rule in RULES:
            rule(self)

    # ------------------------------------------------------------------------------ constructors

    def replace(self, **changes: Any) -> Config:
        """A validated copy with ``changes`` applied (unknown keys raise ConfigError)."""
        check_known(changes)
        if (
            "listen" not in changes
            and self.member_id in self.peers
            and self.listen == self.peers[self.member_id]
        ):
            changes["listen"] = DEFAULT_LISTEN  # derived from peers: derived again
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> Config:
        """Read settings from a TOML file, then apply ``overrides``.

        Keys sit at top level, or under a ``[derecho_async]`` table (then the rest of the file is
        ignored). Values must already have the right TOML type (``member_id = 2``, not ``"2"``);
        ``peers`` is a table whose keys are member ids (``[derecho_async.peers]`` / ``0 =
        "h1:7000"``). An unreadable or malformed file raises ConfigError with key ``"path"``.
        """
        merged = sources.read_toml(path, BY_NAME)
        merged.add(overrides, BY_NAME)
        return _build(merged)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        """Read settings from ``DERECHO_ASYNC_<KEY>`` variables, then apply ``overrides``.

        ``environ`` defaults to :data:`os.environ`. Values are parsed by field type: integers in
        decimal, numbers as floats, booleans as true/false/1/0/yes/no/on/off, optional settings
        unset by an empty string, ``peers`` as ``"0=h1:7000,1=h2:7000"``. A bad value raises
        ConfigError naming the key and the variable; so does an unknown ``DERECHO_ASYNC_*``
        variable (except :data:`~derecho_async.config.ENV_RESERVED`).
        """
        merged = sources.read_env(os.environ if environ is None else environ, BY_NAME)
        merged.add(overrides, BY_NAME)
        return _build(merged)

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
        merged = sources.Merged() if path is None else sources.read_toml(path, BY_NAME)
        merged.update(sources.read_env(os.environ if environ is None else environ, BY_NAME))
        merged.add(overrides, BY_NAME)
        return _build(merged)


KEYS: Final[tuple[Key, ...]] = table(Config)
"""Every setting, in field order: name, type, default, form, environment variable, doc."""
BY_NAME: Final[dict[str, Key]] = {k.name: k for k in KEYS}


def check_known(values: Mapping[str, object]) -> None:
    """ConfigError for the first name in ``values`` that is not a key."""
    sources.check_known(values, BY_NAME)


# -- the rules that relate keys (run after every key passed its own form) ----------------------


def _listen_from_peers(config: Config) -> None:
    # Others dial a member at its `peers` entry, so that is where it listens unless told.
    if config.listen == DEFAULT_LISTEN and config.member_id in config.peers:
        object.__setattr__(config, "listen", config.peers[config.member_id])


def _contact_for_networked(config: Config) -> None:
    if config.contact is not None and not registry.kind(config.transport).networked:
        raise ConfigError("contact", "no contact address (unset) unless transport is 'tcp' or "
                          "'rdma' or another networked transport", config.contact)


def _tls_together(config: Config) -> None:
    files = ("tls_cert", "tls_key", "tls_ca")
    given = [getattr(config, name) is not None for name in files]
    if any(given) and not all(given):
        missing = files[given.index(False)]
        raise ConfigError(
            missing,
            BY_NAME[missing].expected() + " (tls_cert, tls_key and tls_ca go together)",
            None,
        )


def _secret_for_networked(config: Config) -> None:
    if (
        registry.kind(config.transport).networked
        and config.secret is None
        and config.tls_cert is None
    ):
        raise ConfigError(
            "secret", BY_NAME["secret"].expected() + " (required when transport is 'tcp' or "
            "'rdma' or another networked transport, unless tls_cert, tls_key and tls_ca are "
            "set)", None
        )


def _secret_for_clients(config: Config) -> None:
    # Clients prove a secret of their own: one that members hold would let a client act as one.
    if config.client_listen is None:
        return
    if config.client_secret is None and config.tls_cert is None:
        raise ConfigError(
            "client_secret", BY_NAME["client_secret"].expected() + " (required when "
            "client_listen is set without TLS: clients prove it)", None)
    if config.client_secret is not None and config.client_secret == config.secret:
        raise ConfigError(
            "client_secret", "a secret other than `secret` (clients must not hold what "
            "admits a member)", "<the value of secret>")


def _fits_memory(config: Config) -> None:
    # window, max_payload and initial_members together: their tables against the host's memory
    memory.check(config)


RULES: Final[tuple[Callable[[Config], None], ...]] = (
    _listen_from_peers, _contact_for_networked, _tls_together, _secret_for_networked,
    _secret_for_clients, _fits_memory)
"""Checks that relate keys, run in order once each key passed its own form
(``suspect_after_ms`` > ``heartbeat_ms`` is in that key's form); ``listen``'s default is
resolved first, the memory the configuration implies checked last (:mod:`.memory`)."""


def _build(merged: sources.Merged) -> Config:
    """Construct a Config; a ConfigError also says where the offending value came from."""
    try:
        return Config(**merged.values)
    except ConfigError as e:
        source = merged.sources.get(e.key)
        if source is None or source == sources.EXPLICIT:
            raise
        raise ConfigError(e.key, f"{e.expected} (from {source})", e.got) from e
