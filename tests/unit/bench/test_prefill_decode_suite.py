"""The prefill-decode suite's pure parts: a client's result file read, and the figures made from
runs of the two applications (a greedy output that differs is a MISS)."""

from __future__ import annotations

from typing import Any

import pytest

from cmx.bench.harness.core import Verdict
from cmx.bench.suites.e2e import prefill_decode as pd
from cmx.bench.suites.e2e.prefill_decode import PDSettings, RunStats, run_stats


def _result(texts: list[str], errors: list[str] | None = None) -> dict[str, Any]:
    n = len(texts)
    return {"ttfts": [0.1 * (i + 1) for i in range(n)],
            "itls": [[0.01, 0.02] for _ in range(n)], "generated_texts": texts,
            "errors": errors or [""] * n}


def test_a_result_file_reads_into_each_request_and_every_gap() -> None:
    got = run_stats(_result(["a", "b", "c"], ["", "boom", ""]))
    assert (got.completed, got.failed) == (2, 1)
    assert got.ttft_ms == pytest.approx((100.0, 300.0))
    assert got.itl_ms == pytest.approx((10.0, 20.0, 10.0, 20.0))  # the failed one's left out
    assert got.texts == ("a", None, "c")
    assert got.itl(50) == pytest.approx(15.0)


def test_a_result_without_the_detailed_lists_is_refused() -> None:
    with pytest.raises(ValueError, match="save-detailed"):
        run_stats({"ttfts": [0.1], "errors": [""]})


def _runs(split_texts: list[str]) -> dict[str, list[RunStats]]:
    colo = run_stats(_result(["x", "y"]))
    return {"split": [run_stats(_result(split_texts))] * 2, "colocated": [colo, colo]}


@pytest.mark.parametrize(("texts", "verdict"), [(["x", "y"], Verdict.PASS),
                                                 (["x", "z"], Verdict.MISS)])
def test_the_split_passes_only_when_every_greedy_output_is_the_colocated_ones(
    texts: list[str], verdict: Verdict,
) -> None:
    result = pd.SuiteResult(pd.SUITE, command="")
    pd._report(result, PDSettings(), _runs(texts), {"split": 1024, "colocated": 0})
    same = next(f for f in result.figures if "identical" in f.name)
    assert same.verdict is verdict
    ttft = next(f for f in result.figures if f.name.startswith("TTFT p50"))
    assert ttft.interval is not None and ttft.ratio == pytest.approx(1.0)
