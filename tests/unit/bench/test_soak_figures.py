"""The soak's counting and judging: nearest-rank percentiles, p99 TTFT per window, the greedy
comparison and the verdicts of its figures."""

from __future__ import annotations

import pytest

from cmx.bench.harness.core import MiB, Verdict
from cmx.bench.suites.soak.soak_figures import (
    FLAT,
    Outcome,
    RequestRecord,
    Snapshot,
    greedy_mismatches,
    percentile,
    soak_figures,
    windows,
)


def record(sent_s: float, outcome: Outcome = Outcome.COMPLETED, ttft_s: float | None = 0.5,
           greedy: bool = False, prompt: int = 0, text: str = "") -> RequestRecord:
    return RequestRecord(sent_s, "tenant-a", greedy, prompt, outcome, ttft_s, 1.0, text)


def snapshot(rss_mib: int, shm_mib: int) -> Snapshot:
    return Snapshot(0.0, rss_mib * MiB, 10, shm_mib * MiB, shm_mib * MiB)


def test_percentile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 99)


def test_each_window_counts_the_requests_sent_in_it_and_its_own_p99() -> None:
    records = [record(10, ttft_s=1.0), record(20, ttft_s=9.0), record(70, ttft_s=2.0),
               record(80, Outcome.HUNG, ttft_s=None), record(130, Outcome.FAILED, ttft_s=None),
               record(181, ttft_s=4.0)]  # sent at the very end: the last window's
    got = windows(records, 60, 180)
    assert [(w.start_s, w.end_s) for w in got] == [(0, 60), (60, 120), (120, 180)]
    assert [w.ttft_p99_s for w in got] == [9.0, 2.0, 4.0]
    assert got[1].counts[Outcome.HUNG] == 1 and got[1].counts[Outcome.COMPLETED] == 1
    assert got[2].counts[Outcome.FAILED] == 1 and got[2].counts[Outcome.COMPLETED] == 1
    assert windows([record(5, Outcome.FAILED, ttft_s=None)], 60, 60)[0].ttft_p99_s is None


def test_a_window_longer_than_the_run_is_one_window() -> None:
    assert [(w.start_s, w.end_s) for w in windows([record(1)], 300, 120)] == [(0, 120)]


def test_only_completed_greedy_requests_are_compared_with_the_reference() -> None:
    reference = ["alpha", "beta"]
    records = [record(1, greedy=True, prompt=0, text="alpha"),
               record(2, greedy=True, prompt=1, text="gamma"),
               record(3, Outcome.CUT, greedy=True, prompt=1, text="be"),
               record(4, greedy=False, prompt=1, text="anything")]
    assert [r.sent_s for r in greedy_mismatches(records, reference)] == [2]


def verdicts(records: list[RequestRecord], reference: list[str], start: Snapshot,
             end: Snapshot) -> dict[str, Verdict]:
    return {f.name: f.verdict for f in soak_figures(records, reference, start, end)}


def test_a_clean_soak_passes_its_counts_and_one_memory_reading_judges_nothing() -> None:
    records = [record(1, greedy=True, text="alpha"), record(2, Outcome.FAILED, ttft_s=None)]
    figures = soak_figures(records, ["alpha"], snapshot(1000, 400), snapshot(1100, 400))
    got = {f.name: f.verdict for f in figures}
    assert got["requests hung (no whole answer within the bound)"] is Verdict.PASS
    assert got["greedy outputs identical to the cache-off reference"] is Verdict.PASS
    assert got["requests failed cleanly (an error status or a clean error)"] is Verdict.INFO
    # Flat memory from one reading at each end: a single repetition shows nothing held.
    memory = [f for f in figures if f.unit == "MiB"]
    assert len(memory) == 2 and all(f.ratio <= FLAT for f in memory)
    assert all(f.verdict is Verdict.MISS and "fewer than 3" in (f.inconclusive or "")
               for f in memory)


def test_a_hang_a_wrong_greedy_output_and_growing_memory_each_miss() -> None:
    records = [record(1, greedy=True, text="alpha"), record(2, Outcome.HUNG, ttft_s=None)]
    got = verdicts(records, ["beta"], snapshot(1000, 400), snapshot(1500, 600))
    assert got["requests hung (no whole answer within the bound)"] is Verdict.MISS
    assert got["greedy outputs identical to the cache-off reference"] is Verdict.MISS
    assert got["resident memory of the cluster's processes at the end"] is Verdict.MISS
    assert got["/dev/shm of the application at the end"] is Verdict.MISS


def test_no_greedy_answer_cannot_pass_the_greedy_goal() -> None:
    got = verdicts([record(1, Outcome.FAILED, greedy=True, ttft_s=None)], ["alpha"],
                   snapshot(1000, 400), snapshot(1000, 400))
    assert got["greedy outputs identical to the cache-off reference"] is Verdict.MISS
