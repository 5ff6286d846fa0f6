"""The NCCL data plane: device arrays between members on different GPUs, by NCCL broadcasts.

Theory of operation (DESIGN.md §6.7). Per view, each sender roots a communicator per shard
(:mod:`.nccl_plan`); only the root starts broadcasts on it, and it sends each rank a descriptor
on the FIFO channel in the order it enqueues them, so every rank issues the same broadcasts in
the same order and senders never wait on one another (a stream per communicator). A setup
thread per view makes unique ids and joins the communicators in one order every member shares;
the event loop never blocks on NCCL nor on the GPU. Until the sender's communicator is up,
``start`` declines and the next plane takes the message. A view install aborts the old view's
communicators, so a rank killed mid-broadcast costs a view change, not a hang; NCCL errors and
stalled receives abort the communicator and report its root.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from derecho_async.core import ViewInstalled
from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.dataplane import OutOfBand
from derecho_async.runtime.gpu.completions import Completions
from derecho_async.runtime.gpu.descriptor import (
    BROADCAST,
    ArraySpec,
    Descriptor,
    as_lib,
    inline_array,
)
from derecho_async.runtime.gpu.nccl_plan import (
    STALL_FLOOR_BPS,
    Comm,
    CommSpec,
    EarlyUids,
    ViewComms,
    communicator_plan,
    uid_from_frame,
    uid_to_bytes,
    uid_to_tuple,
)
from derecho_async.transport.base import GROUP_MESSAGE_LIMIT
from derecho_async.wire import envelope as env

__all__ = ["NcclPlane"]

log = logging.getLogger("derecho_async.ncclplane")

_ASYNC_CHECK_S = 0.5  # how often communicators with broadcasts in flight are checked for errors
_WARM_UP_BYTES = 4 << 20  # the second warm-up broadcast (see NcclPlane._warm_up)
_BROADCAST_PIECE = 1 << 30  # bytes per ncclBroadcast call (see NcclPlane._enqueue)
_FRAME_MARGIN = 1024  # room under GROUP_MESSAGE_LIMIT for a transport's own header (rdma's)


@dataclass(slots=True)
class _Sent:
    arrays: tuple[Any, ...]  # kept alive until delivered and broadcast
    comm: Comm
    sent: bool = False
    delivered: bool = False


class NcclPlane:
    """Moves device arrays to the ranks of per-sender NCCL communicators (DESIGN.md §6.7).

    A :class:`~derecho_async.runtime.plane.Plane`. ``shards_of(members)`` lists a view's
    shards as (members, senders); ``send(dst, frame)`` puts a frame on the reliable channel;
    ``landed(key, payload)`` reports a message whose arrays are all here; ``suspect(member,
    why)`` reports a member whose communicator failed (the driver's ``on_failure``); ``failed(key,
    exc)`` a message whose bytes came but whose arrays could not be made (it never lands).
    ``setup_s``: how long to wait for a root's unique id (``Config.nccl_setup_s``); ``stall_s``:
    how long a receiver's oldest broadcast may make no progress, plus its size at 100 MB/s,
    before its communicator fails (``Config.nccl_stall_s``); ``busy_poll_us`` and
    ``poll_interval_us`` go to its :class:`~.completions.Completions`
    (``Config.gpu_busy_poll_us``, ``Config.gpu_poll_interval_us``).
    """

    kinds: tuple[int, ...] = (env.NCCL_UID, env.NCCL_DATA)

    def __init__(self, member_id: int,
                 shards_of: Callable[[tuple[int, ...]], Iterable[tuple[Sequence[int],
                                                                       Sequence[int]]]],
                 send: Callable[[int, bytes], None],
                 landed: Callable[[tuple[int, int, int], object], None],
                 suspect: Callable[[int, str], None], *, min_ranks: int = 2,
                 failed: Callable[[tuple[int, int, int], BaseException], None] | None = None,
                 setup_s: float = 60.0, stall_s: float = 60.0,
                 busy_poll_us: float = 2000.0, poll_interval_us: float = 80.0,
                 ) -> None:
        import cupy
        from cupy.cuda import nccl

        self._cp = cupy
        self._nccl = nccl
        self._rt = cupy.cuda.runtime
        self.member_id = member_id
        self.device = int(cupy.cuda.Device().id)
        self._shards_of = shards_of
        self._send = send
        self._landed = landed
        self._suspect = suspect
        self._failed = failed
        self._min_ranks = min_ranks
        self._setup_timeout_s = setup_s
        self._stall_s = stall_s
        self._done = Completions(self._rt, self.device, busy_poll_us=busy_poll_us,
                                 poll_interval_us=poll_interval_us)
        self._fence_event = int(self._rt.eventCreateWithFlags(0x2))  # cudaEventDisableTiming
        self._uint8 = int(getattr(nccl, "NCCL_UINT8", 1))  # ncclUint8: arrays travel as bytes
        self._signed_chars = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
        self._uid_form = "unknown"  # how this CuPy takes a unique id: "bytes" or "tuple"
        # memory a failed setup or receive may still write into, with its stream: held for good
        self._parked: list[tuple[Any, Any]] = []
        self._view: ViewComms | None = None
        self._early = EarlyUids()
        self._outgoing: dict[tuple[int, int, int], _Sent] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._check_handle: asyncio.TimerHandle | None = None
        self._closed = False
        self.sent = 0  # messages this member sent by broadcast
        self.received = 0  # messages that landed here by broadcast
        self._received_view = 0  # of those, in the current view
        self.aborted = 0  # communicators aborted here

    # -- the Plane protocol ----------------------------------------------------------------
    def start(self, key: tuple[int, int, int], payload: object,
              targets: tuple[int, ...]) -> bool:
        """Take ``payload`` if it holds device arrays of this device and this member's
        communicator for exactly ``targets`` is up (else the next plane takes it)."""
        vs = self._view
        if (not isinstance(payload, OutOfBand) or vs is None or key[0] != vs.view_id
                or self._closed):
            return False
        infos = payload.infos()
        if not any(info.is_gpu for info in infos):
            return False
        comm = vs.sending_comm(targets)
        if comm is None or comm.state != "ready":
            return False
        cp = self._cp
        specs: list[ArraySpec] = []
        device: list[Any] = []
        for a, info in zip(payload.arrays, infos, strict=True):
            if not info.is_gpu:
                import numpy as np

                host = np.ascontiguousarray(a)
                raw = host.astype(host.dtype.newbyteorder("<"), copy=False).tobytes()
                specs.append(ArraySpec("numpy", info.dtype, info.shape, info.nbytes, inline=raw))
                continue
            arr = cp.asarray(a)  # CuPy and torch through __cuda_array_interface__, no copy
            if int(arr.device.id) != self.device:
                return False  # NCCL moves only this rank's device memory: the next plane
            if not arr.flags.c_contiguous:
                arr = cp.ascontiguousarray(arr)  # queued on the current stream
            lib = "torch" if info.lib == "torch" else "cupy"
            specs.append(ArraySpec(lib, info.dtype, tuple(arr.shape), int(arr.nbytes), BROADCAST))
            device.append(arr)
        # The frame first: once broadcasts are queued the receivers must get it, so nothing
        # that can refuse it (its size) may come after them.
        body = Descriptor(payload.call, -1, tuple(specs)).encode()
        frame = env.encode(env.NCCL_DATA, key[0], key[1], key[2], comm.spec.index,
                           comm.next_send, body)
        if len(frame) > GROUP_MESSAGE_LIMIT - _FRAME_MARGIN:
            return False  # host arrays too large to travel inline: the next plane
        try:
            self._enqueue(comm, [(int(a.data.ptr), int(a.nbytes)) for a in device])
        except Exception as exc:  # the ranks cannot follow a half-issued message: stop here
            self._fail(comm, f"enqueueing a broadcast failed: {exc!r}")
            return False
        comm.take_send()
        out = self._outgoing[key] = _Sent(tuple(device), comm)
        try:
            for dst in targets:
                self._send(dst, frame)
        except Exception as exc:  # a closing transport: the broadcasts are queued, so this
            # plane keeps the message (no other plane may send it as well); receivers that got
            # the frame see the communicator fail and report this member
            self._fail(comm, f"sending a descriptor failed: {exc!r}")
            return True

        def broadcast_done() -> None:
            out.sent = True
            if out.delivered:
                self._outgoing.pop(key, None)

        self._done.track(comm, broadcast_done)
        self._arm_check()
        self.sent += 1
        return True

    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        """One of this plane's frames arrived from ``sender``."""
        if msg[0] == env.NCCL_UID:
            _, view_id, index, uid = msg
            self.on_uid(sender, view_id, index, uid)
            return
        _, view_id, src, msg_no, index, seq, body = msg
        if src != sender:
            raise ProtocolViolation(f"device data for sender {src} relayed by {sender}")
        vs = self._view
        if vs is None or view_id > vs.view_id:
            raise ProtocolViolation(f"NCCL descriptor for view {view_id}, not installed here")
        if view_id < vs.view_id:
            return  # its communicators are aborted; the core drops the old view's messages
        comm = vs.comm_for_data(sender, index)
        comm.take_recv(seq)
        desc = Descriptor.decode(body, None, broadcast=True)
        key = (view_id, sender, msg_no)
        if comm.state == "ready" and not comm.waiting:
            self._receive(comm, key, desc)
        elif comm.state == "setup":
            comm.waiting.append((key, desc))
        else:
            raise ProtocolViolation(
                f"member {sender}'s communicator {index} is {comm.state} here: {comm.why}")

    def on_own_delivered(self, key: tuple[int, int, int]) -> None:
        out = self._outgoing.get(key)
        if out is not None:
            out.delivered = True
            if out.sent:
                del self._outgoing[key]

    def on_event(self, event: object) -> None:
        if isinstance(event, ViewInstalled):
            self.on_view(event.view.view_id, event.view.members)

    def close(self) -> None:
        """Abort every communicator; stop landing messages."""
        if self._closed:
            return
        self._closed = True
        if self._check_handle is not None:
            self._check_handle.cancel()
        if self._view is not None:
            self._end_view(self._view)
            self._view = None
        self._done.close()

    # -- views and setup ---------------------------------------------------------------------
    def on_view(self, view_id: int, members: tuple[int, ...]) -> None:
        """A view was installed: abort the previous view's communicators, set up this one's."""
        loop = asyncio.get_running_loop()
        self._loop = self._done.loop = loop
        if self._view is not None:
            self._end_view(self._view)
        self._received_view = 0
        plan = communicator_plan(self._shards_of(members), self._min_ranks)
        vs = ViewComms(view_id, members, plan, self.member_id)
        self._view = vs
        for sender, index, uid in self._early.take(view_id):
            try:
                self._accept_uid(vs, sender, index, uid)
            except ProtocolViolation as exc:  # held before the view could check it
                log.warning("member %d: a held NCCL unique id from %d: %s", self.member_id,
                            sender, exc)
                loop.call_soon(self._suspect, sender,  # not inside the driver's step
                               f"protocol violation on the NCCL plane: {exc}")
        if not vs.order or self._closed:
            return
        threading.Thread(target=self._setup, args=(vs, loop), daemon=True,
                         name=f"derecho-nccl-setup-v{view_id}").start()

        def slow() -> None:
            late = [c.spec for c in vs.comms.values() if c.state == "setup"]
            if late and vs is self._view:
                log.warning("member %d: NCCL communicators %s of view %d are not up after %.0f s;"
                            " their messages take the next plane meanwhile", self.member_id,
                            [(s.root, s.index) for s in late], view_id, self._setup_timeout_s)

        loop.call_later(self._setup_timeout_s, slow)

    def on_uid(self, sender: int, view_id: int, index: int, uid: object) -> None:
        """A root's unique id for one of its communicators arrived."""
        raw = uid_from_frame(uid)
        vs = self._view
        if vs is not None and view_id < vs.view_id:
            return
        if vs is None or view_id > vs.view_id:
            self._early.hold(view_id, sender, index, raw)
            return
        self._accept_uid(vs, sender, index, raw)

    def _accept_uid(self, vs: ViewComms, sender: int, index: int, uid: bytes) -> None:
        vs.comm_for_uid(sender, index)  # validates: its root, and this member one of its ranks
        if sender == self.member_id:
            raise ProtocolViolation("a unique id for this member's own communicator")
        with vs.cond:
            if vs.uids.setdefault((sender, index), uid) != uid:
                raise ProtocolViolation(f"member {sender} changed communicator {index}'s id")
            vs.cond.notify_all()

    def _setup(self, vs: ViewComms, loop: asyncio.AbstractEventLoop) -> None:
        """The view's setup thread: make this member's unique ids, then join its communicators
        in the shared order, each followed by its warm-up (DESIGN.md §6.7)."""
        self._cp.cuda.Device(self.device).use()
        for spec in vs.plan.get(self.member_id, ()):
            try:
                mine = uid_to_bytes(self._nccl.get_unique_id())
            except Exception as exc:  # its ranks time out waiting for it, and fail it
                self._post(loop, self._setup_failed, vs, spec, f"no unique id: {exc!r}")
                continue
            with vs.cond:
                vs.uids[(spec.root, spec.index)] = mine
            if not self._post(loop, self._send_uid, vs, spec, mine):
                return
        deadline = time.monotonic() + self._setup_timeout_s
        for spec in vs.order:
            name = (spec.root, spec.index)
            with vs.cond:
                while not vs.cancelled and name not in vs.uids:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    vs.cond.wait(left)
                if vs.cancelled:
                    return
                uid = vs.uids.get(name)
            if uid is None:
                self._post(loop, self._setup_failed, vs, spec,
                           f"no unique id from member {spec.root} in {self._setup_timeout_s} s")
                continue
            try:
                handle = self._join(len(spec.members), uid, spec.members.index(self.member_id))
            except Exception as exc:  # e.g. ncclInvalidUsage: two ranks on one GPU
                self._post(loop, self._setup_failed, vs, spec, f"joining failed: {exc!r}")
                continue
            with vs.cond:
                if vs.cancelled:
                    _abort(handle)
                    return
                vs.joining[name] = handle  # the loop aborts it if the view ends meanwhile
            try:
                stream = self._warm_up(handle, spec.root_rank)
            except Exception as exc:
                stream = None
                why = f"warming up failed: {exc!r}"
            with vs.cond:
                handle = vs.joining.pop(name, None)
            if handle is None:
                return  # aborted by the loop: the view ended
            if stream is None:
                _abort(handle)
                self._post(loop, self._setup_failed, vs, spec, why)
                continue
            if not self._post(loop, self._comm_up, vs, spec, handle, stream):
                _abort(handle)
                return

    def _warm_up(self, handle: Any, root: int) -> Any:
        """Make the communicator's stream and run two broadcasts (1 byte, then
        :data:`_WARM_UP_BYTES`) on it, waiting here for them. NCCL may connect a communicator's
        ranks on its first collectives (``NCCL_RUNTIME_CONNECT``, 2.22 and later), and that
        blocks the calling thread until every rank has issued them: it must happen on this
        thread, in the shared join order, and never on the event loop (where a root's first
        broadcast would wait for receivers that wait for its descriptor)."""
        cp = self._cp
        stream = cp.cuda.Stream(non_blocking=True)
        scratch = cp.empty(_WARM_UP_BYTES, cp.uint8)  # contents irrelevant: nobody reads them
        try:
            for nbytes in (1, _WARM_UP_BYTES):
                handle.broadcast(int(scratch.data.ptr), int(scratch.data.ptr), nbytes,
                                 self._uint8, root, stream.ptr)
        except BaseException:
            # a broadcast queued before the failure may still write into scratch, and waiting
            # for it could mean waiting for a dead rank: keep it (4 MiB) for the process's life
            self._parked.append((stream, scratch))
            raise
        stream.synchronize()
        del scratch  # after the broadcasts completed
        return stream

    def _join(self, nranks: int, uid: bytes, rank: int) -> Any:
        """``NcclCommunicator(nranks, uid, rank)``: blocks until every rank joined.

        Some CuPy releases take the unique id as 128 bytes (the H200 machine's does), others
        as a tuple of C chars, whose signedness is the platform's. The argument is checked
        before NCCL is called, so a rejected form costs nothing."""
        if self._uid_form != "tuple":
            try:
                handle = self._nccl.NcclCommunicator(nranks, uid, rank)
                self._uid_form = "bytes"
                return handle
            except TypeError:
                self._uid_form = "tuple"
        for signed in (self._signed_chars, not self._signed_chars):
            try:
                return self._nccl.NcclCommunicator(nranks, uid_to_tuple(uid, signed), rank)
            except OverflowError:  # this platform's C char has the other signedness
                self._signed_chars = not signed
        raise RuntimeError("a NCCL unique id fits neither char signedness")

    @staticmethod
    def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
        try:
            loop.call_soon_threadsafe(fn, *args)
            return True
        except RuntimeError:  # the loop is closed: nobody to tell
            return False

    def _send_uid(self, vs: ViewComms, spec: CommSpec, uid: bytes) -> None:
        if vs is not self._view or self._closed:
            return
        frame = env.encode(env.NCCL_UID, vs.view_id, spec.index, uid)
        for m in spec.members:
            if m != self.member_id:
                self._send(m, frame)

    def _setup_failed(self, vs: ViewComms, spec: CommSpec, why: str) -> None:
        comm = vs.comms[(spec.root, spec.index)]
        if comm.state != "setup":
            return
        comm.state, comm.why = "failed", why
        if vs is self._view and not self._closed:
            log.warning("member %d: NCCL communicator of member %d (%d ranks, view %d) failed "
                        "here; its messages take another plane: %s", self.member_id, spec.root,
                        len(spec.members), vs.view_id, why)
        if comm.waiting and spec.root != self.member_id:
            comm.waiting.clear()
            self._suspect(spec.root, f"its NCCL communicator failed here: {why}")

    def _comm_up(self, vs: ViewComms, spec: CommSpec, handle: Any, stream: Any) -> None:
        comm = vs.comms[(spec.root, spec.index)]
        if vs is not self._view or self._closed or comm.state != "setup":
            threading.Thread(target=_abort, args=(handle,), daemon=True).start()
            return
        comm.handle = handle
        comm.stream = stream
        comm.state = "ready"
        log.info("member %d: NCCL communicator of member %d up (%d ranks, view %d)",
                 self.member_id, spec.root, len(spec.members), vs.view_id)
        while comm.waiting:
            key, desc = comm.waiting.popleft()
            try:
                self._receive(comm, key, desc)
            except ProtocolViolation as exc:
                comm.waiting.clear()
                self._suspect(spec.root, str(exc))
                return

    def _end_view(self, vs: ViewComms) -> None:
        """Abort ``vs``'s communicators; free what their transfers held once drained."""
        with vs.cond:
            vs.cancelled = True
            warming = list(vs.joining.values())  # joined, warm-up in progress: abort those too
            vs.joining.clear()
            vs.cond.notify_all()
        for handle in warming:
            self.aborted += 1
            threading.Thread(target=_abort, args=(handle,), daemon=True,
                             name="derecho-nccl-abort").start()
        for comm in vs.comms.values():
            self._abort_comm(comm, "aborted", "its view ended")
        for key in [k for k in self._outgoing if k[0] <= vs.view_id]:
            del self._outgoing[key]  # held by the aborted comm's drain (see _abort_comm)

    def _abort_comm(self, comm: Comm, state: str, why: str) -> None:
        """Abort ``comm`` here (a daemon thread calls ncclCommAbort: it ends kernels waiting on
        a dead rank) and drop its transfers; their memory is freed once its stream drained."""
        if comm.state in ("aborted", "failed"):
            return
        comm.state, comm.why = state, why
        comm.waiting.clear()
        comm.oldest = None  # the watchdog's reference to a broadcast's closure (its arrays)
        handle, comm.handle = comm.handle, None
        held = list(comm.inflight)  # their closures hold the destination arrays
        held_out = [o for o in self._outgoing.values() if o.comm is comm]
        _, events = self._done.forget(comm)
        if handle is not None:
            self.aborted += 1
            threading.Thread(target=_abort, args=(handle,), daemon=True,
                             name="derecho-nccl-abort").start()
        if comm.stream is not None and (held or held_out):
            def drained() -> None:
                self._done.recycle(events)
                held.clear()
                held_out.clear()

            self._done.after_stream(drained, comm)
        if comm.waiter is not None:
            comm.waiter.stop()

    def _fail(self, comm: Comm, why: str) -> None:
        """A NCCL error on ``comm``: abort it here; a receiver reports the root as failed."""
        log.warning("member %d: NCCL communicator of member %d failed: %s", self.member_id,
                    comm.spec.root, why)
        self._abort_comm(comm, "failed", why)
        if comm.spec.root != self.member_id:
            self._suspect(comm.spec.root, f"its NCCL communicator failed here: {why}")

    # -- the GPU work ------------------------------------------------------------------------
    def _enqueue(self, comm: Comm, buffers: list[tuple[int, int]]) -> None:
        """Enqueue one in-place broadcast per non-empty (pointer, nbytes) on ``comm``'s stream,
        after the work now queued on the application's current stream."""
        if not any(n for _, n in buffers):
            return
        rt = self._rt
        stream = comm.stream
        current = self._cp.cuda.get_current_stream()
        rt.eventRecord(self._fence_event, current.ptr)
        rt.streamWaitEvent(stream.ptr, self._fence_event, 0)
        root = comm.spec.root_rank
        for ptr, nbytes in buffers:
            # in pieces: CuPy before 13.4 takes the count as a C int (under 2 GiB); root and
            # receivers cut the same buffers the same way, so their broadcasts still match
            for off in range(0, nbytes, _BROADCAST_PIECE):
                n = min(_BROADCAST_PIECE, nbytes - off)
                comm.handle.broadcast(ptr + off, ptr + off, n, self._uint8, root, stream.ptr)

    def _receive(self, comm: Comm, key: tuple[int, int, int], desc: Descriptor) -> None:
        """Allocate the arrays, enqueue the matching broadcasts, land them once complete."""
        cp = self._cp
        placed: list[tuple[ArraySpec, Any]] = []
        regions: list[tuple[int, int]] = []  # (pointer, bytes) the broadcasts write
        try:
            with cp.cuda.Device(self.device):  # the allocations: on this rank's device
                for spec in desc.arrays:
                    out = None if spec.segment != BROADCAST else cp.empty(spec.shape, spec.dtype)
                    placed.append((spec, out))
                    if out is not None:
                        regions.append((int(out.data.ptr), spec.nbytes))
            self._enqueue(comm, regions)
        except Exception as exc:
            if comm.stream is not None and any(out is not None for _, out in placed):
                # broadcasts queued before the failure may still write into these arrays
                try:
                    self._done.after_stream(placed.clear, comm)
                except Exception:  # a broken context: hold them for good rather than free
                    self._parked.append((comm.stream, list(placed)))
            self._abort_comm(comm, "failed", f"enqueueing a broadcast failed: {exc!r}")
            raise ProtocolViolation(
                f"cannot receive member {comm.spec.root}'s broadcast: {exc!r}") from exc
        if not regions:
            self._finish(key, desc.call, placed)
            return
        # the regions it writes: their size scales the receivers' stall watchdog
        self._done.track(comm, lambda: self._finish(key, desc.call, placed), regions)
        self._arm_check()

    def _finish(self, key: tuple[int, int, int], call: bytes,
                placed: list[tuple[ArraySpec, Any]]) -> None:
        try:
            arrays = tuple(inline_array(spec) if out is None else as_lib(out, spec.lib)
                           for spec, out in placed)
            if not self._closed:
                self.received += 1
                self._received_view += 1
                self._landed(key, OutOfBand(call, arrays))
        except Exception as exc:
            log.exception("landing device message %s failed", key)
            if self._failed is None:
                raise
            self._failed(key, exc)

    def poll(self) -> None:
        """Finish every tracked broadcast that has completed (called from the event loop)."""
        self._done.poll()

    # -- asynchronous errors -----------------------------------------------------------------
    def _arm_check(self) -> None:
        if self._check_handle is None and not self._closed and self._loop is not None:
            self._check_handle = self._loop.call_later(_ASYNC_CHECK_S, self._check_async)

    def _check_async(self) -> None:
        """While broadcasts are in flight, ask their communicators for asynchronous errors."""
        self._check_handle = None
        vs = self._view
        if vs is None or self._closed:
            return
        self._done.poll()  # completed work off the queues first: it is progress
        busy = [c for c in vs.comms.values() if c.inflight and c.handle is not None]
        for comm in vs.comms.values():
            if not comm.inflight:
                comm.oldest = None  # it holds a finished broadcast's closure (its arrays)
        now = time.monotonic()
        for comm in busy:
            try:
                comm.handle.check_async_error()
            except Exception as exc:  # NcclError: a rank is gone, or the network failed
                self._fail(comm, f"asynchronous NCCL error: {exc!r}")
                continue
            # A root that is alive but abandoned its side (its own NCCL error) reports nothing
            # and its broadcasts never complete here: past the stall limit without progress a
            # receiver gives up on it, which reports the root and becomes a view change.
            if comm.spec.root != self.member_id and comm.stalled(now, self._stall_s):
                self._fail(comm, f"no broadcast completed in {self._stall_s:.0f} s plus its "
                                 f"size at {STALL_FLOOR_BPS / 1e6:.0f} MB/s")
        if any(c.inflight for c in vs.comms.values()):
            self._arm_check()

    # -- introspection -----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Figures: communicators of the current view by state, messages sent and received by
        broadcast (received also in this view alone), sends still held, communicators
        aborted, unique ids held for future views."""
        comms = list(self._view.comms.values()) if self._view is not None else []
        return {
            "view": self._view.view_id if self._view is not None else -1,
            "communicators": len(comms),
            "ready": sum(1 for c in comms if c.state == "ready"),
            "failed": sum(1 for c in comms if c.state == "failed"),
            "sent": self.sent,
            "received": self.received,
            "received_this_view": self._received_view,
            "sending": len(self._outgoing),
            "aborted": self.aborted,
            "early_uids": len(self._early),
        }

    def communicator(self, root: int, index: int = 0) -> Comm | None:
        """This member's side of communicator (root, index) of the current view (tests)."""
        return self._view.comms.get((root, index)) if self._view is not None else None


def _abort(handle: Any) -> None:
    """``ncclCommAbort`` (on a daemon thread: it may wait for NCCL's own threads)."""
    try:
        handle.abort()
    except Exception as exc:
        log.debug("aborting a NCCL communicator: %r", exc)
