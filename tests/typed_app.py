"""A small application written against the typed API: what a type checker must infer for it.

Never run; type-checked. The project's mypy run checks it as part of tests/, and
tests/test_typed_calls.py checks it alone under mypy --strict (and pyright, when installed), so
that a handle, a reply or ``group.local`` falling back to ``Any`` fails both: ``assert_type``
takes no ``Any`` for a named type.
"""

from __future__ import annotations

from typing import Any, assert_type

import derecho_async as da
from derecho_async.api.client import ClientHandle


class KV(da.Actor):
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    @da.ordered
    def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    @da.ordered
    async def incr(self, key: str, by: int = 1) -> int:
        self.put(key, b"%d" % by)  # a local call inside a handler: the plain method
        return by

    @da.p2p
    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    @da.p2p
    async def size(self) -> int:
        return len(self.data)


class TaggedKV(KV):
    @da.ordered
    def tag(self, key: str, *, tag: str) -> str:
        return f"{key}:{tag}"


async def member(group: da.Group) -> None:
    kv = group.subgroup(KV)
    assert_type(kv, da.SubgroupHandle[KV])
    put = kv[KV.put]  # an OrderedMethod[[key: str, value: bytes], None]
    assert_type(await put("a", b"1"), da.Replies[None])
    assert_type(await kv[KV.put].cast("a", b"1"), tuple[int, int])
    replies = await kv[KV.incr]("a", by=2)  # an async handler: its coroutine unwrapped
    assert_type(replies, da.Replies[int])
    assert_type(replies[0], int | BaseException)
    assert_type(replies.values_ok(), list[int])
    assert_type(replies.raise_on_error(), dict[int, int])
    assert_type(await kv[KV.get].at(1)("a"), bytes | None)
    assert_type(await kv[KV.get].any()("a"), bytes | None)
    assert_type(await kv[KV.size].at(2)(), int)
    got = await kv[KV.get].at(1).versioned("a")
    assert_type(got, da.Versioned[bytes | None])
    assert_type(got.value, bytes | None)

    replica = group.local(KV)  # this member's own replica: a KV
    assert_type(replica, KV)
    assert_type(replica.data, dict[str, bytes])
    assert_type(replica.put("b", b"2"), None)  # the plain method, called here
    assert_type(await replica.incr("b"), int)
    assert_type(KV.put(replica, "c", b"3"), None)

    old = await kv.at_version((1, 2))
    assert_type(old, KV)

    tagged = group.subgroup(TaggedKV, shard=1)  # a subclass's handle takes its base's methods
    assert_type(await tagged[KV.put]("a", b"1"), da.Replies[None])
    assert_type(await tagged[TaggedKV.tag]("a", tag="x"), da.Replies[str])

    untyped = kv.put  # the attribute form: untyped
    assert_type(untyped, Any)


async def client(c: da.Client) -> None:
    kv = c.subgroup(KV)
    assert_type(kv, ClientHandle[KV])
    assert_type(await kv[KV.put]("a", b"1"), da.Replies[None])
    assert_type(await kv[KV.incr].cast("a"), tuple[int, int])
    assert_type(await kv[KV.get].at(0)("a"), bytes | None)
    assert_type(await kv[KV.size].any()(), int)
