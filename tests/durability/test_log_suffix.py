"""A joiner's log suffix: packed records, checked when unpacked; a suffix that does not start
where the joiner's files end is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

import derecho_async as da
from derecho_async import wire
from derecho_async.api.logged_calls import pack_records, unpack_records
from derecho_async.api.rejoin import LogSuffixes
from derecho_async.durability import LogRecord
from tests.runtime.test_durable_group import KV


def _records() -> list[LogRecord]:
    return [LogRecord((3, 0), 10, b"\x00a"), LogRecord((3, 1), 11, b""),
            LogRecord((4, 0), 12, b"\x00" + bytes(300))]


def test_packed_records_come_back_as_they_were() -> None:
    records = _records()
    assert unpack_records(pack_records(records), (2, 9)) == records
    assert unpack_records(b"", (2, 9)) == []


@pytest.mark.parametrize(("mangle", "why"), [
    (lambda b: b[:10], "inside a record header"),
    (lambda b: b[:-1], "past the end"),
    (lambda b: b + b[:30], "not after"),
])
def test_a_damaged_suffix_is_refused_with_where(mangle: object, why: str) -> None:
    data = mangle(pack_records(_records()))  # type: ignore[operator]
    with pytest.raises(ValueError, match=why):
        unpack_records(data, (2, 9))


def test_records_not_after_the_joiners_own_are_refused() -> None:
    with pytest.raises(ValueError, match="not after"):
        unpack_records(pack_records(_records()), (3, 0))


async def test_a_suffix_that_does_not_start_where_the_files_end_is_refused(
        tmp_path: Path) -> None:
    config = da.Config(group="sfx", member_id=0, initial_members=1, transport="sim",
                       data_dir=str(tmp_path))
    async with da.Group(config, actors=[KV]) as group:
        kv = group.subgroup(KV)
        v = await kv.put.cast("a", b"1")
        await kv.persisted(v)
        durable = group._durable
        assert durable is not None
        suffixes = LogSuffixes(durable, 100)
        wrong = (v[0], v[1] + 5)
        with pytest.raises(ValueError, match="files reach"):
            await suffixes.apply({"KV": [wrong[0], wrong[1], b""]})
        with pytest.raises(ValueError, match="malformed"):
            await suffixes.apply({"KV": [v[0], v[1]]})
        with pytest.raises(ValueError, match="not a map"):
            await suffixes.apply([1, 2])
        with pytest.raises(ValueError, match="does not host"):
            await suffixes.apply({"Other": [v[0], v[1], b""]})
        # the right start: the calls run on the actor
        call = pack_records([LogRecord((v[0], v[1] + 1), 0, b"\x00" + _put_bytes("b", b"2"))])
        assert await suffixes.apply({"KV": [v[0], v[1], call]}) == {"KV": 1}
        local = group.local(KV)
        assert isinstance(local, KV) and local.data == {"a": b"1", "b": b"2"}


def _put_bytes(key: str, value: bytes) -> bytes:
    return wire.encode_call("KV.put", (key, value), {})
