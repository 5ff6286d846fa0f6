# Theory of operation
# -------------------
# ``run_actor_schedule(seed)`` runs real Groups (driver, runners, state transfer) of 2-5 members
# on a seeded SimNetwork in virtual time (vloop.run_virtual) and drives them with one actor,
# ``SimLog``, from one ``random.Random(seed)``: one-way and replied ordered calls from random
# members, p2p reads, joins, leaves, crashes (also right after a burst of calls, so pushes are in
# flight and handlers are awaiting), partitions healed later, and slow links. Every choice a
# handler makes (how long it sleeps, whether it raises and what) comes from the call's own
# arguments, so every replica does the same thing; nothing else draws random numbers, so the
# same seed replays the same run bit for bit.
#
# Two sources of truth are recorded for the checker (actorcheck.py):
# * what each member's Group reported through a GroupObserver (deliveries in order, views,
#   snapshots taken at the cut and restored, handler outcomes where the group reports them);
# * what each member's SimLog replica itself did: its restore, and the start and end of every
#   handler with its outcome and the replica's state after it;
# plus what every caller got back (Replies, one-way versions, p2p results, exceptions) and what
# became of every member (live, left, crashed, closed with which error, never admitted).
#
# The end of a schedule heals every fault, waits (in virtual time) for every call to finish,
# and then makes one replied "barrier" call from a live member, so that every survivor has run
# everything delivered before it; then the groups are left where they are and the loop ends.
#
# Durable schedules (about half; knob ``durable``) give every member a data_dir on its own
# SimDisk and small snapshot intervals, and record every one-way call that ``persisted()``
# acknowledged. Their end is a total failure: every member crashes and so does every disk
# (unsynced writes lost or torn); then every member that ever started restarts from what its
# disk kept, on a fresh network, and a barrier call runs in the re-formed group. Each restarted
# replica's log is recorded for the checker's check (h). In about a third of them (knob
# ``late_contact_s``) the lowest member restarts that late, as a contact whose disk or host is
# slow to come back: the others restart without it when they are a majority of the last view (the
# lowest running member plans the restart), and it then joins the running group. Before that, once the end's barrier
# call succeeded, every crashed member restarts from its disk (crashed too) while the group
# runs, and a second barrier shows whether each caught up (check (i)). Member 0's application
# subscribes to the actor's deliveries and to its views from its first view on (check (j)).
#
# Stalling schedules (about half; knob ``stalls``) also stall a member now and then, its beacon
# (knob ``beacons``) still reaching its peers, as when a handler holds its event loop (stalls.py;
# check (l)).
"""Seeded schedules of real Groups hosting a test actor, for the actor-level checker."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from derecho_async.api import Group
from derecho_async.config import Config
from derecho_async.core import Delivered, ViewInstalled
from derecho_async.errors import GroupClosed, PartitionedError, SubscriptionDropped
from derecho_async.logsetup import logger_level
from derecho_async.runtime.observer import GroupObserver
from derecho_async.testing.outcomes import CallOutcome, P2POutcome
from derecho_async.testing.simclients import SimClients
from derecho_async.testing.simdisk import SimDisk
from derecho_async.testing.simlog import (
    CANCEL_AFTER,
    OK,
    RAISE_AFTER,
    RAISE_BEFORE,
    STOP_AFTER,
    SURROGATE_AFTER,
    WEIRD_AFTER,
    SimLog,
    SimLogStop,
    numpy_available,
    outcome_text,
)
from derecho_async.testing.simnet import SimNetwork, TraceEvent, crash_group
from derecho_async.testing.stalls import Stalls
from derecho_async.testing.vloop import run_virtual

__all__ = [
    "ActorRun",
    "CallOutcome",
    "P2POutcome",
    "RecordingObserver",
    "SimLog",
    "SimLogStop",
    "run_actor_schedule",
]

# -- what a run records ------------------------------------------------------------------------


class RecordingObserver(GroupObserver):
    """A GroupObserver that keeps everything every member's Group told it, per member."""

    def __init__(self) -> None:
        self.deliveries: dict[int, list[Delivered]] = {}
        self.views: dict[int, list[ViewInstalled]] = {}
        self.snapshots: list[tuple[int, int, int, dict[str, object]]] = []
        self.restores: list[tuple[int, int, dict[str, object]]] = []
        self.finished: dict[int, list[tuple[str, tuple[int, int], bool, object]]] = {}

    def delivered(self, member: int, events: Sequence[Delivered]) -> None:
        self.deliveries.setdefault(member, []).extend(events)

    def view_installed(self, member: int, event: ViewInstalled) -> None:
        self.views.setdefault(member, []).append(event)

    def snapshot_taken(self, member: int, view_id: int, joiner: int,
                       state: Mapping[str, object]) -> None:
        self.snapshots.append((member, view_id, joiner, dict(state)))

    def restored(self, member: int, view_id: int, state: Mapping[str, object]) -> None:
        self.restores.append((member, view_id, dict(state)))

    def handler_finished(self, member: int, subgroup: str, version: tuple[int, int],
                         ok: bool, value: object) -> None:
        self.finished.setdefault(member, []).append((subgroup, version, ok, value))


