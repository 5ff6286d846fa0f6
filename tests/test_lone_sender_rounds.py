"""How many message hops a lone sender's message takes to become stable and delivered.

With three members and only member 0 sending, one message at a time, the idle members cover
each round with nulls. The message must then be delivered at its sender two hops after it was
sent (out to the others, their frontiers back): the idle members already hold each other's
nulls for the rounds before it, so nothing waits on a null sent in reply to this message."""

from __future__ import annotations

from derecho_async.core import CoreConfig, Delivered, Member, View
from derecho_async.core.layout import DEFAULT_SUBGROUP


def test_a_lone_senders_message_is_delivered_at_the_sender_in_three_steps() -> None:
    members = (0, 1, 2)
    cores = {m: Member(m, CoreConfig(suspect_after=10_000), view=View(0, members))
             for m in members}
    in_flight: list[tuple[int, int, int, int, bytes]] = []  # (to, view, from, offset, data)
    steps_taken: list[int] = []
    delivered = {m: 0 for m in members}
    for i in range(30):
        assert cores[0].submit(DEFAULT_SUBGROUP, b"m%d" % i) is not None
        # Synchronous rounds: every member takes one step on what landed in the round before.
        for step in range(1, 10):
            landed, in_flight = in_flight, []
            for to, view_id, sender, offset, data in landed:
                cores[to].receive_push(view_id, sender, offset, data)
            for m, core in cores.items():
                core.poll()
                ready = core.ready()
                core.advance(ready)
                delivered[m] += sum(isinstance(e, Delivered) for e in ready.events)
                for p in ready.pushes:
                    in_flight += [(t, p.view_id, m, p.offset, bytes(p.data)) for t in p.targets]
            if delivered[0] == i + 1:
                steps_taken.append(step)
                break
        else:
            raise AssertionError(f"message {i} was not delivered at its sender")
    # The first messages start the rounds of nulls; from then on: send, frontiers, deliver.
    assert steps_taken[5:] == [3] * 25, steps_taken
    assert delivered[1] >= 29 and delivered[2] >= 29
