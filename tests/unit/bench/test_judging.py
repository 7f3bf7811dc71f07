"""A goal passes only on a figure that can be judged: no PASS on a negative median, a baseline
of ~0, a non-finite sample, or a difference whose paired interval reaches below zero; and a
paired figure passes only when its whole interval meets the goal."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from cmx.bench.harness.core import Figure, Goal, SuiteResult, Verdict
from cmx.bench.harness.intervals import Interval, alternated
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
    f = fig((-0.0095,), (0.1,))
    assert f.ratio < 0.10 and Goal("<=", 0.10).check(f.ratio) is Verdict.PASS
    assert f.verdict is Verdict.MISS and "negative" in (f.inconclusive or "")


@pytest.mark.parametrize("base", [(0.0,), (1e-12,), (-1.0,), (1.0, 0.0, 1.0)])
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


def test_ordinary_figures_are_judged_as_before() -> None:
    assert fig((0.002,), (0.04,)).verdict is Verdict.PASS
    assert fig((0.02,), (0.04,)).verdict is Verdict.MISS
    assert fig((0.0,), (0.04,)).verdict is Verdict.PASS  # a time of 0 is a real time
    assert fig((-1.0,), (0.0,), None).verdict is Verdict.INFO  # no goal: nothing judged


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
    f = checksum_cost_figure([0.100, 0.095], [0.110, 0.104], 25.0, 12.0)
    assert figure_rows([f])[0][-1] == "**MISS** (inconclusive)"
    suite = SuiteResult("service", "cmx bench service", [f])
    text = render_markdown(BenchReport(MACHINE, "2026-01-01T00:00:00+00:00", {"reps": 2},
                                       [suite]))
    assert "inconclusive, not judged: its median is negative" in text
    assert "bootstrap over 2 pairs" in text
    assert f.to_dict()["inconclusive"] and f.to_dict()["interval"]["low"] < 0
