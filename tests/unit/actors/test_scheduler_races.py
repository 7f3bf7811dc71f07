"""The agent's scheduler where its threads meet: a deadline passing as a place or bytes free,
jobs that raise or are cancelled, closing while callers wait, many submitters at the bound,
and waits ended by an interrupt.

Threads line up on Events and Barriers, or poll ``Scheduler.waiting`` to know one is blocked
inside; every wait is bounded. Where a race has two orders, the test asserts what holds in
either, and drives the pure discipline (``WorkQueues``) through each order exactly.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import pytest

from cmx.actors.agent.scheduler import BusyError, Priority, Scheduler
from cmx.policies.queueing import State, WorkQueues

D = Priority.DEMOTE
BOUND_S = 10.0  # how long any one wait of the test may take before the test fails


def _until(check: Callable[[], bool], what: str) -> None:
    """Poll ``check`` for a state only the scheduler can see (a thread blocked inside it)."""
    pause = threading.Event()
    for _ in range(int(BOUND_S * 1000)):
        if check():
            return
        pause.wait(0.001)
    raise AssertionError(f"never came to pass: {what}")


class _Caller(threading.Thread):
    """Runs ``fn`` in a thread of its own; ``outcome`` is what it returned or raised."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - the outcome the test inspects
            self.value = exc

    def outcome(self) -> Any:
        self.join(BOUND_S)
        assert not self.is_alive(), "still blocked in the scheduler past the test's bound"
        return self.value


def _started(fn: Callable[[], Any]) -> _Caller:
    caller = _Caller(fn)
    caller.start()
    return caller


def _occupy(sched: Scheduler) -> threading.Event:
    """A job that holds a worker until the returned gate opens; out of the queue once it runs."""
    running, gate = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait(BOUND_S)

    sched.submit(D, hold)
    assert running.wait(BOUND_S)
    return gate


def _stage(sched: Scheduler, nbytes: int, timeout_s: float) -> int:
    """Hold ``nbytes`` for a moment; the bytes in use while holding them."""
    with sched.staging(nbytes, timeout_s=timeout_s):
        return sched.stats().staging_bytes_in_use


def _check(sched: Scheduler) -> None:
    with sched._cv:
        sched._queues.check_integrity()


def _waiting(sched: Scheduler, what: str, n: int) -> Callable[[], bool]:
    return lambda: sched.waiting()[what] == n


# -- a deadline passing as a place or bytes free -----------------------------------------------


def test_a_place_freed_as_a_deadline_passes_goes_either_to_the_waiter_or_on_never_both() -> None:
    # Freed first: the waiter holds the place, and its deadline no longer refuses it.
    q: WorkQueues[str] = WorkQueues(bound=1, staging_bytes=0)
    q.submit(D, "running", deadline=1.0)
    late = q.submit(D, "late", deadline=1.0)
    assert q.take() is not None and late.state is State.QUEUED
    assert q.expire(1.0) == [] and q.refused[D] == 0 and q.queued(D) == 1
    q.check_integrity()
    # Refused first: the place freed later goes to the next waiter, or stays free.
    q = WorkQueues(bound=1, staging_bytes=0)
    q.submit(D, "running", deadline=1.0)
    late, next_ = q.submit(D, "late", deadline=1.0), q.submit(D, "next", deadline=2.0)
    assert q.expire(1.0) == [late]
    assert q.take() is not None and next_.state is State.QUEUED and q.queued(D) == 1
    assert q.take() is next_ and q.take() is None and q.queued(D) == 0
    q.check_integrity()


def test_bytes_freed_as_a_deadline_passes_go_either_to_the_waiter_or_back_never_both() -> None:
    q: WorkQueues[str] = WorkQueues(bound=1, staging_bytes=100)
    held = q.stage(100, deadline=1.0)
    late = q.stage(60, deadline=1.0)
    assert q.unstage(held) == [late] and q.expire(1.0) == [] and q.staged == 60
    q.unstage(late)
    assert q.staged == 0
    held = q.stage(100, deadline=1.0)
    late = q.stage(60, deadline=1.0)
    assert q.expire(1.0) == [late] and q.unstage(held) == [] and q.staged == 0
    q.check_integrity()


