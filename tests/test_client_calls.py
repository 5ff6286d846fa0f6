"""The pieces of exactly-once for clients on their own: the tagged call on the wire, the
members' table (bounds, encoding, checks of what another member sent), the snapshot framing,
and the client frames' checks."""

from __future__ import annotations

import asyncio

import pytest

from derecho_async import wire
from derecho_async.api import client_wire as cw
from derecho_async.api.once import (
    MAX_OUTCOME_BYTES,
    WINDOW,
    ClientCalls,
    restore_bytes,
    state_bytes,
)
from derecho_async.errors import ProtocolViolation

CLIENT = bytes(range(16))


def test_a_tagged_call_decodes_as_the_plain_call_and_gives_its_tag_and_time() -> None:
    plain = wire.encode_call("KV.put", ("a", b"1"), {})
    tagged = wire.client_call(plain, CLIENT, 7, 123_456_789)
    assert tagged[0] == 0x95
    assert wire.client_tag(tagged) == (CLIENT, 7)
    assert wire.call_time(tagged) == 123_456_789
    assert wire.decode_call(tagged) == ("KV.put", ("a", b"1"), {})
    assert wire.unstamped(tagged) == plain
    assert wire.client_tag(plain) is None
    assert wire.client_tag(wire.stamp_call(plain, 5)) is None
    with pytest.raises(ValueError):
        wire.client_call(plain, b"short", 1, 0)
    with pytest.raises(ProtocolViolation):
        wire.unstamped(b"\x95" + plain[1:] + b"\xcf" + bytes(8))  # five fields, no tag


def test_the_table_runs_a_number_once_and_answers_copies_with_the_outcome() -> None:
    table = ClientCalls()
    assert table.admit(CLIENT, 0) is None
    waiting = table.admit(CLIENT, 0)  # a copy while the first runs: it waits
    assert waiting == []
    answers: list[tuple[bool, bytes]] = []
    assert isinstance(waiting, list)
    waiting.append(lambda ok, body: answers.append((ok, body)))
    table.done(CLIENT, 0, True, b"\x01")
    assert answers == [(True, b"\x01")]
    assert table.admit(CLIENT, 0) == (True, b"\x01")
    for seq in range(1, WINDOW + 5):
        assert table.admit(CLIENT, seq) is None
        table.done(CLIENT, seq, True, b"\x02")
    stale = table.admit(CLIENT, 0)  # far below the highest: answered, never run
    assert isinstance(stale, tuple) and stale[0] is False
    assert b"DuplicateCall" in stale[1]
    table.admit(CLIENT, WINDOW + 10)
    table.done(CLIENT, WINDOW + 10, True, b"x" * (MAX_OUTCOME_BYTES + 1))
    big = table.admit(CLIENT, WINDOW + 10)
    assert isinstance(big, tuple) and big[0] is False and b"too large" in big[1]


def test_the_table_travels_and_refuses_what_is_malformed() -> None:
    table = ClientCalls()
    for seq in range(3):
        table.admit(CLIENT, seq)
        table.done(CLIENT, seq, seq != 1, b"%d" % seq)
    copy = ClientCalls()
    copy.restore(wire.decode(wire.encode(table.encode())))
    assert copy.encode() == table.encode()
    assert copy.admit(CLIENT, 1) == (False, b"1")
    for bad in ([[b"short", 0, []]], [[CLIENT, 0, [0, True]]], [[CLIENT, 1, [5, True, b""]]],
                "nope", [[CLIENT, 0, [0, 1, b""]]]):
        with pytest.raises(ProtocolViolation):
            ClientCalls().restore(bad)


def test_a_snapshot_holds_the_table_only_when_it_has_clients() -> None:
    table = ClientCalls()
    assert state_bytes({"a": 1}, table) == wire.encode({"a": 1})  # as before clients
    table.admit(CLIENT, 0)
    table.done(CLIENT, 0, True, b"\xc0")
    data = state_bytes({"a": 1}, table)
    assert data[0] == 0xC1
    back = ClientCalls()
    assert restore_bytes(data, back) == {"a": 1}
    assert back.admit(CLIENT, 0) == (True, b"\xc0")
    assert restore_bytes(wire.encode([1]), back) == [1]
    assert len(back) == 0  # a snapshot without a table empties it
    with pytest.raises(ProtocolViolation):
        restore_bytes(data[:3], ClientCalls())
    with pytest.raises(ProtocolViolation):
        restore_bytes(data[:1] + (10**6).to_bytes(4, "big") + data[5:], ClientCalls())


async def test_client_frames_are_checked_on_arrival() -> None:
    def feed(frame: bytes) -> asyncio.StreamReader:
        reader = asyncio.StreamReader()
        reader.feed_data(len(frame).to_bytes(4, "little") + frame)
        reader.feed_eof()
        return reader

    good = wire.pack([cw.CALL, 1, "KV", 0, 0, b"x"])
    assert await cw.read_frame(feed(good), 1024) == [cw.CALL, 1, "KV", 0, 0, b"x"]
    assert (await cw.read_frame(feed(wire.pack([cw.P2P, 2, -1, "KV", 0, b""])), 64))[2] == -1
    for bad in (wire.pack([cw.CALL, 1, "KV", 0, -1, b"x"]),  # a negative number
                wire.pack([cw.CALL, 1, "KV", 0, 0]),  # a field short
                wire.pack([99, 1]),  # an unknown kind
                wire.pack([cw.FAIL, 1, 1, "t", "m"]),  # not a bool
                wire.pack([cw.END, 1, "x" * 600]),  # a reason too long
                b"\xc1"):
        with pytest.raises(ProtocolViolation):
            await cw.read_frame(feed(bad), 1024)
    with pytest.raises(ProtocolViolation, match="at most 8"):
        await cw.read_frame(feed(good), 8)
