"""A handler's exception that cannot be put into words as it is (contract item 8).

An exception whose ``__str__`` raises, or whose message holds a lone surrogate (which UTF-8
cannot encode), is still that call's outcome, the same at every member: the exception itself
at the caller's own member, ``HandlerError(member, type name, safe text)`` from the others, a
logged warning for a one-way call; nobody leaves the group. The same holds for p2p calls and
for external clients' calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

import derecho_async as da
from tests.runtime.simgroups import close, start

SECRET = da.new_secret()
_ids = itertools.count()


class Weird(Exception):
    """An exception that cannot be turned into text."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


WEIRD_TEXT = "<Weird: str() raised RuntimeError>"  # README, contract item 8
SURROGATE = "bad \udc80 input"
SURROGATE_TEXT = "bad \\udc80 input"  # the lone surrogate escaped (backslashreplace)


class Odd(da.Actor):
    def __init__(self) -> None:
        self.n = 0

    @da.ordered
    def weird(self) -> None:
        self.n += 1
        raise Weird()

    @da.ordered
    async def weird_later(self) -> None:
        await asyncio.sleep(0.001)
        self.n += 1
        raise Weird()

    @da.ordered
    def surrogate(self) -> None:
        self.n += 1
        raise ValueError(SURROGATE)

    @da.ordered
    def bump(self) -> int:
        self.n += 1
        return self.n

    @da.p2p
    def weird_read(self) -> int:
        raise Weird()

    @da.p2p
    def surrogate_read(self) -> int:
        raise ValueError(SURROGATE)

    @da.p2p
    def count(self) -> int:
        return self.n

    def snapshot(self) -> int:
        return self.n

    def restore(self, state: int) -> None:
        self.n = state


async def _all_stay(gs: list[da.Group], calls: int) -> None:
    """Every member is still in view 0 and runs a later call: each replica ran ``calls`` + 1."""
    replies = await asyncio.wait_for(gs[1].subgroup(Odd).bump(), 10)
    assert dict(replies) == {0: calls + 1, 1: calls + 1, 2: calls + 1}
    assert all(g.view.view_id == 0 and g.view.members == (0, 1, 2) for g in gs)
    assert all(g.closed is None or not g.closed.done() for g in gs)


async def test_a_replied_call_raising_an_unprintable_exception_answers_at_every_member() -> None:
    _, gs = await start([Odd])
    try:
        for caller in (0, 2):
            for method in (Odd.weird, Odd.weird_later):
                replies = await asyncio.wait_for(gs[caller].subgroup(Odd)[method](), 10)
                assert set(replies) == {0, 1, 2}
                assert isinstance(replies[caller], Weird)  # the caller's own: itself
                for m in {0, 1, 2} - {caller}:
                    assert replies[m] == da.HandlerError(m, "Weird", WEIRD_TEXT)
                with pytest.raises((Weird, da.HandlerError)):
                    replies.raise_on_error()
                assert "Weird" in repr(replies)  # Replies' repr does not fail either
        await _all_stay(gs, 4)
    finally:
        await close(gs)


async def test_a_lone_surrogate_in_a_message_is_escaped_alike_at_every_member() -> None:
    _, gs = await start([Odd])
    try:
        replies = await asyncio.wait_for(gs[1].subgroup(Odd).surrogate(), 10)
        assert isinstance(replies[1], ValueError) and str(replies[1]) == SURROGATE
        assert replies[0] == da.HandlerError(0, "ValueError", SURROGATE_TEXT)
        assert replies[2] == da.HandlerError(2, "ValueError", SURROGATE_TEXT)
        await _all_stay(gs, 1)
    finally:
        await close(gs)


async def test_a_one_way_call_raising_an_unprintable_exception_is_logged_safely(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, gs = await start([Odd])
    h = gs[0].subgroup(Odd)
    try:
        with caplog.at_level("WARNING", logger="derecho_async.group"):
            await asyncio.wait_for(
                asyncio.gather(h.weird.cast(), h.weird_later.cast(), h.surrogate.cast()), 10)
            await _all_stay(gs, 3)
        raised = [r for r in caplog.records if "one-way call raised" in r.getMessage()]
        assert len(raised) == 9  # three calls at three members, each logged where it raised
        formatter = logging.Formatter()
        for record in raised:
            text = record.getMessage()
            text.encode("utf-8")  # strict: nothing a log file could not take
            formatter.format(record)  # the record formats, traceback included
        texts = sorted(r.getMessage().split(" raised ", 1)[1] for r in raised)
        assert texts == sorted([f"Weird: {WEIRD_TEXT}"] * 6 + [f"ValueError: {SURROGATE_TEXT}"] * 3)
    finally:
        await close(gs)


async def test_a_p2p_call_raising_an_unprintable_exception_answers_and_everyone_stays() -> None:
    _, gs = await start([Odd])
    h = gs[0].subgroup(Odd)
    try:
        for m in (1, 2):
            with pytest.raises(da.HandlerError) as info:
                await asyncio.wait_for(h.weird_read.at(m)(), 5)
            assert info.value == da.HandlerError(m, "Weird", WEIRD_TEXT)
            with pytest.raises(da.HandlerError) as info:
                await asyncio.wait_for(h.surrogate_read.at(m)(), 5)
            assert info.value == da.HandlerError(m, "ValueError", SURROGATE_TEXT)
        with pytest.raises(Weird):  # the caller's own member: the exception itself
            await asyncio.wait_for(h.weird_read.at(0)(), 5)
        await _all_stay(gs, 0)
        assert [await h.count.at(m)() for m in (0, 1, 2)] == [1, 1, 1]
    finally:
        await close(gs)


async def test_an_external_clients_calls_get_the_safe_text_from_every_member() -> None:
    _, gs = await start([Odd], client_secret=SECRET, client_listen="127.0.0.1:0")
    try:
        async with await da.Client.connect(
                group=gs[0].config.group, peers={1: str(gs[1].client_address)},
                secret=SECRET) as client:
            odd = client.subgroup(Odd)
            replies = await asyncio.wait_for(odd.weird(), 10)
            assert dict(replies) == {m: da.HandlerError(m, "Weird", WEIRD_TEXT)
                                     for m in (0, 1, 2)}
            replies = await asyncio.wait_for(odd.surrogate(), 10)
            assert dict(replies) == {m: da.HandlerError(m, "ValueError", SURROGATE_TEXT)
                                     for m in (0, 1, 2)}
            await asyncio.wait_for(odd.weird.cast(), 10)
            for m in (1, 2):  # at the relay itself and at another member
                with pytest.raises(da.HandlerError) as info:
                    await asyncio.wait_for(odd.weird_read.at(m)(), 5)
                assert (info.value.type_name, info.value.message) == ("Weird", WEIRD_TEXT)
                with pytest.raises(da.HandlerError) as info:
                    await asyncio.wait_for(odd.surrogate_read.at(m)(), 5)
                assert (info.value.type_name, info.value.message) == ("ValueError",
                                                                      SURROGATE_TEXT)
        await _all_stay(gs, 3)
    finally:
        await close(gs)