def test_submitters_refused_as_places_free_lose_no_job_and_run_none_twice() -> None:
    sched = Scheduler(workers=1, queue_bound=1)
    ran: list[int] = []
    accepted: list[int] = []
    for i in range(100):
        gate = _occupy(sched)
        sched.submit(D, lambda: None)  # the class's one place
        # Deadlines spread over 0-10 ms and the place freed at about 5 ms: some rounds go
        # one way, some the other; what is asserted holds in either.
        caller = _started(functools.partial(
            sched.submit, D, functools.partial(ran.append, i), timeout_s=(i % 20) * 5e-4))
        threading.Event().wait(0.005)
        gate.set()
        out = caller.outcome()
        if not isinstance(out, BusyError):
            out.result(BOUND_S)
            accepted.append(i)
        sched.submit(D, lambda: None).result(BOUND_S)  # the queue has drained
        assert sched.depths()["demote"] == 0 and sched.waiting()["demote"] == 0
        _check(sched)
    assert ran == accepted
    assert sched.stats().done["demote"] == 3 * 100 + len(accepted)
    sched.close()


def test_bytes_freed_past_a_waits_deadline_before_it_wakes_are_its_own() -> None:
    sched = Scheduler(workers=1, staging_bytes=100)
    held = sched.staging(100)
    held.__enter__()
    late = _started(lambda: _stage(sched, 60, timeout_s=1.0))
    _until(_waiting(sched, "staging", 1), "the late staging wait")
    with sched._cv:  # the late wait cannot wake to refuse itself while this is held
        passed = time.monotonic() + 1.0  # after its deadline: it asked before this
        while time.monotonic() <= passed:
            threading.Event().wait(passed - time.monotonic())
        held.__exit__(None, None, None)  # the same (re-entrant) condition
        assert sched.stats().staging_bytes_in_use == 60
    assert late.outcome() == 60
    assert sched.stats().staging_bytes_in_use == 0 and sched.waiting()["staging"] == 0
    _check(sched)
    sched.close()


def test_a_staging_wait_refused_at_its_deadline_leaves_the_bytes_to_the_next() -> None:
    sched = Scheduler(workers=1, staging_bytes=100)
    with sched.staging(100):
        first = _started(lambda: _stage(sched, 100, timeout_s=0.2))
        _until(_waiting(sched, "staging", 1), "the first staging wait")
        second = _started(lambda: _stage(sched, 10, timeout_s=BOUND_S))
        assert isinstance(first.outcome(), BusyError)
        _until(_waiting(sched, "staging", 1), "the second staging wait alone")
    assert second.outcome() == 10
    assert sched.stats().staging_bytes_in_use == 0
    _check(sched)
    sched.close()


# -- jobs that raise or are cancelled ----------------------------------------------------------


def test_a_job_that_raises_holding_staging_gives_its_bytes_back_and_the_worker_goes_on() -> None:
    sched = Scheduler(workers=1, staging_bytes=100)

    def job() -> None:
        with sched.staging(60):
            raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        sched.submit(Priority.LOAD, job).result(BOUND_S)
    after = sched.submit(Priority.LOAD, lambda: sched.stats().staging_bytes_in_use)
    assert after.result(BOUND_S) == 0
    assert sched.stats().done["load"] == 2
    _check(sched)
    sched.close()