@dataclass
class ActorRun:
    """Everything a schedule did and saw (what :func:`check_actor_run` checks)."""

    seed: int
    knobs: dict[str, Any]
    observer: RecordingObserver
    records: dict[int, list[tuple[object, ...]]]
    calls: list[CallOutcome]
    reads: list[P2POutcome]
    fates: dict[int, str]  # member -> "live", "left", "crashed", "closed: ..." or "not admitted"
    final_views: dict[int, tuple[int, tuple[int, ...]]]
    log: list[str]
    counts: dict[str, int]
    trace: list[TraceEvent]
    virtual_s: float = 0.0
    wall_s: float = 0.0
    #: each survivor's log at the end
    final_logs: dict[int, list[int]] = field(default_factory=dict)
    #: what reached the event loop's exception handler (nothing a handler raises should)
    loop_errors: list[str] = field(default_factory=list)
    #: durable schedules: the one-way calls (cids) whose persisted() resolved, in order
    persisted: list[int] = field(default_factory=list)
    #: durable schedules: each member's log after the restart from its disk, and the restart
    #: barrier's cid (None: no restarted member got in)
    restarted_logs: dict[int, list[int]] = field(default_factory=dict)
    restart_barrier: int | None = None
    #: durable schedules: each restarted member's logged (version, time) pairs (history())
    restarted_times: dict[int, list[tuple[tuple[int, int], float]]] = field(default_factory=dict)
    #: durable schedules: each crashed member restarted from its disk while the group ran, with
    #: its log after a barrier call (or why it got no log), and the caller's log after it
    rejoins: dict[int, list[int] | str] = field(default_factory=dict)
    rejoin_log: list[int] = field(default_factory=list)
    #: member 0's subscription to SimLog (versions it yielded, and why it ended if dropped) and
    #: its views() iteration (view ids), from its first view on
    subscribed: list[tuple[int, int]] = field(default_factory=list)
    #: stalling schedules: for each stall no other fault touched, (member, virtual time it
    #: ended, the live members whose view did not hold it then, itself if it was removed)
    stalls: list[tuple[int, float, list[int]]] = field(default_factory=list)
    subscription_end: str | None = None
    views_seen: list[int] = field(default_factory=list)

    @property
    def survivors(self) -> list[int]:
        return sorted(m for m, fate in self.fates.items() if fate == "live")

    def digest(self) -> str:
        """A hash of everything observed (for replay checks: same seed, same digest)."""
        h = hashlib.sha256()
        for part in (
            sorted(self.records.items()),
            [(c.caller, c.cid, c.kind, c.ok, _plain(c.value), c.at) for c in self.calls],
            [(r.caller, r.target, r.ok, _plain(r.value), r.version) for r in self.reads],
            sorted(self.fates.items()),
            sorted(self.final_views.items()),
            sorted((m, [(e.view_id, e.seq, e.sender, e.msg_no) for e in evs])
                   for m, evs in self.observer.deliveries.items()),
            sorted((m, [(e.view.view_id, e.view.members, e.joined, e.departed) for e in evs])
                   for m, evs in self.observer.views.items()),
            sorted(self.counts.items()),
            self.trace,
            self.log,
            sorted(self.final_logs.items()),
            self.loop_errors,
            self.persisted,
            sorted(self.restarted_logs.items()),
            sorted(self.rejoins.items()),
            self.subscribed,
            self.views_seen,
            self.stalls,
            self.virtual_s,
        ):
            h.update(repr(part).encode())
        return h.hexdigest()


