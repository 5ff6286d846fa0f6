"""The asyncio driver of one member: it runs the pure core against a real transport.

Theory of operation: the driver is the transport's handler. Remote pushes go straight into the
core (``receive_push``), channel messages are decoded and dispatched, and either kind of arrival
schedules one *process* callback on the event loop (coalesced: a burst of arrivals costs one
step). A step polls the core, takes its ``Ready`` (``advance`` first: what the core adds while
the step runs, such as a failure a transport reports from inside a push, belongs to the next
step) and carries it out: events to the host in order, then pushes, channel sends and data-plane
transfers through the transport; a step of deliveries alone puts out its pushes first, so peers
learn its frontier while its handlers run. It repeats while the core has more to do; a data plane
that lands messages takes the scheduled step at once (:meth:`Driver.step_now`). Time enters
from a timer that ticks the core every heartbeat period; an idle group therefore costs a
heartbeat per period and nothing else (no busy polling).

Bootstrap: the *contact* (member 0) collects join requests until
``initial_members`` members are known, then forms view 0 and welcomes them; every other member
starts as a joiner whose core retries its join request. A member joining a running group takes
the same path and is admitted by the leader with a state-transfer ticket (the state follows,
streamed: :mod:`.statexfer`). A joiner whose configured contacts are none of them running asks
first the members the transport sees running (``Transport.live_members``; shm: their doorbells),
so a group whose member 0 died still admits members.

Large payloads and arrays move on a data plane; landing them reports ``data_landed`` to the
core, which counts them received only then. Routing happens in one place:
:meth:`Driver.start_transfer` offers each transfer to the planes in :attr:`Driver.planes`, in
order, and the first whose ``start`` returns True owns it; the host-staging plane
(:mod:`.dataplane`: one DATA frame per receiver on the channel) takes whatever none took (device
arrays; every payload on transports without a bulk plane: rdma, loopback). Frames arrive by
envelope kind: :attr:`Driver.receivers` maps each kind to its plane. The bulk plane is the one
the transport's kind names (:mod:`derecho_async.transport.registry`): shm gets :mod:`.shmplane`
(written once into the sender's shared pool, copied out by each receiver), tcp gets
:mod:`.chainplane` (a pipelined chain multicast in blocks). Device
arrays between members of one host go first to the CUDA IPC plane (:mod:`.gpu.ipc`) when it is
on (``gpu_plane``), for peers that announced a pool; with ``gpu_plane="nccl"`` they go first to
the NCCL plane (:mod:`.gpu.nccl`: per-sender communicators), then CUDA IPC over shm. A plane
also sees the core's events (its own deliveries and view installs are its freeing points).
Another plane (a CUDA-IPC plane for device arrays) joins with ``add_plane(plane, first=True)``:
its ``start`` returns False for payloads it does not move, and each of its frame kinds needs a
shape in :mod:`derecho_async.wire.envelope` (decoding validates every field before a plane sees
it). A data frame that breaks the protocol is dropped and its sender reported as failed: the
message could never land, and nothing would be stable again while its sender stays in the view.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, cast

from derecho_async.config import Config
from derecho_async.core import (
    CoreConfig,
    DataKey,
    Delivered,
    Evicted,
    JoinRequest,
    Layout,
    Left,
    Member,
    MemberState,
    Partitioned,
    Ready,
    Suspected,
    View,
    ViewInstalled,
    Welcome,
    decode_message,
    encode_message,
)
from derecho_async.core.effects import Event
from derecho_async.errors import DerechoError, ProtocolViolation
from derecho_async.runtime.addresses import Addresses
from derecho_async.runtime.dataplane import HostStagingPlane
from derecho_async.runtime.plane import Plane
from derecho_async.transport import registry
from derecho_async.transport.base import Transport
from derecho_async.transport.registry import PlaneWiring
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.runtime.gpu.ipc import IpcPlane
    from derecho_async.runtime.gpu.nccl import NcclPlane
    from derecho_async.runtime.statexfer import StateTransfer

_STATE_TAG = 1 << 62  # statexfer.STATE_TAG: data keys of state chunks (never a core msg_no)

__all__ = ["Driver", "Host"]

log = logging.getLogger("derecho_async.driver")


class Host(Protocol):
    """What the driver reports to the layer above it (the Group)."""

    def on_event(self, event: Event) -> None: ...

    def on_delivered(self, events: list[Delivered]) -> None:
        """A run of consecutive Delivered events of one step, in order (one call, not one
        ``on_event`` per message)."""

    def on_app_message(self, sender: int, msg: list[object]) -> None: ...

    def state_ticket(self, view_id: int, joiner: int) -> bytes | None:
        """The state of a Welcome of view ``view_id`` to ``joiner`` (a state-transfer ticket;
        the fence and the transfer start now), or None: send no Welcome (one is under way)."""

    def flush(self) -> None:
        """The events of one step were all reported: send what was batched (replies)."""


async def _import_off_loop(module: str) -> None:
    """Import ``module`` (if installed) in the loop's executor unless it is imported already.

    The data planes, large calls and state transfer import numpy lazily, on the loop; the
    first import can take seconds on a slow or emulated machine, and a member whose loop is
    held that long misses heartbeats and is suspected. Done before the member is in a view,
    the import holds nothing up.
    """
    if module in sys.modules:
        return

    def load() -> None:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)

    await asyncio.get_running_loop().run_in_executor(None, load)


class Driver:
    """Drives one member's core over ``transport`` (see the module docstring)."""

    def __init__(self, config: Config, transport: Transport, layout: Layout, host: Host) -> None:
        self.config = config
        self.transport = transport
        self.host = host
        self.member_id = config.member_id
        tick_s = config.heartbeat_ms / 1000.0
        self.tick_s = tick_s
        self.core_config = CoreConfig(
            window=config.window,
            send_batch=config.send_batch if config.send_batch is not None
            else 8 if (os.cpu_count() or 1) >= 8 else 0,
            max_payload=config.max_payload,
            heartbeat_period=1,
            suspect_after=max(2, math.ceil(config.suspect_after_ms / config.heartbeat_ms)),
            join_retry=max(1, math.ceil(100.0 / config.heartbeat_ms)),
            partition_safety=config.partition_safety,
            layout=layout,
        )
        self.contact = min((*config.peers.keys(), 0)) if config.peers else 0
        self.core: Member | None = None
        self._bootstrap_joiners: list[int] = []
        #: the contact does not form view 0 itself: a restart after total failure forms the
        #: first view through :meth:`form_view` (see ``api/restart.py``)
        self.hold_bootstrap = False
        self._step_handle: asyncio.Handle | None = None  # the step kick() scheduled
        self._stepping = False  # a step is being carried out (steps do not nest)
        self._tick_handle: asyncio.TimerHandle | None = None
        self._tick_due = 0.0  # when the next tick is due (loop time)
        #: a tick this late means the loop was held long enough to matter (a third of the
        #: suspicion timeout); warned about at most every 10 s
        self._stall_warn_s = config.suspect_after_ms / 3000.0
        self._next_stall_warning = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.first_view: asyncio.Future[View] | None = None
        #: what the transport last reported failing (a join that times out says it)
        self.last_failure: str | None = None
        self.delivered = 0  # messages delivered here (every subgroup and sender)
        self.addresses = Addresses(self.member_id, transport)  # contact, MEMBER_ADDR
        self.steps = 0
        self.dataplane = HostStagingPlane(
            transport.send,
            self._data_landed,
            lambda key, body: env.encode(env.DATA, *key, body),
            failed=self._landing_failed,
            staging_failed=self._staging_failed,
        )
        #: bulk planes, tried in order by :meth:`start_transfer` (a GPU plane goes first)
        self.planes: list[Plane] = []
        #: envelope kind -> handler of data frames of that kind: (sender, decoded, raw)
        self.receivers: dict[int, Callable[[int, list[Any], bytes], None]] = {
            env.DATA: self._staging_receive
        }
        #: what the transport's kind provides (see :mod:`..transport.registry`)
        self.transport_kind = registry.kind(config.transport)
        self._bulk_planes_for(transport)
        self.gpuplane: IpcPlane | None = None
        self.ncclplane: NcclPlane | None = None
        #: state transfer (:mod:`.statexfer`): gets the landings of state chunks and the events
        self.statexfer: StateTransfer | None = None

    def _bulk_planes_for(self, transport: Transport) -> None:
        plane = self.transport_kind.build_bulk_plane(PlaneWiring(
            self.member_id, transport, self._data_landed, self._landing_failed,
            self._staging_failed))
        if plane is not None:
            self.add_plane(plane)

    def add_plane(self, plane: Plane, *, first: bool = False) -> None:
        """Route payloads to ``plane`` (before the others with ``first``) and its frame kinds
        to its ``receive``."""
        if first:
            self.planes.insert(0, plane)
        else:
            self.planes.append(plane)
        for kind in plane.kinds:
            self.receivers[kind] = plane.receive

    def start_transfer(self, key: tuple[int, int, int], payload: object,
                       targets: tuple[int, ...]) -> object:
        """Move one large payload: the first plane that takes it, else host staging. Returns
        the plane that took it."""
        for plane in self.planes:
            try:
                if plane.start(key, payload, targets):
                    return plane
            except Exception:  # the step must not fail (it would run again): next plane
                log.exception("member %d: %s could not take %s", self.member_id,
                              type(plane).__name__, key)
        self.dataplane.start(key, payload, targets)
        return self.dataplane

    def release_sent(self, key: tuple[int, int, int]) -> None:
        """Tell the planes that this member's payload ``key`` is no longer needed anywhere (a
        state chunk the joiner acknowledged)."""
        for plane in self.planes:
            try:
                plane.on_own_delivered(key)
            except Exception:
                log.exception("member %d: %s could not free %s", self.member_id,
                              type(plane).__name__, key)

    def _staging_receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        _, view_id, src, msg_no, data = msg
        if src != sender:
            raise ProtocolViolation(f"data for sender {src} relayed by {sender}")
        self.dataplane.receive((view_id, src, msg_no), data)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the transport and the clock; begin bootstrap or joining."""
        self._loop = asyncio.get_running_loop()
        self.first_view = self._loop.create_future()
        await _import_off_loop("numpy")
        self._start_gpu_plane()
        self.transport.on_refused = self._refused
        await self.transport.start(self)
        # a member given a `contact` address joins through whoever answers there
        via = (None if self.config.contact is None
               else await self.addresses.reach_contact(self.config))
        is_contact = self.member_id == self.contact and via is None
        if is_contact and self.config.initial_members == 1 and not self.hold_bootstrap:
            self.form_view(0, [])
        elif not is_contact:
            contacts = tuple(sorted(self.config.peers)) or (self.contact,)
            contacts = tuple(c for c in contacts if c != self.member_id) or (self.contact,)
            if via is not None:
                contacts = (via, *(c for c in contacts if c not in (via, self.contact)))
            else:
                contacts = self._with_running_members(contacts)
            self.core = Member(self.member_id, self.core_config, contacts=contacts)
        self._tick_due = self._loop.time() + self.tick_s
        self._tick_handle = self._loop.call_later(self.tick_s, self._on_tick)
        self.kick()

    def _with_running_members(self, contacts: tuple[int, ...]) -> tuple[int, ...]:
        """A joiner's contacts: the configured ones while one of them runs or the transport
        cannot tell (a bootstrap with member 0 up, tcp). When none runs but the transport sees
        members that do (shm: their doorbells), those come first, lowest id first: the leader
        is among them and admits, the others ignore the request; the configured ones stay last
        (one that starts late still forms view 0)."""
        running = [m for m in self.transport.live_members() if m != self.member_id]
        if not running or any(c in running for c in contacts):
            return contacts
        log.info("member %d: contact %s not running; asking the running members %s",
                 self.member_id, ", ".join(map(str, contacts)), running)
        return tuple(dict.fromkeys((*running, *contacts)))

    def _start_gpu_plane(self) -> None:
        mode = self.config.gpu_plane
        one_host = self.transport_kind.one_host
        if mode == "host" or (mode == "auto" and not one_host):
            return
        from derecho_async.runtime.gpu.selection import (
            gpu_available,
            nccl_unavailable,
            select_gpu_planes,
        )

        planes = select_gpu_planes(mode, one_host, gpu_available, nccl_unavailable)
        if "ipc" in planes:
            self._start_ipc_plane()
        if "nccl" in planes:
            self._start_nccl_plane()

    def _start_nccl_plane(self) -> None:
        from derecho_async.runtime.gpu.nccl import NcclPlane

        layout = self.core_config.layout

        def shards_of(members: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
            return [(s.members, s.senders) for s in layout.assign(members).shards]

        config = self.config
        self.ncclplane = NcclPlane(self.member_id, shards_of, self.transport.send,
                                   self._data_landed, self.on_failure,
                                   failed=self._landing_failed,
                                   setup_s=config.nccl_setup_s, stall_s=config.nccl_stall_s,
                                   busy_poll_us=config.gpu_busy_poll_us,
                                   poll_interval_us=config.gpu_poll_interval_us)
        self.add_plane(self.ncclplane, first=True)
        log.info("member %d: device arrays travel by NCCL broadcasts (GPU %d)",
                 self.member_id, self.ncclplane.device)

    def _start_ipc_plane(self) -> None:
        from derecho_async.runtime.gpu.ipc import IpcPlane

        self.gpuplane = IpcPlane(
            self.member_id,
            self.config.gpu_pool_mb << 20,
            self.transport.send,
            self._data_landed,
            failed=self._landing_failed,
            landed_batch=self.step_now,
            busy_poll_us=self.config.gpu_busy_poll_us,
            poll_interval_us=self.config.gpu_poll_interval_us,
        )
        self.add_plane(self.gpuplane, first=True)
        log.info("member %d: device arrays travel by CUDA IPC (GPU %s)",
                 self.member_id, self.gpuplane.bus_id)

    async def close(self) -> None:
        """Stop the clock and release the transport."""
        if self._closed:
            return
        self._closed = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        if self.statexfer is not None:
            self.statexfer.close()
        for plane in self.planes:
            try:
                plane.close()
            except Exception:
                log.exception("member %d: closing a data plane failed", self.member_id)
        # A dead peer must not hold up shutdown: give queued traffic a second, then close.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.transport.drain(), timeout=1.0)
        await self.transport.close()

    def leave(self, reason: str = "") -> None:
        """Ask the core to leave the group and push that out now; ``reason`` (empty for a leave
        the application asked for) goes into the Left event the host gets."""
        if self.core is not None:
            self.core.leave(reason)
            self._step()

    # -- TransportHandler ----------------------------------------------------------------------
    def on_push(self, view_id: int, sender: int, offset: int, data: bytes) -> None:
        core = self.core
        if core is None:
            return
        core.receive_push(view_id, sender, offset, data)
        self.kick()

    def on_message(self, sender: int, payload: bytes) -> None:
        if self.core is not None:
            self.core.heard_from(sender)
        try:
            msg = env.decode(payload)
            kind = msg[0]
            if kind == env.CORE:
                self._on_core_message(sender, msg[1])
            elif kind == env.MEMBER_ADDR:
                self.addresses.heard(self.core, msg[1])
            else:
                receive = self.receivers.get(kind)
                if receive is None:
                    self.host.on_app_message(sender, msg)
                else:
                    try:
                        receive(sender, msg, payload)
                    except ProtocolViolation as exc:
                        # its message could never land: nothing would be stable again
                        self.on_failure(sender, f"protocol violation on the data plane: {exc}")
                        raise
                    except Exception as exc:
                        # A well-formed frame that this member could not take in (out of
                        # memory for its buffer, a device error): the fault is here, not the
                        # sender's, so this member leaves (as for a failed landing).
                        log.exception("member %d: a data frame from %d failed", self.member_id,
                                      sender)
                        self._leave_for(f"a data frame from {sender} could not be taken in "
                                        f"here: {exc!r}")
                        return
        except ProtocolViolation as exc:
            log.warning("member %d: dropped a message from %d: %s", self.member_id, sender, exc)
            return
        self.kick()

    def _refused(self, member: int, error: DerechoError) -> None:
        """``member`` refused this member for good (another secret or group, an id in use): a
        member still joining gives up at once with that error."""
        if self.first_view is not None and not self.first_view.done():
            self.first_view.set_exception(error)

    def on_failure(self, member: int, reason: str) -> None:
        log.info("member %d: transport reports %d: %s", self.member_id, member, reason)
        self.last_failure = reason
        if self.core is not None:
            self.core.report_failure(member)
            self.kick()

    def _data_landed(self, key: tuple[int, int, int], payload: object) -> None:
        if key[2] >= _STATE_TAG:
            if self.statexfer is not None:
                self.statexfer.landed(key, payload)
            return
        if self.core is not None:
            self.core.data_landed(DataKey(*key), payload)
            self.kick()

    def _landing_failed(self, key: tuple[int, int, int], exc: BaseException) -> None:
        """A message's bytes arrived but could not be made into its payload here (a plane's
        completion or off-loop rebuild raised). It never lands, so it would never be stable and the group would
        wait on this member for good: leave instead, and let the others go on without it."""
        if key[2] >= _STATE_TAG:  # a state chunk: the transfer fails, not the group
            if self.statexfer is not None:
                self.statexfer.landing_failed(key, exc)
            return
        self._leave_for(f"message {key} could not land here: {exc!r}")

    def _staging_failed(self, key: tuple[int, int, int], exc: BaseException) -> None:
        """This member's own message could not be staged for sending: nobody will ever receive
        its bytes, so it would never be stable; leave, and the ragged trim drops it."""
        if key[2] >= _STATE_TAG:  # a state chunk: that transfer is aborted, this member stays
            if self.statexfer is not None:
                self.statexfer.staging_failed(key, exc)
            return
        self._leave_for(f"message {key} could not be sent from here: {exc!r}")

    def _leave_for(self, reason: str) -> None:
        """A local failure would hold the group up for good: leave, saying ``reason``."""
        core = self.core
        if core is None or core.state is not MemberState.ACTIVE:
            return
        log.error("member %d: %s; leaving the group so the others are not held up",
                  self.member_id, reason)
        core.leave(reason)
        self.kick()

    # -- stepping ------------------------------------------------------------------------------
    def kick(self) -> None:
        """Schedule one processing step (coalesced)."""
        if self._step_handle is None and not self._closed and self._loop is not None:
            self._step_handle = self._loop.call_soon(self._step)

    def step_now(self) -> None:
        """Take the scheduled step at once, if one is scheduled. A data plane calls this after
        landing a batch of messages: the frontier that says so goes out now, not after every
        callback already waiting on the loop (a burst of descriptor frames takes hundreds of
        microseconds, and the sender's next messages wait for this stability)."""
        if self._step_handle is not None and not self._stepping:
            self._step()

    def _log_suspicion(self, event: Suspected, view_id: int) -> None:
        """Say why this member now suspects a peer; a peer that left is no cause for alarm."""
        why = {
            "silent": f"no sign of life for {self.config.suspect_after_ms:g} ms",
            "link": "the transport lost it",
            "violation": "it broke the protocol",
            "peer": "another member suspects it",
            "left": "it left the group",
        }.get(event.cause, event.cause)
        log.log(logging.INFO if event.cause == "left" else logging.WARNING,
                "member %d suspects member %d (view %d): %s", self.member_id, event.member,
                view_id, why)

    def _on_tick(self) -> None:
        if self._closed:
            return
        loop = self._loop
        assert loop is not None
        now = loop.time()
        late = now - self._tick_due
        if late > self._stall_warn_s and now >= self._next_stall_warning:
            # Peers see no heartbeat from a member whose loop is held: say so here, where the
            # cause is (a handler or a library call that blocks), not only as their suspicion.
            self._next_stall_warning = now + 10.0
            core = self.core
            where = ("before joining" if core is None or core.state is not MemberState.ACTIVE
                     else f"in view {core.view.view_id}")
            if self.transport.beacon_on:
                rule = (f"its beacon keeps it in the group until the loop is held for "
                        f"{self.config.max_loop_hold_ms:.0f} ms")
            else:
                rule = f"peers suspect a member after {self.config.suspect_after_ms:.0f} ms"
            log.warning("member %d: the event loop was held for %.0f ms %s (%s)",
                        self.member_id, (late + self.tick_s) * 1000, where, rule)
        self._tick_due = now + self.tick_s
        self._tick_handle = loop.call_later(self.tick_s, self._on_tick)
        alive = self.transport.beacon_tick()
        if self.core is not None:
            for member in alive:
                self.core.heard_from(member)
            self.core.tick()
        self._step()

    def _step(self) -> None:
        handle = self._step_handle
        if handle is not None:  # taken now (a tick, step_now): the scheduled one is not needed
            handle.cancel()
            self._step_handle = None
        core = self.core
        if core is None or self._closed:
            return
        if self._stepping:  # called from inside a step (a handler leaving): take it next
            self.kick()
            return
        core.poll()
        ready = core.ready()
        if not ready:
            return
        self.steps += 1
        # Taken from the core before it is carried out: what the core adds meanwhile (a
        # transport reporting a failure from inside a push, a member leaving from a handler)
        # goes into the next Ready, for the next step, not into lists half carried out.
        core.advance(ready)
        self._stepping = True
        try:
            self._execute(core, ready)
        except BaseException as exc:
            # The step is half carried out (a slot push may be gone while the counter that
            # publishes it goes out in the next step) and cannot be taken again (its
            # deliveries may have run): peers can no longer trust this member's row. (The
            # host takes every handler's outcome itself; this is for the runtime's own bugs.)
            log.exception("member %d: carrying out a step failed", self.member_id)
            self._leave_for(f"carrying out a step failed ({type(exc).__name__}: {exc})")
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise  # the process is asked to stop: the leave above is already under way
        finally:
            self._stepping = False
        # Yield to the loop before the next step, even with more to do: the transport rings its
        # peers' doorbells then, and they start on these records while this member writes the
        # next batch (Config.send_batch) instead of waiting for all of them. With nothing more
        # to do (the usual case) no step is scheduled: the next input kicks one.
        if not core.settled():
            self.kick()

    def _execute(self, core: Member, ready: Ready) -> None:
        events = ready.events
        if events and not ready.sends:
            for event in events:
                if type(event) is not Delivered:
                    break
            else:
                # Only deliveries (the usual busy step): the pushes go out first, so peers
                # learn this member's frontier (what became stable, what it holds) while it
                # runs the handlers, instead of after them. Nothing in a push waits on a
                # handler: the delivered counter it may carry is read by no peer's protocol.
                self._put_out(ready)
                self._report_delivered(cast("list[Delivered]", events))
                self.host.flush()
                return
        if events:
            host = self.host
            run: list[Delivered] = []
            for event in events:
                if type(event) is Delivered:
                    run.append(event)
                    continue
                if run:
                    self._report_delivered(run)
                    run = []
                if isinstance(event, ViewInstalled):
                    self.transport.set_view(
                        event.view.view_id, event.view.members, core.schema.row_bytes
                    )
                    for m in event.view.members:
                        if m != self.member_id:
                            self.transport.add_peer(m, self.config.peers.get(m))
                    self.addresses.on_view(event.view.members, event.joined)
                    if self.first_view is not None and not self.first_view.done():
                        self.first_view.set_result(event.view)
                elif isinstance(event, Suspected):
                    self._log_suspicion(event, core.view.view_id)
                elif isinstance(event, (Partitioned, Evicted, Left)) and (
                    self.first_view is not None and not self.first_view.done()
                ):
                    self.first_view.set_exception(RuntimeError(type(event).__name__))
                host.on_event(event)
                if self.statexfer is not None:  # (a joiner's holds go in before the view's calls)
                    self.statexfer.on_event(event)
                for plane in self.planes:
                    plane.on_event(event)
            if run:
                self._report_delivered(run)
            host.flush()  # one batch of replies per step
        # After the events: a view's install sets up the transport its pushes go out on.
        self._put_out(ready)

    def _put_out(self, ready: Ready) -> None:
        """Carry out a step's pushes, channel sends and data-plane transfers."""
        transport = self.transport
        for p in ready.pushes:
            transport.push(p.view_id, p.offset, p.data, p.targets)
        for s in ready.sends:
            message = s.message
            if s.attach_state and isinstance(message, Welcome):
                # Every call delivered before this view was handed to the runners (the step's
                # events came first): the ticket's fence is the cut (see .statexfer).
                ticket = self.host.state_ticket(message.view_id, s.to)
                if ticket is None:  # a transfer to this joiner is under way: no second one
                    continue
                message = Welcome(message.view_id, message.members, ticket)
            transport.send(s.to, env.encode(env.CORE, encode_message(message)))
        for t in ready.transfers:
            self.start_transfer(t.key, t.payload, t.targets)
        for v in ready.violations:
            log.warning("member %d: protocol violation: %s", self.member_id, v)

    def _report_delivered(self, run: list[Delivered]) -> None:
        """Hand a run of deliveries to the host, then tell the planes which were mine."""
        self.delivered += len(run)
        self.host.on_delivered(run)
        planes = self.planes
        if planes:
            me = self.member_id
            for event in run:
                if event.sender == me:
                    key = (event.view_id, me, event.msg_no)
                    for plane in planes:
                        plane.on_own_delivered(key)

    # -- bootstrap -----------------------------------------------------------------------------
    def _on_core_message(self, sender: int, raw: object) -> None:
        message = decode_message(raw)
        if self.core is None:
            # The contact before view 0: count the members asking in.
            if isinstance(message, JoinRequest) and message.joiner == sender:
                if sender not in self._bootstrap_joiners and sender != self.member_id:
                    self._bootstrap_joiners.append(sender)
                    self.transport.add_peer(sender, self.config.peers.get(sender))
                if (len(self._bootstrap_joiners) + 1 >= self.config.initial_members
                        and not self.hold_bootstrap):
                    self.form_view(0, self._bootstrap_joiners)
            return
        if isinstance(message, JoinRequest) and message.joiner != sender:
            raise ProtocolViolation(f"join request for {message.joiner} sent by {sender}")
        if isinstance(message, JoinRequest):
            self.transport.add_peer(sender, self.config.peers.get(sender))
            view = self.core.view if self.core.state is MemberState.ACTIVE else None
            if view is not None and sender not in view.members:
                self.addresses.share(view.members, to=(sender,))  # (the leader may be another)
        self.core.receive_message(sender, message)

    def join_through(self, member: int, others: tuple[int, ...] = ()) -> None:
        """The contact, holding its bootstrap, joins a group that runs without it by asking
        ``member``, then each of ``others`` in turn, to admit it (as every other joiner does:
        only the group's leader admits, and ``member`` need not be it)."""
        if self.core is not None or self._closed:
            return
        contacts = tuple(dict.fromkeys(m for m in (member, *others) if m != self.member_id))
        for m in contacts:
            self.transport.add_peer(m, self.config.peers.get(m))
        self.core = Member(self.member_id, self.core_config, contacts=contacts)
        self.kick()

    def form_view(self, view_id: int, others: list[int]) -> None:
        """The contact forms the group's first view ``view_id`` with ``others`` and itself, and
        welcomes them into it (view 0 at bootstrap; a restart's view after total failure, which
        the member that plans it forms: a joiner core not yet admitted gives way to it)."""
        if self.core is not None and self.core.state is not MemberState.JOINING:
            return
        members = tuple(sorted({self.member_id, *others}))
        for m in members:
            if m != self.member_id and m not in self._bootstrap_joiners:
                self.transport.add_peer(m, self.config.peers.get(m))
        view = View(view_id, members)
        self.core = Member(self.member_id, self.core_config, view=view)
        for m in members:
            if m != self.member_id:
                self.transport.send(
                    m, env.encode(env.CORE, encode_message(Welcome(view_id, members, None)))
                )
        self._step()

    # -- introspection -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def state(self) -> MemberState:
        return self.core.state if self.core is not None else MemberState.JOINING
