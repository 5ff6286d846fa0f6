"""The CUDA IPC plane's receiving half: descriptors in, copies into this member's pool, landing.

Theory of operation (DESIGN.md §6.6). A descriptor is checked against what its sender announced,
and each announced segment's size against the allocation its handle opens (once, when it is
mapped): what breaks these rules, or a handle that cannot be opened, is the sender's fault (a
ProtocolViolation); an allocation or a copy that fails here is this member's, and it leaves.
Each array is copied into a region of this member's own pool on a *non-blocking* stream kept
per sender, which waits on the sender's event: a dead sender stalls only its own copies. The
copies issued for a sender until the loop's next turn are tracked by one event
(:class:`~.completions.Completions`); once they are done the loop rebuilds arrays of the
sender's kind over the copied regions and lands the message.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
from collections.abc import Callable
from typing import Any

from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.dataplane import OutOfBand
from derecho_async.runtime.gpu.descriptor import ArraySpec, Descriptor, as_lib, inline_array
from derecho_async.runtime.gpu.ipc_pool import CUDA_MEMCPY_DEFAULT, IpcPool, Peer

__all__ = ["IpcReceiving"]

log = logging.getLogger("derecho_async.gpuplane")

_BATCH_BYTES = 8 << 20  # copies tracked by one event at most (see IpcPlane.receive_descriptor)
_IPC_LAZY_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
# CUDA runtime error codes (CuPy's CUDARuntimeError.status) that say this process or its device
# cannot take on more, or cannot work at all, rather than that a handle it was given is bad: when
# opening a peer's IPC handle fails with one of these, the receiver is at fault (_open_peer).
_LOCAL_CUDA_ERRORS = frozenset({
    2,  # cudaErrorMemoryAllocation
    3,  # cudaErrorInitializationError
    4,  # cudaErrorCudartUnloading
    35,  # cudaErrorInsufficientDriver
    46,  # cudaErrorDevicesUnavailable
    100,  # cudaErrorNoDevice
    101,  # cudaErrorInvalidDevice
    700,  # cudaErrorIllegalAddress (sticky: this process's context is lost)
    719,  # cudaErrorLaunchFailure (sticky)
})


class IpcReceiving(IpcPool):
    """The receiving half of :class:`~.ipc.IpcPlane`."""

    def receive_descriptor(self, sender: int, key: tuple[int, int, int], raw: bytes) -> None:
        """A descriptor arrived: copy its arrays into this member's pool, then land them."""
        peer = self._peers.get(sender)
        desc = Descriptor.decode(raw, peer.announced if peer is not None else None)
        if self._reclaim:
            self.reclaim()
        stream = 0  # the pointer of the peer's stream, once the first device array is met
        copied = 0  # bytes of the copies issued for this message
        placed: list[tuple[ArraySpec, int, int]] = []  # (spec, seg, off); seg -1: inline
        try:
            for spec in desc.arrays:
                segment = spec.segment
                if segment < 0:
                    placed.append((spec, -1, 0))
                    continue
                assert peer is not None and peer.announced is not None  # decode checked it
                if not stream:
                    stream = self._stream_for(peer).ptr
                    if desc.event >= 0:  # -1: the sender's arrays were final when it sent
                        ev = peer.events.get(desc.event)
                        if ev is None:
                            ev = self._open_peer(sender, self._rt.ipcOpenEventHandle,
                                                 peer.announced.events[desc.event])
                            peer.events[desc.event] = ev
                        self._rt.streamWaitEvent(stream, ev, 0)
                base = peer.mapped.get(segment)
                if base is None:
                    base = self._map_segment(sender, peer, segment)
                nbytes = spec.nbytes
                seg, off = self._alloc(nbytes)
                placed.append((spec, seg, off))
                if nbytes:
                    self._rt.memcpyAsync(self._segments[seg].ptr + off, base + spec.offset,
                                         nbytes, CUDA_MEMCPY_DEFAULT, stream)
                    copied += nbytes
        except Exception:
            # A handle that cannot be opened is the sender's fault (_open_peer says so, unless
            # the failure is this process's own); an allocation or a copy that fails is this
            # member's, and the driver makes it leave.
            regions = [(seg, off) for _, seg, off in placed if seg >= 0]
            if regions:  # copies into them may be queued: free them once the stream is past
                assert peer is not None
                try:
                    self._done.after_stream(lambda: self._free_regions(regions), peer)
                except Exception:
                    # The device fails this too: the regions stay taken (a queued copy may
                    # still write them), and the error raised is the first one, which the
                    # member leaves for.
                    log.exception("member %d: the regions of %s stay taken", self.member_id,
                                  key)
            raise
        if not stream:  # no device arrays: nothing to wait for
            self._finish(key, desc.call, placed)
            return
        assert peer is not None
        # Tracked in batches: one event per peer for the copies issued until the loop's next
        # turn (descriptors arrive in bursts; for small copies an event record and query cost
        # about as much as the copy's own call). Copies of _BATCH_BYTES or more close the batch
        # at once: a message held back until a later large copy finished would land late.
        batch = peer.batch
        batch.append((key, desc.call, placed))
        peer.batch_bytes += copied
        if peer.batch_bytes >= _BATCH_BYTES:
            self._flush_peer(peer)
        elif len(batch) == 1:  # the first of this peer's batch: flush it at the next turn
            if not self._unflushed:
                (self._done.loop or asyncio.get_running_loop()).call_soon(self._flush)
            self._unflushed[peer] = None

    def _map_segment(self, sender: int, peer: Peer, index: int) -> int:
        """Map ``sender``'s announced segment ``index`` here, once. The announced size is
        checked against the allocation the handle opens (the driver knows its extent): every
        copy is bounded by the announced size, so a larger claim would let a sender make its
        receivers read past its memory."""
        assert peer.announced is not None
        size, handle = peer.announced.segments[index]
        base = self._open_peer(sender, self._rt.ipcOpenMemHandle, handle, _IPC_LAZY_PEER_ACCESS)
        end = _allocation_end(base)
        if end is not None and end - base < size:
            try:
                self._rt.ipcCloseMemHandle(base)
            except Exception as exc:
                log.debug("closing a refused peer segment: %r", exc)
            raise ProtocolViolation(
                f"member {sender} announced a segment of {size} bytes; its memory holds "
                f"{end - base}")
        peer.mapped[index] = base
        return base

    @staticmethod
    def _open_peer(sender: int, opener: Callable[..., Any], *args: object) -> int:
        """Open one of ``sender``'s announced IPC handles here. A handle that does not open is
        the sender's fault, a ProtocolViolation (the exporter is gone, is not on this host, or
        sent a bad handle: its messages cannot land here); a failure that says this process or
        its device cannot take on more (:data:`_LOCAL_CUDA_ERRORS`, MemoryError) is raised as
        is: the fault is this member's, and it leaves rather than have the sender removed."""
        try:
            return int(opener(*args))
        except Exception as exc:
            if isinstance(exc, MemoryError) or getattr(exc, "status", None) in _LOCAL_CUDA_ERRORS:
                raise
            raise ProtocolViolation(
                f"cannot map member {sender}'s device memory: {exc!r}") from exc

    def _flush(self) -> None:
        """Track the copies issued since the last flush: one completion per peer."""
        peers, self._unflushed = self._unflushed, {}
        for peer in peers:
            self._flush_peer(peer)

    def _flush_peer(self, peer: Peer) -> None:
        items, peer.batch = peer.batch, []
        peer.batch_bytes = 0
        if items and not self._closed:
            regions = [(seg, off) for _, _, placed in items for _, seg, off in placed if seg >= 0]
            self._done.track(peer, functools.partial(self._finish_batch, items), regions)

    def _finish_batch(
        self, items: list[tuple[tuple[int, int, int], bytes, list[tuple[ArraySpec, int, int]]]]
    ) -> None:
        for key, call, placed in items:
            try:
                self._finish(key, call, placed)
            except Exception as exc:  # the others of the batch still land
                log.exception("landing device message %s failed", key)
                if self._failed is not None:
                    self._failed(key, exc)

    def _stream_for(self, peer: Peer) -> Any:
        """The stream of ``peer``'s copies, fenced after the last use of reclaimed memory."""
        stream = peer.stream
        if stream is None:
            stream = peer.stream = self._cp.cuda.Stream(non_blocking=True)
        if peer.fenced != (self._reclaimed, self._released):
            rt = self._rt
            if peer.fenced[0] != self._reclaimed:
                rt.eventRecord(self._fence_event, self._cp.cuda.get_current_stream().ptr)
                rt.streamWaitEvent(stream.ptr, self._fence_event, 0)
            if peer.fenced[1] != self._released:
                rt.eventRecord(self._fence_event, self._stream.ptr)
                rt.streamWaitEvent(stream.ptr, self._fence_event, 0)
            peer.fenced = (self._reclaimed, self._released)
        return stream

    def poll(self) -> None:
        """Finish every tracked copy that has completed (called from the event loop)."""
        self._done.poll()

    def _finish(self, key: tuple[int, int, int], call: bytes,
                placed: list[tuple[ArraySpec, int, int]]) -> None:
        arrays: list[object] = []
        for i, (spec, seg, off) in enumerate(placed):
            try:
                if seg < 0:
                    arrays.append(inline_array(spec))
                    continue
                arrays.append(as_lib(self._array_over(seg, off, spec.shape, spec.dtype,
                                                      spec.nbytes), spec.lib))
            except BaseException:
                # The arrays made so far, and this one's region once its owner exists (the
                # first thing _array_over makes), go back when collected; the regions of the
                # arrays not yet reached are freed here. The caller reports the failure.
                self._free_regions([(sg, of) for _, sg, of in placed[i + 1:] if sg >= 0])
                raise
        if not self._closed:
            self._landed(key, OutOfBand(call, tuple(arrays)))


@functools.cache
def _address_range() -> Any:
    """The driver's ``cuMemGetAddressRange_v2`` (through ctypes: CuPy does not wrap it), or None
    where the driver library cannot be loaded (then announced sizes go unchecked, said once)."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemGetAddressRange_v2
    except (OSError, AttributeError) as exc:
        log.warning("cannot check peers' announced segment sizes (no cuMemGetAddressRange): %r",
                    exc)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                   ctypes.c_uint64]
    return fn


def _allocation_end(ptr: int) -> int | None:
    """The end address of the device allocation that holds ``ptr``, or None if unknown."""
    fn = _address_range()
    if fn is None:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    return int(base.value) + int(size.value)

