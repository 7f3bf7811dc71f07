"""The agent's queue discipline alone: classes, places, staging holds, deadlines."""

from __future__ import annotations

import pytest

from cmx.policies.queueing import State, WorkQueues
from cmx.protocol import Priority


def test_the_first_class_with_work_goes_first_and_a_freed_place_goes_to_the_first_waiter() -> None:
    q: WorkQueues[str] = WorkQueues(bound=1, staging_bytes=0)
    d1 = q.submit(Priority.DEMOTE, "d1", deadline=10.0)
    d2 = q.submit(Priority.DEMOTE, "d2", deadline=10.0)
    d3 = q.submit(Priority.DEMOTE, "d3", deadline=10.0)
    q.submit(Priority.LOAD, "l1", deadline=10.0)
    assert (d1.state, d2.state, d3.state) == (State.QUEUED, State.WAITING, State.WAITING)
    q.check_integrity()
    taken = [q.take(), q.take()]
    assert [s.item for s in taken if s] == ["l1", "d1"]
    assert d2.state is State.QUEUED and d3.state is State.WAITING  # in the order they came
    assert q.expire(10.0) == [d3] and d3.state is State.REFUSED
    assert q.refused[Priority.DEMOTE] == 1 and q.taken == 2
    assert q.withdraw(d2) is False  # it holds a place: nothing to refuse
    q.check_integrity()


def test_holds_that_fit_are_granted_at_once_and_waiters_in_the_order_they_asked() -> None:
    q: WorkQueues[str] = WorkQueues(bound=4, staging_bytes=100)
    a = q.stage(70, deadline=5.0)
    big, small = q.stage(60, deadline=5.0), q.stage(30, deadline=6.0)
    assert (a.state, big.state, small.state) == (State.GRANTED, State.WAITING, State.GRANTED)
    capped = q.stage(500, deadline=5.0)  # at most the whole budget
    assert capped.nbytes == 100 and capped.state is State.WAITING
    assert q.unstage(a) == [big]  # 30 + 60 fit; the whole budget does not
    assert q.expire(5.0) == [capped] and q.refused_holds == 1
    assert q.staged == 90
    q.check_integrity()
    with pytest.raises(ValueError, match="refused"):
        q.unstage(capped)
