"""The persistence frontier in the core: each member's ``persisted`` word, the lowest of a
shard's members as :class:`Persisted` events, reset by a view change."""

from __future__ import annotations

from derecho_async.core import Persisted
from derecho_async.core.schema import RowSchema
from derecho_async.testing import SimCluster


def test_the_column_sits_at_the_end_of_the_row_and_moves_nothing() -> None:
    sc = RowSchema(3, 2, 8, 64)
    assert sc.persisted.words == 2
    assert sc.persisted.offset + sc.persisted.nbytes == sc.row_bytes
    assert sc.shards[1].slots.offset + sc.shards[1].slots.nbytes == sc.persisted.offset


def test_without_durable_members_nothing_is_emitted() -> None:
    c = SimCluster(3, seed=1)
    for i in range(5):
        c.send(i % 3, b"x%d" % i)
    assert c.run_until_idle()
    assert all(c.persisted(m) == [] for m in range(3))


def test_the_frontier_is_the_lowest_member_and_rises_only() -> None:
    c = SimCluster(3, seed=2)
    for i in range(6):
        c.send(i % 3, b"m%d" % i)
    assert c.run_until_idle()
    view_id = c.views(0)[-1].view_id
    c.members[0].set_persisted(0, 5)
    c.members[1].set_persisted(0, 7)
    c.run(40)
    assert all(c.persisted(m) == [] for m in range(3)), "member 2 has published nothing"
    c.members[2].set_persisted(0, 3)
    c.run(40)
    expect = [Persisted("default", 0, view_id, 3)]
    assert all(c.persisted(m) == expect for m in range(3))
    c.members[2].set_persisted(0, 2)  # lower: ignored
    c.members[2].set_persisted(0, 9)
    c.run(40)
    expect.append(Persisted("default", 0, view_id, 5))
    assert all(c.persisted(m) == expect for m in range(3))
    c.check()


def test_a_view_change_starts_the_marks_again() -> None:
    c = SimCluster(3, seed=3, suspect_after=20)
    for m in range(3):
        c.members[m].set_persisted(0, 4)
    c.run(40)
    assert c.persisted(0)[-1].mark == 4
    c.crash(2)
    assert c.run_until_idle()
    new_view = c.views(0)[-1]
    assert new_view.members == (0, 1)
    c.members[0].set_persisted(0, 1)
    c.members[1].set_persisted(0, 1)
    c.run(40)
    assert c.persisted(1)[-1] == Persisted("default", 0, new_view.view_id, 1)
    c.check()
