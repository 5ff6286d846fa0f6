"""The user-facing group: join, host replicated actors, make ordered and p2p calls, leave.

Theory of operation: a :class:`Group` builds the transport named by its :class:`Config`, a
:class:`~derecho_async.runtime.driver.Driver` for the pure core, and one subgroup per actor class
(the layout), each with its actor and :class:`~derecho_async.runtime.runner.SerialRunner`. It is
a facade over three parts that share only this member's :class:`Membership`: the
:class:`CallTable` (this member's own calls, their replies and backpressure), the
:class:`Dispatcher` (delivered calls run here, replies batched back) and the
:class:`P2PServer` (p2p calls made and served); and, built on them, the :class:`Relay`
(external clients), the :class:`Forwarder` (calls to shards hosted elsewhere) and the
:class:`Handoffs` (a sharded actor's state to the members that gain its shards). It is the
driver's ``Host``: ``on_delivered`` and ``flush`` are the dispatcher's own methods; the other
callbacks are routed here. See docs/DESIGN.md §7.2, §7.16 and §7.17.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, Final, Self, TypeVar, cast

from derecho_async import hotpath
from derecho_async.api.actor import Actor, ActorSpec, actor_spec
from derecho_async.api.calls import CallTable, decode_result
from derecho_async.api.delivery import Dispatcher, Hosted
from derecho_async.api.durable import Durable
from derecho_async.api.forward import Forwarder
from derecho_async.api.handles import SubgroupHandle, check_version
from derecho_async.api.handoff import Handoffs
from derecho_async.api.logged_calls import HistoryEntry
from derecho_async.api.membership import Membership
from derecho_async.api.notify import Notifier
from derecho_async.api.once import ClientCalls
from derecho_async.api.p2pcalls import P2PServer
from derecho_async.api.rejoin import LogSuffixes
from derecho_async.api.relay import Relay
from derecho_async.api.restart import Restart
from derecho_async.api.sharding import Sharded
from derecho_async.config import Config, memory
from derecho_async.core import (
    Delivered,
    Evicted,
    Layout,
    Left,
    MemberState,
    Partitioned,
    Persisted,
    SendFailed,
    ShardAssignment,
    SubgroupSpec,
    View,
    ViewInstalled,
)
from derecho_async.core.effects import Event
from derecho_async.durability import Fs
from derecho_async.errors import (
    AuthenticationError,
    ConfigError,
    GroupClosed,
    JoinRefused,
    PartitionedError,
    UsageError,
)
from derecho_async.runtime.driver import Driver
from derecho_async.runtime.observer import GroupObserver
from derecho_async.runtime.runner import SerialRunner
from derecho_async.runtime.statexfer import StateTransfer
from derecho_async.transport import registry
from derecho_async.transport.base import Transport
from derecho_async.wire import envelope as env

__all__ = ["Group"]

A = TypeVar("A", bound=Actor)

log = logging.getLogger("derecho_async.group")


class FromConfig(enum.Enum):
    """The default of :meth:`Group.start`'s ``timeout``: the config's ``join_timeout_s``."""

    FROM_CONFIG = enum.auto()


FROM_CONFIG: Final = FromConfig.FROM_CONFIG


def _make_transport(config: Config) -> Transport:
    """The transport ``config.transport`` names (see :mod:`.transport.registry`)."""
    return registry.kind(config.transport).build(config)


class Group:
    """One member's membership in a group (see the module docstring).

    ``async with Group(config, actors=[Log]) as group:`` joins, and leaves on exit;
    ``await Group.join(config, actors=[Log])`` and ``await group.leave()`` do the same by hand.
    """

    on_delivered: Callable[[list[Delivered]], None]
    """Host.on_delivered: run the ordered calls of a run of deliveries, in order (the
    dispatcher's method itself, so the driver's call reaches the delivery loop directly)."""
    flush: Callable[[], None]
    """Host.flush: send the replies batched while the driver reported a step's events (the
    dispatcher's method itself)."""

    def __init__(
        self,
        config: Config,
        actors: Sequence[type[Actor] | Sharded] = (),
        *,
        transport: Transport | None = None,
        observer: GroupObserver | None = None,
        fs: Fs | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        """``transport``: a transport to use instead of the one ``config`` names (testing kits
        such as derecho_async.testing build their own); ``observer``: hooks told of deliveries,
        views and state transfer (:class:`~derecho_async.runtime.observer.GroupObserver`);
        ``fs``: the file system ``data_dir`` is on (default: the real one; the simulator's
        :class:`~derecho_async.testing.simdisk.SimDisk` can crash); ``clock``: the wall clock,
        in nanoseconds since the epoch, that durable calls are stamped and logged with (the
        simulator passes its virtual one). Actors of several shards whose tables cannot fit
        the host's memory raise :class:`ConfigError`, as ``Config`` does for one shard."""
        if not isinstance(config, Config):
            raise UsageError("Group needs a derecho_async.Config")
        if transport is not None and transport.member_id != config.member_id:
            raise UsageError(f"the transport is member {transport.member_id}'s, "
                             f"not member {config.member_id}'s")
        self.config = config
        self._transport = transport
        self._observer = observer
        self._state = state = Membership(config, config.member_id)
        self._specs: dict[str, ActorSpec] = {}
        self._sharded: dict[str, Sharded] = {}  # the sharded actors (api/sharding.py)
        for item in actors:
            spec = actor_spec(item.cls if isinstance(item, Sharded) else item)
            if spec.name in self._specs:
                raise UsageError(f"two actor classes named {spec.name!r}")
            self._specs[spec.name] = spec
            if isinstance(item, Sharded):
                self._sharded[spec.name] = item
        if self._sharded and config.data_dir is not None:
            raise UsageError("sharded actors cannot be durable yet: leave data_dir unset, or "
                             "the actor unsharded")
        self._actors: dict[str, Actor] = {}
        self._runners: dict[str, SerialRunner] = {}
        for name, spec in self._specs.items():
            self._actors[name] = spec.cls()
            self._runners[name] = SerialRunner()
        # one lookup per delivered call; each method table caches the names already checked
        hosted = {name: Hosted(spec, self._runners[name], self._actors[name], {})
                  for name, spec in self._specs.items()}
        names = tuple(self._specs) or ("default",)
        self.layout = Layout(tuple(
            SubgroupSpec(n, shards=sh.shards, min_per_shard=sh.min_replicas,
                         policy=sh.policy()) if (sh := self._sharded.get(n)) is not None
            else SubgroupSpec(n) for n in names))
        if self.layout.n_shards > 1:  # Config checked one shard's tables; every shard has its own
            memory.check(config, shards=self.layout.n_shards)
        self._calls = calls = CallTable(state, self._assignment, tuple(self._runners.values()),
                                        clock)
        self._p2p = P2PServer(state, self._specs, hosted)
        # per subgroup, what external clients' calls did (replicated state: api/once.py)
        self._once = {name: ClientCalls() for name in self._specs}
        self._dispatch = dispatch = Dispatcher(state, hosted, calls, self._p2p.last_delivered,
                                               observer, self._once)
        self.on_delivered = dispatch.on_delivered
        self.flush = dispatch.flush
        self._durable: Durable | None = None
        self._restart: Restart | None = None  # restarting with files (until in a view)
        self._rejoin: LogSuffixes | None = None  # a member restarted with files rejoins
        if config.data_dir is not None:
            self._durable = Durable(config, state, hosted, self._p2p.last_delivered, fs, clock,
                                    self._once)
            self._rejoin = LogSuffixes(self._durable, config.snapshot_every)
        self._notifier = Notifier(clock, self._rewire)
        # calls to shards this member does not host go to a member that does
        self._forwarder = Forwarder(config.member_id, self._send, self._hosts_of)
        self._assigned: tuple[int, ShardAssignment] | None = None  # (view id, its assignment)
        # serves external clients (listening only with client_listen)
        self._relay = Relay(state, self._specs, calls, self._p2p, self.subscribe, clock,
                            self._forwarder,
                            {n: sh.shards for n, sh in self._sharded.items()}, self._hosts_of)
        self._forwarder.serve = self._relay.submit_hosted
        # moves sharded actors' state to the members that gain their shards
        self._handoffs = Handoffs(config.member_id, self._sharded, hosted, self._once,
                                  self._send, config.state_chunk_kb << 10,
                                  config.state_stall_s, self._shard_failed)
        self._rewire()
        self._closed_future: asyncio.Future[None] | None = None
        self._driver: Driver | None = None
        self._xfer: StateTransfer | None = None  # state transfer to and from joiners
        self._gone: asyncio.Future[None] | None = None  # resolved once a deferred leave is done
        self._started = False
        for runner in self._runners.values():
            runner.watcher = calls.on_runner_progress
        self.history: list[View] = []
        self.installed_at: list[float] = []  # time.monotonic() of each install in ``history``

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    async def join(
        cls,
        config: Config,
        actors: Sequence[type[Actor] | Sharded] = (),
        *,
        timeout: float | FromConfig | None = FROM_CONFIG,
        transport: Transport | None = None,
        observer: GroupObserver | None = None,
        fs: Fs | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> Self:
        """Join the group named by ``config`` and return once this member is in a view.

        ``timeout``: as for :meth:`start`. ``transport``, ``observer``, ``fs``, ``clock``: as for
        :class:`Group`."""
        group = cls(config, actors, transport=transport, observer=observer, fs=fs, clock=clock)
        await group.start(timeout=timeout)
        return group

    async def start(self, *, timeout: float | FromConfig | None = FROM_CONFIG) -> None:
        """Start the transport and wait until this member has installed its first view.

        ``timeout`` seconds (default: the ``join_timeout_s`` key; None: no limit) give up with
        :class:`GroupClosed`, naming the last failure the transport saw. A member that refuses
        this one for good (another secret or group, a certificate that names someone else)
        raises :class:`AuthenticationError` at once. A port that cannot be bound raises
        :class:`ConfigError` naming ``listen``."""
        if isinstance(timeout, FromConfig):
            timeout = self.config.join_timeout_s
        if self._started:
            raise UsageError("this Group was already started")
        self._started = True
        hotpath.note_fallback(log)
        last_view = None
        if self._durable is not None:  # the actors resume from this member's files
            await self._durable.open()
            last_view = self._durable.last_view()
        transport = self._transport if self._transport is not None else _make_transport(self.config)
        driver = Driver(self.config, transport, self.layout, self)
        self._driver = self._state.driver = driver
        if self._durable is not None and last_view is not None:
            self._restart = Restart(
                self._durable, driver, last_view,
                grace_s=2 * self.config.suspect_after_ms / 1000,
                stall_s=self.config.state_stall_s, fail=self._restart_failed)
            driver.hold_bootstrap = self._restart.is_contact
        plain = [n for n in self._actors if n not in self._sharded]  # (shards: handoffs)
        self._xfer = StateTransfer(driver, {n: self._actors[n] for n in plain},
                                   {n: self._runners[n] for n in plain}, self._observer,
                                   self._rejoin, {n: self._once[n] for n in plain})
        try:
            await driver.start()
        except BaseException:
            await driver.close()  # release what the transport holds (names, sockets)
            raise
        if self._restart is not None:
            self._restart.start()
        assert driver.first_view is not None
        try:
            await asyncio.wait_for(asyncio.shield(driver.first_view), timeout)
        except TimeoutError:
            if self._restart is not None:
                self._restart.stop()
            await self._abandon(driver)
            cause = "" if driver.last_failure is None else f"; last: {driver.last_failure}"
            raise GroupClosed(
                f"member {self.config.member_id} was not admitted to group "
                f"{self.config.group!r} within {timeout} s{cause}"
            ) from None
        except RuntimeError as exc:
            await self._abandon(driver)
            raise GroupClosed(f"could not join: {exc}") from None
        except (GroupClosed, AuthenticationError, JoinRefused):
            await self._abandon(driver)
            raise
        if self._state.closed is not None:  # (a restart that could not go on)
            await self._abandon(driver)
            raise self._state.closed
        try:  # a joiner: its state, streamed from its sponsor (see runtime.statexfer)
            await self._xfer.restored()
        except GroupClosed:
            await self.leave()  # nobody else leaves
            raise
        if self.config.client_listen is not None:
            try:
                await self._relay.start()
            except ConfigError:
                await self.leave()
                raise
            self._relay.announce(self.view.members)

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
            if self._state.closed is None and not driver.closed:
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
        if self._durable is not None:
            await self._durable.aclose()

    def _send(self, member: int, data: bytes) -> None:
        driver = self._driver
        if driver is not None and not driver.closed:
            driver.transport.send(member, data)

    def _shard_failed(self, reason: str) -> None:
        """A shard's state could not reach this member: it leaves (nobody else does)."""
        log.error("member %d: %s; leaving the group", self.member_id, reason)
        driver = self._driver
        if driver is not None and self._state.exiting is None:
            self._state.exiting = GroupClosed(reason)
            driver.leave(reason)

    async def _abandon(self, driver: Driver) -> None:
        """A start that failed: release the transport and close the files."""
        await driver.close()
        if self._durable is not None:
            await self._durable.aclose()

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
        view = self._state.view
        if view is None:
            raise UsageError("the group has not installed a view yet")
        return view

    @property
    def closed(self) -> asyncio.Future[None]:
        """A future set once this member is out of the group: its exception says why (the error
        its calls now raise: it left, was removed, wedged). Read it on the group's loop."""
        fut = self._closed_future
        if fut is None:
            fut = self._closed_future = asyncio.get_running_loop().create_future()
            if self._state.closed is not None:
                _fail_quietly(fut, self._state.closed)
        return fut

    def views(self) -> AsyncIterator[View]:
        """Every view this member installs from now on, in order; the iteration ends when it
        is out of the group (:attr:`closed` says why)."""
        return self._notifier.views()

    def subscribe(self, actor: type[Actor], *, since: tuple[int, int] | None = None,
                  max_backlog: int = 65536) -> AsyncIterator[HistoryEntry]:
        """``actor``'s calls as this member delivers them (stable, in the group's order, each
        once), as :class:`HistoryEntry` (version, time, method, args, kwargs, one_way), from
        now on, or every one after version ``since`` (replayed from the log first: needs
        ``data_dir``). The iteration ends when this member is out of the group; a subscriber
        more than ``max_backlog`` deliveries behind is dropped with
        :class:`SubscriptionDropped`, so a slow one never makes the member hold more."""
        spec = self._spec_of(actor)
        if since is not None:
            if self._durable is None:
                raise UsageError("subscribe(since=...) replays from the log: it needs data_dir")
            since = check_version(since)
        if type(max_backlog) is not int or max_backlog < 1:
            raise UsageError(f"max_backlog must be a positive int, got {max_backlog!r}")
        return self._notifier.subscribe(spec.name, since, self._durable, max_backlog)

    def _rewire(self) -> None:
        """The dispatcher's hook for each run of deliveries: the log's, the subscriptions'."""
        log_run = self._durable.record if self._durable is not None else None
        if not self._notifier.subscribed:
            self._dispatch.record = log_run
            return
        notify = self._notifier.on_run
        if log_run is None:
            self._dispatch.record = notify
            return

        def both(events: list[Delivered]) -> None:
            log_run(events)
            notify(events)

        self._dispatch.record = both

    @property
    def _closed(self) -> BaseException | None:  # (what tests and kits read: as ``closed``)
        return self._state.closed

    @property
    def relay(self) -> Relay:
        """This member's service to external clients (:class:`derecho_async.Client`): it
        listens on ``client_listen`` when that is set; the simulator's clients call
        :meth:`Relay.submit` directly."""
        return self._relay

    @property
    def client_address(self) -> str | None:
        """``host:port`` where this member serves external clients (``client_listen``, its
        port chosen when that was 0), None when it serves none."""
        relay = self._relay
        return f"{relay.address[0]}:{relay.address[1]}" if relay.listening else None

    @property
    def member_id(self) -> int:
        return self.config.member_id

    def subgroup(self, actor: type[A], shard: int | None = None) -> SubgroupHandle[A]:
        """The handle for calls into ``actor``'s subgroup; for a sharded actor, into its shard
        ``shard``: ordered among that shard's members (made at a member that hosts it), p2p
        calls to them. ``handle[Actor.method]`` is typed from the handler's signature (see
        :class:`SubgroupHandle`)."""
        spec = self._spec_of(actor)
        sharded = self._sharded.get(spec.name)
        if sharded is None:
            if shard not in (None, 0):
                raise UsageError(f"{spec.name} is not sharded: no shard {shard!r}")
            return SubgroupHandle(self._calls, self._p2p, spec, self._durable)
        if shard is None and sharded.shards == 1:
            shard = 0
        if type(shard) is not int or not 0 <= shard < sharded.shards:
            raise UsageError(f"{spec.name} has shards 0 to {sharded.shards - 1}: say which "
                             f"(subgroup({spec.name}, shard=k)), not {shard!r}")
        name, k = spec.name, shard
        return SubgroupHandle(self._calls, self._p2p, spec, None, shard,
                              lambda: self._hosts_of(name, k), self._forwarder)

    def shards(self, actor: type[Actor]) -> dict[int, tuple[int, ...]]:
        """``actor``'s shards in the current view: shard -> its members (rank order). An
        unsharded actor is one shard of every member."""
        spec = self._spec_of(actor)
        return {info.shard: info.members for info in self._assignment().shards
                if info.subgroup == spec.name}

    def hosted_shard(self, actor: type[Actor]) -> int | None:
        """The shard of sharded ``actor`` whose state this member's replica holds (None:
        none). It is the shard ``shards()`` gives this member, but while a view is inadequate
        (nothing moves then) or the shard's state is still coming."""
        spec = self._spec_of(actor)
        if spec.name not in self._sharded:
            raise UsageError(f"{spec.name} is not sharded")
        return self._handoffs.held.get(spec.name)

    def _assignment(self) -> ShardAssignment:
        view = self._state.view
        if view is None:
            raise UsageError("the group has not installed a view yet")
        got = self._assigned
        if got is None or got[0] != view.view_id:
            got = self._assigned = (view.view_id, self.layout.assign(view.members))
        return got[1]

    def _hosts_of(self, actor: str, shard: int) -> tuple[int, ...]:
        """The members of ``actor``'s shard ``shard`` in the current view (none: no view)."""
        if self._state.view is None:
            return ()
        info = self._assignment().find(actor, shard)
        return info.members if info is not None else ()

    def local(self, actor: type[A]) -> A:
        """This member's own replica of ``actor`` (for local reads), an instance of ``actor``;
        of a sharded actor, the replica of the shard it hosts (``shards()`` says which), as
        ``actor()`` made it when it hosts none (the same object throughout: a shard's state is
        restored into it)."""
        return cast("A", self._actors[self._spec_of(actor).name])  # made as spec.cls()

    def device_buffer(self, shape: int | tuple[int, ...], dtype: str = "float32") -> Any:
        """A CuPy array to fill and send without a copy.

        With the CUDA IPC plane active (see ``gpu_plane``) the array is allocated in this
        member's IPC-exported device pool, so an ordered call carrying it sends it in place.
        Leave it unchanged until the call's replies are in. Its memory returns to the pool when
        the array is garbage-collected. Without the plane it is a plain ``cupy.empty`` array.
        """
        driver = self._state.check_open()
        if driver.gpuplane is not None:
            return driver.gpuplane.device_buffer(shape, dtype)
        try:
            import cupy
        except ImportError as exc:
            raise UsageError("device_buffer needs CuPy (the 'gpu' extra)") from exc
        return cupy.empty(shape, dtype=dtype)

    def device_pool_stats(self) -> dict[str, int] | None:
        """Figures of this member's CUDA IPC device pool, or None when the plane is off."""
        driver = self._state.check_open()
        return driver.gpuplane.stats() if driver.gpuplane is not None else None

    def nccl_stats(self) -> dict[str, int] | None:
        """Figures of this member's NCCL plane (communicators by state, messages sent and
        received by broadcast), or None when it is off (see ``gpu_plane``)."""
        driver = self._state.check_open()
        return driver.ncclplane.stats() if driver.ncclplane is not None else None

    def stats(self) -> dict[str, int]:
        """This member's counters (since it started) and gauges (now), for metrics:
        ``delivered`` (messages delivered here, every subgroup), ``sent`` (ordered calls this
        member multicast: its own, one-way and relayed ones), ``views`` (views installed),
        ``view_id`` and ``members`` (the current view), ``in_flight_calls`` (this member's
        calls not completed, those waiting for room included), ``queued_calls`` (delivered
        calls waiting for handlers) and ``pool_bytes`` (device memory the GPU plane's pool
        holds; 0 without one). Raises :class:`GroupClosed` once the member is out."""
        driver = self._state.check_open()
        calls = self._calls
        pool = driver.gpuplane.stats()["pool_bytes"] if driver.gpuplane is not None else 0
        view = self.view
        return {
            "delivered": driver.delivered,
            "sent": 0 if driver.core is None else driver.core.submitted,
            "views": len(self.history),
            "view_id": view.view_id,
            "members": len(view.members),
            "in_flight_calls": len(calls.pending) + len(calls.casts) + len(calls.parked),
            "queued_calls": calls.queued_calls,
            "pool_bytes": pool,
        }

    @property
    def queued_calls(self) -> int:
        """Delivered ordered calls waiting here for their handlers (all actors)."""
        return self._calls.queued_calls

    def _spec_of(self, actor: type[Actor]) -> ActorSpec:
        spec = self._specs.get(getattr(actor, "__name__", ""))
        if spec is None or spec.cls is not actor:
            raise UsageError(f"{actor!r} is not one of this group's actors")
        return spec

    # -- driver callbacks (Host; on_delivered and flush are the dispatcher's) ------------------
    def on_event(self, event: Event) -> None:
        """Host.on_event: one event of a protocol step other than a run of deliveries."""
        self._dispatch.batching = True
        if isinstance(event, Delivered):
            self.on_delivered([event])
        elif isinstance(event, ViewInstalled):
            self._on_view(event)
            if self._durable is not None:
                self._durable.on_view(event)
        elif isinstance(event, Persisted):
            if self._durable is not None:
                self._durable.on_persisted(event)
        elif isinstance(event, SendFailed):
            self._calls.send_failed(event.msg_no, event.reason)
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

    def on_app_message(self, sender: int, msg: list[object]) -> None:
        """Host.on_app_message: replies to my calls, p2p requests and answers."""
        kind = msg[0]
        if kind == env.REPLIES:
            items = msg[1]
            assert isinstance(items, list)
            self._calls.on_replies(sender, items)
        elif kind == env.REPLY:
            _, _sub, msg_no, ok, body = msg
            assert isinstance(msg_no, int) and isinstance(body, bytes)
            self._calls.record_reply(msg_no, sender, decode_result(sender, bool(ok), body))
        elif kind in (env.HANDOFF, env.HANDOFF_EMPTY):
            self._handoffs.on_message(sender, msg)
        elif kind == env.FORWARD:
            self._forwarder.on_forward(sender, msg)
        elif kind == env.FORWARDED:
            self._forwarder.on_answer(sender, msg)
        elif kind == env.CLIENT_ADDR:
            self._relay.heard(sender, str(msg[1]), int(msg[2]))  # type: ignore[call-overload]
        elif kind == env.P2P_REQ:
            _, req, actor_name, method, body = msg
            assert isinstance(req, int) and isinstance(body, bytes)
            self._p2p.serve(sender, req, str(actor_name), str(method), body)
        elif kind in env.RESTART_KINDS:
            if self._restart is not None:
                self._restart.on_message(sender, msg)
            elif kind == env.RECOVER_INFO and self._state.view is not None and (
                    self._state.closed is None and self._driver is not None):
                # a member restarting with its files while the group runs: it joins through me
                # (or another member), and its files make most of its state
                if self._rejoin is not None:
                    self._rejoin.offered(sender, msg[3])  # type: ignore[arg-type]
                self._driver.transport.send(sender, env.encode(env.RECOVER_LIVE,
                                                               self._state.view.view_id))
        elif kind == env.P2P_RESP:
            _, req, ok, body, view_id, seq_plus_one = msg  # (seq + 1: the field is unsigned)
            assert isinstance(req, int) and isinstance(body, bytes)
            assert isinstance(view_id, int) and isinstance(seq_plus_one, int)
            self._p2p.on_response(sender, req, bool(ok), body, view_id, seq_plus_one - 1)

    def state_ticket(self, view_id: int, joiner: int) -> bytes | None:
        """Host.state_ticket: the ticket of a fenced, streamed state transfer to ``joiner``."""
        return self._xfer.ticket(view_id, joiner) if self._xfer is not None else None

    def _restart_failed(self, exc: BaseException) -> None:
        """The restart cannot go on: the join fails with ``exc``."""
        driver = self._driver
        self._close(exc)
        if driver is not None and driver.first_view is not None and not driver.first_view.done():
            driver.first_view.set_exception(exc)

    def _on_view(self, ev: ViewInstalled) -> None:
        state = self._state
        if self._restart is not None:
            self._restart.check_view(ev.view.view_id,
                                     founding=ev.state is None and state.me in ev.joined)
            self._restart = None
        if state.me in ev.joined:  # the state this member starts from: no call of this view
            self._p2p.joined(ev)
        if self._rejoin is not None:
            self._rejoin.joined(ev.joined)
        # (a joiner's state: the driver hands the view to self._xfer next, which holds the
        # runners until it restored it)
        self._calls.new_view()
        log.info(
            "member %d: view %d installed: members %s%s",
            self.member_id,
            ev.view.view_id,
            list(ev.view.members),
            f", departed {sorted(ev.departed)}" if ev.departed else "",
        )
        state.view = ev.view
        self.history.append(ev.view)
        if self._sharded:
            self._handoffs.on_view(ev.view, ev.joined, ev.state is None and state.me in ev.joined,
                                   self._assignment())
        self._notifier.on_view(ev.view)
        self._relay.on_view(ev.view)
        self._forwarder.on_view(ev.view)
        self._relay.announce(ev.joined)
        if self._observer is not None:
            self._observer.view_installed(state.me, ev)
        self._p2p.serve_early_soon()
        self.installed_at.append(time.monotonic())
        gone = set(ev.departed)
        self._calls.on_departed(gone)
        self._p2p.on_departed(gone)

    def _close(self, exc: BaseException) -> None:
        """This member is out of the group (``exc`` says why): every call in flight fails."""
        if self._state.closed is None:
            self._state.closed = exc
        if self._gone is not None and not self._gone.done():
            self._gone.set_result(None)
        self._calls.fail_in_flight(exc)
        self._p2p.fail_all(exc)
        self._calls.fail_parked(exc)
        if self._durable is not None:
            self._durable.close(exc)
        if self._restart is not None:
            self._restart.stop()
        if self._closed_future is not None and not self._closed_future.done():
            _fail_quietly(self._closed_future, exc)
        self._notifier.close()
        self._relay.close()
        self._forwarder.close(exc)


def _fail_quietly(fut: asyncio.Future[None], exc: BaseException) -> None:
    """Set ``fut``'s exception, marked retrieved: nobody need be waiting for it."""
    fut.set_exception(exc)
    fut.exception()
