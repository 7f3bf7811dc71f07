"""Prefetch policies with a fake clock: how long a free replica waits for its prefix."""

from __future__ import annotations

import pytest

from cmx.policies.prefetch import (
    PREFETCH_POLICIES,
    PrefetchOutcome,
    PrefetchPolicy,
    make_prefetch,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakePrefetch:
    """Completes at ``done_at`` on the fake clock; waiting advances the clock."""

    def __init__(self, clock: Clock, started_s: float, done_at: float) -> None:
        self.clock, self.started_s, self.done_at = clock, started_s, done_at

    def done(self) -> bool:
        return self.clock.now >= self.done_at

    def wait(self, timeout_s: float) -> bool:
        if self.clock.now + timeout_s >= self.done_at:
            self.clock.now = max(self.clock.now, self.done_at)
            return True
        self.clock.now += timeout_s
        return False


def test_every_registered_policy_builds() -> None:
    for name in PREFETCH_POLICIES:
        assert isinstance(make_prefetch(name), PrefetchPolicy)
    with pytest.raises(ValueError, match="known"):
        make_prefetch("eager")


@pytest.mark.parametrize("name", sorted(PREFETCH_POLICIES))
def test_no_prefetch_and_a_finished_one_cost_no_wait(name: str) -> None:
    clock = Clock()
    policy = make_prefetch(name)
    assert policy.wait(None, clock).outcome is PrefetchOutcome.NONE
    done = policy.wait(FakePrefetch(clock, 99.0, 99.5), clock)
    assert done.outcome is PrefetchOutcome.DONE and done.waited_s == 0.0


def test_best_effort_never_waits() -> None:
    clock = Clock()
    w = make_prefetch("best_effort").wait(FakePrefetch(clock, 100.0, 100.3), clock)
    assert w.outcome is PrefetchOutcome.CUT and w.waited_s == 0.0 and clock.now == 100.0


def test_wait_complete_waits_for_the_move_but_not_forever() -> None:
    clock = Clock()
    w = make_prefetch("wait_complete").wait(FakePrefetch(clock, 100.0, 100.3), clock)
    assert w.outcome is PrefetchOutcome.DONE and w.waited_s == pytest.approx(0.3)
    clock = Clock()
    stuck = make_prefetch("wait_complete", max_wait_s=2.0).wait(
        FakePrefetch(clock, 100.0, 1e9), clock)
    assert stuck.outcome is PrefetchOutcome.CUT and stuck.waited_s == pytest.approx(2.0)


def test_timeout_counts_from_the_prefetch_start_not_from_now() -> None:
    clock = Clock()
    policy = make_prefetch("timeout", timeout_s=0.5)
    late = policy.wait(FakePrefetch(clock, 99.8, 101.0), clock)  # 0.2 s already spent queueing
    assert late.outcome is PrefetchOutcome.CUT and late.waited_s == pytest.approx(0.3)
    clock = Clock()
    spent = policy.wait(FakePrefetch(clock, 99.0, 101.0), clock)  # its time is up already
    assert spent.outcome is PrefetchOutcome.CUT and spent.waited_s == 0.0
    clock = Clock()
    ok = policy.wait(FakePrefetch(clock, 100.0, 100.2), clock)
    assert ok.outcome is PrefetchOutcome.DONE and ok.waited_s == pytest.approx(0.2)


def test_the_callers_cap_bounds_every_policy() -> None:
    clock = Clock()
    w = make_prefetch("wait_complete").wait(FakePrefetch(clock, 100.0, 105.0), clock, cap_s=0.1)
    assert w.outcome is PrefetchOutcome.CUT and w.waited_s == pytest.approx(0.1)
