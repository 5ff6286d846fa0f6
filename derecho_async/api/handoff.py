"""A sharded actor's state moves to the members that gain its shards at a view change.

Theory of operation (docs/DESIGN.md §7.17): at every view a member computes each sharded
actor's assignment (the core's, from the layout policy) and compares it with the previous
view's. For each shard that gains members, the lowest-ranked member of the new view that hosted
it before is its source: at the cut (a hold on the actor's runner: every call delivered before
the view has finished, none after has started) it takes the snapshot, with the shard's table of
clients' calls, and sends it in chunks (HANDOFF) to each gainer. A gainer holds its runner from
the view on and restores the state when the last chunk is in; the calls of its new shard wait
behind the hold. A member that loses its shard drops the state at the cut; one that moves both
sends the old shard's (if it is the source) and receives the new one's. A shard none of whose
hosts survived starts empty (logged as an error): the leader tells joiners so (HANDOFF_EMPTY),
members that were in the view see it themselves. At a group's first view every founder holds
its shard's (empty) state. A gain whose source departs before its state is in, or that waits
longer than ``state_stall_s``, makes the member leave the group (nobody else does).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from derecho_async.api.once import ClientCalls, restore_bytes, state_bytes
from derecho_async.api.sharding import Sharded, shard_of
from derecho_async.errors import ProtocolViolation
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.api.delivery import Hosted
    from derecho_async.core import ShardAssignment, View

__all__ = ["Handoffs"]

log = logging.getLogger("derecho_async.shards")

_MAX_CHUNKS: Final = 1 << 20
_AHEAD: Final = 8  # views ahead of this member's whose chunks it keeps (they came early)

Assigned = list[tuple[int, ...]]


@dataclass(slots=True)
class _Gain:
    """A shard's state this member waits for."""

    shard: int
    view_id: int
    source: int | None  # None: not known (a joiner, until the first chunk)
    since: float
    chunks: list[bytes] = field(default_factory=list)
    count: int = -1  # chunks in all (-1: none yet)
    empty: bool = False  # no host survived: start from a fresh state
    release: Callable[[], None] | None = None  # the runner's hold, once reached