def test_a_job_cancelled_before_it_runs_gives_its_place_to_the_next_waiter() -> None:
    sched = Scheduler(workers=1, queue_bound=2)
    gate = _occupy(sched)
    ran: list[str] = []
    dropped = sched.submit(D, lambda: ran.append("dropped"))
    kept = sched.submit(D, lambda: ran.append("kept"))
    assert dropped.cancel()
    assert sched.depths()["demote"] == 2  # held until a worker takes it, as before
    late = _started(lambda: sched.submit(D, lambda: ran.append("late"), timeout_s=BOUND_S))
    _until(_waiting(sched, "demote", 1), "a submitter at the full class")
    gate.set()
    late.outcome().result(BOUND_S)
    kept.result(BOUND_S)
    assert ran == ["kept", "late"]
    assert sched.depths()["demote"] == 0 and sched.waiting()["demote"] == 0
    assert sched.stats().done["demote"] == 3  # the gate's job, kept and late
    _check(sched)
    sched.close()


# -- closing while callers wait ----------------------------------------------------------------


def test_close_refuses_waiting_submitters_at_once_and_still_runs_what_was_queued() -> None:
    sched = Scheduler(workers=1, queue_bound=1)
    gate = _occupy(sched)
    queued = sched.submit(D, lambda: "queued")
    callers = [_started(lambda: sched.submit(D, lambda: "late", timeout_s=60.0))
               for _ in range(2)]
    _until(_waiting(sched, "demote", 2), "two submitters at the full class")
    sched.close()
    assert all(isinstance(c.outcome(), BusyError) for c in callers)
    gate.set()
    assert queued.result(BOUND_S) == "queued"
    assert sched.waiting()["demote"] == 0
    _check(sched)


def test_close_leaves_staging_waits_to_their_bytes_or_their_deadline() -> None:
    # Jobs still running when the scheduler closes may need staging to finish, as before.
    sched = Scheduler(workers=1, staging_bytes=100)
    with sched.staging(100):
        patient = _started(lambda: _stage(sched, 50, timeout_s=60.0))
        brief = _started(lambda: _stage(sched, 50, timeout_s=0.05))
        _until(_waiting(sched, "staging", 2), "two staging waits")
        sched.close()
        assert isinstance(brief.outcome(), BusyError)
        assert sched.waiting()["staging"] == 1
    assert patient.outcome() == 50
    assert sched.stats().staging_bytes_in_use == 0
    _check(sched)


# -- many submitters at once at the bound ------------------------------------------------------


def test_many_submitters_at_the_bound_each_run_once_or_are_refused_never_both() -> None:
    sched = Scheduler(workers=1, queue_bound=4)
    gate = _occupy(sched)
    ran: list[int] = []
    line = threading.Barrier(16)

    def submit(i: int) -> Future[Any]:
        line.wait(BOUND_S)
        # Half give up at once if the class is full; half wait until it drains.
        return sched.submit(D, lambda: ran.append(i), timeout_s=0.0 if i % 2 else BOUND_S)

    callers = [_started(functools.partial(submit, i)) for i in range(16)]
    refused = sum(isinstance(callers[i].outcome(), BusyError) for i in range(1, 16, 2))
    _until(lambda: sched.depths()["demote"] + sched.waiting()["demote"] == 16 - refused,
           "every submitter not refused placed or waiting")
    assert sched.depths()["demote"] == 4
    _check(sched)
    gate.set()
    outcomes = [c.outcome() for c in callers]
    accepted = [i for i, out in enumerate(outcomes) if not isinstance(out, BusyError)]
    for i in accepted:
        outcomes[i].result(BOUND_S)
    assert sorted(ran) == accepted and set(range(0, 16, 2)) <= set(accepted)
    assert len(accepted) >= 4  # the four places free when they came are taken by someone
    assert sched.depths()["demote"] == 0 and sched.waiting()["demote"] == 0
    assert sched.stats().done["demote"] == 1 + len(accepted)
    _check(sched)
    sched.close()


# -- staging requests of every size ------------------------------------------------------------


