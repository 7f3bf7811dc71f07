"""The paired miss benchmark's pure parts: the order requests run in, their prompts, the interval
of a ratio of medians, and the figures a run's samples become."""

from __future__ import annotations

import pytest

from cmx.bench.harness.core import Verdict
from cmx.bench.suites.e2e.e2e_miss import BASE, VARIANTS, _figures
from cmx.bench.suites.e2e.e2e_pairs import (
    VOCAB,
    Slot,
    prompt_ids,
    prompt_seed,
    ratio_interval,
    schedule,
)


def test_two_engines_alternate_and_swap_who_goes_first_each_repetition() -> None:
    slots = schedule(["cmx", "none"], reps=4, lengths=[512])
    assert [s.variant for s in slots] == ["cmx", "none", "none", "cmx"] * 2
    assert [s.rep for s in slots] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_every_variant_runs_once_per_repetition_and_length_and_each_leads_once() -> None:
    names = [v.name for v in VARIANTS]
    slots = schedule(names, reps=len(names), lengths=[4096, 8128])
    assert [s.tokens for s in slots] == [4096] * len(names) ** 2 + [8128] * len(names) ** 2
    for n in (4096, 8128):
        for rep in range(len(names)):
            got = [s.variant for s in slots if s.tokens == n and s.rep == rep]
            assert sorted(got) == sorted(names)
        leaders = [next(s.variant for s in slots if s.tokens == n and s.rep == rep)
                   for rep in range(len(names))]
        assert sorted(leaders) == sorted(names)


def test_a_schedule_needs_variants() -> None:
    with pytest.raises(ValueError):
        schedule([], reps=2, lengths=[512])


def test_each_request_gets_a_fresh_prompt_and_a_rerun_the_same_one() -> None:
    slots = schedule(["cmx", "none"], reps=3, lengths=[512, 1024])
    seeds = [prompt_seed(s) for s in slots]
    assert len(set(seeds)) == len(seeds)
    assert prompt_seed(Slot(512, 0, "cmx"), salt=1) != prompt_seed(Slot(512, 0, "cmx"))
    ids = prompt_ids(seeds[0], 512)
    assert ids == prompt_ids(seeds[0], 512)
    assert len(ids) == 512 and all(VOCAB[0] <= t < VOCAB[1] for t in ids)
    assert ids != prompt_ids(seeds[1], 512)


def test_the_ratio_is_of_medians_and_its_interval_holds_it() -> None:
    a = [1.0, 1.2, 1.1, 5.0, 1.3]
    b = [1.0, 1.0, 1.0, 1.0, 1.0]
    iv = ratio_interval(a, b)
    assert iv.ratio == pytest.approx(1.2)
    assert iv.low <= iv.ratio <= iv.high
    assert iv.low >= 1.0 and iv.high <= 5.0
    assert ratio_interval(a, b) == iv  # seeded: the same samples give the same interval


def test_a_constant_ratio_has_no_spread_and_one_repetition_is_its_own_interval() -> None:
    iv = ratio_interval([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert (iv.ratio, iv.low, iv.high) == (2.0, 2.0, 2.0)
    one = ratio_interval([3.0], [2.0])
    assert (one.ratio, one.low, one.high) == (1.5, 1.5, 1.5)


def test_pairs_are_resampled_together() -> None:
    # Each repetition's pair has ratio 1 though the repetitions differ 10x: resampling pairs
    # together keeps every resample's ratio at 1; resampling them apart would not.
    iv = ratio_interval([1.0, 10.0, 1.0, 10.0, 1.0], [1.0, 10.0, 1.0, 10.0, 1.0])
    assert (iv.low, iv.high) == (1.0, 1.0)


@pytest.mark.parametrize("a,b,level", [([1.0], [1.0, 2.0], 0.95), ([], [], 0.95),
                                       ([1.0], [1.0], 1.0)])
def test_unpaired_or_empty_samples_and_bad_levels_are_refused(
        a: list[float], b: list[float], level: float) -> None:
    with pytest.raises(ValueError):
        ratio_interval(a, b, level=level)


def test_a_runs_samples_become_paired_figures_with_goals_on_the_miss_alone() -> None:
    reps = 3
    by = {v.name: [1.0, 1.1, 0.9] for v in VARIANTS}
    by["miss"] = [1.02, 1.12, 0.92]
    figures, tables = _figures({512: by}, {512: [1.0, 1.0, 1.0]})
    names = {f.name: f for f in figures}
    assert len(figures) == len(BASE) + 1
    miss = names["TTFT, 512-token prompt, CMXConnector, a prompt nobody stored"]
    assert miss.baseline_samples == tuple(by["none"]) and len(miss.samples) == reps
    assert miss.verdict is Verdict.PASS and "[" in miss.note
    opted = names["TTFT, 512-token prompt, CMXConnector, request opted out (skip)"]
    assert opted.verdict is Verdict.INFO
    assert len(tables[0].rows) == len(figures)
