"""Capacity at a TTFT p99 target: the search, its bounds, its interval, and the command."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cmx.cli import app
from cmx.simulate import CMX, SimConfig, simulate
from cmx.simulate.capacity import (
    IntervalMethod,
    Measure,
    Outcome,
    find_capacity,
    median_interval,
    scenario_builder,
)

# One node of the seed scenario (8 replicas), a minute of arrivals: a run is ~0.1 s, and the
# TTFT p99 crosses 10 s near load 0.3.
TINY = scenario_builder("seed", CMX, nodes=1, duration_s=60.0)


@pytest.mark.parametrize("start_load", [0.5, 0.04])  # bracketed from above, from below
def test_the_capacity_meets_the_target_and_one_step_above_misses_it(start_load: float) -> None:
    cap = find_capacity(TINY, target_p99_s=10.0, seeds=2, resolution=0.02, start_load=start_load)
    assert cap.strategy == "cmx" and len(cap.seeds) == 2
    for s in cap.seeds:
        assert s.outcome is Outcome.RESOLVED and s.met and s.missed
        assert s.missed.load == pytest.approx(s.met.load + 0.02)
        # The reported p99s are those of ordinary runs at those loads and seeds.
        met = simulate(TINY(s.met.load, s.seed)).ttft_s.p99
        missed = simulate(TINY(s.missed.load, s.seed)).ttft_s.p99
        assert met == s.met.p99_s <= 10.0 < missed == s.missed.p99_s
        assert s.met.rate_per_s == TINY(s.met.load, s.seed).workload.rate_per_s
        # Doubling (or halving) then bisection: a handful of runs, not one per grid step.
        assert s.simulations <= 10 and len({p.load for p in s.points}) == s.simulations
        assert s.points[0].load == start_load and (s.points[1].load > start_load) == (
            start_load < s.met.load
        )
    loads = sorted(s.load for s in cap.seeds)
    assert cap.interval is IntervalMethod.MIN_MAX and cap.load_interval == tuple(loads)
    assert cap.load == pytest.approx(np.median(loads)) and 0 < cap.load < 1
    assert cap.simulations == sum(s.simulations for s in cap.seeds)


def _step_at(rate_per_s: float) -> Measure:
    """A stand-in for the simulator: p99 1 s up to ``rate_per_s``, 100 s above it."""

    def p99(config: SimConfig) -> float:
        return 1.0 if config.workload.rate_per_s <= rate_per_s else 100.0

    return p99


def test_the_search_finds_every_crossing_of_a_monotone_p99_in_at_most_eleven_runs() -> None:
    rate_per_load = TINY(1.0, 0).workload.rate_per_s
    for k in range(0, 202):
        step = _step_at((k * 0.02 + 1e-6) * rate_per_load)
        cap = find_capacity(TINY, seeds=1, measure=step)
        (s,) = cap.seeds
        assert s.load == pytest.approx(min(k, 200) * 0.02), k
        assert s.outcome is {0: Outcome.NONE, 200: Outcome.MAX_LOAD}.get(
            min(k, 200), Outcome.RESOLVED
        )
        assert s.simulations <= 11


def test_the_same_seeds_give_the_same_answer_and_other_seeds_other_runs() -> None:
    a = find_capacity(TINY, seeds=2, first_seed=3).to_dict()
    b = find_capacity(TINY, seeds=2, first_seed=3).to_dict()
    assert a == b
    c = find_capacity(TINY, seeds=2, first_seed=5).to_dict()
    assert [s["seed"] for s in c["seeds"]] == [5, 6]
    assert c["seeds"][0]["points"][0]["p99_s"] != a["seeds"][0]["points"][0]["p99_s"]


def test_a_target_nobody_meets_is_zero_capacity() -> None:
    # A cold 64K-token prefill alone takes longer than a second.
    cap = find_capacity(TINY, target_p99_s=1.0, seeds=2)
    assert cap.load == cap.rate_per_s == 0.0 and cap.p99_s is None
    assert cap.load_interval == (0.0, 0.0)
    for s in cap.seeds:
        assert s.outcome is Outcome.NONE and s.met is None and s.load == 0.0
        assert s.missed is not None and s.missed.load == pytest.approx(0.02)
        assert all(p.p99_s > 1.0 for p in s.points)


def test_the_search_reports_its_bounds() -> None:
    easy = find_capacity(TINY, target_p99_s=1e6, seeds=1, max_load=0.5)
    (s,) = easy.seeds
    assert s.outcome is Outcome.MAX_LOAD and s.load == 0.5 and s.missed is None
    short = find_capacity(TINY, seeds=1, max_simulations=2)
    (s,) = short.seeds
    assert s.outcome is Outcome.BUDGET and s.simulations == 2


@pytest.mark.parametrize(
    "bad",
    [
        dict(target_p99_s=0.0),
        dict(target_p99_s=-5.0),
        dict(seeds=0),
        dict(resolution=0.0),
        dict(start_load=0.0),
        dict(resolution=5.0),
        dict(max_simulations=0),
    ],
)
def test_bad_inputs_raise_before_any_run(bad: dict) -> None:  # type: ignore[type-arg]
    def build(load: float, seed: int):  # type: ignore[no-untyped-def]
        raise AssertionError("simulated")

    with pytest.raises(ValueError):
        find_capacity(build, **bad)


def test_the_interval_is_a_bootstrap_of_the_median_from_five_seeds() -> None:
    x = np.array([0.30, 0.32, 0.34, 0.36, 0.50, 0.34, 0.28])
    lo, hi, method = median_interval(x)
    assert method is IntervalMethod.BOOTSTRAP_95
    assert x.min() <= lo < np.median(x) < hi <= x.max()
    assert (lo, hi) != (x.min(), x.max())  # the resampled medians rarely reach the extremes
    assert median_interval(x) == (lo, hi, method)
    assert median_interval(x[:4]) == (0.30, 0.36, IntervalMethod.MIN_MAX)


def test_the_command_prints_and_writes_each_strategys_capacity(tmp_path: Path) -> None:
    args = [
        "simulate",
        "seed",
        "--capacity",
        "--nodes",
        "1",
        "--duration",
        "60",
        "--seeds",
        "2",
        "--out",
        str(tmp_path),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "TTFT p99 <= 10 s" in out and "min-max" in out and out.count("resolved") == 4
    doc = json.loads((tmp_path / "simulate-seed-capacity.json").read_text())
    assert [c["strategy"] for c in doc["capacity"]] == ["cmx", "lmcache-like"]
    ours = doc["capacity"][0]
    assert ours["target_p99_s"] == 10.0 and ours["interval"] == "min-max"
    assert [s["seed"] for s in ours["seeds"]] == [0, 1] and ours["simulations"] > 2
    assert ours["load"] == find_capacity(TINY, seeds=2).load
    assert not (tmp_path / "simulate-seed.json").exists()  # the plain run did not run
    bad = CliRunner().invoke(app, ["simulate", "seed", "--capacity", "--p99-target", "0"])
    assert bad.exit_code == 2 and "p99 target" in bad.output