def test_a_staging_request_over_the_whole_budget_holds_the_whole_budget() -> None:
    sched = Scheduler(workers=1, staging_bytes=100)
    assert _stage(sched, 10_000, timeout_s=0.0) == 100
    with sched.staging(1):
        with pytest.raises(BusyError, match="staging budget"):
            _stage(sched, 10_000, timeout_s=0.05)
    assert sched.stats().staging_bytes_in_use == 0
    _check(sched)
    sched.close()


def test_a_smaller_staging_request_passes_a_larger_one_that_waits() -> None:
    sched = Scheduler(workers=1, staging_bytes=100)
    with sched.staging(50):
        with sched.staging(50):
            large = _started(lambda: _stage(sched, 80, timeout_s=BOUND_S))
            small = _started(lambda: _stage(sched, 40, timeout_s=BOUND_S))
            _until(_waiting(sched, "staging", 2), "both waiting")
        assert small.outcome() == 90  # 40 fits beside the 50 still held; 80 does not
        assert sched.waiting()["staging"] == 1
    assert large.outcome() == 80
    _check(sched)
    sched.close()


def test_a_job_holding_staging_gets_its_inner_job_staged_past_a_larger_waiter() -> None:
    sched = Scheduler(workers=2, staging_bytes=100)
    holding, large_waits = threading.Event(), threading.Event()

    def outer() -> int:
        with sched.staging(50):
            holding.set()
            assert large_waits.wait(BOUND_S)
            inner = sched.submit(Priority.LOAD, lambda: _stage(sched, 40, timeout_s=BOUND_S))
            return inner.result(BOUND_S)

    job = sched.submit(Priority.LOAD, outer)
    assert holding.wait(BOUND_S)
    large = _started(lambda: _stage(sched, 100, timeout_s=BOUND_S))
    _until(_waiting(sched, "staging", 1), "the whole budget asked for")
    large_waits.set()
    assert job.result(BOUND_S) == 90
    assert large.outcome() == 100
    assert sched.stats().staging_bytes_in_use == 0
    _check(sched)
    sched.close()


# -- waits ended by an interrupt ---------------------------------------------------------------


class _Interrupted(Exception):
    """Raised in the main thread by the test's signal handler, as Ctrl-C raises there."""


@contextmanager
def _interrupt_when(check: Callable[[], bool]) -> Iterator[None]:
    """Interrupt the main thread with a signal once ``check()`` holds."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread only")

    def handler(signum: int, frame: object) -> None:
        raise _Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None

    def send() -> None:
        _until(check, "the main thread waiting in the scheduler")
        signal.pthread_kill(main, signal.SIGUSR1)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        yield
    finally:
        sender.join(BOUND_S)
        signal.signal(signal.SIGUSR1, old)


def test_a_staging_wait_ended_by_an_interrupt_leaves_no_bytes_held() -> None:
    sched = Scheduler(workers=1, staging_bytes=100)
    with sched.staging(100):
        with _interrupt_when(_waiting(sched, "staging", 1)), pytest.raises(_Interrupted):
            _stage(sched, 10, timeout_s=BOUND_S)
        assert sched.waiting()["staging"] == 0
    assert sched.stats().staging_bytes_in_use == 0
    assert _stage(sched, 100, timeout_s=0.0) == 100
    _check(sched)
    sched.close()


def test_a_submit_ended_by_an_interrupt_queues_no_job() -> None:
    sched = Scheduler(workers=1, queue_bound=1)
    gate = _occupy(sched)
    ran: list[str] = []
    sched.submit(D, lambda: ran.append("queued"))
    with _interrupt_when(_waiting(sched, "demote", 1)), pytest.raises(_Interrupted):
        sched.submit(D, lambda: ran.append("interrupted"), timeout_s=BOUND_S)
    assert sched.waiting()["demote"] == 0
    gate.set()
    sched.submit(D, lambda: ran.append("after")).result(BOUND_S)
    assert ran == ["queued", "after"]
    _check(sched)
    sched.close()
