"""A goal passes only on a figure that can be judged: no PASS with fewer than 3 repetitions, on
a negative median, a baseline of ~0, a non-finite sample, or a difference whose paired interval
reaches below zero; and every figure passes only when the far end of its interval meets the
goal (the upper end for "<=", the lower end for ">="), paired or not. A count of every trial
is judged as counted."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from cmx.bench.harness.core import Figure, Goal, SuiteResult, Verdict
from cmx.bench.harness.intervals import Interval, alternated, independent_ratio_interval
from cmx.bench.harness.report import BenchReport, figure_rows, render_markdown
from cmx.bench.suites.hits.hits import checksum_cost_figure

AT_MOST = Goal("<=", 0.10)
MACHINE = {"cpu": "Test CPU", "cores": 2, "memory_gib": 4.0, "disk": "vda", "filesystem": "ext4",
           "kernel": "6.0"}


def fig(samples: tuple[float, ...], base: tuple[float, ...], goal: Goal | None = AT_MOST,
        interval: Interval | None = None) -> Figure:
    return Figure("service", "cost", "s", samples, "the whole load", base, goal,
                  interval=interval)


def test_a_negative_median_never_passes_an_upper_bound() -> None:
    f = fig((-0.0095,) * 3, (0.1,) * 3)
    assert f.ratio < 0.10 and Goal("<=", 0.10).check(f.ratio) is Verdict.PASS
    assert f.verdict is Verdict.MISS and "negative" in (f.inconclusive or "")


@pytest.mark.parametrize("base", [(0.0,) * 3, (1e-12,) * 3, (-1.0,) * 3, (1.0, 0.0, 1.0)])
def test_a_baseline_of_about_zero_makes_the_ratio_unjudgeable(base: tuple[float, ...]) -> None:
    samples = tuple(1.0 for _ in base)
    for goal in (Goal(">=", 0.8), Goal("<=", 1e15)):
        f = fig(samples, base, goal)
        assert f.verdict is Verdict.MISS and "baseline" in (f.inconclusive or "")


def test_non_finite_samples_are_unjudgeable() -> None:
    assert fig((math.nan, 1.0, 1.0), (1.0, 1.0, 1.0)).verdict is Verdict.MISS
    assert fig((1.0,), (math.inf,), Goal("<=", 2.0)).verdict is Verdict.MISS


def test_a_difference_needs_an_interval_and_one_that_stays_above_zero() -> None:
    # Pairs whose median difference is positive but some of them negative: a difference.
    bare = fig((0.002, -0.004, 0.003), (0.04, 0.04, 0.04))
    assert bare.value > 0 and bare.verdict is Verdict.MISS
    low = fig((0.002, -0.004, 0.003), (0.04, 0.04, 0.04),
              interval=Interval(0.05, -0.1, 0.075, 0.95))
    assert low.verdict is Verdict.MISS and "below zero" in (low.inconclusive or "")
    ok = fig((0.002, 0.001, 0.003), (0.04, 0.04, 0.04),
             interval=Interval(0.05, 0.025, 0.075, 0.95))
    assert ok.inconclusive is None and ok.verdict is Verdict.PASS


def test_a_paired_ratio_passes_only_when_its_whole_interval_meets_the_goal() -> None:
    samples, base = (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)
    crossing = fig(samples, base, Goal("<=", 1.05), Interval(1.0, 0.9, 1.17, 0.95))
    assert crossing.ratio <= 1.05 and crossing.verdict is Verdict.MISS
    inside = fig(samples, base, Goal("<=", 1.05), Interval(1.0, 0.9, 1.04, 0.95))
    assert inside.verdict is Verdict.PASS
    at_least = fig(samples, base, Goal(">=", 0.8), Interval(1.0, 0.7, 1.2, 0.95))
    assert at_least.verdict is Verdict.MISS
    assert fig(samples, base, Goal(">=", 0.8), Interval(1.0, 0.85, 1.2, 0.95)).verdict \
        is Verdict.PASS


def test_fewer_than_three_repetitions_never_pass() -> None:
    # A ratio of 0.05 against a bound of 0.10, on one and on two repetitions: not shown.
    for n in (1, 2):
        f = fig((0.002,) * n, (0.04,) * n)
        assert f.ratio == pytest.approx(0.05) and f.verdict is Verdict.MISS
        assert "fewer than 3" in (f.inconclusive or "")
        paired = fig((0.002,) * n, (0.04,) * n, interval=Interval(0.05, 0.05, 0.05, 0.95))
        assert paired.verdict is Verdict.MISS
    short_baseline = fig((0.002,) * 3, (0.04,) * 2)
    assert short_baseline.verdict is Verdict.MISS and short_baseline.reps == 2
    assert fig((0.002,) * 3, (0.04,) * 3).verdict is Verdict.PASS
    assert fig((0.0,) * 3, (0.04,) * 3).verdict is Verdict.PASS  # a time of 0 is a real time
    assert fig((-1.0,), (0.0,), None).verdict is Verdict.INFO  # no goal: nothing judged


def test_an_unpaired_figure_is_judged_by_the_far_end_of_its_own_interval() -> None:
    # Medians that meet the goal, one repetition far off: the interval crosses the bound.
    at_most = fig((0.002, 0.003, 0.02, 0.003, 0.002), (0.04,) * 5)
    assert at_most.ratio == pytest.approx(0.075) and AT_MOST.check(at_most.ratio) is Verdict.PASS
    assert at_most.verdict is Verdict.MISS
    iv = at_most.judged_interval
    assert iv is not None and at_most.interval is None and iv.high > 0.10
    at_least = fig((0.9, 0.5, 0.9, 0.95, 0.5), (1.0,) * 5, Goal(">=", 0.8))
    assert at_least.ratio == pytest.approx(0.9) and at_least.verdict is Verdict.MISS
    steady = fig((0.9, 0.92, 0.88), (1.0, 1.01, 0.99), Goal(">=", 0.8))
    assert steady.judged_interval is not None and steady.judged_interval.low > 0.8
    assert steady.verdict is Verdict.PASS
    assert steady.to_dict()["interval"]["paired"] is False


def test_sides_measured_apart_are_resampled_each_on_its_own() -> None:
    iv = independent_ratio_interval([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0])
    assert iv.ratio == pytest.approx(1.25) and iv.low < 1.0 < 1.5 < iv.high
    assert independent_ratio_interval([3.0], [2.0]) == Interval(1.5, 1.5, 1.5, 0.95)
    with pytest.raises(ValueError):
        independent_ratio_interval([], [1.0])
    steady = fig((0.9, 0.92, 0.88), (1.0, 1.01, 0.99), Goal(">=", 0.8))
    text = render_markdown(BenchReport(MACHINE, "2026-01-01T00:00:00+00:00", {"reps": 3},
                                       [SuiteResult("service", "cmx bench service", [steady])]))
    assert "bootstrap over 3 and 3 repetitions, each side resampled on its own" in text


def test_a_count_of_every_trial_is_judged_as_counted() -> None:
    none_hung = Figure.count("soak", "hung", "requests", 0, 1200, "requests sent",
                             Goal("<=", 0.0))
    assert none_hung.judged_interval is None and none_hung.verdict is Verdict.PASS
    one_hung = Figure.count("soak", "hung", "requests", 1, 1200, "requests sent",
                            Goal("<=", 0.0))
    assert one_hung.verdict is Verdict.MISS
    nothing_sent = Figure.count("soak", "hung", "requests", 0, 0, "requests sent",
                                Goal("<=", 0.0))
    assert nothing_sent.verdict is Verdict.MISS and nothing_sent.inconclusive
    with pytest.raises(ValueError, match="whole number"):
        Figure("soak", "hung", "requests", (0.5,), "sent", (3.0,), counted=True)
    with pytest.raises(ValueError, match="whole number"):
        Figure("soak", "hung", "requests", (0.0, 0.0), "sent", (3.0, 3.0), counted=True)
    with pytest.raises(ValueError, match="no larger"):  # a share, never above what was sent
        Figure.count("e2e", "identical", "outputs", 40, 32, "sent", Goal(">=", 1.0))


def test_pairs_alternate_which_variant_goes_first() -> None:
    order: list[str] = []

    def run(name: str, value: float) -> Callable[[], float]:
        def measure() -> float:
            order.append(name)
            return value + len(order)
        return measure

    a, b = alternated(4, run("A", 0.0), run("B", 100.0))
    assert order == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert a == [1.0, 4.0, 5.0, 8.0] and b == [102.0, 103.0, 106.0, 107.0]
    with pytest.raises(ValueError):
        alternated(0, run("A", 0.0), run("B", 0.0))


def test_the_checksum_cost_is_paired_and_a_negative_one_is_inconclusive() -> None:
    # The run that read "-9.5 ms, ratio -0.09, PASS": unverified loads slower than verified.
    loads = [0.100, 0.095, 0.105, 0.098, 0.102]
    bare = [0.110, 0.104, 0.112, 0.108, 0.111]
    f = checksum_cost_figure(loads, bare, 25.0, 12.0)
    assert f.samples == pytest.approx(tuple(x - y for x, y in zip(loads, bare, strict=True)))
    assert f.baseline_samples == tuple(loads) and f.interval is not None
    assert f.value < 0 and f.verdict is Verdict.MISS and f.inconclusive
    # Noisy pairs around a small positive cost: the interval reaches below zero.
    noisy = checksum_cost_figure([0.10, 0.10, 0.10, 0.10, 0.10],
                                 [0.099, 0.098, 0.104, 0.097, 0.103], 25.0, 12.0)
    assert noisy.value > 0 and noisy.interval is not None and noisy.interval.low < 0
    assert noisy.verdict is Verdict.MISS
    clean = checksum_cost_figure([0.10, 0.101, 0.099], [0.098, 0.099, 0.097], 25.0, 12.0)
    assert clean.verdict is Verdict.PASS


def test_the_report_says_inconclusive_and_why() -> None:
    f = checksum_cost_figure([0.100, 0.095, 0.098], [0.110, 0.104, 0.108], 25.0, 12.0)
    assert figure_rows([f])[0][-1] == "**MISS** (inconclusive)"
    suite = SuiteResult("service", "cmx bench service", [f])
    text = render_markdown(BenchReport(MACHINE, "2026-01-01T00:00:00+00:00", {"reps": 3},
                                       [suite]))
    assert "inconclusive, not judged: its median is negative" in text
    assert "bootstrap over 3 pairs" in text
    assert f.to_dict()["inconclusive"] and f.to_dict()["interval"]["low"] < 0