class Handoffs:
    """This member's part in moving sharded actors' state (see the module header)."""

    def __init__(self, me: int, sharded: Mapping[str, Sharded], hosted: Mapping[str, Hosted],
                 once: Mapping[str, ClientCalls], send: Callable[[int, bytes], None],
                 chunk_bytes: int, stall_s: float, fail: Callable[[str], None]) -> None:
        self._me = me
        self._sharded = sharded
        self._hosted = hosted
        self._once = once
        self._send = send
        self._chunk = max(1024, chunk_bytes)
        self._stall_s = stall_s
        self._fail = fail
        self.held: dict[str, int | None] = {}
        """Per sharded actor, the shard whose state this member's replica holds (None: none)."""
        self._prev: dict[str, Assigned] | None = None  # the previous view's assignment
        self._gains: dict[str, _Gain] = {}
        self._early: dict[tuple[str, int, int], list[tuple[int, int, int, bytes]]] = {}
        self._view_id = -1

    @staticmethod
    def assigned(assignment: ShardAssignment, name: str) -> Assigned:
        """Each shard's members of ``name`` in an assignment, in shard order."""
        return [info.members for info in assignment.shards if info.subgroup == name]

    # -- a view ----------------------------------------------------------------------------
    def on_view(self, view: View, joined: tuple[int, ...], founding: bool,
                assignment: ShardAssignment) -> None:
        """View ``view`` is installed (before any of its calls runs here)."""
        me = self._me
        self._view_id = view.view_id
        loop = asyncio.get_running_loop()
        leader = view.members[0] == me
        for name, waiting in list(self._gains.items()):
            if waiting.source is not None and waiting.source not in view.members:
                self._fail(f"the state of shard {waiting.shard} of {name} was still coming "
                           f"from member {waiting.source}, which departed")
                return
            if waiting.source is None and not waiting.empty and assignment.adequate:
                # (a joiner that heard nothing yet: whoever was to tell it may be gone)
                self._fail(f"the view changed before the state of shard {waiting.shard} of "
                           f"{name} began to come")
                return
        if not assignment.adequate:  # no shard runs in it: nothing moves
            return
        now: dict[str, Assigned] = {}
        for name in self._sharded:
            dealt = self.assigned(assignment, name)
            now[name] = dealt
            new = shard_of(dealt, me)
            before = self._prev.get(name) if self._prev is not None else None
            if before is None and name not in self.held:  # this member's first view
                self.held[name] = new if founding else None
            duty: tuple[int, list[int]] | None = None  # (shard, gainers) I send
            if before is not None:
                p = shard_of(before, me)
                if p is not None and self.held.get(name) == p:
                    hosts = [m for m in view.members if m in before[p]]
                    gainers = [m for m in dealt[p] if m not in before[p] and m != me]
                    if hosts and hosts[0] == me and gainers:
                        duty = (p, gainers)
                if leader:  # gainers of a shard no host of which survived start it empty
                    for k, members in enumerate(dealt):
                        if not any(m in view.members for m in before[k]):
                            for g in members:
                                if g != me:
                                    self._send(g, env.encode(env.HANDOFF_EMPTY, name, k,
                                                             view.view_id))
            pending = self._gains.get(name)
            if pending is not None and new != pending.shard:
                self._fail(f"member {me} moved off shard {pending.shard} of {name} before its "
                           "state came")
                return
            gain: _Gain | None = None
            if new is not None and new != self.held.get(name) and pending is None:
                gain = _Gain(new, view.view_id, None, loop.time())
                if before is not None:
                    hosts = [m for m in view.members if m in before[new]]
                    gain.source = hosts[0] if hosts else None
                    gain.empty = not hosts
                self._gains[name] = gain
                for item in self._early.pop((name, new, view.view_id), []):
                    self._chunk_in(name, *item)
            drop = new is None and self.held.get(name) is not None
            if duty is not None or gain is not None or drop:
                hosted = self._hosted[name]
                hosted.runner.submit_hold(
                    functools.partial(self._reached, name, view.view_id, duty, gain, drop))
        self._prev = now
        if self._gains:
            loop.call_later(self._stall_s / 2, self._check)
        for key in [k for k in self._early if k[2] <= view.view_id]:
            del self._early[key]

    def _reached(self, name: str, view_id: int, duty: tuple[int, list[int]] | None,
                 gain: _Gain | None, drop: bool, release: Callable[[], None]) -> None:
        """The cut of view ``view_id`` for ``name``: send, drop, or wait for the state."""
        hosted = self._hosted[name]
        table = self._once.get(name)
        if duty is not None:
            shard, gainers = duty
            try:
                data = state_bytes(hosted.actor.snapshot(), table)
            except Exception as exc:  # the gainers wait, then leave: say why here
                log.error("member %d: snapshot of shard %d of %s failed: %r", self._me, shard,
                          name, exc)
                data = b""
            if data:
                count = max(1, -(-len(data) // self._chunk))
                for g in gainers:
                    for i in range(count):
                        chunk = data[i * self._chunk : (i + 1) * self._chunk]
                        self._send(g, env.encode(env.HANDOFF, name, shard, view_id, i, count,
                                                 chunk))
                log.info("member %d: sent shard %d of %s (%d bytes) to %s for view %d",
                         self._me, shard, name, len(data), gainers, view_id)
        if gain is None:
            if drop:
                self._fresh(name)
                self.held[name] = None
            release()
            return
        gain.release = release
        self._try_restore(name, gain)

    def _fresh(self, name: str) -> None:
        hosted = self._hosted[name]
        hosted.actor.restore(hosted.spec.cls().snapshot())
        table = self._once.get(name)
        if table is not None:
            table.restore([])

    # -- chunks ----------------------------------------------------------------------------
    def on_message(self, sender: int, msg: list[Any]) -> None:
        """A HANDOFF or HANDOFF_EMPTY from ``sender``."""
        kind, name, shard, view_id = msg[0], msg[1], msg[2], msg[3]
        if name not in self._sharded or shard >= self._sharded[name].shards:
            raise ProtocolViolation(f"a handoff of shard {shard} of {name!r}")
        if kind == env.HANDOFF_EMPTY:
            gain = self._gains.get(name)
            if gain is not None and (gain.shard, gain.view_id) == (shard, view_id):
                gain.empty = True
                self._try_restore(name, gain)
            return
        _, _, _, _, index, count, chunk = msg
        if not 0 <= index < count <= _MAX_CHUNKS:
            raise ProtocolViolation(f"handoff chunk {index} of {count}")
        gain = self._gains.get(name)
        if gain is None or (gain.shard, gain.view_id) != (shard, view_id):
            if self._view_id < view_id <= self._view_id + _AHEAD:  # before my view install
                self._early.setdefault((name, shard, view_id), []).append(
                    (sender, index, count, chunk))
            return
        self._chunk_in(name, sender, index, count, chunk)

    def _chunk_in(self, name: str, sender: int, index: int, count: int, chunk: bytes) -> None:
        gain = self._gains[name]
        if gain.source is None:
            gain.source = sender
        if sender != gain.source or index != len(gain.chunks) or (
                gain.count not in (-1, count)):
            raise ProtocolViolation(f"handoff chunk {index}/{count} of {name} from {sender}, "
                                    f"expected {len(gain.chunks)} from {gain.source}")
        gain.count = count
        gain.chunks.append(chunk)
        gain.since = asyncio.get_running_loop().time()
        self._try_restore(name, gain)

    def _try_restore(self, name: str, gain: _Gain) -> None:
        if gain.release is None or not (gain.empty or len(gain.chunks) == gain.count):
            return
        del self._gains[name]
        hosted = self._hosted[name]
        try:
            if gain.empty:
                log.error("member %d: no host of shard %d of %s survived into view %d: it "
                          "starts empty", self._me, gain.shard, name, gain.view_id)
                self._fresh(name)
            else:
                data = b"".join(gain.chunks)
                hosted.actor.restore(restore_bytes(data, self._once.get(name)))
                log.info("member %d: restored shard %d of %s (%d bytes) from member %s",
                         self._me, gain.shard, name, len(data), gain.source)
        except Exception as exc:
            gain.release()
            self._fail(f"the state of shard {gain.shard} of {name} could not be restored: "
                       f"{exc!r}")
            return
        self.held[name] = gain.shard
        gain.release()

    def _check(self) -> None:
        """Leave when a gain has waited longer than ``state_stall_s`` for its next chunk."""
        now = asyncio.get_running_loop().time()
        for name, gain in self._gains.items():
            if gain.release is not None and now - gain.since > self._stall_s:
                self._fail(f"the state of shard {gain.shard} of {name} did not come within "
                           f"{self._stall_s} s")
                return
        if self._gains:
            asyncio.get_running_loop().call_later(self._stall_s / 2, self._check)
