"""The prefill-decode suite's pure parts: a client's result file read, and the figures made from
runs of the two applications (a greedy output that differs is a MISS)."""

from __future__ import annotations

from typing import Any

import pytest

from cmx.bench.harness.core import Verdict
from cmx.bench.suites.e2e import prefill_decode as pd
from cmx.bench.suites.e2e.prefill_decode import PDSettings, RunStats, run_stats

OUT = PDSettings().output_len


def _result(texts: list[str], errors: list[str] | None = None) -> dict[str, Any]:
    n = len(texts)
    return {"ttfts": [0.1 * (i + 1) for i in range(n)],
            "itls": [[0.01, 0.02] for _ in range(n)], "generated_texts": texts,
            "errors": errors or [""] * n, "output_lens": [OUT] * n}


def test_a_result_file_reads_into_each_request_and_every_gap() -> None:
    got = run_stats(_result(["a", "b", "c"], ["", "boom", ""]), OUT)
    assert (got.completed, got.failed) == (2, 1)
    assert got.ttft_ms == pytest.approx((100.0, 300.0))
    assert got.itl_ms == pytest.approx((10.0, 20.0, 10.0, 20.0))  # the failed one's left out
    assert got.texts == ("a", None, "c")
    assert got.itl(50) == pytest.approx(15.0)


def test_a_result_without_the_detailed_lists_is_refused() -> None:
    with pytest.raises(ValueError, match="save-detailed"):
        run_stats({"ttfts": [0.1], "errors": [""]}, OUT)


def _runs(split_texts: list[str]) -> dict[str, list[RunStats]]:
    colo = run_stats(_result(["x", "y"]), OUT)
    return {"split": [run_stats(_result(split_texts), OUT)] * 2, "colocated": [colo, colo]}


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


def test_a_stream_cut_short_or_a_failure_without_a_reason_is_not_completed() -> None:
    data = _result(["a", "", "c"])
    data["output_lens"] = [OUT, 0, OUT - 5]
    assert run_stats(data, OUT).texts == ("a", None, None)


def test_failed_requests_are_a_miss_and_never_pass_as_identical() -> None:
    colo = run_stats(_result(["x", "y"]), OUT)
    split = run_stats(_result(["x", "y"], ["", "timed out"]), OUT)
    result = pd.SuiteResult(pd.SUITE, command="")
    pd._report(result, PDSettings(), {"split": [split], "colocated": [colo]}, {})
    by_name = {f.name.split(",")[0].split(" ")[0]: f for f in result.figures}
    assert by_name["greedy"].verdict is Verdict.MISS  # 1 of 2 sent, not 1 of 1 answered
    assert by_name["requests"].verdict is Verdict.MISS and by_name["requests"].value == 1
