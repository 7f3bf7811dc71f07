"""The agent's prioritized, bounded work queues."""

from __future__ import annotations

import threading

import pytest

from cmx.actors.agent.scheduler import BusyError, Priority, Scheduler


def test_loads_run_before_prefetches_before_demotions() -> None:
    sched = Scheduler(workers=1, queue_bound=10)
    gate = threading.Event()
    order: list[str] = []
    blocker = sched.submit(Priority.LOAD, gate.wait)
    futures = [
        sched.submit(Priority.DEMOTE, lambda: order.append("demote")),
        sched.submit(Priority.PREFETCH, lambda: order.append("prefetch")),
        sched.submit(Priority.LOAD, lambda: order.append("load")),
    ]
    gate.set()
    blocker.result(timeout=5)
    for f in futures:
        f.result(timeout=5)
    assert order == ["load", "prefetch", "demote"]
    sched.close()


def test_full_queue_applies_backpressure_with_a_bound() -> None:
    sched = Scheduler(workers=1, queue_bound=2)
    gate = threading.Event()
    sched.submit(Priority.DEMOTE, gate.wait)
    sched.submit(Priority.DEMOTE, lambda: None)
    sched.submit(Priority.DEMOTE, lambda: None)
    with pytest.raises(BusyError, match="DEMOTE queue full"):
        sched.submit(Priority.DEMOTE, lambda: None, timeout_s=0.2)
    # Other classes are not blocked by a full demotion queue.
    load = sched.submit(Priority.LOAD, lambda: 7, timeout_s=0.2)
    gate.set()
    assert load.result(timeout=5) == 7
    sched.close()


def test_errors_reach_the_waiter() -> None:
    sched = Scheduler(workers=2)

    def boom() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        sched.submit(Priority.LOAD, boom).result(timeout=5)
    sched.close()


def test_staging_budget_is_bounded() -> None:
    sched = Scheduler(workers=1, staging_bytes=100)
    with sched.staging(80):
        with pytest.raises(BusyError, match="staging budget"):
            with sched.staging(40, timeout_s=0.1):
                pass
        assert sched.stats().staging_bytes_in_use == 80
    assert sched.stats().staging_bytes_in_use == 0
    sched.close()
