"""The tcp data plane: a pipelined chain multicast of large host payloads, in blocks.

Theory of operation (RDMC's chain schedule). The sender lays the payload out flat
(:func:`~.dataplane.write_flat`) and cuts it into blocks of ``block_size`` bytes. The *chain* is
the targets ordered from the sender's id upward, wrapping around (deterministic from the view,
and different senders start at different members). The sender sends every block to the first
member of the chain only; each member, as soon as a block arrives and checks out, forwards the
very same frame to its successor and copies the block into its assembly buffer. So the sender's
link carries the payload once whatever the group size, and with ``k`` blocks the last member
has it after ``k + len(chain) - 1`` block times instead of ``len(chain) * k``. A payload of one
block has nothing to pipeline: the sender sends it to every target itself, each frame naming a
chain of one, so nobody waits for a relay.

Frames (channel messages)::

    [BLOCK, view_id, origin, msg_no, index, count, total, head, block]

``head`` is non-empty in block 0 only: msgpack ``[chain, meta, block_size]``. A receiver checks
every header before using it: block 0 opens an assembly (the chain is distinct ids in the order
every sender uses, members of the view with the origin, holds this member but not the origin,
and the frame came from this member's predecessor, so no member can inject a message of another
origin ahead of itself in that origin's chain; relays are trusted with what they forward, as in
any chain; the view is at most one ahead of the installed one; at most ``_MAX_ASSEMBLIES`` are
open per origin, and the receive buffer is taken only once all of this checked out; the meta's layout
is exactly ``total`` bytes; ``count`` and every block length follow from ``total`` and
``block_size``); every later block must come from the same predecessor, in order, with the same
``count`` and ``total``. Anything else is a :class:`ProtocolViolation` (the driver drops the
frame and reports the sender). A receive buffer this member cannot allocate for a valid header
is its own failure, not the sender's: the error propagates and the driver makes this member
leave the group, so the others are neither held up nor made to evict a healthy sender.

Pacing: every frame on a link shares one ordered stream with that link's row pushes, so a
sender queues at most ``_PACE_BYTES`` of blocks at a time on its first link and waits until the
transport handed them to the kernel (``TcpTransport.flushed``) before queuing more; heartbeats
and ordering pushes interleave with the blocks instead of waiting behind a whole payload.
Relays forward at the rate blocks arrive.

Large payloads: a call of at least ``OFF_LOOP_BYTES`` is laid out flat in the loop's default
executor (numpy copies, without the GIL), and its blocks go out once that is done (not at all if
a newer view made the message moot meanwhile; a failure makes the sender leave, as a failed
staging does). A receiver's buffer for such a payload is not populated up front (that system
call holds the GIL): its pages fault in as the blocks are copied in.

Failures: a relay that crashes stops the flow downstream, so its successors never land the
message. The core then counts it as not received there: the ragged trim delivers it at every
survivor or at none, and a surviving sender re-sends it in the next view under a new key.
Assemblies of views older than the installed one are dropped when it is installed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgpack  # type: ignore[import-untyped]

from derecho_async.core.effects import ViewInstalled
from derecho_async.errors import ProtocolViolation
from derecho_async.runtime.dataplane import (
    OFF_LOOP_BYTES,
    FlatLayout,
    RecvBuffers,
    flat_layout,
    flat_meta,
    read_flat,
    write_flat,
)
from derecho_async.wire import envelope as env

if TYPE_CHECKING:
    from derecho_async.transport.registry import PlaneWiring

__all__ = ["ChainPlane", "chain_order", "for_transport"]

log = logging.getLogger("derecho_async.dataplane")

Key = tuple[int, int, int]

BLOCK_SIZE = 1 << 20
#: bytes a sender queues on its first link before waiting for the kernel to take them
_PACE_BYTES = 4 << 20
_MIN_BLOCK = 4096
_MAX_BLOCK = 64 << 20
_MAX_CHAIN = 4096
_MAX_ASSEMBLIES = 1024  # messages of one origin being assembled at once
_MAX_TOTAL = (1 << 30) + (64 << 20)  # a payload's flat bytes: 1 GiB of data plus its layout


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The running event loop, if any (without one, large payloads are laid out on the spot)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def chain_order(sender: int, targets: tuple[int, ...]) -> list[int]:
    """The chain for ``sender``: targets above it ascending, then those below it ascending."""
    return sorted(t for t in targets if t > sender) + sorted(t for t in targets if t < sender)


@dataclass(slots=True)
class _Assembly:
    predecessor: int
    successor: int | None
    layout: FlatLayout
    block_size: int
    count: int
    total: int
    chain: tuple[int, ...]
    next: int = 0
    parts: list[bytes] = field(default_factory=list)  # plain payloads: joined at the end
    buf: Any = None  # calls: a uint8 array from RecvBuffers, blocks copied in place


class ChainPlane:
    """Large host payloads as a pipelined chain multicast in blocks (see the module docstring)."""

    kinds: tuple[int, ...] = (env.BLOCK,)

    def __init__(
        self,
        member_id: int,
        send: Callable[[int, bytes], None],
        landed: Callable[[Key, object], None],
        block_size: int = BLOCK_SIZE,
        flushed: Callable[[int], Awaitable[None]] | None = None,
        *,
        staging_failed: Callable[[Key, BaseException], None] | None = None,
    ) -> None:
        if not _MIN_BLOCK <= block_size <= _MAX_BLOCK:
            raise ValueError(f"block_size {block_size}")
        self.member_id = member_id
        self.block_size = block_size
        self._send = send
        self._landed = landed
        self.sent = 0  # payloads this member started (statistics, tests)
        self.landed = 0  # payloads that landed here
        self.assemblies: dict[Key, _Assembly] = {}
        self._flushed = flushed
        self._staging_failed = staging_failed
        self._staging: dict[Key, asyncio.Future[Any]] = {}  # large calls being laid out
        self._closed = False
        self._pumps: set[asyncio.Task[None]] = set()
        self.buffers = RecvBuffers()
        self._view_id = -1
        self._members: frozenset[int] = frozenset()
        self._open_per_origin: dict[int, int] = {}

    # -- sending -------------------------------------------------------------------------------
    def start(self, key: Key, payload: object, targets: tuple[int, ...]) -> bool:
        meta = flat_meta(payload)
        if meta is None:
            return False
        if not targets:
            return True
        layout = flat_layout(meta)
        chain = chain_order(self.member_id, targets)
        if layout.plain:
            flat = memoryview(payload).cast("B")  # type: ignore[arg-type]
        else:
            loop = _running_loop() if layout.total >= OFF_LOOP_BYTES else None
            if loop is not None:  # laid out off the loop; the blocks go out once it is done
                fut = loop.run_in_executor(None, self._stage, payload, layout)
                self._staging[key] = fut
                fut.add_done_callback(functools.partial(self._staged, key, meta, chain))
                self.sent += 1
                return True
            staged = self.buffers.take(layout.total)  # recycled once the frames are built
            flat = memoryview(staged)
            write_flat(payload, layout, flat)
        self.sent += 1
        self._send_blocks(key, meta, layout.total, chain, flat)
        return True

    def _stage(self, payload: object, layout: FlatLayout) -> memoryview:
        """In a worker thread: ``payload`` laid out flat in a new buffer."""
        staged = self.buffers.take(layout.total, populate=False)
        flat = memoryview(staged)
        write_flat(payload, layout, flat)
        return flat

    def _staged(self, key: Key, meta: list[Any], chain: list[int],
                fut: asyncio.Future[memoryview]) -> None:
        """On the loop: the layout of ``key`` is done; send its blocks (unless it failed, the
        plane closed, or a newer view made the message moot)."""
        self._staging.pop(key, None)
        if self._closed or fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.error("member %d: laying out %s failed: %r", self.member_id, key, exc)
            if self._staging_failed is not None:
                self._staging_failed(key, exc)
            return
        if key[0] < self._view_id:
            return  # superseded: re-sent under a new key if its sender survives
        flat = fut.result()
        self._send_blocks(key, meta, len(flat), chain, flat)

    def _send_blocks(self, key: Key, meta: list[Any], total: int, chain: list[int],
                     flat: memoryview) -> None:
        """Send the ``total`` flat bytes of ``key`` down ``chain`` (see the module docstring)."""
        bs = self.block_size
        count = max(1, -(-total // bs))
        if count == 1:
            # One block: nothing to pipeline, so each target gets it straight from the sender
            # (a chain of one) and nobody waits for a relay.
            for t in chain:
                head = msgpack.packb([[t], meta, bs], use_bin_type=True)
                self._send(t, env.encode(env.BLOCK, *key, 0, 1, total, head, flat))
            return
        head = msgpack.packb([chain, meta, bs], use_bin_type=True)
        first = chain[0]

        def frame(i: int) -> bytes:
            block = flat[i * bs : min(total, (i + 1) * bs)]
            return env.encode(env.BLOCK, *key, i, count, total, head if i == 0 else b"", block)

        if self._flushed is None or count * bs <= _PACE_BYTES:
            for i in range(count):
                self._send(first, frame(i))
        else:
            task = asyncio.get_running_loop().create_task(self._pump(key, first, count, frame))
            self._pumps.add(task)
            task.add_done_callback(self._pump_done)

    async def _pump(
        self, key: Key, first: int, count: int, frame: Callable[[int], bytes]
    ) -> None:
        """Send the blocks of ``key`` with at most ``_PACE_BYTES`` queued on the link beyond
        what the kernel holds; gives up when a newer view makes the message moot."""
        assert self._flushed is not None
        queued = 0
        for i in range(count):
            if key[0] < self._view_id:
                return  # superseded: re-sent under a new key if its sender survives
            data = frame(i)
            self._send(first, data)
            queued += len(data)
            if queued >= _PACE_BYTES and i + 1 < count:
                await self._flushed(first)
                queued = 0

    def _pump_done(self, task: asyncio.Task[None]) -> None:
        self._pumps.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("member %d: sending blocks failed: %r", self.member_id, task.exception())

    def on_own_delivered(self, key: Key) -> None:
        pass  # nothing held: the frames were handed to the transport

    def on_event(self, event: object) -> None:
        if isinstance(event, ViewInstalled):
            self._view_id = vid = event.view.view_id
            self._members = frozenset(event.view.members)
            for key in [k for k in self.assemblies if k[0] < vid]:
                self._forget(key)

    def _forget(self, key: Key) -> None:
        del self.assemblies[key]
        left = self._open_per_origin[key[1]] - 1
        if left:
            self._open_per_origin[key[1]] = left
        else:
            del self._open_per_origin[key[1]]

    # -- receiving -----------------------------------------------------------------------------
    def receive(self, sender: int, msg: list[Any], raw: bytes) -> None:
        _, view_id, origin, msg_no, index, count, total, head, block = msg
        key = (view_id, origin, msg_no)
        st = self.assemblies.get(key)
        if index == 0:
            if st is not None:
                raise ProtocolViolation(f"block 0 of {key} arrived twice")
            if view_id > self._view_id + 1:
                raise ProtocolViolation(f"block of view {view_id} in view {self._view_id}")
            st = self._open(sender, origin, count, total, head)
            if view_id == self._view_id and not ({origin, *st.chain} <= self._members):
                raise ProtocolViolation(f"block chain {st.chain} of {origin} outside the view")
            if view_id < self._view_id:
                st = None  # a message of an old view: nobody needs it any more
            elif self._open_per_origin.get(origin, 0) >= _MAX_ASSEMBLIES:
                raise ProtocolViolation(
                    f"more than {_MAX_ASSEMBLIES} large messages of {origin} at once"
                )
            elif not st.layout.plain:
                # Only now, with every header checked. ``total`` is bounded by _MAX_TOTAL, so
                # a failure here is this member's (out of memory): it propagates, and the
                # driver makes this member leave rather than blame the sender. A large one is
                # not populated here (on the loop): its pages fault in block by block.
                take = self.buffers.take
                st.buf = take(total) if total < OFF_LOOP_BYTES else take(total, populate=False)
        else:
            if st is None:
                if view_id < self._view_id:
                    return  # dropped at the view change; nobody downstream needs it any more
                raise ProtocolViolation(f"block {index} of {key} without block 0")
            if head or index != st.next or count != st.count or total != st.total:
                raise ProtocolViolation(
                    f"block {index}/{count} of {total} bytes for {key}; expected block "
                    f"{st.next}/{st.count} of {st.total}"
                )
            if sender != st.predecessor:
                raise ProtocolViolation(f"block of {key} from {sender}, not {st.predecessor}")
        assert st is not None or index == 0
        if st is None:
            return
        want = st.block_size if index < st.count - 1 else st.total - st.block_size * index
        if len(block) != want:
            raise ProtocolViolation(f"block {index} of {key} has {len(block)} bytes, not {want}")
        if index == 0:
            self.assemblies[key] = st
            self._open_per_origin[origin] = self._open_per_origin.get(origin, 0) + 1
        if st.successor is not None:
            self._send(st.successor, raw)
        if st.buf is not None:
            off = index * st.block_size
            memoryview(st.buf)[off : off + len(block)] = block
        else:
            st.parts.append(block)
        st.next = index + 1
        if st.next == st.count:
            self._forget(key)
            if st.buf is not None:
                payload = read_flat(st.layout, None, owned=st.buf)
            else:
                payload = read_flat(st.layout, b"".join(st.parts))
            self.landed += 1
            self._landed(key, payload)

    def _open(self, sender: int, origin: int, count: int, total: int, head: bytes) -> _Assembly:
        try:
            parsed = msgpack.unpackb(head, raw=False, use_list=True, strict_map_key=True)
        except Exception as exc:
            raise ProtocolViolation(f"undecodable block head: {exc}") from exc
        if not (isinstance(parsed, list) and len(parsed) == 3):
            raise ProtocolViolation("block head must be [chain, meta, block_size]")
        chain, meta, bs = parsed
        if (
            not isinstance(chain, list)
            or not 0 < len(chain) <= _MAX_CHAIN
            or not all(type(m) is int and 0 <= m < 1 << 63 for m in chain)
            or len(set(chain)) != len(chain)
            or origin in chain
            or self.member_id not in chain
            or chain != chain_order(origin, tuple(chain))
        ):
            # the order is the one every sender uses, so a member can only ever be fed by the
            # member just before it in its origin's chain
            raise ProtocolViolation(f"bad block chain {chain!r:.200}")
        if type(total) is not int or not 0 < total <= _MAX_TOTAL:
            raise ProtocolViolation(f"block head announces {total!r} bytes")
        if type(bs) is not int or not _MIN_BLOCK <= bs <= _MAX_BLOCK:
            raise ProtocolViolation(f"bad block size {bs!r}")
        layout = flat_layout(meta, limit=total)
        if layout.total != total:
            raise ProtocolViolation(f"block head: {total} bytes, its meta says {layout.total}")
        if count != max(1, -(-total // bs)):
            raise ProtocolViolation(f"{count} blocks of {bs} bytes for {total} bytes")
        pos = chain.index(self.member_id)
        predecessor = origin if pos == 0 else chain[pos - 1]
        if sender != predecessor:
            raise ProtocolViolation(f"block 0 from {sender}, the chain says {predecessor}")
        successor = chain[pos + 1] if pos + 1 < len(chain) else None
        return _Assembly(predecessor, successor, layout, bs, count, total, tuple(chain))

    def close(self) -> None:
        self._closed = True
        for fut in self._staging.values():
            fut.cancel()  # a layout under way ends in its thread; nothing is sent after it
        self._staging.clear()
        self.assemblies.clear()
        self._open_per_origin.clear()
        for task in self._pumps:
            task.cancel()
        self._pumps.clear()


def for_transport(wiring: PlaneWiring) -> ChainPlane | None:
    """The bulk plane of a tcp transport (see ``transport.registry``); None for another kind
    of transport object (host staging then moves its payloads)."""
    from derecho_async.transport.tcp import TcpTransport

    t = wiring.transport
    if not isinstance(t, TcpTransport):
        return None
    return ChainPlane(wiring.member_id, t.send, wiring.landed, flushed=t.flushed,
                      staging_failed=wiring.staging_failed)
