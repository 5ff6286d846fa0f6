"""The CUDA IPC plane: device arrays between members of one host, through pooled buffers.

Theory of operation (DESIGN.md §6.6). :class:`IpcPlane` is one class in four modules: its state
and device pool (:mod:`.ipc_pool`), its sending half (:mod:`.ipc_send`: stage or send in place,
descriptors out), its receiving half (:mod:`.ipc_receive`: copy into this member's pool, land),
and here the views (announce the pool, forget departed peers) and the
:class:`~derecho_async.runtime.plane.Plane` protocol the driver calls. Whenever a view is
installed (and whenever the pool grows) a member announces its pool's IPC handles to each peer;
receivers open them once, on first use, and close them when the peer leaves the view. No handle
travels per message, and the event loop never waits on the GPU.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from derecho_async.core import ViewInstalled
from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.dataplane import OutOfBand
from derecho_async.runtime.gpu.ipc_pool import Peer
from derecho_async.runtime.gpu.ipc_receive import IpcReceiving
from derecho_async.runtime.gpu.ipc_send import IpcSending
from derecho_async.runtime.gpu.pool import PoolAnnouncement
from derecho_async.wire import envelope as env

__all__ = ["IpcPlane"]

log = logging.getLogger("derecho_async.gpuplane")

_MAX_BATCH = 1 << 16  # descriptors in one GPU_BATCH frame (a step sends at most a window's worth)


class IpcPlane(IpcSending, IpcReceiving):
    """Moves device arrays between members of one host through pooled CUDA IPC buffers.

    A :class:`~derecho_async.runtime.plane.Plane` for the driver: it takes payloads with
    device arrays bound for peers that announced a pool. ``send(dst, frame)`` puts its frames
    on the reliable channel (the descriptors made in one turn of the loop go together);
    ``landed(key, payload)`` reports a message whose bytes are all here, ``failed(key, exc)`` one
    whose bytes came but whose arrays could not be made (it will never land), and
    ``landed_batch()`` follows each look at the copies that landed any (the driver takes its
    step then, so the frontier goes out at once). ``busy_poll_us`` and ``poll_interval_us``
    (``Config.gpu_busy_poll_us``, ``Config.gpu_poll_interval_us``) go to its
    :class:`~.completions.Completions`. See DESIGN.md §6.6.
    """

    kinds: tuple[int, ...] = (env.GPU_POOL, env.GPU_DATA, env.GPU_BATCH)

    # -- views -----------------------------------------------------------------------------
    def on_view(self, view_id: int, members: tuple[int, ...]) -> None:
        """A view was installed: announce the pool to its members, forget departed peers, and
        reclaim what older views' sends held."""
        self._done.loop = asyncio.get_running_loop()
        self._view_members = members
        old = [k for k in self._outgoing if k[0] < view_id]
        for key in old:
            self.release(key)
        if old:
            self._released += 1  # receivers' copies out of these may still be queued
        for m in [m for m in self._announced_to if m not in members]:
            del self._announced_to[m]  # one that comes back gets the announcement again
        for m in [p for p in self._peers if p not in members]:
            self._drop_peer(m)
        self._announce_all()

    def _drop_peer(self, member: int) -> None:
        """Forget a departed peer: once its stream has drained, free the regions its copies
        were writing and close its handles (never, if the stream stalled on its dead event)."""
        peer = self._peers.pop(member)
        self._flush_peer(peer)  # copies not yet tracked: forgotten with the rest
        regions, events = self._done.forget(peer)

        def drained() -> None:
            self._free_regions(regions)
            self._done.recycle(events)
            self._close_peers([peer])

        if peer.stream is None:
            drained()
        else:
            self._done.after_stream(drained, peer)
        if peer.waiter is not None:
            peer.waiter.stop()  # after the drain above (a stalled stream keeps it waiting)

    def on_announcement(self, sender: int, raw: bytes) -> None:
        """A peer's POOL announcement arrived."""
        ann = PoolAnnouncement.decode(raw)
        peer = self._peers.setdefault(sender, Peer())
        old = peer.announced
        if old is not None and (len(ann.segments) < len(old.segments)
                                or ann.segments[: len(old.segments)] != old.segments
                                or ann.events[: len(old.events)] != old.events):
            raise ProtocolViolation(f"member {sender} rewrote its announced pool")
        peer.announced = ann

    def peer_ready(self, member: int) -> bool:
        """Whether ``member`` announced a pool (so device arrays can go to it by IPC)."""
        p = self._peers.get(member)
        return p is not None and p.announced is not None

    def _close_peers(self, peers: list[Peer]) -> None:
        for p in peers:
            for ptr in p.mapped.values():
                try:
                    self._rt.ipcCloseMemHandle(ptr)
                except Exception as exc:  # the exporter is gone: nothing to give back
                    log.debug("closing a peer segment: %r", exc)
            for ev in p.events.values():
                try:
                    self._rt.eventDestroy(ev)
                except Exception as exc:
                    log.debug("destroying a peer event: %r", exc)

    # -- the Plane protocol ----------------------------------------------------------------
    def start(self, key: tuple[int, int, int], payload: object,
              targets: tuple[int, ...]) -> bool:
        """Take ``payload`` if it holds device arrays and every target announced a pool."""
        if type(payload) is not OutOfBand:
            return False
        peers = self._peers
        for m in targets:
            p = peers.get(m)
            if p is None or p.announced is None:  # peer_ready, inline: once per target
                return False
        infos = payload.infos()
        for info in infos:
            if info.is_gpu:
                self.send(key, payload, targets, infos)
                return True
        return False

    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        """One of this plane's frames arrived from ``sender``."""
        if msg[0] == env.GPU_POOL:
            self.on_announcement(sender, msg[1])
            return
        if msg[0] == env.GPU_BATCH:
            _, view_id, src, items = msg
            if src != sender:
                raise ProtocolViolation(f"device data for sender {src} relayed by {sender}")
            if len(items) % 2 or len(items) > 2 * _MAX_BATCH:
                raise ProtocolViolation(f"device descriptor batch of {len(items)} fields")
            for i in range(0, len(items), 2):
                msg_no, body = items[i], items[i + 1]
                if type(msg_no) is not int or not 0 <= msg_no < 1 << 63 or type(body) is not bytes:
                    raise ProtocolViolation("device descriptor batch entry is not [msg_no, bytes]")
                self.receive_descriptor(sender, (view_id, src, msg_no), body)
            return
        _, view_id, src, msg_no, body = msg
        if src != sender:
            raise ProtocolViolation(f"device data for sender {src} relayed by {sender}")
        self.receive_descriptor(sender, (view_id, src, msg_no), body)

    def on_own_delivered(self, key: tuple[int, int, int]) -> None:
        self.release(key)

    def on_event(self, event: object) -> None:
        if isinstance(event, ViewInstalled):
            self.on_view(event.view.view_id, event.view.members)

    def close(self) -> None:
        """Stop landing messages; pool memory is released when the process ends."""
        self._closed = True
        self._done.close()
        try:
            self._stream.synchronize()
        except Exception as exc:
            log.debug("synchronizing the plane's stream at close: %r", exc)
        # a peer's stream may have stalled on a dead member's event: close only idle ones
        idle = [p for p in self._peers.values()
                if p.stream is None or self._rt.streamQuery(p.stream.ptr) == 0]
        for p in self._peers.values():
            if p.waiter is not None:
                p.waiter.stop()
        self._peers.clear()
        self._close_peers(idle)
