"""The user-facing group: join, host replicated actors, make ordered and p2p calls, leave.

Theory of operation: a :class:`Group` builds the transport named by its :class:`Config`, a
:class:`~derecho_async.runtime.driver.Driver` for the pure core, and one subgroup per actor class
(the layout). An ordered call encodes ``(method, args, kwargs)`` with the msgpack codec and
submits it to the core; when the message is delivered, every member runs the handler through the
actor's :class:`~derecho_async.runtime.runner.SerialRunner` (one at a time, in delivery order)
and sends its result back to the caller, which completes the call's future once every member of
the delivering view answered; members that leave or fail first are reported as
:class:`MemberFailed`. A *one-way* call (``handle.method.cast(...)``) travels the same way under
the wire name ``<Actor>.<method>.cast``: members run it in the same order and reply to nobody;
the caller's future completes with the call's version when the caller itself delivers it
(delivery implies stability). A p2p call goes to one member over the channel and runs on the
actor's runner there, between ordered handlers (after those already queued).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import CoroutineType, TracebackType
from typing import Any, Final, NamedTuple, Self

from derecho_async import hotpath, wire
from derecho_async.actor import Actor, ActorSpec, actor_spec
from derecho_async.config import Config
from derecho_async.core import (
    Delivered,
    Evicted,
    Layout,
    Left,
    MemberState,
    Partitioned,
    SendFailed,
    SubgroupSpec,
    View,
    ViewInstalled,
)
from derecho_async.core.effects import Event
from derecho_async.errors import (
    DerechoError,
    GroupClosed,
    MemberFailed,
    PartitionedError,
    ProtocolViolation,
    QueueFull,
    UsageError,
)
from derecho_async.runtime import largecall
from derecho_async.runtime.dataplane import MAX_ARRAYS, OutOfBand
from derecho_async.runtime.driver import Driver
from derecho_async.runtime.observer import GroupObserver
from derecho_async.runtime.runner import SerialRunner
from derecho_async.runtime.statexfer import StateTransfer
from derecho_async.transport import registry
from derecho_async.transport.base import Transport
from derecho_async.wire import envelope as env

__all__ = ["Group", "HandlerError", "Replies", "SubgroupHandle", "Versioned"]

log = logging.getLogger("derecho_async.group")


class HandlerError(DerechoError):
    """A handler raised at another member: its exception type name and message."""

    def __init__(self, member: int, type_name: str, message: str) -> None:
        self.member = member
        self.type_name = type_name
        self.message = message
        super().__init__(f"member {member}: {type_name}: {message}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HandlerError) and (
            (other.member, other.type_name, other.message)
            == (self.member, self.type_name, self.message)
        )

    def __hash__(self) -> int:
        return hash((self.member, self.type_name, self.message))


class Replies(Mapping[int, object]):
    """The outcome of an ordered call: member id -> result, exception or :class:`MemberFailed`.

    ``version`` is the call's ``(view_id, seq)``, identical at every member.
    """

    def __init__(self, results: dict[int, object], version: tuple[int, int]) -> None:
        self._results = results  # the group hands it over (it keeps no reference)
        self._ordered = False  # sorted by member id on first iteration (most callers never do)
        self.version = version

    def _sorted(self) -> dict[int, object]:
        if not self._ordered:
            self._results = dict(sorted(self._results.items()))
            self._ordered = True
        return self._results

    def __getitem__(self, member: int) -> object:
        return self._results[member]

    def __iter__(self) -> Iterator[int]:
        return iter(self._sorted())

    def __len__(self) -> int:
        return len(self._results)

    def values_ok(self) -> list[object]:
        """The results of the members that answered without an exception."""
        return [v for v in self._sorted().values() if not isinstance(v, BaseException)]

    def __repr__(self) -> str:
        return f"Replies({self._sorted()!r}, version={self.version})"


_CAST = ".cast"  # wire name suffix of a one-way call: "<Actor>.<method>.cast"
_Methods = dict[str, tuple[Callable[..., object], bool]]
"""Wire name of a call -> (the bound ordered method it runs, whether it is one-way)."""


@dataclass(slots=True)
class _Parked:
    """An encoded call waiting for room (backpressure): sent in call order once there is."""

    subgroup: str
    payload: bytes | OutOfBand
    size: int
    future: asyncio.Future[Any]
    one_way: bool


_MAX_EARLY_P2P = 1024  # p2p requests held before this member's first view, at most
_PARKED_OVERHEAD = 256  # bytes a parked call weighs beyond its encoding (for max_queued_mb)


@dataclass(slots=True)
class _PendingCall:
    future: asyncio.Future[Replies]
    expected: frozenset[int] | None = None
    version: tuple[int, int] = (0, 0)
    results: dict[int, object] = field(default_factory=dict)


def _make_transport(config: Config) -> Transport:
    """The transport ``config.transport`` names (see :mod:`.transport.registry`)."""
    return registry.kind(config.transport).build(config)


class _OrderedMethod:
    __slots__ = ("_cast_wire", "_group", "_spec", "_wire")

    def __init__(self, group: Group, spec: ActorSpec, name: str) -> None:
        self._group = group
        self._spec = spec
        # the wire names of the call and of its one-way form, made once per handle
        self._wire = f"{spec.name}.{name}"
        self._cast_wire = f"{spec.name}.{name}{_CAST}"

    def __call__(self, *args: object, **kwargs: object) -> Awaitable[Replies]:
        return self._group._ordered_call(self._spec, self._wire, args, kwargs)

    def cast(self, *args: object, **kwargs: object) -> asyncio.Future[tuple[int, int]]:
        """A one-way ordered call: multicast like ``handle.method(...)``, but no member replies.

        Every member runs the handler in the same total order as every other ordered call of
        the subgroup; results are dropped, and a handler's exception is logged at the member
        where it was raised. The returned future resolves to the call's version
        ``(view_id, seq)`` once the call is *delivered at this member*: delivery means
        stability, so every member of that view holds it, and (virtual synchrony) every member
        that survives into the next view delivers it too. It does not wait for any handler,
        this member's own included. On a view change before delivery the call is delivered in
        that view's ragged trim or, re-sent, in the next view (the sender survived), and the
        future resolves then; it fails with :class:`GroupClosed` / :class:`PartitionedError`
        when this member leaves, is removed or wedges first. Encoding errors and a closed group
        raise at once.
        """
        return self._group._cast(self._spec, self._cast_wire, args, kwargs)


class Versioned(NamedTuple):
    """A p2p call's result and the version of the replica state it read.

    ``version`` is the ``(view_id, seq)`` of the last ordered call of the actor's subgroup that
    member had applied when the p2p handler ran (the same version :attr:`Replies.version` gives
    the caller of that call); ``(view_id, -1)`` when it had applied none of view ``view_id``'s
    calls yet: the state that view began with.
    """

    value: Any
    version: tuple[int, int]


class P2PCall:
    """A p2p method bound to one member: ``await call(*args)`` gives the handler's result,
    ``await call.versioned(*args)`` a :class:`Versioned` (result and the version it read)."""

    __slots__ = ("_group", "_member", "_name", "_spec")

    def __init__(self, group: Group, spec: ActorSpec, name: str, member: int) -> None:
        self._group = group
        self._spec = spec
        self._name = name
        self._member = member

    async def __call__(self, *args: object, **kwargs: object) -> Any:
        got = await self._group._p2p_call(self._member, self._spec, self._name, args, kwargs)
        return got.value

    def versioned(self, *args: object, **kwargs: object) -> Awaitable[Versioned]:
        """The call, answered with the version of the state the handler read."""
        return self._group._p2p_call(self._member, self._spec, self._name, args, kwargs)


class _P2PMethod:
    def __init__(self, group: Group, spec: ActorSpec, name: str) -> None:
        self._group = group
        self._spec = spec
        self._name = name

    def at(self, member: int) -> P2PCall:
        """The call bound to ``member``: ``await handle.method.at(m)(*args)``, or
        ``await handle.method.at(m).versioned(*args)`` (see :class:`P2PCall`)."""
        return P2PCall(self._group, self._spec, self._name, member)


class SubgroupHandle:
    """Calls into one actor's subgroup: ``await handle.method(...)`` for ``@ordered`` methods
    (every member's result), ``await handle.method.cast(...)`` for the same call one-way (no
    replies; it completes when the call is delivered here), ``await handle.method.at(member)(...)``
    for ``@p2p`` methods."""

    def __init__(self, group: Group, spec: ActorSpec) -> None:
        self._group = group
        self._spec = spec

    def __getattr__(self, name: str) -> Any:
        # Called only for names not yet in the instance: the method object made here is kept
        # there, so the next ``handle.method`` is a plain attribute read (a call per message).
        kind = self._spec.kind_of(name)
        method: _OrderedMethod | _P2PMethod
        if kind == "ordered":
            method = _OrderedMethod(self._group, self._spec, name)
        elif kind == "p2p":
            method = _P2PMethod(self._group, self._spec, name)
        else:
            raise AttributeError(
                f"actor {self._spec.name} has no @ordered or @p2p method {name!r}")
        self.__dict__[name] = method
        return method


class Group:
    """One member's membership in a group (see the module docstring).

    ``async with Group(config, actors=[Log]) as group:`` joins, and leaves on exit;
    ``await Group.join(config, actors=[Log])`` and ``await group.leave()`` do the same by hand.
    """

    def __init__(
        self,
        config: Config,
        actors: Sequence[type[Actor]] = (),
        *,
        transport: Transport | None = None,
        observer: GroupObserver | None = None,
    ) -> None:
        """``transport``: a transport to use instead of the one ``config`` names (testing kits
        such as derecho_async.testing build their own); ``observer``: hooks told of deliveries,
        views and state transfer (:class:`~derecho_async.runtime.observer.GroupObserver`)."""
        if not isinstance(config, Config):
            raise UsageError("Group needs a derecho_async.Config")
        if transport is not None and transport.member_id != config.member_id:
            raise UsageError(f"the transport is member {transport.member_id}'s, "
                             f"not member {config.member_id}'s")
        self.config = config
        self._max_call = config.max_call_mb << 20  # bytes of an encoded ordered call, at most
        self._transport = transport
        self._observer = observer
        self._me = config.member_id
        self._specs: dict[str, ActorSpec] = {}
        for cls in actors:
            spec = actor_spec(cls)
            if spec.name in self._specs:
                raise UsageError(f"two actor classes named {spec.name!r}")
            self._specs[spec.name] = spec
        self._actors: dict[str, Actor] = {}
        self._runners: dict[str, SerialRunner] = {}
        for name, spec in self._specs.items():
            self._actors[name] = spec.cls()
            self._runners[name] = SerialRunner()
        # subgroup -> (spec, runner, actor, {wire name: (bound ordered method, one-way)}): one
        # lookup per delivered call; the map caches the names already checked against the spec.
        self._hosted: dict[str, tuple[ActorSpec, SerialRunner, Actor, _Methods]] = {
            name: (spec, self._runners[name], self._actors[name], {})
            for name, spec in self._specs.items()
        }
        names = tuple(self._specs) or ("default",)
        self.layout = Layout(tuple(SubgroupSpec(n) for n in names))
        self._driver: Driver | None = None
        self._xfer: StateTransfer | None = None  # state transfer to and from joiners
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the group runs on
        self._view: View | None = None
        self._pending: dict[int, _PendingCall] = {}
        # One-way calls of mine not delivered yet: msg_no -> future of their version.
        self._casts: dict[int, asyncio.Future[tuple[int, int]]] = {}
        self._early_replies: dict[int, dict[int, object]] = {}
        self._p2p_ids = itertools.count(1)
        self._p2p: dict[int, tuple[int, asyncio.Future[Versioned]]] = {}
        self._closed: BaseException | None = None
        self._gone: asyncio.Future[None] | None = None  # resolved once a deferred leave is done
        self._started = False
        # Shard members per subgroup in the current view (whose replies an ordered call awaits).
        self._repliers: dict[str, frozenset[int]] = {}
        # Replies made while the driver reports a step's events, per caller: sent as one
        # REPLIES message per caller when the step's events are done (Host.flush).
        self._outbox: dict[int, list[object]] = {}
        self._batching = False
        # The last call delivered per subgroup (the version a p2p call queued now reads), and
        # the version of a state no call of which was delivered yet (a joiner's restored one).
        # (versions only: an event would keep its payload, device arrays included, alive)
        self._last_delivered: dict[str, tuple[int, int]] = {}
        self._base_version = (0, -1)
        # Backpressure (see _room): own calls waiting for room, in call order, and whether this
        # member stopped taking new messages because its handlers lag.
        self._max_queued = config.max_queued_calls
        self._max_queued_bytes = config.max_queued_mb << 20
        self._parked: deque[_Parked] = deque()
        self._parked_bytes = 0
        self._paused = False
        for runner in self._runners.values():
            runner.watcher = self._on_runner_progress
        self._exiting: BaseException | None = None  # a handler's SystemExit/KeyboardInterrupt
        # p2p requests that came before this member's first view: served once it is installed
        # (after its state restore is queued), in arrival order
        self._early_p2p: list[tuple[int, int, str, str, bytes]] = []
        self.history: list[View] = []
        self.installed_at: list[float] = []  # time.monotonic() of each install in ``history``

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    async def join(
        cls,
        config: Config,
        actors: Sequence[type[Actor]] = (),
        *,
        timeout: float | None = 60.0,
        transport: Transport | None = None,
        observer: GroupObserver | None = None,
    ) -> Self:
        """Join the group named by ``config`` and return once this member is in a view.

        ``transport``, ``observer``: as for :class:`Group`."""
        group = cls(config, actors, transport=transport, observer=observer)
        await group.start(timeout=timeout)
        return group

    async def start(self, *, timeout: float | None = 60.0) -> None:
        """Start the transport and wait until this member has installed its first view."""
        if self._started:
            raise UsageError("this Group was already started")
        self._started = True
        logging.getLogger("derecho_async").setLevel(self.config.log_level)
        transport = self._transport if self._transport is not None else _make_transport(self.config)
        driver = Driver(self.config, transport, self.layout, self)
        self._driver = driver
        self._xfer = StateTransfer(driver, self._actors, self._runners, self._observer)
        try:
            await driver.start()
        except BaseException:
            await driver.close()  # release what the transport holds (names, sockets)
            raise
        assert driver.first_view is not None
        try:
            await asyncio.wait_for(asyncio.shield(driver.first_view), timeout)
        except TimeoutError:
            await driver.close()
            raise GroupClosed(
                f"member {self.config.member_id} was not admitted to group "
                f"{self.config.group!r} within {timeout} s"
            ) from None
        except RuntimeError as exc:
            await driver.close()
            raise GroupClosed(f"could not join: {exc}") from None
        try:  # a joiner: its state, streamed from its sponsor (see runtime.statexfer)
            await self._xfer.restored()
        except GroupClosed:
            await self.leave()  # nobody else leaves
            raise

    async def leave(self) -> None:
        """Leave the group: the others install a view without this member. Idempotent.

        Called during a view change, this waits (a few suspicion timeouts at most) for the change
        to end, so the member leaves the view it installs; see :meth:`Member.leave`.
        """
        driver = self._driver
        if driver is None:
            return
        if driver.core is not None and driver.core.state is MemberState.ACTIVE:
            driver.leave()
            if self._closed is None and not driver.closed:
                if self._gone is None:  # (a second leave() meanwhile waits for the same end)
                    self._gone = asyncio.get_running_loop().create_future()
                wait_s = 1.0 + 4 * self.config.suspect_after_ms / 1000
                try:
                    await asyncio.wait_for(asyncio.shield(self._gone), wait_s)
                except TimeoutError:
                    log.warning("member %d: the view change under way did not end within "
                                "%.1f s; leaving without it", self.member_id, wait_s)
        self._close(GroupClosed("this member left the group"))
        await driver.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.leave()

    # -- accessors -----------------------------------------------------------------------------
    @property
    def view(self) -> View:
        """The view this member is in."""
        if self._view is None:
            raise UsageError("the group has not installed a view yet")
        return self._view

    @property
    def closed(self) -> BaseException | None:
        """Why this member is out of the group (the error its calls now raise: it left, was
        removed, wedged), or None while it is in (or not started)."""
        return self._closed

    @property
    def member_id(self) -> int:
        return self.config.member_id

    def subgroup(self, actor: type[Actor]) -> SubgroupHandle:
        """The handle for calls into ``actor``'s subgroup."""
        return SubgroupHandle(self, self._spec_of(actor))

    def local(self, actor: type[Actor]) -> Actor:
        """This member's own replica of ``actor`` (for local reads)."""
        return self._actors[self._spec_of(actor).name]

    def device_buffer(self, shape: int | tuple[int, ...], dtype: str = "float32") -> Any:
        """A CuPy array to fill and send without a copy.

        With the CUDA IPC plane active (see ``gpu_plane``) the array is allocated in this
        member's IPC-exported device pool, so an ordered call carrying it sends it in place.
        Leave it unchanged until the call's replies are in. Its memory returns to the pool when
        the array is garbage-collected. Without the plane it is a plain ``cupy.empty`` array.
        """
        driver = self._check_open()
        if driver.gpuplane is not None:
            return driver.gpuplane.device_buffer(shape, dtype)
        try:
            import cupy
        except ImportError as exc:
            raise UsageError("device_buffer needs CuPy (the 'gpu' extra)") from exc
        return cupy.empty(shape, dtype=dtype)

    def device_pool_stats(self) -> dict[str, int] | None:
        """Figures of this member's CUDA IPC device pool, or None when the plane is off."""
        driver = self._check_open()
        return driver.gpuplane.stats() if driver.gpuplane is not None else None

    def nccl_stats(self) -> dict[str, int] | None:
        """Figures of this member's NCCL plane (communicators by state, messages sent and
        received by broadcast), or None when it is off (see ``gpu_plane``)."""
        driver = self._check_open()
        return driver.ncclplane.stats() if driver.ncclplane is not None else None

    def _spec_of(self, actor: type[Actor]) -> ActorSpec:
        spec = self._specs.get(getattr(actor, "__name__", ""))
        if spec is None or spec.cls is not actor:
            raise UsageError(f"{actor!r} is not one of this group's actors")
        return spec

    def _check_open(self) -> Driver:
        if self._closed is not None:
            raise self._closed
        if self._driver is None or self._driver.core is None or self._view is None:
            raise UsageError("the group is not started")
        return self._driver

    # -- ordered calls -------------------------------------------------------------------------
    def _encode(
        self, spec: ActorSpec, wire_name: str, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> tuple[Driver, bytes | OutOfBand, int]:
        """Encode a call: (driver, payload, encoded size). UsageError when its encoding is over
        ``max_call_mb``."""
        driver = self._driver
        if (driver is None or driver.core is None or self._closed is not None
                or self._view is None or self._exiting is not None):
            driver = self._check_open()  # raises why (the open group is tested inline: per call)
        core = driver.core
        assert core is not None
        arrays: list[object] = []
        # Small numpy arrays (up to a slot's worth) are copied into the call itself: they skip
        # the data plane's pool, descriptor frame and landing report, several times cheaper per
        # message; the handler gets the same owned numpy arrays either way.
        call = wire.encode_call(wire_name, args, kwargs, buffers=arrays,
                                 inline_bytes=core.config.max_payload)
        if len(arrays) > MAX_ARRAYS:
            raise UsageError(f"an ordered call carries at most {MAX_ARRAYS} arrays, not "
                             f"{len(arrays)}: pack them into fewer")
        oob = OutOfBand(call, tuple(arrays)) if arrays else None
        # the encoded size: large byte strings and arrays are out of band, so nothing is copied
        size = len(call) if oob is None else oob.nbytes
        if size > self._max_call:
            raise UsageError(f"an ordered call of {size} bytes encoded is over the bound of "
                             f"max_call_mb={self.config.max_call_mb} ({self._max_call} bytes)")
        return driver, (call if oob is None else oob), size

    def _send(self, driver: Driver, subgroup: str, payload: bytes | OutOfBand,
              size: int) -> int | None:
        """Queue an encoded call in the core: its msg_no, None when this member cannot send."""
        core = driver.core
        assert core is not None
        if type(payload) is bytes:
            return core.submit(subgroup, payload)
        return core.submit(subgroup, payload, nbytes=size)  # arrays travel on the data plane

    # -- backpressure ----------------------------------------------------------------------------
    def _room(self) -> bool:
        """Whether a call may go to the core now: this member's own calls not completed and the
        delivered calls waiting for its handlers are within ``max_queued_calls`` (and bytes
        within ``max_queued_mb``; see :meth:`_check_backlog`), and none waits before it."""
        return (not self._parked and not self._paused
                and len(self._casts) + len(self._pending) < self._max_queued)

    def _park(self, spec: ActorSpec, payload: bytes | OutOfBand, size: int,
              future: asyncio.Future[Any], one_way: bool) -> None:
        """No room for a call now: wait for it (in call order) or fail (``when_queue_full``)."""
        if self.config.when_queue_full == "error":
            raise QueueFull(
                f"member {self._me}: {len(self._casts) + len(self._pending)} own calls in flight"
                f" and {self.queued_calls} delivered calls waiting for handlers here "
                f"(max_queued_calls={self._max_queued}, max_queued_mb={self.config.max_queued_mb}"
                f"); when_queue_full='error'")
        weight = size + _PARKED_OVERHEAD
        if self._parked_bytes + weight > self._max_queued_bytes:
            raise QueueFull(
                f"member {self._me}: the calls waiting for room here reached max_queued_mb="
                f"{self.config.max_queued_mb} (max_queued_calls={self._max_queued}): await "
                f"earlier calls before making more")
        self._parked.append(_Parked(spec.name, payload, size, future, one_way))
        self._parked_bytes += weight

    def _unpark(self) -> None:
        """Hand parked calls to the core, in order, while there is room."""
        parked = self._parked
        driver = self._driver
        if driver is None or self._closed is not None:
            return
        sent = False
        while parked and not self._paused and (
                len(self._casts) + len(self._pending) < self._max_queued):
            call = parked.popleft()
            self._parked_bytes -= call.size + _PARKED_OVERHEAD
            if call.future.done():  # cancelled by its caller while it waited: never sent
                continue
            msg_no = self._send(driver, call.subgroup, call.payload, call.size)
            if msg_no is None:
                call.future.set_exception(self._closed or GroupClosed("this member cannot send now"))
                continue
            if call.one_way:
                self._casts[msg_no] = call.future
            else:
                self._pending[msg_no] = _PendingCall(call.future)
            sent = True
        if sent:
            driver.kick()

    @property
    def queued_calls(self) -> int:
        """Delivered ordered calls waiting here for their handlers (all actors)."""
        return sum(r.queued for r in self._runners.values())

    def _check_backlog(self) -> None:
        """Stop taking new messages while the delivered calls waiting for this member's handlers
        are over ``max_queued_calls`` or ``max_queued_mb``: nothing new becomes stable anywhere
        until they drain, so every sender's calls wait (backpressure; see the README)."""
        if self._paused:
            return
        runners = self._runners.values()
        if (sum(r.queued for r in runners) >= self._max_queued
                or sum(r.queued_bytes for r in runners) >= self._max_queued_bytes):
            driver = self._driver
            if driver is not None and driver.core is not None:
                self._paused = True
                driver.core.set_receiving(False)

    def _on_runner_progress(self) -> None:
        """A runner took a queued call: resume taking messages once the backlog halved."""
        if self._paused:
            runners = self._runners.values()
            if (sum(r.queued for r in runners) <= self._max_queued // 2
                    and sum(r.queued_bytes for r in runners) <= self._max_queued_bytes // 2):
                self._paused = False
                driver = self._driver
                if driver is not None and driver.core is not None:
                    driver.core.set_receiving(True)
                    driver.kick()
        if self._parked and not self._paused:
            self._unpark()

    async def _ordered_call(
        self, spec: ActorSpec, wire_name: str, args: tuple[object, ...],
        kwargs: dict[str, object]
    ) -> Replies:
        """Submit an ordered call named ``wire_name`` (``<Actor>.<method>``) and await its
        replies."""
        driver, payload, size = self._encode(spec, wire_name, args, kwargs)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[Replies] = loop.create_future()
        if not self._room():
            self._park(spec, payload, size, fut, one_way=False)
            return await fut
        msg_no = self._send(driver, spec.name, payload, size)
        if msg_no is None:
            raise self._closed or GroupClosed("this member cannot send now")
        self._pending[msg_no] = _PendingCall(fut)
        driver.kick()
        return await fut

    def _cast(
        self, spec: ActorSpec, wire_name: str, args: tuple[object, ...],
        kwargs: dict[str, object]
    ) -> asyncio.Future[tuple[int, int]]:
        """Submit a one-way ordered call named ``wire_name`` (``<Actor>.<method>.cast``; see
        :meth:`_OrderedMethod.cast`)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        driver, payload, size = self._encode(spec, wire_name, args, kwargs)
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        if not self._room():
            self._park(spec, payload, size, fut, one_way=True)
            return fut
        msg_no = self._send(driver, spec.name, payload, size)
        if msg_no is None:
            raise self._closed or GroupClosed("this member cannot send now")
        self._casts[msg_no] = fut
        driver.kick()
        return fut

    def _cast_done(self, ok: bool, value: object) -> None:
        """A one-way call's handler finished here: nobody waits for it, so only log a failure
        (a ``SystemExit`` or ``KeyboardInterrupt`` is this member's departure)."""
        if not ok:
            exc = value if isinstance(value, BaseException) else None
            log.warning("member %d: the handler of a one-way call raised %r", self._me, value,
                        exc_info=exc)
            if isinstance(value, (SystemExit, KeyboardInterrupt)):
                self._handler_exit(value)

    def _handler_exit(self, exc: BaseException) -> None:
        """A handler raised ``SystemExit`` or ``KeyboardInterrupt``: this member leaves the
        group in order (its reply to that call is already made); its handlers run no more."""
        if self._exiting is not None:
            return
        self._exiting = exc
        for runner in self._runners.values():
            runner.stop()
        reason = f"a handler raised {type(exc).__name__}: {exc}"
        log.warning("member %d: %s; leaving the group", self._me, reason)
        driver = self._driver
        if driver is not None:
            driver.leave(reason)

    def _complete(self, msg_no: int) -> None:
        call = self._pending.get(msg_no)
        if call is not None and call.expected is not None:
            self._complete_call(msg_no, call, call.expected)

    def _complete_call(self, msg_no: int, call: _PendingCall, expected: frozenset[int]) -> None:
        """Resolve pending ``call`` once every expected member replied."""
        if len(call.results) >= len(expected):  # results only ever hold expected members
            del self._pending[msg_no]
            if not call.future.done():
                call.future.set_result(Replies(call.results, call.version))
            if self._parked:  # room for a call that waits (replies come outside steps too)
                self._unpark()

    def _record_reply(self, msg_no: int, member: int, value: object) -> None:
        call = self._pending.get(msg_no)
        if call is None:
            return
        if call.expected is None:
            self._early_replies.setdefault(msg_no, {})[member] = value
            return
        if member in call.expected:
            call.results.setdefault(member, value)
            self._complete_call(msg_no, call, call.expected)

    def _expected_repliers(self, subgroup: str) -> frozenset[int]:
        members = self._repliers.get(subgroup)
        if members is None:
            info = self.layout.assign(self.view.members).find(subgroup)
            members = frozenset(info.members if info is not None else self.view.members)
            self._repliers[subgroup] = members
        return members

    def _on_own_delivered(self, ev: Delivered) -> None:
        """One of my ordered calls is delivered: its repliers and version are now known (a
        one-way call is complete)."""
        if self._casts:
            cast = self._casts.pop(ev.msg_no, None)
            if cast is not None:
                if not cast.done():
                    cast.set_result((ev.view_id, ev.seq))
                return
        call = self._pending.get(ev.msg_no)
        if call is not None:
            call.expected = self._expected_repliers(ev.subgroup)
            call.version = (ev.view_id, ev.seq)
            early = self._early_replies.pop(ev.msg_no, None)
            if early:
                for m, v in early.items():
                    if m in call.expected:
                        call.results.setdefault(m, v)

    @classmethod
    def _method_entry(
        cls, spec: ActorSpec, actor: Actor, methods: _Methods, name: str
    ) -> tuple[Callable[..., object], bool]:
        """The (method, one-way) a call named ``name`` runs (ProtocolViolation if none)."""
        return methods.get(name) or cls._ordered_method(spec, actor, methods, name)

    @staticmethod
    def _ordered_method(
        spec: ActorSpec, actor: Actor, methods: _Methods, name: str
    ) -> tuple[Callable[..., object], bool]:
        """The bound ordered method a call named ``name`` runs and whether the call is one-way
        (wire name ``<Actor>.<method>.cast``); checked once per name."""
        one_way = name.endswith(_CAST)
        actor_name, _, method = (name[: -len(_CAST)] if one_way else name).partition(".")
        if actor_name != spec.name or method not in spec.ordered:
            raise ProtocolViolation(f"no ordered method {name!r}")
        fn: Callable[..., object] = getattr(actor, method)
        methods[name] = entry = (fn, one_way)
        return entry

    def on_delivered(self, events: list[Delivered]) -> None:
        """Run the ordered calls of a run of deliveries, in order (Host.on_delivered).

        The usual call (a free runner, a plain handler returning None, a caller elsewhere) is
        run and its reply batched without the runner's queue or a callback per message: by the
        native loop (:func:`hotpath.dispatch_calls`) where the extension is built, which hands
        each event it does not take to :meth:`_deliver_one`, the general path, and goes on
        after it. A one-way call is run the same way and answered to nobody."""
        self._batching = True
        last = self._last_delivered
        if len(self._hosted) == 1:
            ev = events[-1]
            last[ev[0]] = (ev[2], ev[3])
        else:
            for ev in events:
                last[ev[0]] = (ev[2], ev[3])
        dispatch = _dispatch_calls
        if self._observer is not None:
            self._observer.delivered(self._me, events)
            dispatch = None  # every outcome goes through _deliver_one, which reports it
        if dispatch is None:
            for ev in events:
                self._deliver_one(ev)
        else:
            me, hosted, casts, finish = self._me, self._hosted, self._casts, self._finish_call
            i, n = 0, len(events)
            while i < n:
                # replies are batched only while the group is open (as _deliver_one decides)
                outbox = (self._outbox if self._closed is None and self._driver is not None
                          else None)
                i = dispatch(events, i, me, hosted, casts, outbox, _NIL, finish)
                if i < n:
                    self._deliver_one(events[i])
                    i += 1
        self._check_backlog()

    def _finish_call(self, ev: Delivered, one_way: bool, ok: bool, value: object) -> None:
        """An outcome of a call the native loop ran that is not the usual one (see
        :func:`hotpath.dispatch_calls`): an exception, a coroutine, a result to send back, any
        outcome of my own call awaiting replies."""
        if not one_way and ev.sender == self._me:
            self._on_own_delivered(ev)  # its repliers and version (the general path: before)
        if type(value) is CoroutineType:
            runner = self._hosted[ev.subgroup][1]
            done = self._cast_done if one_way else functools.partial(self._reply, ev)
            runner.step_coroutine(value, done)
        elif one_way:
            self._cast_done(ok, value)
        else:
            self._reply(ev, ok, value)

    def _deliver_one(self, ev: Delivered) -> None:
        """Run one delivered ordered call: the general path of :meth:`on_delivered`."""
        subgroup, _, _, _, sender, _, payload = ev
        me = self._me
        if sender == me:
            self._on_own_delivered(ev)
        hosted = self._hosted.get(subgroup)
        if hosted is None:
            return
        spec, runner, actor, methods = hosted
        observer = self._observer
        reply: Callable[[bool, object], None]
        cast_done: Callable[[bool, object], None] = self._cast_done
        if observer is not None:  # every outcome reported: no shortcuts below
            reply = functools.partial(self._observed, ev, functools.partial(self._reply, ev))
            cast_done = functools.partial(self._observed, ev, self._cast_done)
        try:
            if type(payload) is bytes:
                # (the usual call of a known method is the native loop's: decode_call's own
                # native pass is enough for what reaches this path)
                name, args, kwargs = wire.decode_call(payload)
            elif isinstance(payload, OutOfBand):
                if largecall.is_large(payload):  # decoded off the loop, in turn on the runner
                    if observer is None:
                        reply = functools.partial(self._reply, ev)
                    call = largecall.OffLoopCall(
                        payload, functools.partial(self._method_entry, spec, actor, methods),
                        reply, cast_done, me, sender)
                    runner.submit(call.run, call.done, payload.nbytes)
                    return
                # my own call of device arrays alone comes back as it was sent; the rest (and
                # every peer's) is decoded and its arrays checked
                own = wire.own_device_call(payload.call, payload.arrays) if sender == me else None
                name, args, kwargs = own if own is not None else wire.decode_call(
                    payload.call, buffers=list(payload.arrays))
            else:
                raise ProtocolViolation("ordered call payload is not bytes")
            entry = methods.get(name)
            if entry is None:
                entry = self._ordered_method(spec, actor, methods, name)
        except (ProtocolViolation, DerechoError) as exc:
            log.warning("member %d: undeliverable call from %d: %s", me, sender, exc)
            self._reply(ev, False, exc)
            return
        fn, one_way = entry
        if observer is not None or runner.stopped:
            runner.submit_call(fn, args, kwargs, cast_done if one_way else reply)
            return
        if one_way:
            if not runner.idle():
                runner.submit_call(fn, args, kwargs, self._cast_done,
                                   len(payload) if type(payload) is bytes else 0)
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # any outcome is the call's (a SystemExit: departure)
                self._cast_done(False, exc)
                return
            if type(result) is CoroutineType:
                runner.step_coroutine(result, self._cast_done)
            return
        if not runner.idle():
            runner.submit_call(fn, args, kwargs, functools.partial(self._reply, ev),
                               len(payload) if type(payload) is bytes else 0)
            return
        # A free runner would run it on the spot: do so here (as SerialRunner._run).
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # any outcome is the call's (a SystemExit: departure)
            self._reply(ev, False, exc)
            return
        if type(result) is CoroutineType:
            runner.step_coroutine(result, functools.partial(self._reply, ev))
        elif (
            result is None
            and sender != me
            and self._batching
            and self._closed is None
            and self._driver is not None
        ):
            out = self._outbox.get(sender)
            if out is None:
                out = self._outbox[sender] = []
            out += (ev.msg_no, True, _NIL)
        elif sender == me:
            self._record_reply(ev.msg_no, me, result)  # as _reply does
        else:
            self._reply(ev, True, result)

    def _observed(self, ev: Delivered, then: Callable[[bool, object], None], ok: bool,
                  value: object) -> None:
        """An outcome of a delivered call, told to the observer before it goes on to ``then``."""
        if self._observer is not None:
            self._observer.handler_finished(self._me, ev.subgroup, (ev.view_id, ev.seq), ok,
                                            value)
        then(ok, value)

    def _reply(self, ev: Delivered, ok: bool, value: object) -> None:
        if not ok and isinstance(value, (SystemExit, KeyboardInterrupt)):
            self._reply_to(ev, ok, value)
            self._handler_exit(value)  # after the reply: the caller learns what happened
            return
        self._reply_to(ev, ok, value)

    def _reply_to(self, ev: Delivered, ok: bool, value: object) -> None:
        if ev.sender == self._me:
            self._record_reply(ev.msg_no, self._me, value)
            return
        driver = self._driver
        if driver is None or self._closed is not None:
            return
        try:
            if ok and value is None:
                body = _NIL
            else:
                body = wire.encode(value) if ok else _encode_error(value)
        except (TypeError, ValueError, OverflowError) as exc:
            ok, body = False, _encode_error(exc)
        if self._batching:
            out = self._outbox.get(ev.sender)
            if out is None:
                out = self._outbox[ev.sender] = []
            out += (ev.msg_no, ok, body)
            return
        driver.transport.send(ev.sender, env.encode(env.REPLY, ev.subgroup, ev.msg_no, ok, body))

    # -- p2p calls -----------------------------------------------------------------------------
    async def _p2p_call(
        self,
        member: int,
        spec: ActorSpec,
        method: str,
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> Versioned:
        driver = self._check_open()
        if member not in self.view.members:
            raise MemberFailed(member, "is not a member of the current view")
        loop = asyncio.get_running_loop()
        if member == self.member_id:
            mine: asyncio.Future[Versioned] = loop.create_future()

            def answer(ok: bool, value: object, version: tuple[int, int]) -> None:
                if mine.done():
                    return
                if ok:
                    mine.set_result(Versioned(value, version))
                else:
                    assert isinstance(value, BaseException)
                    mine.set_exception(value)

            self._run_p2p(spec, method, args, kwargs, answer)
            return await mine
        req = next(self._p2p_ids)
        fut: asyncio.Future[Versioned] = loop.create_future()
        self._p2p[req] = (member, fut)
        body = wire.encode_call(f"{spec.name}.{method}", args, kwargs)
        driver.transport.send(member, env.encode(env.P2P_REQ, req, spec.name, method, body))
        return await fut

    def _run_p2p(self, spec: ActorSpec, method: str, args: tuple[object, ...],
                 kwargs: dict[str, object],
                 answer: Callable[[bool, object, tuple[int, int]], None]) -> None:
        """Run a p2p handler on its actor's runner, between ordered handlers: it reads the state
        after every call delivered so far (the version it answers with), never a half-applied
        call. With ``check_p2p_reads`` a handler that changes the replica is undone and fails."""
        name = spec.name
        _spec, runner, actor, _methods = self._hosted[name]
        version = self._last_delivered.get(name, self._base_version)
        fn: Callable[..., object] = getattr(actor, method)
        if self.config.check_p2p_reads:
            fn = _read_only(actor, f"{name}.{method}", fn)

        def done(ok: bool, value: object) -> None:
            answer(ok, value, version)

        if runner.stopped:
            done(False, GroupClosed("this member is leaving the group"))
            return
        runner.submit_call(fn, args, kwargs, done)

    def _serve_early_p2p(self) -> None:
        early, self._early_p2p = self._early_p2p, []
        for request in early:
            self._serve_p2p(*request)

    def _serve_p2p(self, sender: int, req: int, actor_name: str, method: str, body: bytes) -> None:
        spec = self._specs.get(actor_name)
        driver = self._driver
        if driver is None:
            return

        def answer(ok: bool, value: object, version: tuple[int, int] = (0, -1)) -> None:
            try:
                data = wire.encode(value) if ok else _encode_error(value)
            except (TypeError, ValueError, OverflowError) as exc:
                ok, data = False, _encode_error(exc)
            view_id, seq = version
            if self._closed is None:
                driver.transport.send(
                    sender, env.encode(env.P2P_RESP, req, ok, data, view_id, seq + 1))

        if spec is None or method not in spec.p2p:
            answer(False, UsageError(f"no p2p method {actor_name}.{method}"))
            return
        if self._view is None:  # a caller in the view admitting me: run it once I am in it
            if len(self._early_p2p) >= _MAX_EARLY_P2P:
                answer(False, UsageError("too many p2p calls before this member's first view"))
                return
            self._early_p2p.append((sender, req, actor_name, method, body))
            return
        try:
            _name, args, kwargs = wire.decode_call(body)
        except ProtocolViolation as exc:
            answer(False, exc)
            return
        self._run_p2p(spec, method, args, kwargs, answer)

    # -- driver callbacks (Host) ---------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        self._batching = True
        if isinstance(event, Delivered):
            self.on_delivered([event])
        elif isinstance(event, ViewInstalled):
            self._on_view(event)
        elif isinstance(event, SendFailed):
            call = self._pending.pop(event.msg_no, None)
            if call is not None and not call.future.done():
                call.future.set_exception(GroupClosed(f"call not delivered: {event.reason}"))
            cast = self._casts.pop(event.msg_no, None)
            if cast is not None and not cast.done():
                cast.set_exception(GroupClosed(f"call not delivered: {event.reason}"))
        elif isinstance(event, Partitioned):
            self._close(
                PartitionedError(
                    f"member {self.member_id} lost a majority of view {event.view_id} and wedged"
                )
            )
        elif isinstance(event, Evicted):
            self._close(GroupClosed(f"member {self.member_id} was removed from the group"))
        elif isinstance(event, Left):
            why = f": {event.reason}" if event.reason else ""
            self._close(GroupClosed(f"this member left the group{why}"))

    def flush(self) -> None:
        """Send the replies batched while the driver reported a step's events (and hand parked
        calls to the core if the step made room)."""
        self._batching = False
        if self._parked:
            self._unpark()
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        driver = self._driver
        if driver is None or self._closed is not None:
            return
        send = driver.transport.send
        for caller, items in outbox.items():
            # items is [msg_no, ok, body, ...]: one frame per caller, split where the bodies
            # add up to _REPLIES_BYTES, so a batch of large results never makes one huge frame
            start, size = 0, 0
            for i in range(2, len(items), 3):
                size += len(items[i])  # type: ignore[arg-type]
                if size >= _REPLIES_BYTES or i + 1 == len(items):
                    self._send_replies(send, caller, items[start : i + 1])
                    start, size = i + 1, 0

    def _send_replies(self, send: Callable[[int, bytes], None], caller: int,
                      items: list[object]) -> None:
        try:
            send(caller, env.encode(env.REPLIES, items))
        except (UsageError, ValueError, OverflowError) as exc:  # e.g. a result over the frame limit
            log.warning("member %d: replies to %d could not be sent (%s): sending errors",
                        self.member_id, caller, exc)
            failed: list[object] = []
            for i in range(0, len(items), 3):
                failed += [items[i], False, _encode_error(exc)]
            send(caller, env.encode(env.REPLIES, failed))

    def _on_view(self, ev: ViewInstalled) -> None:
        if self._me in ev.joined:  # the state this member starts from: no call of this view
            self._base_version = (ev.view.view_id, -1)
            self._last_delivered.clear()
        # (a joiner's state: the driver hands the view to self._xfer next, which holds the
        # runners until it restored it)
        self._repliers = {}
        log.info(
            "member %d: view %d installed: members %s%s",
            self.member_id,
            ev.view.view_id,
            list(ev.view.members),
            f", departed {sorted(ev.departed)}" if ev.departed else "",
        )
        self._view = ev.view
        self.history.append(ev.view)
        if self._observer is not None:
            self._observer.view_installed(self._me, ev)
        if self._early_p2p:  # after this step: once the state transfer holds the runners
            asyncio.get_running_loop().call_soon(self._serve_early_p2p)
        self.installed_at.append(time.monotonic())
        gone = set(ev.departed)
        for msg_no, call in list(self._pending.items()):
            if call.expected is None:
                continue
            for m in call.expected - call.results.keys():
                if m in gone:
                    call.results[m] = MemberFailed(m, "left the group before replying")
            self._complete(msg_no)
        for req, (member, fut) in list(self._p2p.items()):
            if member in gone and not fut.done():
                fut.set_exception(MemberFailed(member, "left the group before replying"))
                del self._p2p[req]

    def on_app_message(self, sender: int, msg: list[object]) -> None:
        kind = msg[0]
        if kind == env.REPLIES:
            items = msg[1]
            assert isinstance(items, list)
            if len(items) % 3:
                raise ProtocolViolation("a batch of replies is not (msg_no, ok, result) triples")
            it = iter(items)
            pending = self._pending
            for msg_no, ok, body in zip(it, it, it, strict=False):  # len % 3 == 0
                if type(msg_no) is not int or type(ok) is not bool or type(body) is not bytes:
                    raise ProtocolViolation("malformed reply in a batch of replies")
                # None, the usual result, is what _decode_result gives for _NIL
                value = None if ok and body == _NIL else _decode_result(sender, ok, body)
                call = pending.get(msg_no)
                if call is None:
                    continue
                expected = call.expected
                if expected is not None and sender in expected:  # the usual reply, as
                    call.results.setdefault(sender, value)  # _record_reply records it
                    self._complete_call(msg_no, call, expected)
                else:
                    self._record_reply(msg_no, sender, value)
        elif kind == env.REPLY:
            _, _sub, msg_no, ok, body = msg
            assert isinstance(msg_no, int) and isinstance(body, bytes)
            self._record_reply(msg_no, sender, _decode_result(sender, bool(ok), body))
        elif kind == env.P2P_REQ:
            _, req, actor_name, method, body = msg
            assert isinstance(req, int) and isinstance(body, bytes)
            self._serve_p2p(sender, req, str(actor_name), str(method), body)
        elif kind == env.P2P_RESP:
            _, req, ok, body, view_id, seq_plus_one = msg  # (seq + 1: the field is unsigned)
            assert isinstance(req, int) and isinstance(body, bytes)
            assert isinstance(view_id, int) and isinstance(seq_plus_one, int)
            entry = self._p2p.pop(req, None)
            if entry is None or entry[0] != sender or entry[1].done():
                return
            result = _decode_result(sender, bool(ok), body)
            if ok:
                entry[1].set_result(Versioned(result, (view_id, seq_plus_one - 1)))
            else:
                assert isinstance(result, BaseException)
                entry[1].set_exception(result)

    def state_ticket(self, view_id: int, joiner: int) -> bytes | None:
        """Host.state_ticket: the ticket of a fenced, streamed state transfer to ``joiner``."""
        return self._xfer.ticket(view_id, joiner) if self._xfer is not None else None

    def _close(self, exc: BaseException) -> None:
        if self._closed is None:
            self._closed = exc
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)
        for call in self._pending.values():
            if not call.future.done():
                call.future.set_exception(exc)
        self._pending.clear()
        for cast in self._casts.values():
            if not cast.done():
                cast.set_exception(exc)
        self._casts.clear()
        for _member, fut in self._p2p.values():
            if not fut.done():
                fut.set_exception(exc)
        self._p2p.clear()
        for parked in self._parked:
            if not parked.future.done():
                parked.future.set_exception(exc)
        self._parked.clear()
        self._parked_bytes = 0


_NIL = b"\xc0"  # msgpack None: the result of most handlers
# The native loop over delivered calls (Group.on_delivered); without the extension the general
# path runs alone, as the pure twin would only repeat it (as wire.calls does with decode_plain_call).
_dispatch_calls: Final = hotpath.dispatch_calls if hotpath.IMPLEMENTATION == "native" else None
_REPLIES_BYTES = 16 << 20  # result bytes in one REPLIES frame, at most (about)


def _encode_error(exc: object) -> bytes:
    name = type(exc).__name__
    return wire.encode([name, str(exc)])


def _decode_result(sender: int, ok: bool, body: bytes) -> object:
    try:
        value = wire.decode(body)
    except ProtocolViolation as exc:
        return exc
    if ok:
        return value
    if isinstance(value, list | tuple) and len(value) == 2:
        return HandlerError(sender, str(value[0]), str(value[1]))
    return HandlerError(sender, "Exception", repr(value))


def _read_only(actor: Actor, label: str, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` checked not to change ``actor``'s replica (``check_p2p_reads``): its snapshot is
    compared before and after; a change is undone (the snapshot before is restored) and the call
    fails with :class:`UsageError`."""

    def check(before: bytes) -> None:
        if wire.encode(actor.snapshot()) != before:
            state: Any = wire.decode(before)
            actor.restore(state)
            raise UsageError(f"p2p handler {label} changed the replica (p2p handlers may only "
                             f"read; the change was undone)")

    def run(*args: object, **kwargs: object) -> object:
        before = wire.encode(actor.snapshot())
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            check(before)
            raise
        if type(result) is not CoroutineType:
            check(before)
            return result

        async def finish(coro: Any = result) -> object:
            try:
                value = await coro
            except BaseException:
                check(before)
                raise
            check(before)
            return value

        return finish()

    return run
