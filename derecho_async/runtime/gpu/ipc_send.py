"""The CUDA IPC plane's sending half: arrays staged or sent in place, descriptors out.

Theory of operation (DESIGN.md §6.6). Each device array of a call that already lies in the
sender's pool (:meth:`~.ipc_pool.IpcPool.device_buffer`) goes in place; any other is copied into
a fresh pool region on the plane's blocking stream (so after what the application queued on the
default stream), and one interprocess event is recorded after the copies. When every array goes
in place and the application's current stream has nothing queued, the arrays are final: the
descriptor names no event (-1) and the sender's GPU does no work for the message. Descriptors
made in one turn of the loop go out together, one GPU_BATCH frame per target list. A message's
regions and event are freed when it is delivered here (stable: every receiver's copy is done) or
a later view is installed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from derecho_async.runtime.dataplane import ArrayInfo, OutOfBand
from derecho_async.runtime.gpu.descriptor import ArraySpec, Descriptor, inline_spec, new_spec
from derecho_async.runtime.gpu.ipc_pool import CUDA_MEMCPY_DEFAULT, IpcPool, Outgoing
from derecho_async.wire import envelope as env

__all__ = ["IpcSending"]

log = logging.getLogger("derecho_async.gpuplane")

_NO_SPEC = ArraySpec("cupy", "uint8", (), 0)  # a staged array's place until it has one


class IpcSending(IpcPool):
    """The sending half of :class:`~.ipc.IpcPlane`."""

    def send(self, key: tuple[int, int, int], payload: OutOfBand, targets: tuple[int, ...],
             infos: tuple[ArrayInfo, ...]) -> None:
        """Stage ``payload``'s device arrays (described by ``infos``) in the pool and send
        descriptors to ``targets``."""
        if self._reclaim:
            self.reclaim()
        # One pass over the arrays: host arrays go inline, device arrays in the pool go in
        # place, the others are staged below. ``infos`` already holds dtype, shape and size.
        specs: list[ArraySpec] = []
        keep: list[object] = []  # the device arrays, held until the message is delivered here
        staged: list[tuple[int, Any, str, ArrayInfo]] = []  # (spec index, array, lib, info)
        for a, info in zip(payload.arrays, infos, strict=True):
            if not info.is_gpu:
                specs.append(inline_spec(a, info))
                continue
            # CuPy as is; torch and others through __cuda_array_interface__ (no copy)
            arr: Any = a if type(a) is self._ndarray else self._cp.asarray(a)
            if not arr.flags.c_contiguous:
                arr = self._cp.ascontiguousarray(arr)  # queued on the current stream
            keep.append(arr)
            lib = "torch" if info.lib == "torch" else "cupy"
            nbytes = info.nbytes
            place = self._locate(arr.data.ptr, nbytes) if nbytes else None
            if place is None:
                staged.append((len(specs), arr, lib, info))
                specs.append(_NO_SPEC)
            else:
                specs.append(new_spec(ArraySpec, (lib, info.dtype, info.shape, nbytes, place[0],
                                                  place[1], None)))
        regions: list[tuple[int, int]] = []
        ev = -1
        rt = self._rt
        current = self._cp.cuda.get_current_stream()
        if staged or rt.streamQuery(current.ptr) != 0:
            # Staging copies, or the application's stream may still be writing an array sent in
            # place: order the copies after it and let receivers wait on an event. (Otherwise
            # the arrays are final already, and receivers copy at once: no work of this
            # process's GPU context stands between the receivers' copies.)
            stream = self._stream
            if current.ptr != 0 and current.ptr != stream.ptr:
                stream.wait_event(current.record())
            for i, arr, lib, info in staged:
                nbytes = info.nbytes
                seg, off = self._alloc(nbytes)
                regions.append((seg, off))
                if nbytes:
                    rt.memcpyAsync(self._segments[seg].ptr + off, arr.data.ptr, nbytes,
                                   CUDA_MEMCPY_DEFAULT, stream.ptr)
                specs[i] = new_spec(ArraySpec, (lib, info.dtype, info.shape, nbytes, seg, off,
                                                None))
            if not self._free_events:
                self._grow_events()
                self._announce_all()
            ev = self._free_events.pop()
            rt.eventRecord(self._events[ev], stream.ptr)
        self._outgoing[key] = Outgoing(regions, ev, tuple(keep))
        body = Descriptor(payload.call, ev, tuple(specs)).encode()
        out = self._desc_out
        if not out:  # the first of this turn: send them all once the step that makes them ends
            (self._done.loop or asyncio.get_running_loop()).call_soon(self._send_queued)
        pending = out.get(targets)
        if pending is None:
            out[targets] = [(key, body)]
        else:
            pending.append((key, body))

    def _send_queued(self) -> None:
        """Send the descriptors made since the last turn: one frame per target list."""
        out, self._desc_out = self._desc_out, {}
        if self._closed:
            return
        for targets, items in out.items():
            try:
                for frame in self._frames(items):
                    for dst in targets:
                        self._send(dst, frame)
            except Exception:  # a closing transport: the others still go out
                log.exception("sending %d device descriptors to %s failed", len(items), targets)

    @staticmethod
    def _frames(items: list[tuple[tuple[int, int, int], bytes]]) -> list[bytes]:
        """GPU_DATA for one descriptor; GPU_BATCH for several of one view (a view change inside
        a turn splits them)."""
        if len(items) == 1:
            (key, body), = items
            return [env.encode(env.GPU_DATA, *key, body)]
        frames: list[bytes] = []
        start = 0
        for i in range(1, len(items) + 1):
            if i == len(items) or items[i][0][0] != items[start][0][0]:
                view_id, sender, _ = items[start][0]
                flat: list[object] = []
                for key, body in items[start:i]:
                    flat += (key[2], body)
                frames.append(env.encode(env.GPU_BATCH, view_id, sender, flat))
                start = i
        return frames

    def release(self, key: tuple[int, int, int]) -> None:
        """The message ``key`` was delivered here (or its view ended): free what it held."""
        out = self._outgoing.pop(key, None)
        if out is None:
            return
        for seg, off in out.regions:
            self._segments[seg].alloc.free(off)
        if out.event >= 0:
            self._free_events.append(out.event)
