"""Restart after total failure: members that restart with their files re-form the group.

Theory of operation (docs/DESIGN.md §7.13): a member whose ``data_dir`` holds a last view is
*recovering*. Until it is in a view it sends its RECOVER_INFO (that last view and how far each
subgroup's log is durable) to the contact and the members of that view (a running one keeps it:
:mod:`.rejoin`). The contact, recovering too, does not form view 0:
it gathers infos until it has heard from a majority of the latest last view any of them reports
(the *restart rule*: the same majority rule as every view change, so a view that could have
installed after it and persisted anything would have been reported by one of them), waits a
short grace for the rest of that view, and sends a RECOVER_PLAN: the new view's id (the latest
last view's + 1), its members (everyone heard from) and, per subgroup, the member with the
longest durable log (the ragged trim, from disk). Each member whose log is shorter asks that
source for the suffix (SUFFIX_REQ) and gets its records (SUFFIX, in chunks; with the source's
snapshot first when the source's log no longer reaches back that far), replays them into its
actors, logs them durably, then answers RECOVER_READY. With every member ready, the contact
forms the new view; ordered traffic resumes in it. A planned member that goes quiet is dropped
and the plan made again. A member without files joins as before (a fresh joiner, admitted once
the group is formed). A running member that hears a RECOVER_INFO answers RECOVER_LIVE: the group
did not fail, and a recovering contact joins it through that member like any joiner.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from derecho_async.api.logged_calls import SuffixChunk, version_from_wire, wire_version
from derecho_async.errors import GroupClosed, ProtocolViolation
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
    __slots__ = ("durable", "last_view", "members")

    def __init__(self, last_view: int, members: tuple[int, ...],
                 durable: dict[str, Version | None]) -> None:
        self.last_view = last_view
        self.members = members
        self.durable = durable


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
        # the contact's bookkeeping
        self._infos: dict[int, _Info] = {}
        self._majority_at: float | None = None
        self._plan: tuple[int, tuple[int, ...]] | None = None  # (new view id, members)
        self._plan_epoch = 0
        self._ready: set[int] = set()
        self._plan_at = 0.0
        # every member's: the plan it follows, the suffixes it still waits for
        self._following: int | None = None  # the epoch of the plan being followed
        self._waiting: set[str] = set()
        self._sources: dict[str, int] = {}
        self._applying: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._chunks: asyncio.Queue[tuple[str, SuffixChunk]] = asyncio.Queue()

    @property
    def is_contact(self) -> bool:
        return self._me == self._contact

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Begin: announce this member's files (to itself, when it is the contact)."""
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
        info = self._info_message()
        if self.is_contact:
            self._on_info(self._me, env.decode(info))
            self._step_contact(loop.time())
            if self._plan is None:  # a member of the group still running would answer LIVE
                for m in self._told():
                    self._send(m, info)
        else:  # (every member of the last view: whichever admits me, it knows my files)
            for m in self._told():
                self._send(m, info)
        self._timer = loop.call_later(_INFO_EVERY_S, self._tick)

    def _info_message(self) -> bytes:
        durable = [[name, *wire_version(v)] for name, v in self._durable.durable_versions().items()]
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
        if kind == env.RECOVER_INFO:
            if self.is_contact:
                self._on_info(sender, msg)
        elif kind == env.RECOVER_PLAN:
            if sender == self._contact:
                self._on_plan(msg)
        elif kind == env.SUFFIX_REQ:
            self._on_suffix_request(sender, msg)
        elif kind == env.SUFFIX:
            self._on_suffix(sender, msg)
        elif kind == env.RECOVER_LIVE and self.is_contact and self._plan is None:
            # the group runs without me (I restarted alone): join it, as any member would
            log.info("member %d: the group runs (view %d): joining through member %d",
                     self._me, msg[1], sender)
            self.stop()
            self._driver.join_through(sender, (*self.last_view[1], *self._driver.config.peers))
        elif (kind == env.RECOVER_READY and self.is_contact and self._plan is not None
              and msg[1] == self._plan_epoch):
            self._ready.add(sender)
            self._step_contact(asyncio.get_running_loop().time())

    def _on_info(self, sender: int, msg: list[Any]) -> None:
        _, last_view, members, durable = msg
        if len(self._infos) >= 64 and sender not in self._infos:
            raise ProtocolViolation("too many members in the restart", sender)
        self._infos[sender] = _Info(
            last_view, tuple(members),
            {name: version_from_wire(view_id, seq1) for name, view_id, seq1 in durable})

    # -- the contact ---------------------------------------------------------------------------
    def _step_contact(self, now: float) -> None:
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
        latest = max(self._infos.values(), key=lambda i: i.last_view)
        last_members = set(latest.members)
        heard = last_members & set(self._infos)
        if 2 * len(heard) <= len(last_members):
            self._majority_at = None
            return
        if self._majority_at is None:
            self._majority_at = now
        if heard != last_members and now - self._majority_at < self._grace_s:
            return
        self._make_plan(latest.last_view + 1)

    def _make_plan(self, new_view: int) -> None:
        members = tuple(sorted(self._infos))
        names = sorted({n for info in self._infos.values() for n in info.durable})
        sources = []
        for name in names:
            best, best_v = self._me, self._infos[self._me].durable.get(name)
            for m in members:
                v = self._infos[m].durable.get(name)
                if v is not None and (best_v is None or v > best_v):
                    best, best_v = m, v
            sources.append([name, best, *wire_version(best_v)])
        self._plan_epoch += 1
        self._plan = (new_view, members)
        self._ready = set()
        self._plan_at = asyncio.get_running_loop().time()
        log.info("member %d: restart plan %d: view %d with %s, sources %s", self._me,
                 self._plan_epoch, new_view, list(members), sources)
        plan = env.encode(env.RECOVER_PLAN, self._plan_epoch, new_view, list(members), sources)
        for m in members:
            if m == self._me:
                self._on_plan(env.decode(plan))
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
    def _on_plan(self, msg: list[Any]) -> None:
        _, epoch, _new_view, members, sources = msg
        if self._me not in members:
            return
        self._following = epoch
        if self._applying is not None:
            self._applying.cancel()
        mine = self._durable.durable_versions()
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
        if self._following == epoch:
            ready = env.encode(env.RECOVER_READY, epoch)
            if self.is_contact:
                self.on_message(self._me, env.decode(ready))
            else:
                self._send(self._contact, ready)

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
