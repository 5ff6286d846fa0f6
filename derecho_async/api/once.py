"""Exactly once for external clients' calls: what each client's ordered calls did, per subgroup.

Theory of operation (docs/DESIGN.md §7.16): a client numbers its ordered calls to a subgroup
0, 1, 2, ... and never has a call ``seq`` unanswered while it sends one at ``seq + WINDOW`` or
later. Its relay multicasts each call tagged with ``(client id, seq)`` (``wire.client_call``).
Every member asks its :class:`ClientCalls` at delivery: the first delivery of a ``(client,
seq)`` runs the handler and keeps its outcome (the encoded reply); a later one (the client
retried through another relay after the first failed, and both copies were delivered) runs
nothing and answers the kept outcome, once the first has finished. A ``seq`` at or below the
client's highest minus ``WINDOW`` was answered to the client already: a stale copy, answered
with an error and not run. Outcomes below that line are forgotten, and clients beyond
``MAX_CLIENTS`` are forgotten least recently delivered first, so the table is bounded.

The table is replicated state: every member builds it from the same calls in the same order
(a replay of the log included), and it travels with the actor's state: a state transfer
carries it beside the snapshots, a durable snapshot holds it (:func:`state_bytes`).
"""

from __future__ import annotations

import asyncio
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from derecho_async import wire
from derecho_async.errors import ProtocolViolation

__all__ = ["MAX_CLIENTS", "WINDOW", "ClientCalls", "Numbering", "Outcome", "restore_bytes",
           "state_bytes"]

WINDOW: Final = 1024
"""A client's ordered calls to one subgroup that may be unanswered at once, at most."""
MAX_CLIENTS: Final = 1 << 16
"""Clients a subgroup's table keeps, at most (the least recently delivered is forgotten)."""
MAX_OUTCOME_BYTES: Final = 1 << 20
"""An outcome larger than this is not kept: a retried copy is answered with an error."""

Outcome = tuple[bool, bytes]
"""A call's outcome as it travels back: ``(ok, encoded result or [type name, message])``."""
Waiter = Callable[[bool, bytes], None]

_STALE: Final[Outcome] = (False, wire.encode(["DuplicateCall", "a retried copy of a call "
                                              "already answered: not run again"]))
_TOO_LARGE: Final[Outcome] = (False, wire.encode(["DuplicateCall", "a retried copy of a call "
                                                  "that ran: its result was too large to keep"]))
# A durable snapshot that also holds a client table starts with 0xc1, a byte msgpack never
# begins a value with: an actor's own snapshot (every other) is read as it always was.
_TABLE_MARK: Final = b"\xc1"
_LEN: Final = struct.Struct(">I")


class _Client:
    __slots__ = ("hi", "kept")

    def __init__(self) -> None:
        self.hi = -1  # the highest seq delivered
        self.kept: dict[int, Outcome | list[Waiter]] = {}  # seq -> outcome, or its waiters


