"""The "e2e-serve" rate sweep: rates rise until a run breaks the TTFT p99 target, at most
``MAX_RATES`` of them, so that a setup which holds a higher rate than the other shows it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cmx.bench.harness.core import SuiteResult, Verdict
from cmx.bench.suites.e2e.serve_report import Rounds, report
from cmx.bench.suites.e2e.serve_sweep import MAX_RATES, P99_TARGET_MS, RATES, held, sweep
from cmx.bench.suites.e2e.vllm_results import ServeRun
from cmx.bench.suites.e2e.vllm_serve import ServeSettings

DATASET = "prefix_repetition"


def run_at(rate: float, capacity: float, failed: int = 0) -> ServeRun:
    """A run of a setup that keeps its p99 within the target up to ``capacity`` req/s."""
    p99 = 4_000.0 if rate <= capacity else 3 * P99_TARGET_MS
    return ServeRun(completed=32, failed=failed, duration_s=32 / rate,
                    request_throughput=0.95 * rate, token_throughput=1000 * rate,
                    ttft_p50_ms=p99 / 4, ttft_p99_ms=p99)


def fake_measure(capacity: float, asked: list[float]) -> Callable[[float], ServeRun]:
    """The sweep's measure function, faked: a run at each rate asked, recorded in ``asked``."""
    def measure(rate: float) -> ServeRun:
        asked.append(rate)
        return run_at(rate, capacity)
    return measure


def test_the_sweep_stops_after_the_first_run_past_the_target() -> None:
    asked: list[float] = []
    done = sweep(RATES, fake_measure(1.0, asked))
    assert asked == [0.2, 0.3, 0.4, 0.6, 0.8, 1.1]  # 1.1 is the first past 1.0 req/s
    assert [r for r, _ in done] == asked
    assert all(held(run) for _, run in done[:-1]) and not held(done[-1][1])


def test_a_failed_request_breaks_the_sweep_as_a_slow_p99_does() -> None:
    asked: list[float] = []

    def measure(rate: float) -> ServeRun:
        asked.append(rate)
        return run_at(rate, 100.0, failed=1 if rate >= 0.4 else 0)

    assert [r for r, _ in sweep(RATES, measure)] == [0.2, 0.3, 0.4] == asked


def test_a_setup_that_never_breaks_runs_every_rate_and_no_more() -> None:
    asked: list[float] = []
    done = sweep(RATES, fake_measure(100.0, asked))
    assert asked == list(RATES) and len(done) == len(RATES) <= MAX_RATES
    assert all(held(run) for _, run in done)


@pytest.mark.parametrize("rates", [(), (0.4, 0.2), (0.2, 0.2), (0.0, 1.0),
                                   tuple(0.1 * (i + 1) for i in range(MAX_RATES + 1))])
def test_rates_must_be_positive_rising_and_bounded(rates: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="rates"):
        sweep(rates, fake_measure(1.0, []))
    with pytest.raises(ValueError, match="rates"):
        ServeSettings(rates=rates)


def rounds(capacity: float, n: int) -> list[dict[tuple[str, float], ServeRun]]:
    return [{(DATASET, r): run for r, run in sweep(RATES, fake_measure(capacity, []))}
            for _ in range(n)]


def test_a_setup_that_holds_a_higher_rate_shows_a_gain_above_one() -> None:
    # vLLM alone holds up to 0.6 req/s; with the connector, up to 1.2 req/s.
    by_round: Rounds = {"cmx": rounds(1.2, 3), "none": rounds(0.6, 3)}
    assert max(r for _, r in by_round["none"][0]) == 0.8  # its sweep ended at its break
    assert max(r for _, r in by_round["cmx"][0]) == 1.6  # this one went on to its own
    result = SuiteResult("e2e-serve", command="")
    report(result, {k: v[0] for k, v in by_round.items()}, rounds=3, by_round=by_round)
    (judged,) = [f for f in result.figures if f.goal is not None]
    assert judged.samples == pytest.approx((0.95 * 1.1,) * 3)
    assert judged.baseline_samples == pytest.approx((0.95 * 0.6,) * 3)
    assert judged.ratio > 1.5 and judged.interval is not None
    assert judged.verdict is Verdict.PASS
    assert not any("lower bound" in n for n in result.notes)


def test_one_round_is_not_enough_to_pass_and_a_sweep_that_never_broke_says_so() -> None:
    by_round: Rounds = {"cmx": rounds(100.0, 1), "none": rounds(0.6, 1)}
    result = SuiteResult("e2e-serve", command="")
    report(result, {k: v[0] for k, v in by_round.items()}, by_round=by_round)
    (judged,) = [f for f in result.figures if f.goal is not None]
    assert judged.ratio > 1.5 and judged.verdict is Verdict.MISS
    assert "fewer than 3" in (judged.inconclusive or "")
    assert any(n.startswith("cmx, prefix_repetition, round 1") and "lower bound" in n
               for n in result.notes)


def test_a_baseline_that_never_broke_leaves_the_goal_unjudged() -> None:
    # vLLM alone held to the last rate: its throughput is a lower bound, and however well the
    # connector did, the ratio to it cannot show a gain; the figure is a MISS, inconclusive.
    by_round: Rounds = {"cmx": rounds(100.0, 3), "none": rounds(100.0, 3)}
    result = SuiteResult("e2e-serve", command="")
    report(result, {k: v[0] for k, v in by_round.items()}, rounds=3, by_round=by_round)
    (judged,) = [f for f in result.figures if f.goal is not None]
    assert judged.verdict is Verdict.MISS and "lower bound" in (judged.inconclusive or "")


def test_a_setup_that_failed_leaves_the_goal_counted_as_inconclusive() -> None:
    by_round: Rounds = {"none": rounds(0.6, 3)}
    result = SuiteResult("e2e-serve", command="")
    report(result, {k: v[0] for k, v in by_round.items()}, rounds=3, by_round=by_round,
           failed={"cmx": "TimeoutExpired: the client ran past 1800 s"})
    (judged,) = [f for f in result.figures if f.goal is not None]
    assert judged.verdict is Verdict.MISS and "TimeoutExpired" in (judged.inconclusive or "")