def _plain(value: object) -> object:
    """A comparable, repr-stable form of an outcome (exceptions as type name and text)."""
    if isinstance(value, BaseException):
        return outcome_text(value)
    if isinstance(value, Mapping):
        return sorted((k, _plain(v)) for k, v in value.items())
    return value


# -- the schedule ------------------------------------------------------------------------------

HEARTBEAT_MS = 20.0
SUSPECT_MS = 200.0
BEACON_HOLD_S = 30.0  # the simulated max_loop_hold_ms: longer than any stall
GROUP = "actorsim"


DATA_DIR = "/sim"
_EPOCH_NS = 1_800_000_000 * 10**9  # the simulated wall clock's zero


def _virtual_clock() -> int:
    """The wall clock of a simulated member: the virtual loop's, from a fixed epoch (so durable
    calls' stamps, and with them the bytes pushed, replay bit for bit)."""
    return _EPOCH_NS + int(asyncio.get_running_loop().time() * 1e9)


def _config(member: int, n: int, ids: int, knobs: Mapping[str, Any]) -> Config:
    return Config(
        data_dir=DATA_DIR if knobs["durable"] else None,
        snapshot_every=int(knobs["snapshot_every"]),
        group=GROUP,
        member_id=member,
        initial_members=n,
        transport="sim",  # names the kind only: the SimNetwork endpoint is passed in
        peers={m: f"sim{m}:1" for m in range(ids)},  # joiners may ask any of these to admit them
        heartbeat_ms=HEARTBEAT_MS,
        suspect_after_ms=SUSPECT_MS,
        send_batch=0,  # its default depends on os.cpu_count(): fixed, so runs replay anywhere
        window=knobs["window"],
        max_queued_calls=knobs["max_queued_calls"],
        state_chunk_kb=4,
        state_stall_s=5.0,
        fence_timeout_s=5.0,
        log_level=knobs["log_level"],
    )


def run_actor_schedule(seed: int, **knobs: Any) -> ActorRun:
    """Run actor schedule ``seed`` (see the module header) and return what it recorded.

    Knobs (all optional): ``steps`` (driver actions, default drawn 20-60), ``members`` (2-5,
    default drawn), ``trace`` (keep the network's trace, default False), ``faults`` (default
    True), ``max_virtual_s`` (60), ``log_level`` of the groups (CRITICAL), ``skew_member`` (a
    member whose replica hashes some calls wrongly: a divergence the checker must catch), and
    any drawn knob (``window``, ``max_queued_calls``, ``p_slow``, ``p_raise``, ``durable``,
    ``snapshot_every``, ``clients``, ``stalls``, ``beacons``...). Nothing is checked here: see
    :func:`derecho_async.testing.actorcheck.check_actor_run`.
    """
    rng = random.Random(seed)
    disk_rng = random.Random(f"durable-{seed}")  # (the schedules without disks stay as they were)
    client_rng = random.Random(f"clients-{seed}")  # (and those without clients)
    stall_rng = random.Random(f"stalls-{seed}")  # (and those without stalls)
    late_rng = random.Random(f"late-{seed}")  # (and those whose contact restarts in time)
    drawn: dict[str, Any] = {
        "members": rng.randint(2, 5),
        "steps": rng.randint(20, 60),
        "window": rng.choice([2, 4, 16, 64]),
        "max_queued_calls": rng.choice([2, 8, 64]),
        "max_delay_s": rng.choice([0.0005, 0.002, 0.006]),
        "split_probability": rng.choice([0.0, 0.3]),
        "with_array": numpy_available() and rng.random() < 0.5,
        "p_slow": rng.choice([0.2, 0.5, 0.8]),
        "p_raise": rng.choice([0.0, 0.1, 0.3]),
        "faults": True,
        "trace": False,
        "max_virtual_s": 60.0,
        "log_level": "CRITICAL",
        "skew_member": None,
        "durable": disk_rng.random() < 0.5,
        "snapshot_every": disk_rng.choice([3, 10, 10000]),
        "disk_seed": disk_rng.randrange(1 << 30),
        "clients": client_rng.random() < 0.5,
        "stalls": stall_rng.random() < 0.5,
        "beacons": True,
        "stall_seed": stall_rng.randrange(1 << 30),
        "late_contact_s": (late_rng.uniform(1.5, 6.0) * SUSPECT_MS / 1000
                           if late_rng.random() < 1 / 3 else 0.0),
    }
    for k in knobs:
        if k not in drawn:
            raise TypeError(f"run_actor_schedule: unknown knob {k!r}")
    drawn.update(knobs)
    run = ActorRun(seed, drawn, RecordingObserver(), {}, [], [], {}, {}, [], {}, [])
    wall = time.perf_counter()
    with logger_level(str(drawn["log_level"])):
        run_virtual(lambda: _schedule(rng, run), max_virtual_s=float(drawn["max_virtual_s"]))
    run.wall_s = time.perf_counter() - wall
    return run