class ClientCalls:
    """One subgroup's table (see the module header)."""

    __slots__ = ("_clients",)

    def __init__(self) -> None:
        self._clients: OrderedDict[bytes, _Client] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def admit(self, client: bytes, seq: int) -> Outcome | list[Waiter] | None:
        """At a delivery of ``(client, seq)``: None when it is the first (run it, then call
        :meth:`done`); else its outcome, or the list of those waiting for it (append yours)."""
        entry = self._clients.get(client)
        if entry is None:
            entry = self._clients[client] = _Client()
            if len(self._clients) > MAX_CLIENTS:
                self._clients.popitem(last=False)
        else:
            self._clients.move_to_end(client)
        if seq <= entry.hi - WINDOW:
            return _STALE
        kept = entry.kept.get(seq)
        if kept is not None:
            return kept
        entry.kept[seq] = []
        if seq > entry.hi:
            entry.hi = seq
            floor = seq - WINDOW
            if len(entry.kept) > WINDOW:
                for old in [s for s, o in entry.kept.items()
                            if s <= floor and type(o) is tuple]:
                    del entry.kept[old]
        return None

    def done(self, client: bytes, seq: int, ok: bool, body: bytes) -> None:
        """The first delivery of ``(client, seq)`` finished here with this outcome: keep it,
        and answer those waiting for it."""
        entry = self._clients.get(client)
        if entry is None:
            return
        waiting = entry.kept.get(seq)
        if type(waiting) is not list:
            return
        outcome = (ok, body) if len(body) <= MAX_OUTCOME_BYTES else _TOO_LARGE
        entry.kept[seq] = outcome
        for waiter in waiting:
            waiter(*outcome)

    # -- as replicated state ---------------------------------------------------------------
    def encode(self) -> list[object]:
        """The table as the codec carries it: ``[[client, hi, [seq, ok, body, ...]], ...]``,
        least recently delivered first (outcomes still running are left out: a snapshot is
        taken where every earlier call finished)."""
        out: list[object] = []
        for client, entry in self._clients.items():
            flat: list[object] = []
            for seq, kept in entry.kept.items():
                if type(kept) is tuple:
                    flat += (seq, kept[0], kept[1])
            out.append([client, entry.hi, flat])
        return out

    def restore(self, value: object) -> None:
        """Replace the table with one :meth:`encode` made (at another member: checked)."""
        if not isinstance(value, list | tuple) or len(value) > MAX_CLIENTS:
            raise ProtocolViolation("a client table is not a list of clients")
        clients: OrderedDict[bytes, _Client] = OrderedDict()
        for row in value:
            if not (isinstance(row, list | tuple) and len(row) == 3
                    and type(row[0]) is bytes and len(row[0]) == wire.CLIENT_ID_BYTES
                    and type(row[1]) is int and -1 <= row[1] < 1 << 64
                    and isinstance(row[2], list | tuple) and len(row[2]) % 3 == 0
                    and len(row[2]) <= 3 * (WINDOW + 1)):
                raise ProtocolViolation("a malformed row in a client table")
            entry = _Client()
            entry.hi = row[1]
            flat = row[2]
            for i in range(0, len(flat), 3):
                seq, ok, body = flat[i : i + 3]
                if not (type(seq) is int and 0 <= seq <= entry.hi and type(ok) is bool
                        and type(body) is bytes):
                    raise ProtocolViolation("a malformed outcome in a client table")
                entry.kept[seq] = (ok, body)
            clients[row[0]] = entry
        self._clients = clients


class Numbering:
    """A caller's numbers for one subgroup (or shard): the next, and those unanswered. A number
    is handed out only while it is less than ``WINDOW`` above the lowest unanswered, so the
    members' table never needs an outcome older than that."""

    def __init__(self) -> None:
        self.next = 0
        self.open: set[int] = set()
        self.waiters: list[asyncio.Future[None]] = []

    async def take(self) -> int:
        """The next number (waiting while the window is full)."""
        while self.open and self.next - min(self.open) >= WINDOW:
            fut = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            await fut
        seq = self.next
        self.next += 1
        self.open.add(seq)
        return seq

    def answered(self, seq: int) -> None:
        """Number ``seq``'s call is answered (or given up)."""
        self.open.discard(seq)
        waiters, self.waiters = self.waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


def state_bytes(actor_state: object, table: ClientCalls | None) -> bytes:
    """A durable snapshot's bytes: the actor's snapshot, and the client table when it has
    clients (see :func:`restore_bytes`)."""
    data: bytes = wire.encode(actor_state)
    if table is None or not len(table):
        return data
    head: bytes = wire.encode(table.encode())
    return b"".join((_TABLE_MARK, _LEN.pack(len(head)), head, data))


def restore_bytes(data: bytes, table: ClientCalls | None) -> object:
    """The actor's state a :func:`state_bytes` snapshot holds, decoded; ``table`` (if given)
    is restored from it (emptied when it holds none)."""
    if data[:1] != _TABLE_MARK:
        if table is not None:
            table.restore([])
        return wire.decode(data)
    if len(data) < 1 + _LEN.size:
        raise ProtocolViolation("a snapshot with a client table is cut short")
    (n,) = _LEN.unpack_from(data, 1)
    start = 1 + _LEN.size
    if start + n > len(data):
        raise ProtocolViolation("a snapshot's client table runs past its end")
    if table is not None:
        table.restore(wire.decode(data[start : start + n]))
    return wire.decode(data[start + n :])
