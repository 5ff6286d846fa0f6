"""The sponsor's end of state transfer: fence, snapshot, freeze, then stream the chunks.

Theory of operation: :meth:`Sponsor.ticket` starts an :class:`Outgoing` transfer and puts a hold
into every runner: it is reached exactly when the calls delivered before the joiner's view have
finished. Then every ``snapshot()`` runs, the map is encoded with large values out of band, the
buffers are frozen off the loop and the holds released, and a STATE_BEGIN manifest goes to the
joiner. On its STATE_READY chunks are built and hashed off the loop and moved on the data
planes, at most :data:`WINDOW` unacknowledged; each STATE_ACK frees a chunk's plane buffers. A
view change both survive re-sends what is unacknowledged under the new view id. Whatever fails
aborts the transfer (the joiner is told why) and the sponsor stays. See docs/DESIGN.md §7.7.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]

from derecho_async import wire
from derecho_async.runtime.dataplane import MAX_ARRAYS, OutOfBand
from derecho_async.runtime.statexfer.chunks import (
    Stream,
    build_chunk,
    device_parts,
    freeze,
    numpy_module,
)
from derecho_async.runtime.statexfer.context import (
    CLIENTS_KEY,
    LOG_EVERY_S,
    LOG_SUFFIX_KEY,
    Context,
    failure,
    log,
    restore_reason,
)
from derecho_async.runtime.statexfer.wire import XFER_MASK, chunk_msg_no, encode_ticket
from derecho_async.wire import MAX_DECODE_SIZE
from derecho_async.wire import envelope as env

__all__ = ["WINDOW", "Outgoing", "Sponsor"]

WINDOW = 4
"""Chunks a sponsor keeps unacknowledged (built, hashed, sent), at most."""

_Frozen = list[tuple[str, str, list[int], Any, object]]


@dataclass(eq=False)
class Outgoing:
    """A transfer this member sponsors."""

    xfer_id: int
    joiner: int
    view_id: int
    runners: int
    started: float
    releases: list[Callable[[], None]] = field(default_factory=list)
    phase: str = "fence"  # fence, freeze, ready_wait, stream, done, aborted
    fence_timer: asyncio.TimerHandle | None = None
    parts: list[Any] = field(default_factory=list)
    #: actors sent as log suffixes: their state here at the fence (for an observer)
    observed: dict[str, object] = field(default_factory=dict)
    stream: Stream | None = None
    next_index: int = 0
    building: int = 0
    inflight: dict[int, tuple[tuple[int, int, int], OutOfBand]] = field(default_factory=dict)
    #: keys of earlier copies of an unacknowledged chunk (sent under older views): the joiner
    #: may still read them, so their plane buffers go only with the chunk's acknowledgement
    resent: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    acked: int = 0
    by_gpu: set[int] = field(default_factory=set)  # chunks a GPU plane took (last sent)
    bytes_done: int = 0
    last_progress: float = 0.0
    last_log: float = 0.0


class Sponsor:
    """The transfers this member sponsors, by transfer id (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.transfers: dict[int, Outgoing] = {}
        self._ids = itertools.count(1)
        #: test hook: ``hook(index, chunk) -> chunk`` applied after hashing
        self.chunk_hook: Callable[[int, Any], Any] | None = None

    def ticket(self, view_id: int, joiner: int) -> bytes | None:
        """A ticket for a transfer to ``joiner`` that starts now (the fence goes into every
        runner), or None while one to ``joiner`` runs."""
        for out in self.transfers.values():
            if out.joiner == joiner:
                return None
        ctx = self.ctx
        now = ctx.now()
        out = Outgoing(next(self._ids) & XFER_MASK, joiner, view_id, len(ctx.runners), now,
                       last_progress=now, last_log=now)
        self.transfers[out.xfer_id] = out
        loop = ctx.loop
        out.fence_timer = loop.call_later(ctx.fence_s, self._fence_timeout, out)
        for runner in ctx.runners.values():
            runner.submit_hold(functools.partial(self._reached, out))
        if not ctx.runners:
            loop.call_soon(self._snapshot, out)
        ctx.tick_soon()
        log.info("member %d: state transfer %d to joiner %d (view %d): fencing %d runners",
                 ctx.me, out.xfer_id, joiner, view_id, len(ctx.runners))
        return encode_ticket(out.xfer_id)

    # -- fence and snapshot --------------------------------------------------------------------
    def _reached(self, out: Outgoing, release: Callable[[], None]) -> None:
        if out.phase != "fence":
            release()
            return
        out.releases.append(release)
        if len(out.releases) == out.runners:
            self.ctx.loop.call_soon(self._snapshot, out)

    def _fence_timeout(self, out: Outgoing) -> None:
        if out.phase == "fence":
            self.abort(out, f"the calls delivered before view {out.view_id} did not finish "
                            f"within fence_timeout_s={self.ctx.fence_s:g} s at member "
                            f"{self.ctx.me}")

    def _snapshot(self, out: Outgoing) -> None:
        if out.phase != "fence":
            return
        state_log = self.ctx.state_log
        if state_log is None:
            self._take(out, {})
            return
        task = self.ctx.loop.create_task(state_log.suffixes(out.joiner, out.view_id))
        task.add_done_callback(functools.partial(self._suffixed, out))

    def _suffixed(self, out: Outgoing, task: asyncio.Future[dict[str, object]]) -> None:
        if out.phase != "fence":
            return
        exc = failure(task)
        if exc is not None:  # the snapshots can still do
            log.warning("member %d: no log suffix for joiner %d: %r", self.ctx.me, out.joiner,
                        exc)
        self._take(out, {} if exc is not None else task.result())

    def _take(self, out: Outgoing, suffixes: dict[str, object]) -> None:
        """Fenced: take every actor's snapshot but those whose state goes as a log suffix."""
        if out.fence_timer is not None:
            out.fence_timer.cancel()
        out.phase = "freeze"
        ctx = self.ctx
        state: dict[str, object] = {}
        for name, actor in ctx.actors.items():
            try:
                if name not in suffixes:
                    state[name] = actor.snapshot()
                elif ctx.observer is not None:  # (what the joiner must arrive at)
                    out.observed[name] = wire.decode(wire.encode(actor.snapshot()))
            except Exception as exc:
                self.abort(out, restore_reason(name, "snapshot", exc))
                return
        tables = {name: table.encode() for name, table in ctx.tables.items()
                  if name in state and len(table)}
        if tables:
            state[CLIENTS_KEY] = tables
        if suffixes:
            state[LOG_SUFFIX_KEY] = suffixes
            log.info("member %d: state transfer %d to %d: %s as log suffixes", ctx.me,
                     out.xfer_id, out.joiner, ", ".join(sorted(suffixes)))
        buffers: list[object] = []
        try:
            skeleton = wire.encode(state, buffers=buffers)
        except (TypeError, ValueError, OverflowError) as exc:
            self.abort(out, f"the state of member {ctx.me} could not be encoded: {exc}")
            return
        if len(buffers) > MAX_ARRAYS or len(skeleton) > MAX_DECODE_SIZE:
            self.abort(out, f"the state has {len(buffers)} arrays and a skeleton of "
                            f"{len(skeleton)} bytes: over the bounds ({MAX_ARRAYS}, "
                            f"{MAX_DECODE_SIZE})")
            return

        on_device = ctx.gpu_plane()

        def freeze_all() -> _Frozen:
            return [freeze(b, on_device) for b in buffers]

        fut = ctx.loop.run_in_executor(None, freeze_all)
        fut.add_done_callback(functools.partial(self._frozen, out, state, skeleton))

    def _frozen(self, out: Outgoing, state: dict[str, object], skeleton: bytes,
                fut: asyncio.Future[_Frozen]) -> None:
        if out.phase != "freeze":
            return
        ctx = self.ctx
        exc = failure(fut)
        if exc is not None:
            self.abort(out, f"copying the state at member {ctx.me} failed: {exc!r}")
            return
        frozen = fut.result()
        ctx.release_holds(out)  # what is sent can no longer change
        np = numpy_module()
        manifest: list[list[Any]] = [["skeleton", "uint8", [len(skeleton)], len(skeleton)]]
        out.parts = [np.frombuffer(skeleton, np.uint8)]
        for kind, dtype, shape, flat, _value in frozen:
            manifest.append([kind, dtype, shape, int(flat.nbytes)])
            out.parts.append(flat)
        out.stream = stream = Stream([int(p.nbytes) for p in out.parts], ctx.chunk_bytes,
                                     device_parts(manifest))
        if ctx.observer is not None:
            try:
                seen = wire.decode(skeleton, buffers=[f[4] for f in frozen])
            except Exception:
                seen = state
            if isinstance(seen, dict):
                seen.pop(LOG_SUFFIX_KEY, None)
                seen.pop(CLIENTS_KEY, None)
                seen.update(out.observed)
                ctx.observer.snapshot_taken(ctx.me, out.view_id, out.joiner, seen)
        out.phase = "ready_wait"
        out.last_progress = ctx.now()
        log.info("member %d: state transfer %d to %d: snapshot of %d bytes in %d parts, "
                 "%d chunks of %d bytes", ctx.me, out.xfer_id, out.joiner, stream.total,
                 len(manifest), stream.count, stream.chunk)
        ctx.send(out.joiner, env.encode(env.STATE_BEGIN, out.xfer_id, out.view_id,
                                        stream.chunk, stream.total, manifest))

    # -- the stream ----------------------------------------------------------------------------
    def receive(self, kind: int, sender: int, msg: list[Any]) -> None:
        """STATE_READY, STATE_ACK or STATE_ABORT from the joiner of transfer ``msg[1]``."""
        out = self.transfers.get(msg[1])
        if out is None or out.joiner != sender:
            return
        if kind == env.STATE_ABORT:
            self.abort(out, f"joiner {sender} gave it up: {msg[2]}", tell=False,
                       level=logging.INFO if out.phase == "ready_wait" else logging.ERROR)
        elif kind == env.STATE_READY and out.phase == "ready_wait":
            out.phase = "stream"
            out.last_progress = self.ctx.now()
            self._pump(out)
        elif kind == env.STATE_ACK and out.phase == "stream":
            self._on_ack(out, msg[2])

    def _pump(self, out: Outgoing) -> None:
        stream = out.stream
        assert stream is not None
        loop = self.ctx.loop
        while (out.phase == "stream" and out.next_index < stream.count
               and len(out.inflight) + out.building < WINDOW):
            index = out.next_index
            out.next_index += 1
            out.building += 1
            fut = loop.run_in_executor(None, build_chunk, out.parts, stream, index)
            fut.add_done_callback(functools.partial(self._built, out, index))

    def _built(self, out: Outgoing, index: int,
               fut: asyncio.Future[tuple[Any, bytes, int]]) -> None:
        out.building -= 1
        if out.phase != "stream":
            return
        exc = failure(fut)
        if exc is not None:
            self.abort(out, f"building chunk {index} at member {self.ctx.me} failed: {exc!r}")
            return
        arr, digest, how = fut.result()
        if self.chunk_hook is not None:
            arr = self.chunk_hook(index, arr)
        header = msgpack.packb([out.xfer_id, index, digest, how], use_bin_type=True)
        payload = OutOfBand(header, (arr,))
        self._ship(out, index, payload)

    def _ship(self, out: Outgoing, index: int, payload: OutOfBand) -> None:
        ctx = self.ctx
        view = ctx.view
        view_id = view.view_id if view is not None else out.view_id
        key = (view_id, ctx.me, chunk_msg_no(out.xfer_id, index))
        earlier = out.inflight.get(index)
        if earlier is not None and earlier[0] != key:
            out.resent.setdefault(index, []).append(earlier[0])
        out.inflight[index] = (key, payload)
        driver = ctx.driver
        plane = driver.start_transfer(key, payload, (out.joiner,))
        if plane is not None and plane in (driver.gpuplane, driver.ncclplane):
            out.by_gpu.add(index)
        else:
            out.by_gpu.discard(index)

    def _on_ack(self, out: Outgoing, index: int) -> None:
        entry = out.inflight.pop(index, None)
        if entry is None:
            return  # a duplicate (a chunk re-sent under a new view landed twice)
        ctx = self.ctx
        for key in (*out.resent.pop(index, ()), entry[0]):
            ctx.driver.release_sent(key)
        assert out.stream is not None
        out.acked += 1
        out.bytes_done += out.stream.length(index)
        out.last_progress = ctx.now()
        if out.acked == out.stream.count:
            out.phase = "done"
            del self.transfers[out.xfer_id]
            took = ctx.now() - out.started
            log.info("member %d: state transfer %d to %d done: %d bytes in %.2f s (%d of %d "
                     "chunks moved by a GPU plane)", ctx.me, out.xfer_id, out.joiner,
                     out.stream.total, took, len(out.by_gpu), out.stream.count)
            return
        self._pump(out)

    # -- views, failures, the timer ------------------------------------------------------------
    def on_view(self, members: set[int], view_id: int) -> None:
        """A view was installed: transfers to departed joiners end; the others re-send what is
        unacknowledged under the new view (the joiner drops chunks of views it left behind)."""
        for out in list(self.transfers.values()):
            if out.joiner not in members:
                self.abort(out, f"joiner {out.joiner} departed (view {view_id})", tell=False,
                           level=logging.WARNING)
            elif out.phase == "stream":
                for index, (_key, payload) in list(out.inflight.items()):
                    self._ship(out, index, payload)

    def abort_all(self, reason: str, *, tell: bool) -> None:
        """End every transfer (this member leaves or closes), logged as a warning."""
        for out in list(self.transfers.values()):
            self.abort(out, reason, tell=tell, level=logging.WARNING)

    def staging_failed(self, xfer_id: int, index: int, exc: BaseException) -> None:
        """A plane could not send chunk ``index`` of transfer ``xfer_id``."""
        out = self.transfers.get(xfer_id)
        if out is not None:
            self.abort(out, f"state chunk {index} could not be sent from here: {exc!r}")

    def tick(self, now: float) -> None:
        """Abort transfers whose joiner made no progress for ``state_stall_s``; log progress."""
        ctx = self.ctx
        for out in list(self.transfers.values()):
            if out.phase in ("ready_wait", "stream") and now - out.last_progress > ctx.stall_s:
                self.abort(out, f"joiner {out.joiner} made no progress for "
                                f"state_stall_s={ctx.stall_s:g} s")
            elif out.phase == "stream" and now - out.last_log >= LOG_EVERY_S:
                out.last_log = now
                assert out.stream is not None
                log.info("member %d: state transfer %d to %d: %d of %d bytes (%.1f MiB/s)",
                         ctx.me, out.xfer_id, out.joiner, out.bytes_done, out.stream.total,
                         out.bytes_done / (1 << 20) / max(now - out.started, 1e-9))

    def abort(self, out: Outgoing, reason: str, *, tell: bool = True,
              level: int = logging.ERROR) -> None:
        """End ``out``: release its holds and plane buffers, log ``reason`` and, if ``tell``,
        send it to the joiner. This member stays in the group."""
        if out.phase in ("done", "aborted"):
            return
        out.phase = "aborted"
        self.transfers.pop(out.xfer_id, None)
        if out.fence_timer is not None:
            out.fence_timer.cancel()
        ctx = self.ctx
        ctx.release_holds(out)
        for key, _payload in out.inflight.values():
            ctx.driver.release_sent(key)
        for keys in out.resent.values():
            for key in keys:
                ctx.driver.release_sent(key)
        out.inflight.clear()
        out.resent.clear()
        out.parts = []
        log.log(level, "member %d: state transfer %d to joiner %d aborted: %s; this member "
                "stays in the group", ctx.me, out.xfer_id, out.joiner, reason)
        if tell:
            ctx.send(out.joiner, env.encode(env.STATE_ABORT, out.xfer_id, reason[:4000]))