async def _schedule(rng: random.Random, run: ActorRun) -> None:
    knobs = run.knobs
    loop = asyncio.get_running_loop()
    n = int(knobs["members"])
    ids = n + 8  # joiners take the next ids
    stalls = bool(knobs["stalls"])
    net = SimNetwork(
        rng,
        max_delay_s=float(knobs["max_delay_s"]),
        split_probability=float(knobs["split_probability"]),
        trace=bool(knobs["trace"]),
        # (no beacon unless stalls: the other schedules replay as they did)
        beacon_hold_s=BEACON_HOLD_S if stalls and knobs["beacons"] else None,
    )
    stall_rng = random.Random(int(knobs["stall_seed"]))
    # which exception a RAISE_AFTER call raises: a stream of its own, so that the main stream's
    # draws (and with them every schedule's calls, faults and timing) stay as they were
    raise_rng = random.Random(f"raise-{run.seed}")
    obs = run.observer

    def on_loop_error(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        what = "{}: {}".format(*outcome_text(exc)) if exc is not None else ""
        run.loop_errors.append(f"{loop.time():.4f} {context.get('message')} {what}".strip())

    loop.set_exception_handler(on_loop_error)
    groups: dict[int, Group] = {}
    live: set[int] = set()
    tasks: list[asyncio.Future[Any]] = []
    next_id = n
    next_cid = 1

    def say(text: str) -> None:
        run.log.append(f"{loop.time():9.4f} {text}")

    durable = bool(knobs["durable"])
    disks: dict[int, SimDisk] = {}
    persist_tasks: list[asyncio.Future[Any]] = []

    def make(member: int) -> Group:
        fs = None
        if durable:
            fs = disks.setdefault(member, SimDisk(int(knobs["disk_seed"]) + member))
        g = Group(_config(member, n, ids, knobs), [SimLog], transport=net.transport(member),
                  observer=obs, fs=fs, clock=_virtual_clock)
        actor = g.local(SimLog)
        actor.bind(member, run.records.setdefault(member, []), bool(knobs["with_array"]),
                   skew=member == knobs["skew_member"])
        groups[member] = g
        return g

    async def start(member: int) -> None:
        g = make(member)
        try:
            await g.start(timeout=5.0)
        except (GroupClosed, PartitionedError) as exc:
            run.fates[member] = f"not admitted: {exc}"
            say(f"member {member} not admitted: {exc}")
            return
        run.fates[member] = "live"
        live.add(member)
        say(f"member {member} in view {g.view.view_id} {list(g.view.members)}")

    await asyncio.gather(*(start(m) for m in range(n)))
    watchers = _watch(run, groups[0]) if 0 in live else []

    def closed(member: int) -> bool:
        return groups[member].closed.done()

    def refresh() -> None:
        """Members whose group closed on its own (wedged, removed) are no longer live."""
        for m in sorted(live):
            fut = groups[m].closed
            exc = fut.exception() if fut.done() else None
            if exc is not None:
                live.discard(m)
                run.fates[m] = f"closed: {type(exc).__name__}: {exc}"
                say(f"member {m} closed: {type(exc).__name__}: {exc}")

    def settled() -> bool:
        """No view change under way: every live member's view is the set of live members."""
        members = tuple(sorted(live))
        return all(groups[m].view.members == members for m in live)

    def draw_call(caller: int) -> None:
        nonlocal next_cid
        cid = next_cid
        next_cid += 1
        mode = OK
        if rng.random() < float(knobs["p_raise"]):
            mode = rng.choice([RAISE_BEFORE, RAISE_AFTER, STOP_AFTER, CANCEL_AFTER])
            if mode == RAISE_AFTER:  # a third each: ValueError, unprintable, lone surrogate
                mode = raise_rng.choice([RAISE_AFTER, WEIRD_AFTER, SURROGATE_AFTER])
        handle = groups[caller].subgroup(SimLog)
        kind = "cast" if rng.random() < 0.6 else "call"
        args: tuple[object, ...]
        if rng.random() < float(knobs["p_slow"]):
            before = rng.choice([0.0, 0.0005, 0.003, 0.02])
            between = rng.choice([0.0, 0.001, 0.004])
            method, args = "slow", (cid, mode, before, between)
        else:
            method, args = "add", (cid, mode)
        out = CallOutcome(caller, cid, kind, method, mode)
        run.calls.append(out)
        fn = getattr(handle, method)
        try:
            aw = fn.cast(*args) if kind == "cast" else fn(*args)
        except BaseException as exc:  # a closed group raises at once
            out.ok, out.value, out.at = False, exc, loop.time()
            return

        async def wait() -> None:
            try:
                value = await aw
            except BaseException as exc:
                out.ok, out.value = False, exc
            else:
                out.ok, out.value = True, value
                if durable and kind == "cast":
                    persist_tasks.append(asyncio.ensure_future(persisted(value)))
            out.at = loop.time()

        async def persisted(version: Any) -> None:
            try:
                await handle.persisted(version)
            except (GroupClosed, PartitionedError):
                return
            run.persisted.append(cid)

        tasks.append(asyncio.ensure_future(wait()))

    clients = SimClients(run.seed, float(knobs["p_raise"]))

    def draw_client_call() -> None:
        """An external client's call (testing/simclients.py): the members must run it once."""
        nonlocal next_cid
        call = clients.draw(next_cid)
        next_cid += 1
        out = CallOutcome(-1 - call.who, call.cid, call.kind, "add", call.mode)
        run.calls.append(out)

        async def send() -> None:
            out.ok, out.value = await clients.send(call, groups, live)
            out.at = loop.time()

        tasks.append(asyncio.ensure_future(send()))

    def draw_read(caller: int) -> None:
        members = groups[caller].view.members
        target = rng.choice(members)
        out = P2POutcome(caller, target)
        run.reads.append(out)
        fn = groups[caller].subgroup(SimLog).read.at(target)
        versioned = hasattr(fn, "versioned") and rng.random() < 0.5
        out.versioned = versioned

        async def read() -> None:
            try:
                got = await (fn.versioned() if versioned else fn())
            except BaseException as exc:
                out.ok, out.value = False, exc
                return
            out.ok = True
            if versioned:
                value, version = (got.value, got.version) if hasattr(got, "value") else got
                out.value, out.version = value, tuple(version)
            else:
                out.value = got

        tasks.append(asyncio.ensure_future(read()))

    async def leave(member: int) -> None:
        try:
            await groups[member].leave()
        finally:
            say(f"member {member} left")

    partitioned_until: float | None = None
    slow_links: list[tuple[int, int]] = []
    stalled = Stalls(net, stall_rng, stalls, SUSPECT_MS / 1000, say, run.stalls)

    def view_of(member: int) -> tuple[int, ...]:
        return groups[member].view.members

    steps = int(knobs["steps"])
    p_fault = 0.12 if knobs["faults"] else 0.0
    for _ in range(steps):
        await asyncio.sleep(rng.choice([0.0, 0.0005, 0.002, 0.005, 0.01, 0.03]))
        refresh()
        if partitioned_until is not None and loop.time() >= partitioned_until:
            net.heal()
            partitioned_until = None
            say("heal")
        stalled.step(loop.time(), live, partitioned_until is not None, view_of, refresh)
        if not live:
            break
        r = rng.random()
        if r < p_fault:
            kind = rng.choice(["join", "join", "leave", "crash", "crash_burst", "partition",
                               "slow_link"])
            alive = sorted(live)
            calm = partitioned_until is None and settled()  # no partition, no view change
            if kind == "join" and next_id < ids:
                member = next_id
                next_id += 1
                say(f"join {member}")
                tasks.append(asyncio.ensure_future(start(member)))
            elif kind == "leave" and len(alive) >= 2 and calm:
                member = rng.choice(alive)
                live.discard(member)
                run.fates[member] = "left"
                # (anyone's leave: it waits a while for the stalled member, then goes anyway,
                # and in a small group the stalled one is left a minority)
                stalled.touch()
                say(f"leave {member}")
                tasks.append(asyncio.ensure_future(leave(member)))
            elif kind in ("crash", "crash_burst") and len(alive) >= 3 and calm:
                member = rng.choice(alive)
                if kind == "crash_burst":  # calls mid-push and handlers awaiting
                    for _ in range(rng.randint(1, 6)):
                        draw_call(member)
                    await asyncio.sleep(rng.choice([0.0, 0.0002, 0.001]))
                live.discard(member)
                run.fates[member] = "crashed"
                stalled.touch(member)
                say(f"crash {member}")
                crash_group(net, groups[member])
            elif kind == "partition" and len(alive) >= 3 and calm:
                rng.shuffle(alive)
                cut = rng.randint(1, (len(alive) - 1) // 2)
                minority, majority = sorted(alive[:cut]), sorted(alive[cut:])
                net.partition(majority, minority)
                stalled.touch()
                partitioned_until = loop.time() + rng.choice([0.01, 0.05, 0.5])
                say(f"partition {majority} | {minority}")
            elif kind == "slow_link" and len(alive) >= 2:
                a, b = rng.sample(alive, 2)
                net.set_link(a, b, extra_delay_s=rng.choice([0.005, 0.03]),
                             jitter_s=rng.choice([0.0, 0.005]))
                slow_links.append((a, b))
                say(f"slow link {a}->{b}")
        elif r < 0.75:
            for _ in range(rng.choice([1, 1, 2, 4])):
                draw_call(rng.choice(sorted(live)))
        else:
            draw_read(rng.choice(sorted(live)))
        if knobs["clients"] and live:
            for _ in range(clients.burst()):
                draw_client_call()

    # the end: heal everything, let every call finish, then a barrier call from a live member
    stalled.end(loop.time(), live, view_of, refresh)
    if partitioned_until is not None:
        net.heal()
        say("heal")
    for a, b in slow_links:
        net.set_link(a, b)
    if tasks:
        await asyncio.wait(tasks, timeout=10.0)
    refresh()
    for _ in range(3):
        if not live:
            break
        for _ in range(500):  # 5 s at most
            if settled():
                break
            await asyncio.sleep(0.01)
            refresh()
        caller = min(live)
        out = CallOutcome(caller, next_cid, "barrier", "add", OK)
        next_cid += 1
        run.calls.append(out)
        try:
            out.value = await asyncio.wait_for(
                groups[caller].subgroup(SimLog).add(out.cid, OK), 10.0)
            out.ok = True
        except (GroupClosed, PartitionedError) as exc:
            out.ok, out.value = False, exc
        out.at = loop.time()
        refresh()
        if out.ok:
            break
    # every member not crashed (those that left too) finishes the handlers it has begun or
    # queued: their outcomes are the calls' own, not cancellations at the end of the run
    for _ in range(2000):
        if all(g.queued_calls == 0 and g.local(SimLog).running == 0
               for m, g in groups.items() if run.fates.get(m) != "crashed"):
            break
        await asyncio.sleep(0.01)
    rejoined: list[Group] = []
    if durable and live and any(c.kind == "barrier" and c.ok for c in run.calls):
        rejoined = await _rejoin_crashed(run, net, disks, groups[min(live)], n, ids, next_cid)
        next_cid += 1
    for m, g in sorted(groups.items()):
        if g.history:
            run.final_views[m] = (g.view.view_id, g.view.members)
    for m in sorted(live):
        actor = groups[m].local(SimLog)
        run.final_logs[m] = list(actor.log)
    if durable and persist_tasks:
        await asyncio.wait(persist_tasks, timeout=5.0)
    for g in [*(groups[m] for m in sorted(live)), *rejoined]:
        crash_group(net, g)  # stop them without a view change (the run is over)
    if watchers:  # (they end with member 0's group, which is out now)
        await asyncio.wait(watchers, timeout=5.0)
    if durable:
        await _total_failure(rng, run, net, disks, n, ids, next_cid, say)
    run.counts = dict(net.counts)
    run.trace = list(net.trace)
    run.virtual_s = loop.time()


def _watch(run: ActorRun, group: Group) -> list[asyncio.Future[None]]:
    """Member 0's application subscribes to SimLog's deliveries and to its views from its first
    view on; what they yield goes into ``run`` (check (j))."""
    deliveries = group.subscribe(SimLog)
    views = group.views()

    async def take_deliveries() -> None:
        try:
            async for entry in deliveries:
                run.subscribed.append(entry.version)
        except SubscriptionDropped as exc:
            run.subscription_end = repr(exc)

    async def take_views() -> None:
        async for view in views:
            run.views_seen.append(view.view_id)

    return [asyncio.ensure_future(take_deliveries()), asyncio.ensure_future(take_views())]


async def _rejoin_crashed(run: ActorRun, net: SimNetwork, disks: dict[int, SimDisk],
                          caller: Group, n: int, ids: int, cid: int) -> list[Group]:
    """Each crashed member's disk crashes too; the member restarts from what it kept while the
    group runs (a log suffix or a snapshot brings it up to date), then ``caller`` makes a
    barrier call ``cid``. Records each one's log once it ran the barrier (check (i))."""
    back: list[Group] = []
    for m in sorted(m for m, fate in run.fates.items() if fate == "crashed" and m in disks):
        disks[m].crash()
        g = Group(_config(m, n, ids, run.knobs), [SimLog], transport=net.transport(m),
                  fs=disks[m], clock=_virtual_clock)
        actor = g.local(SimLog)
        actor.bind(m, [], bool(run.knobs["with_array"]))
        try:
            await g.start(timeout=5.0)
        except (GroupClosed, PartitionedError) as exc:
            run.rejoins[m] = f"not admitted: {exc}"
            continue
        back.append(g)
    if not back:
        return back
    try:
        await asyncio.wait_for(caller.subgroup(SimLog).add(cid, OK), 10.0)
    except (GroupClosed, PartitionedError, TimeoutError) as exc:
        for g in back:
            run.rejoins[g.member_id] = f"rejoined, but the barrier failed: {exc!r}"
        return back
    lead = caller.local(SimLog)
    run.rejoin_log = list(lead.log)
    for g in back:
        actor = g.local(SimLog)
        for _ in range(500):
            if cid in actor.log or g.closed.done():
                break
            await asyncio.sleep(0.01)
        run.rejoins[g.member_id] = list(actor.log)
    return back


async def _total_failure(rng: random.Random, run: ActorRun, old: SimNetwork,
                         disks: dict[int, SimDisk], n: int, ids: int, cid: int,
                         say: Any) -> None:
    """Every disk crashes (every member already has); then every member that ever started
    restarts from its disk on a fresh network, and one barrier call runs (see the header)."""
    for m in sorted(disks):
        disks[m].crash()
    say("total failure: every member and every disk crashed")
    net = SimNetwork(rng, max_delay_s=0.001)
    groups: dict[int, Group] = {}
    for m in sorted(disks):
        g = Group(_config(m, n, ids, run.knobs), [SimLog], transport=net.transport(m),
                  fs=disks[m], clock=_virtual_clock)
        actor = g.local(SimLog)
        actor.bind(m, [], bool(run.knobs["with_array"]))
        groups[m] = g

    late = float(run.knobs["late_contact_s"])

    async def start(m: int) -> bool:
        if late and m == min(groups):
            say(f"restart: member {m} restarts {late:.2f} s late")
            await asyncio.sleep(late)
        try:
            await groups[m].start(timeout=10.0)
        except (GroupClosed, PartitionedError) as exc:
            say(f"restart: member {m} not back: {exc}")
            return False
        return True

    back = [m for m, ok in zip(sorted(groups), await asyncio.gather(
        *(start(m) for m in sorted(groups))), strict=True) if ok]
    say(f"restart: members {back} back")
    if back:
        for _ in range(500):  # every restarted member in one view
            views = {groups[m].view.members for m in back if not groups[m].closed.done()}
            if len(views) == 1 and set(next(iter(views))) == {
                    m for m in back if not groups[m].closed.done()}:
                break
            await asyncio.sleep(0.01)
        caller = min(m for m in back if not groups[m].closed.done())
        try:
            await asyncio.wait_for(groups[caller].subgroup(SimLog).add(cid, OK), 10.0)
            run.restart_barrier = cid
        except (GroupClosed, PartitionedError, TimeoutError) as exc:
            say(f"restart: barrier failed: {exc!r}")
        for m in back:
            if not groups[m].closed.done():
                actor = groups[m].local(SimLog)
                run.restarted_logs[m] = list(actor.log)
                run.restarted_times[m] = [(e.version, e.time) async for e in
                                          groups[m].subgroup(SimLog).history()]
    for g in groups.values():
        if g._driver is not None and not g._driver.closed:
            crash_group(net, g)
    old.counts.update({f"restart {k}": v for k, v in net.counts.items()})
