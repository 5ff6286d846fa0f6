"""Restart after total failure: members that restart with their files re-form the group.

Theory of operation (docs/DESIGN.md §7.13): a member whose ``data_dir`` holds a last view is
*recovering*. Until it is in a view it sends its RECOVER_INFO (that last view, how far each
subgroup's files reach, and how far it acknowledged them durable: its frontier file) to every
member it knows of: the contact, the members of that view and its ``peers`` (a running one
keeps it: :mod:`.rejoin`). One of the recovering members *plans* the restart: the lowest id
among them that is running, which each tells for itself from the infos it hears (a member
heard of and then quiet for a grace, or never heard of within twice that since this one
started, is taken to be down). So the contact (member 0) plans when it runs, and the next
member when it does not (its files are damaged, its host is gone). The planner does not form
view 0: it gathers infos until it has heard from a majority of the latest last view any of
them reports (the *restart rule*: the same majority rule as every view change, so a view that
could have installed after it and persisted anything would have been reported by one of them),
waits a short grace for the rest of that view, and sends a RECOVER_PLAN: the new view's id (the
latest last view's + 1), its members (everyone heard from) and, per subgroup, the member with the
longest durable log (the ragged trim, from disk). It first checks that source against every
member's acknowledged frontier: a restart below it would lose calls ``persisted()`` may have
acknowledged, so it waits for the rest of the last view, and once all of it has reported and
none holds them, it sends RECOVER_ABORT naming the gap and every member stops with
:class:`~derecho_async.errors.DataLost`. Each member whose log is shorter than the source's asks
it for the suffix (SUFFIX_REQ) and gets its records (SUFFIX, in chunks; with the source's
snapshot first when the source's log no longer reaches back that far), replays them into its
actors, logs them durably, then answers RECOVER_READY. With every member ready, the planner
forms the new view; ordered traffic resumes in it. A planned member that goes quiet is dropped
and the plan made again. A member without files joins as before (a fresh joiner, admitted once
the group is formed). A running member that hears a RECOVER_INFO answers RECOVER_LIVE: the group
did not fail, and a recovering member joins it through that member like any joiner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from derecho_async.api.logged_calls import SuffixChunk, version_from_wire, wire_version
from derecho_async.errors import DataLost, GroupClosed, ProtocolViolation
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.api.durable import Durable
    from derecho_async.api.logged_calls import Version
    from derecho_async.runtime.driver import Driver

__all__ = ["Restart"]

log = logging.getLogger("derecho_async.restart")

_INFO_EVERY_S = 0.1  # how often a recovering member repeats its info until it is in a view
_CHUNK_BYTES = 4 << 20  # record bytes in one SUFFIX message (about)


class _Info:
    __slots__ = ("acked", "durable", "last_view", "members")

    def __init__(self, last_view: int, members: tuple[int, ...],
                 durable: dict[str, Version | None], acked: dict[str, Version | None]) -> None:
        self.last_view = last_view
        self.members = members
        self.durable = durable
        self.acked = acked


class Restart:
    """One recovering member's part in the restart (see the module header)."""

    def __init__(self, durable: Durable, driver: Driver, last_view: tuple[int, tuple[int, ...]],
                 grace_s: float, stall_s: float, fail: Callable[[BaseException], None]) -> None:
        self._durable = durable
        self._driver = driver
        self._me = driver.member_id
        self._contact = driver.contact
        self.last_view = last_view
        self._grace_s = grace_s
        self._stall_s = stall_s
        self._fail = fail
        self._timer: asyncio.TimerHandle | None = None
        self.done = False
        # who may plan, in order; when each was last heard from; when this one started
        self._candidates = tuple(sorted({self._me, *self._told()}))
        self._heard: dict[int, float] = {}
        self._started_at = 0.0
        self._held_back = ""  # why the planner waits (logged when it changes)
        # the contact's bookkeeping
        self._infos: dict[int, _Info] = {}
        self._majority_at: float | None = None
        self._plan: tuple[int, tuple[int, ...]] | None = None  # (new view id, members)
        self._plan_epoch = 0
        self._ready: set[int] = set()
        self._plan_at = 0.0
        # every member's: the plan it follows, the suffixes it still waits for
        self._following: int | None = None  # the epoch of the plan being followed
        self._following_planner: int | None = None  # and whose plan it is
        self._waiting: set[str] = set()
        self._sources: dict[str, int] = {}
        self._applying: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._chunks: asyncio.Queue[tuple[str, SuffixChunk]] = asyncio.Queue()

    @property
    def is_contact(self) -> bool:
        """Whether this member is the configured contact (it holds its bootstrap: it never
        forms view 0 of a new group)."""
        return self._me == self._contact

    def planner(self, now: float) -> int:
        """Who plans the restart, as this member sees it: the lowest candidate that runs (see
        the module header)."""
        grace = self._grace_s
        for m in sorted({*self._candidates, *self._heard}):  # (one with another last view too)
            if m == self._me:
                return m
            heard = self._heard.get(m)
            if heard is None:
                if now - self._started_at < 2 * grace:
                    return m  # (perhaps still starting: give it time)
            elif now - heard < grace:
                return m
        return self._me

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Begin: announce this member's files (to itself, when it is the contact)."""
        self._started_at = asyncio.get_running_loop().time()
        for m in self._told():  # (tcp: the members it tells may talk before one is in a view)
            self._admit(m)
        self._tick()

    def _told(self) -> list[int]:
        """Whom this member tells of its files: the contact and every member of its last view,
        and the members its config names (``peers``): the group may run on without all of
        its last view (they left), and then only a newer member can answer."""
        return sorted({self._contact, *self.last_view[1], *self._driver.config.peers}
                      - {self._me})

    def _admit(self, member: int) -> None:
        if member != self._me:
            self._driver.transport.add_peer(member, self._driver.config.peers.get(member))

    def stop(self) -> None:
        """The member is in a view (or out for good): no more restart traffic."""
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._applying is not None:
            self._applying.cancel()

    def check_view(self, view_id: int, founding: bool) -> None:
        """A view is being installed here: a founding view older than the files would put
        versions the log already holds again (the contact started without its files)."""
        if founding and view_id <= self.last_view[0]:
            self._fail(GroupClosed(
                f"member {self._me} restarted with files of view {self.last_view[0]}, but the "
                f"contact formed a new group at view {view_id}: restart the contact with its "
                "data_dir too (a member without files joins a running group, it cannot "
                "restart one)"))
        self.stop()

    def _tick(self) -> None:
        if self.done:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        info = self._info_message()
        self._on_info(self._me, env.decode(info))
        # (every member it knows: a running one answers LIVE, a recovering one learns its
        # files, and whichever plans or admits it knows them)
        for m in self._told():
            self._send(m, info)
        if self.planner(now) == self._me:
            self._step_planner(now)
        elif self._plan is not None:  # a lower member runs after all: it plans
            log.info("member %d: member %d plans the restart now", self._me, self.planner(now))
            self._plan = None
        if not self.done:
            self._timer = loop.call_later(_INFO_EVERY_S, self._tick)

    def _info_message(self) -> bytes:
        acked = self._durable.acked_versions()
        durable = [[name, *wire_version(v), *wire_version(acked.get(name))]
                   for name, v in self._durable.durable_versions().items()]
        view_id, members = self.last_view
        return env.encode(env.RECOVER_INFO, view_id, list(members), durable)

    def _send(self, to: int, payload: bytes) -> None:
        try:
            self._admit(to)
            self._driver.transport.send(to, payload)
        except Exception as exc:  # a peer not up yet: the next tick tries again
            log.debug("member %d: restart message to %d not sent: %r", self._me, to, exc)

    # -- messages ------------------------------------------------------------------------------
    def on_message(self, sender: int, msg: list[Any]) -> None:
        """A restart message from ``sender`` (validated by the envelope)."""
        if self.done:
            return
        kind = msg[0]
        now = asyncio.get_running_loop().time()
        if kind == env.RECOVER_INFO:
            self._on_info(sender, msg)
            self._heard[sender] = now
        elif kind == env.RECOVER_PLAN:
            if sender == self.planner(now):
                self._on_plan(sender, msg)
        elif kind == env.SUFFIX_REQ:
            self._on_suffix_request(sender, msg)
        elif kind == env.SUFFIX:
            self._on_suffix(sender, msg)
        elif kind == env.RECOVER_LIVE:
            self._on_live(sender, msg[1])
        elif (kind == env.RECOVER_READY and self._plan is not None
              and msg[1] == self._plan_epoch):
            self._ready.add(sender)
            if self.planner(now) == self._me:
                self._step_planner(now)
        elif kind == env.RECOVER_ABORT and sender == self.planner(now):
            log.error("member %d: member %d refused to restart the group: %s", self._me,
                      sender, msg[1])
            self.stop()
            self._fail(DataLost(f"member {sender} refused to restart the group: {msg[1]}"))

    def _on_live(self, sender: int, view_id: object) -> None:
        """The group runs (this member restarted alone, or late): join it, as any joiner."""
        if self._plan is not None and self._ready:
            return  # (members follow this member's plan: it forms, or drops them, first)
        self._plan = None
        driver = self._driver
        if driver.core is None:  # (the contact holds its bootstrap: it joins through sender)
            log.info("member %d: the group runs (view %s): joining through member %d",
                     self._me, view_id, sender)
            self.stop()
            driver.join_through(sender, (*self.last_view[1], *driver.config.peers))
        else:  # a joiner already: ask sender too (it, or whom it names, admits)
            driver.core.add_contacts([sender])

    def _on_info(self, sender: int, msg: list[Any]) -> None:
        _, last_view, members, durable = msg
        if len(self._infos) >= 64 and sender not in self._infos:
            raise ProtocolViolation("too many members in the restart", sender)
        self._infos[sender] = _Info(
            last_view, tuple(members),
            {name: version_from_wire(view_id, seq1) for name, view_id, seq1, _, _ in durable},
            {name: version_from_wire(a_view, a_seq1) for name, _, _, a_view, a_seq1 in durable})

    # -- the planner ---------------------------------------------------------------------------
    def _running(self, now: float) -> dict[int, _Info]:
        """The infos of the members heard from within a grace (and this member's own)."""
        return {m: info for m, info in self._infos.items()
                if m == self._me or now - self._heard.get(m, -1e9) < self._grace_s}

    def _step_planner(self, now: float) -> None:
        if self._plan is not None:
            if self._ready >= set(self._plan[1]):
                self._form()
            elif now - self._plan_at > self._stall_s:
                quiet = set(self._plan[1]) - self._ready
                log.warning("member %d: no restart answer from %s: planning without them",
                            self._me, sorted(quiet))
                for m in quiet:
                    self._infos.pop(m, None)
                self._plan = None
            return
        infos = self._running(now)
        latest = max(infos.values(), key=lambda i: i.last_view)
        last_members = set(latest.members)
        heard = last_members & set(infos)
        if 2 * len(heard) <= len(last_members):
            self._majority_at = None
            return
        if self._majority_at is None:
            self._majority_at = now
        if heard != last_members and now - self._majority_at < self._grace_s:
            return
        sources, gap = self._choose_sources(infos)
        if gap:
            if heard != last_members:  # a member not heard from yet may hold them
                self._hold_back(f"{gap}; waiting for members {sorted(last_members - heard)}"
                                f" of view {latest.last_view}, whose files may hold them")
                return
            self._abort(infos, f"{gap}; no member of view {latest.last_view} holds them")
            return
        self._make_plan(latest.last_view + 1, tuple(sorted(infos)), sources)

    def _choose_sources(self, infos: dict[int, _Info]) -> tuple[list[list[Any]], str]:
        """Per subgroup, the member with the longest durable log among ``infos``; and the
        gaps: subgroups whose longest log ends below a frontier some member acknowledged."""
        names = sorted({n for info in infos.values() for n in info.durable})
        sources: list[list[Any]] = []
        gaps = []
        for name in names:
            best, best_v = self._me, infos[self._me].durable.get(name)
            for m in sorted(infos):
                v = infos[m].durable.get(name)
                if v is not None and (best_v is None or v > best_v):
                    best, best_v = m, v
            sources.append([name, best, *wire_version(best_v)])
            acked: list[tuple[Version, int]] = []
            for m, info in infos.items():
                v = info.acked.get(name)
                if v is not None:
                    acked.append((v, m))
            if acked:
                top, by = max(acked)
                if best_v is None or best_v < top:
                    gaps.append(f"{name}: member {by} acknowledged calls up to {top} as durable, "
                                f"but the longest log (member {best}'s) reaches only {best_v}")
        return sources, "; ".join(gaps)

    def _hold_back(self, why: str) -> None:
        if why != self._held_back:
            self._held_back = why
            log.warning("member %d: the restart waits: %s", self._me, why)

    def _abort(self, infos: dict[int, _Info], why: str) -> None:
        """Refuse to restart below an acknowledged frontier: every member stops, saying why."""
        log.error("member %d: refusing to restart the group: %s", self._me, why)
        message = env.encode(env.RECOVER_ABORT, why[:4000])
        for m in infos:
            if m != self._me:
                self._send(m, message)
        self.stop()
        self._fail(DataLost(f"refused to restart the group: {why}"))

    def _make_plan(self, new_view: int, members: tuple[int, ...],
                   sources: list[list[Any]]) -> None:
        self._plan_epoch += 1
        self._plan = (new_view, members)
        self._ready = set()
        self._plan_at = asyncio.get_running_loop().time()
        log.info("member %d: restart plan %d: view %d with %s, sources %s", self._me,
                 self._plan_epoch, new_view, list(members), sources)
        plan = env.encode(env.RECOVER_PLAN, self._plan_epoch, new_view, list(members), sources)
        for m in members:
            if m == self._me:
                self._on_plan(self._me, env.decode(plan))
            else:
                self._send(m, plan)

    def _form(self) -> None:
        assert self._plan is not None
        new_view, members = self._plan
        self.stop()
        log.warning("member %d: restarting the group as view %d with %s", self._me, new_view,
                    list(members))
        self._driver.form_view(new_view, list(members))

    # -- every member --------------------------------------------------------------------------
    def _on_plan(self, planner: int, msg: list[Any]) -> None:
        _, epoch, _new_view, members, sources = msg
        if self._me not in members:
            return
        self._following = epoch
        self._following_planner = planner
        if self._applying is not None:
            self._applying.cancel()
        mine = self._durable.applied_versions()  # (an earlier plan's chunks included)
        self._waiting = set()
        self._sources = {}
        for name, source, view_id, seq1 in sources:
            target = version_from_wire(view_id, seq1)
            have = mine.get(name)
            if source == self._me or target is None or (have is not None and have >= target):
                continue
            self._waiting.add(name)
            self._sources[name] = source
            self._send(source, env.encode(env.SUFFIX_REQ, epoch, name, *wire_version(have)))
        self._chunks = asyncio.Queue()
        self._applying = asyncio.get_running_loop().create_task(self._apply(epoch))

    async def _apply(self, epoch: int) -> None:
        try:
            while self._waiting:
                name, chunk = await self._chunks.get()
                await self._durable.apply_suffix(name, chunk)
                if chunk.last:
                    self._waiting.discard(name)
            await self._durable.sync()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("member %d: applying the restart suffix failed", self._me)
            self._fail(GroupClosed(f"restart failed: {exc!r}"))
            return
        planner = self._following_planner
        if self._following == epoch and planner is not None:
            ready = env.encode(env.RECOVER_READY, epoch)
            if planner == self._me:
                self.on_message(self._me, env.decode(ready))
            else:
                self._send(planner, ready)

    def _on_suffix_request(self, sender: int, msg: list[Any]) -> None:
        _, epoch, name, view_id, seq1 = msg
        since = version_from_wire(view_id, seq1)
        loop = asyncio.get_running_loop()

        async def serve() -> None:
            async for chunk in self._durable.suffix(name, since, _CHUNK_BYTES):
                self._send(sender, env.encode(env.SUFFIX, epoch, name, *chunk.wire()))

        task = loop.create_task(serve())
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    def _on_suffix(self, sender: int, msg: list[Any]) -> None:
        _, epoch, name, snapshot, records, last = msg
        if epoch != self._following or self._sources.get(name) != sender:
            return  # (only the planned source's records, for the plan being followed)
        self._chunks.put_nowait((name, SuffixChunk.from_wire(snapshot, records, last)))
