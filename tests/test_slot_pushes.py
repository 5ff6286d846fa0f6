"""What a sender pushes of its slot ring: the records, not the unused rest of their slots.

A slot holds ``max_payload`` bytes; a null record or a short message uses a header and a few
bytes of it. The push of the last record of a run stops where that record ends, so a 100-byte
message moves about 136 bytes instead of the whole slot, and a short message that reuses the
slot of a longer one must still arrive exactly (the stale tail of the slot is never read)."""

from __future__ import annotations

from typing import cast

from derecho_async.core import CoreConfig, Delivered, Member, View
from derecho_async.core.layout import DEFAULT_SUBGROUP


def _run(cores: dict[int, Member], rounds: int, pushes: list[tuple[int, int]],
         delivered: dict[int, list[bytes]]) -> None:
    for _ in range(rounds):
        for m, core in cores.items():
            core.tick()
            core.poll()
            ready = core.ready()
            for ev in ready.events:
                if isinstance(ev, Delivered):
                    delivered[m].append(bytes(cast(bytes, ev.payload)))  # inline records: bytes
            for p in ready.pushes:
                pushes.append((m, len(p.data)))
                for t in p.targets:
                    cores[t].receive_push(p.view_id, m, p.offset, p.data)
            core.advance(ready)


def test_pushes_stop_at_the_end_of_the_last_record_and_short_messages_arrive_exactly() -> None:
    config = CoreConfig(window=4, max_payload=1024, suspect_after=1000)
    cores = {m: Member(m, config, view=View(0, (0, 1))) for m in (0, 1)}
    slot = 32 + 1024
    pushes: list[tuple[int, int]] = []
    delivered: dict[int, list[bytes]] = {0: [], 1: []}
    # long, then ever shorter messages, one at a time: each reuses a slot of a longer one
    sizes = [1024, 1000, 700, 400, 100, 9, 1, 0, 513, 8]
    sent = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    for data in sent:
        assert cores[0].submit(DEFAULT_SUBGROUP, data) is not None
        _run(cores, 6, pushes, delivered)
    assert delivered[0] == delivered[1] == sent
    slot_pushes = [n for m, n in pushes if n > 24]  # counters: 16 or 24 bytes
    sender = [n for m, n in pushes if m == 0 and n > 24]
    assert sorted(sender) == sorted(32 + (n + 7) // 8 * 8 for n in sizes)
    nulls = [n for m, n in pushes if m == 1 and n > 24]
    assert nulls and set(nulls) == {32}  # member 1's null records: a header each
    assert max(slot_pushes) <= slot


def test_counters_travel_in_one_push_after_the_slots_and_delivering_alone_pushes_nothing() -> None:
    """A pass pushes its slot records, then one push of the adjacent sent_records,
    recv_frontier and delivered words (data before counter); a pass that only delivered pushes
    nothing (no peer's step reads ``delivered``: it rides with the next push). In a closed loop
    of one message at a time from member 0, the idle member 1 then pushes twice per message:
    its null's slot and its counters."""
    config = CoreConfig(window=4, max_payload=256, suspect_after=1000)
    cores = {m: Member(m, config, view=View(0, (0, 1))) for m in (0, 1)}
    cols = cores[0].schema.shards[0]
    counters = (cols.sent_records.offset, 3 * 8)
    progress = (cols.recv_frontier.offset, 2 * 8)
    row = cores[0].schema.row_bytes
    seen: dict[int, list[tuple[int, int]]] = {0: [], 1: []}  # member -> (row offset, bytes)
    delivered = 0
    for i in range(20):
        assert cores[0].submit(DEFAULT_SUBGROUP, b"m%d" % i) is not None
        for _ in range(6):
            for m, core in cores.items():
                core.poll()
                ready = core.ready()
                delivered += sum(1 for ev in ready.events if isinstance(ev, Delivered) and m == 1)
                kinds = []
                for p in ready.pushes:
                    at = (p.offset - core.rank * row, len(p.data))
                    seen[m].append(at)
                    kinds.append("slots" if at[0] >= cols.slots.offset else at)
                    for t in p.targets:
                        cores[t].receive_push(p.view_id, m, p.offset, p.data)
                # the slots of a pass come before its counters, and the counter never alone
                if counters in kinds:
                    assert all(k == "slots" for k in kinds[: kinds.index(counters)]), kinds
                assert (cols.sent_records.offset, 8) not in kinds, kinds
                core.advance(ready)
    assert delivered == 20
    heartbeat_free = {m: [a for a in s if a[0] >= cols.sent_records.offset] for m, s in seen.items()}
    for s in heartbeat_free.values():  # every counter push is one of the two shapes
        assert all(a in (counters, progress) or a[0] >= cols.slots.offset for a in s), s
        assert (cols.delivered.offset, 8) not in s
    assert len(heartbeat_free[1]) <= 2 * 20, heartbeat_free[1]


def test_a_burst_of_small_messages_shares_slots_and_its_push_moves_about_what_they_hold() -> None:
    """Twenty 100-byte messages queued at once go out in batch records (several to a slot):
    the sender's slot pushes come to little more than the messages, where a slot each would
    push 20 x 1 KB; both members deliver all twenty, in order, each exactly."""
    config = CoreConfig(window=8, max_payload=1024, suspect_after=1000)
    cores = {m: Member(m, config, view=View(0, (0, 1))) for m in (0, 1)}
    pushes: list[tuple[int, int]] = []
    delivered: dict[int, list[bytes]] = {0: [], 1: []}
    sent = [bytes([i + 1]) * (100 - i % 3) for i in range(20)]
    for data in sent:
        assert cores[0].submit(DEFAULT_SUBGROUP, data) is not None
    _run(cores, 8, pushes, delivered)
    assert delivered[0] == delivered[1] == sent
    shard = next(sh for sh in cores[0].shards if sh is not None)
    assert shard.sent_records == 3  # 20 entries of 16 + 104 bytes, 8 to a 1 KB slot
    # one push of the run: two full slots, then the third as far as its 4 entries go
    slot_pushes = [n for m, n in pushes if m == 0 and n > 24]
    assert slot_pushes == [2 * (32 + 1024) + 32 + 4 * (16 + 104)]
