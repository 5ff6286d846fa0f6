"""The joiner's end of state transfer: hold the runners, receive, verify, restore.

Theory of operation: on the view carrying its ticket (:meth:`Joiner.expect`) the joiner puts a
hold into every runner, so the new view's calls wait for the restore. It accepts only the
STATE_BEGIN manifest of the sponsor and transfer its ticket names, within
:data:`MAX_STATE_BYTES`, allocates the parts (a device part in device memory where a GPU plane
runs here) and answers STATE_READY. Each landed chunk's index, length and digest are checked and
the chunk is copied into place off the loop, then acknowledged (STATE_ACK). With every chunk in,
the skeleton is decoded with the rebuilt buffers off the loop, each ``restore()`` runs and the
holds are released. Any failure (the sponsor departing or aborting, a bad digest, no progress,
a raising ``restore``) fails :meth:`Joiner.restored` with :class:`GroupClosed`; the joiner then
leaves, nobody else does. See docs/DESIGN.md §7.7.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]

from derecho_async import wire
from derecho_async.core import ViewInstalled
from derecho_async.errors import GroupClosed, ProtocolViolation
from derecho_async.runtime.dataplane import OutOfBand
from derecho_async.runtime.statexfer.chunks import (
    CHECKSUM,
    DIGEST,
    SHA256,
    Stream,
    checksum,
    copy_into,
    device_parts,
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
from derecho_async.runtime.statexfer.wire import INDEX_BITS, decode_ticket, split_msg_no
from derecho_async.wire import envelope as env
from derecho_async.wire import is_cupy_array

__all__ = ["MAX_STATE_BYTES", "Incoming", "Joiner"]

MAX_STATE_BYTES = 1 << 46
"""The largest state a joiner accepts a manifest for (64 TiB: a sanity bound, not a budget)."""
_MAX_CHUNK = 1 << 30
_MIN_CHUNK = 4096


@dataclass(eq=False)
class Incoming:
    """The transfer that brings this joiner its state."""

    xfer_id: int
    sponsor: int
    view_id: int
    started: float
    future: asyncio.Future[None]
    releases: list[Callable[[], None]] = field(default_factory=list)
    phase: str = "wait_begin"  # wait_begin, receiving, finishing, replaying, done, failed
    parts: list[tuple[str, str, list[int], Any]] = field(default_factory=list)
    stream: Stream | None = None
    chunk_state: bytearray = field(default_factory=bytearray)
    done: int = 0
    on_device: int = 0  # chunks that landed in device memory (moved by a GPU plane)
    bytes_done: int = 0
    last_progress: float = 0.0
    last_log: float = 0.0


class Joiner:
    """The transfer that brings this member its state, if it joined a running group (see the
    module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.incoming: Incoming | None = None

    async def restored(self) -> None:
        """Return once this member's state is restored (at once for a founding member, whose
        first view carries no ticket); :class:`GroupClosed` naming why it failed."""
        inc = self.incoming
        if inc is not None:
            await asyncio.shield(inc.future)

    def active(self) -> bool:
        """Whether a transfer is under way here (the timer must keep running)."""
        inc = self.incoming
        return inc is not None and inc.phase in ("wait_begin", "receiving", "finishing",
                                                 "replaying")

    def expect(self, ev: ViewInstalled) -> bool:
        """This member's first view, whose Welcome carried a ticket: hold the runners and wait
        for that transfer. False if the ticket is not one (the join has failed then)."""
        ctx = self.ctx
        fut: asyncio.Future[None] = ctx.loop.create_future()
        now = ctx.now()
        inc = Incoming(-1, -1 if ev.sponsor is None else ev.sponsor, ev.view.view_id, now, fut,
                       last_progress=now, last_log=now)
        self.incoming = inc
        for runner in ctx.runners.values():  # the new view's calls wait for the restore
            runner.submit_hold(inc.releases.append)
        assert ev.state is not None
        try:
            inc.xfer_id = decode_ticket(ev.state)
        except ProtocolViolation as exc:
            self.fail(f"the Welcome from {inc.sponsor}: {exc}")
            return False
        if ev.sponsor is None:
            self.fail("the Welcome names no sponsor")
            return False
        log.info("member %d: waiting for state transfer %d from member %d (view %d)",
                 ctx.me, inc.xfer_id, inc.sponsor, inc.view_id)
        ctx.tick_soon()
        return True

    def on_begin(self, sender: int, msg: list[Any]) -> None:
        """A STATE_BEGIN manifest: allocate and answer STATE_READY if it is the one expected."""
        _, xfer_id, _view_id, chunk, total, manifest = msg
        ctx = self.ctx
        inc = self.incoming
        if (inc is None or inc.phase != "wait_begin" or sender != inc.sponsor
                or xfer_id != inc.xfer_id):
            # a duplicate Welcome's transfer (or a stale one): the sponsor frees it at once
            ctx.send(sender, env.encode(env.STATE_ABORT, xfer_id,
                                        f"member {ctx.me} expects no state transfer "
                                        f"{xfer_id} from {sender}"))
            return
        sizes = [int(p[3]) for p in manifest]
        if not _MIN_CHUNK <= chunk <= _MAX_CHUNK or sum(sizes) != total or (
            total > MAX_STATE_BYTES
        ) or -(-total // chunk) + len(sizes) >= 1 << INDEX_BITS:
            self.fail(f"state manifest from {sender} out of bounds: chunk {chunk}, total "
                      f"{total}, parts {len(sizes)}")
            return
        np = numpy_module()
        cupy: Any = sys.modules.get("cupy") if ctx.gpu_plane() else None
        try:  # a device part lands on the device where a GPU plane runs here
            inc.parts = [(str(p[0]), str(p[1]), list(p[2]),
                          cupy.empty(int(p[3]), cupy.uint8) if p[0] == "cuda" and cupy is not None
                          else np.empty(int(p[3]), np.uint8)) for p in manifest]
        except Exception as exc:  # MemoryError, CuPy's OutOfMemoryError
            self.fail(f"no memory here for a state of {total} bytes: {exc!r}")
            return
        inc.stream = Stream(sizes, chunk, device_parts(manifest))
        inc.chunk_state = bytearray(inc.stream.count)
        inc.phase = "receiving"
        inc.last_progress = ctx.now()
        log.info("member %d: state transfer %d from %d: %d bytes in %d parts, %d chunks",
                 ctx.me, xfer_id, sender, total, len(sizes), inc.stream.count)
        ctx.send(sender, env.encode(env.STATE_READY, xfer_id))

    def landed(self, key: tuple[int, int, int], payload: object) -> None:
        """A state chunk landed here: check it and store it off the loop."""
        inc = self.incoming
        _view_id, src, msg_no = key
        xfer_id, index = split_msg_no(msg_no)
        if inc is None or inc.phase != "receiving" or src != inc.sponsor or (
            xfer_id != inc.xfer_id
        ):
            return
        stream = inc.stream
        assert stream is not None
        if index < stream.count and inc.chunk_state[index]:
            # A copy re-sent under a new view, known by its key alone: once the first copy is
            # acknowledged the sponsor frees every copy's region, so this one's bytes may be
            # another chunk's by now. Never read them; acknowledge a stored chunk again.
            if inc.chunk_state[index] == 2:
                self.ctx.send(src, env.encode(env.STATE_ACK, xfer_id, index))
            return
        np = numpy_module()
        arr: Any = payload.arrays[0] if isinstance(payload, OutOfBand) and len(
            payload.arrays) == 1 else None
        header: object = None
        if isinstance(payload, OutOfBand):
            try:
                header = msgpack.unpackb(payload.call, raw=False) if len(
                    payload.call) <= 128 else None
            except Exception:
                header = None
        if not (
            index < stream.count
            and (isinstance(arr, np.ndarray) or is_cupy_array(arr))
            and arr.dtype == np.uint8 and arr.ndim == 1
            and arr.shape[0] == stream.length(index)
            and isinstance(header, list) and len(header) == 4 and header[0] == xfer_id
            and header[1] == index and isinstance(header[2], bytes)
            and len(header[2]) == DIGEST and header[3] in (SHA256, CHECKSUM)
        ):
            self.fail(f"a malformed state chunk {index} from {src}")
            return
        inc.chunk_state[index] = 1
        inc.on_device += is_cupy_array(arr)
        digest, how = header[2], header[3]
        pieces = stream.pieces(index)
        dests = [p[3] for p in inc.parts]

        def store() -> bool:
            if how == CHECKSUM:
                if checksum(arr) != digest:
                    return False
            elif hashlib.sha256(memoryview(
                    arr.get() if is_cupy_array(arr) else arr)).digest() != digest:
                return False
            for part, off, at, n in pieces:
                copy_into(dests[part], off, arr, at, n)
            if is_cupy_array(arr) or any(is_cupy_array(dests[p[0]]) for p in pieces):
                import cupy

                # done before the landed region can go back to the plane's pool
                cupy.cuda.get_current_stream().synchronize()
            return True

        fut = self.ctx.loop.run_in_executor(None, store)
        fut.add_done_callback(functools.partial(self._stored, inc, index))

    def _stored(self, inc: Incoming, index: int, fut: asyncio.Future[bool]) -> None:
        if inc.phase != "receiving":
            return
        exc = failure(fut)
        if exc is not None:
            self.fail(f"storing state chunk {index} failed here: {exc!r}")
            return
        stream = inc.stream
        assert stream is not None
        if not fut.result():
            self.fail(f"state chunk {index} from {inc.sponsor} does not match its sha256 "
                      "digest")
            return
        inc.chunk_state[index] = 2
        inc.done += 1
        inc.bytes_done += stream.length(index)
        inc.last_progress = self.ctx.now()
        self.ctx.send(inc.sponsor, env.encode(env.STATE_ACK, inc.xfer_id, index))
        if inc.done == stream.count:
            self._finish(inc)

    def _finish(self, inc: Incoming) -> None:
        inc.phase = "finishing"
        parts, inc.parts = inc.parts, []
        me = self.ctx.me

        def rebuild() -> object:
            np = numpy_module()
            buffers: list[object] = []
            for kind, dtype, shape, dest in parts[1:]:
                if is_cupy_array(dest):  # landed on the device: a view, no copy
                    buffers.append(dest.view(np.dtype(dtype)).reshape(shape))
                    continue
                le = np.dtype(dtype).newbyteorder("<")
                host = dest.view(le).reshape(shape).astype(np.dtype(dtype), copy=False)
                if kind == "cuda":
                    try:
                        import cupy

                        host = cupy.asarray(host)
                    except ImportError:
                        log.warning("member %d: a device array of the state arrives as numpy "
                                    "(no CuPy here)", me)
                buffers.append(host)
            skeleton = parts[0][3].tobytes()
            parts.clear()  # the decoded bytes are copies: the receive buffers can go
            return wire.decode(skeleton, buffers=buffers)

        fut = self.ctx.loop.run_in_executor(None, rebuild)
        fut.add_done_callback(functools.partial(self._rebuilt, inc))

    def _rebuilt(self, inc: Incoming, fut: asyncio.Future[object]) -> None:
        if inc.phase != "finishing":
            return
        exc = failure(fut)
        if exc is not None:
            self.fail(f"the state from {inc.sponsor} could not be decoded: {exc!r}")
            return
        value = fut.result()
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            self.fail(f"the state from {inc.sponsor} is not a map of actor names")
            return
        ctx = self.ctx
        suffixes = value.pop(LOG_SUFFIX_KEY, None)
        tables = value.pop(CLIENTS_KEY, None)
        if not isinstance(tables, dict | None):
            self.fail(f"the state from {inc.sponsor} holds a malformed client table")
            return
        for name, actor in ctx.actors.items():
            if name in value:
                try:
                    actor.restore(value[name])
                    table = ctx.tables.get(name)
                    if table is not None:
                        table.restore((tables or {}).get(name, []))
                except Exception as exc2:
                    self.fail(restore_reason(name, "restore", exc2))
                    return
        if suffixes is None:
            self._restored(inc, value)
            return
        if ctx.state_log is None:
            self.fail(f"member {inc.sponsor} sent log suffixes, and this member keeps no log")
            return
        inc.phase = "replaying"
        task = ctx.loop.create_task(ctx.state_log.apply(suffixes))
        task.add_done_callback(functools.partial(self._replayed, inc, value))

    def _replayed(self, inc: Incoming, value: dict[str, object],
                  task: asyncio.Future[dict[str, int]]) -> None:
        if inc.phase != "replaying":
            return
        exc = failure(task)
        if exc is not None:
            self.fail(f"the log suffix from {inc.sponsor} could not be used: {exc}")
            return
        ctx = self.ctx
        ran = task.result()
        log.info("member %d: state transfer %d from %d: ran %s from log suffixes", ctx.me,
                 inc.xfer_id, inc.sponsor,
                 ", ".join(f"{n} calls of {name}" for name, n in sorted(ran.items())))
        if ctx.observer is not None:
            for name in ran:
                value[name] = wire.decode(wire.encode(ctx.actors[name].snapshot()))
        self._restored(inc, value)

    def _restored(self, inc: Incoming, value: dict[str, object]) -> None:
        ctx = self.ctx
        inc.phase = "done"
        stream = inc.stream
        total = stream.total if stream is not None else 0
        took = ctx.now() - inc.started
        log.info("member %d: state transfer %d from %d restored: %d bytes in %.2f s "
                 "(%.1f MiB/s; %d of %d chunks landed in device memory)", ctx.me, inc.xfer_id,
                 inc.sponsor, total, took, total / (1 << 20) / max(took, 1e-9), inc.on_device,
                 stream.count if stream is not None else 0)
        if ctx.observer is not None:
            ctx.observer.restored(ctx.me, inc.view_id, value)
        ctx.release_holds(inc)
        if not inc.future.done():
            inc.future.set_result(None)

    # -- failures and the timer ----------------------------------------------------------------
    def on_abort(self, sender: int, xfer_id: int, why: str) -> bool:
        """A STATE_ABORT: True if it ends this member's own transfer (the join fails)."""
        inc = self.incoming
        if inc is not None and sender == inc.sponsor and xfer_id == inc.xfer_id:
            self.fail(f"member {sender} aborted the state transfer: {why}")
            return True
        return False

    def on_view(self, members: set[int], view_id: int) -> None:
        """A later view: the join fails if the sponsor departed before it ended."""
        inc = self.incoming
        if inc is not None and inc.phase not in ("done", "failed") and (
            inc.sponsor not in members
        ):
            self.fail(f"the sponsor, member {inc.sponsor}, departed during the state "
                      f"transfer (view {view_id})")

    def landing_failed(self, xfer_id: int, index: int, src: int, exc: BaseException) -> None:
        """A plane could not land chunk ``index`` of transfer ``xfer_id`` from ``src``."""
        inc = self.incoming
        if inc is not None and src == inc.sponsor and xfer_id == inc.xfer_id:
            self.fail(f"state chunk {index} could not land here: {exc!r}")

    def tick(self, now: float) -> None:
        """Fail a transfer that made no progress for ``state_stall_s`` (plus
        ``fence_timeout_s`` before the manifest came); log progress."""
        ctx = self.ctx
        inc = self.incoming
        if inc is not None and inc.phase in ("wait_begin", "receiving"):
            bound = ctx.stall_s + (ctx.fence_s if inc.phase == "wait_begin" else 0.0)
            if now - inc.last_progress > bound:
                self.fail(f"the state transfer from {inc.sponsor} made no progress for "
                          f"{bound:g} s (state_stall_s={ctx.stall_s:g}"
                          + (f", fence_timeout_s={ctx.fence_s:g})" if inc.phase == "wait_begin"
                             else ")"))
            elif inc.phase == "receiving" and now - inc.last_log >= LOG_EVERY_S:
                inc.last_log = now
                assert inc.stream is not None
                log.info("member %d: state transfer %d from %d: %d of %d bytes (%.1f MiB/s)",
                         ctx.me, inc.xfer_id, inc.sponsor, inc.bytes_done, inc.stream.total,
                         inc.bytes_done / (1 << 20) / max(now - inc.started, 1e-9))

    def fail(self, reason: str) -> None:
        """The join fails: tell the sponsor, and fail :meth:`restored` with ``reason``."""
        inc = self.incoming
        if inc is None or inc.phase in ("done", "failed"):
            return
        was = inc.phase
        inc.phase = "failed"
        inc.parts = []
        ctx = self.ctx
        log.error("member %d: the join failed: %s", ctx.me, reason)
        if was != "wait_begin" or inc.xfer_id >= 0:
            ctx.send(inc.sponsor, env.encode(env.STATE_ABORT, max(inc.xfer_id, 0),
                                             f"the joiner failed: {reason}"[:4000]))
        if not inc.future.done():
            inc.future.set_exception(GroupClosed(f"member {ctx.me} could not join: {reason}"))
            inc.future.exception()  # retrieved here too: nobody may be waiting any more
