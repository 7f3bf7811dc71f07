"""Reading and merging the result files of vLLM's benchmark client, and the client's arguments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cmx.bench.suites.e2e.serve_report import sustained
from cmx.bench.suites.e2e.vllm_results import (
    ClientResult,
    ServeRun,
    merge,
    parse_result,
    percentile,
    read_result,
)
from cmx.bench.suites.e2e.vllm_serve import ServeSettings, client_args


def _result(ttfts: list[float], errors: list[str] | None = None, duration: float = 10.0,
            ) -> dict[str, object]:
    """A result as ``vllm bench serve --save-result --save-detailed`` writes it (vLLM 0.29)."""
    errors = errors if errors is not None else [""] * len(ttfts)
    failed = sum(1 for e in errors if e)
    return {"date": "20250101-000000", "backend": "vllm", "num_prompts": len(ttfts),
            "request_rate": 1.0, "duration": duration, "completed": len(ttfts) - failed,
            "failed": failed, "total_input_tokens": 100 * len(ttfts),
            "total_output_tokens": 8 * (len(ttfts) - failed), "request_throughput": 0.4,
            "output_throughput": 3.2, "total_token_throughput": 43.2,
            "median_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "ttfts": ttfts,
            "itls": [[] for _ in ttfts], "errors": errors, "input_lens": [100] * len(ttfts),
            "output_lens": [8] * len(ttfts), "start_times": [0.0] * len(ttfts)}


def test_a_result_file_is_read_and_failed_requests_drop_out_of_ttfts(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result([0.5, 0.0, 0.7], ["", "boom", ""])))
    r = read_result(path)
    assert (r.completed, r.failed, r.duration_s) == (2, 1, 10.0)
    assert r.ttfts_s == (0.5, 0.7)
    assert (r.input_tokens, r.output_tokens) == (300, 16)
    assert r.request_throughput == pytest.approx(0.2)


def test_a_result_without_per_request_ttfts_is_refused() -> None:
    data = _result([0.5])
    del data["ttfts"]
    with pytest.raises(ValueError, match="save-detailed"):
        parse_result(data)


def test_percentiles_match_numpys_linear_default() -> None:
    import numpy as np
    xs = [0.3, 0.1, 0.9, 0.5, 0.2, 0.8, 0.4]
    for q in (0, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_two_clients_merge_into_one_run() -> None:
    a = ClientResult(completed=4, failed=0, duration_s=10.0, input_tokens=400, output_tokens=32,
                     ttfts_s=(0.1, 0.2, 0.3, 0.4))
    b = ClientResult(completed=3, failed=1, duration_s=14.0, input_tokens=300, output_tokens=24,
                     ttfts_s=(1.0, 2.0, 3.0))
    run = merge([a, b])
    assert (run.completed, run.failed, run.duration_s) == (7, 1, 14.0)
    assert run.request_throughput == pytest.approx(7 / 14)
    assert run.token_throughput == pytest.approx(756 / 14)
    assert run.ttft_p50_ms == pytest.approx(400.0)  # the median of all seven, not of two medians
    assert run.ttft_p99_ms == pytest.approx(percentile([0.1, 0.2, 0.3, 0.4, 1, 2, 3], 99) * 1000)
    with pytest.raises(ValueError):
        merge([])


@pytest.mark.parametrize("dataset", ["prefix_repetition", "random"])
def test_the_clients_arguments_are_vllms_own(dataset: str, tmp_path: Path) -> None:
    import vllm.benchmarks.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    s = ServeSettings(prefix_len=256, suffix_len=64, num_prefixes=2, output_len=4)
    args = client_args(dataset, s, "http://127.0.0.1:9", "/m", 0.5, 6, tmp_path / "x.json")
    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    ns = parser.parse_args(args)
    assert (ns.dataset_name, ns.num_prompts, ns.request_rate) == (dataset, 6, 0.5)
    assert ns.save_result and ns.save_detailed and ns.result_filename == "x.json"
    if dataset == "random":
        assert (ns.random_prefix_len, ns.random_input_len) == (256, 64)
    else:
        assert (ns.prefix_repetition_prefix_len, ns.prefix_repetition_num_prefixes) == (256, 2)


def test_an_unknown_dataset_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        client_args("sharegpt", ServeSettings(), "u", "m", 1.0, 2, tmp_path / "x.json")


def test_settings_that_vllms_client_would_refuse_are_refused_here() -> None:
    with pytest.raises(ValueError, match="num_prompts must be at least 8"):
        ServeSettings(num_prompts=4, num_prefixes=4)  # two per client, fewer than the prefixes
    with pytest.raises(ValueError, match="rates"):
        ServeSettings(rates=(0.0,))
    assert ServeSettings(num_prompts=4, num_prefixes=4, datasets=("random",)).num_prompts == 4


def _run(throughput: float, p99_ms: float, failed: int = 0) -> ServeRun:
    return ServeRun(completed=10, failed=failed, duration_s=10 / throughput,
                    request_throughput=throughput, token_throughput=100 * throughput,
                    ttft_p50_ms=p99_ms / 2, ttft_p99_ms=p99_ms)


def test_the_throughput_judged_is_the_fastest_run_whose_p99_held() -> None:
    runs = {("prefix_repetition", 0.2): _run(0.2, 4_000),
            ("prefix_repetition", 0.4): _run(0.4, 9_000),
            ("prefix_repetition", 0.8): _run(0.7, 30_000),  # past the p99 target
            ("prefix_repetition", 0.6): _run(0.6, 5_000, failed=1),  # a request failed
            ("random", 1.0): _run(1.0, 1_000)}  # another workload
    assert sustained(runs, "prefix_repetition") == runs[("prefix_repetition", 0.4)]
    assert sustained({("prefix_repetition", 0.8): _run(0.7, 30_000)}, "prefix_repetition") is None


def test_the_throughput_goal_compares_the_connector_with_vllm_alone_at_the_same_p99() -> None:
    from cmx.bench.harness.core import SuiteResult, Verdict
    from cmx.bench.suites.e2e.serve_report import report as _report

    none = {("prefix_repetition", r): _run(r, p) for r, p in ((0.2, 6_000), (0.4, 20_000))}
    cmx = {("prefix_repetition", r): _run(r, p) for r, p in ((0.2, 2_000), (0.4, 7_000))}
    result = SuiteResult("e2e-serve", command="")
    _report(result, {"cmx": cmx, "none": none})
    (judged,) = [f for f in result.figures if f.goal is not None]
    assert (judged.value, judged.baseline) == (0.4, 0.2) and judged.goal is not None
    assert judged.goal.check(judged.ratio) is Verdict.PASS  # 2x at p99 <= 10 s
    result = SuiteResult("e2e-serve", command="")
    _report(result, {"cmx": {("prefix_repetition", 0.2): _run(0.2, 12_000)}, "none": none})
    (judged,) = [f for f in result.figures if f.goal is not None]
    assert judged.value == 0.0  # the connector held the p99 at no rate: a miss, not a skip
    result = SuiteResult("e2e-serve", command="")
    _report(result, {"cmx": cmx, "none": {("prefix_repetition", 0.4): _run(0.4, 20_000)}})
    assert not [f for f in result.figures if f.goal is not None]
    assert any("no baseline" in n for n in result.notes)


def test_rounds_pool_every_request_and_add_their_durations() -> None:
    from cmx.bench.suites.e2e.vllm_results import ClientResult, pool

    def client(duration: float, ttfts: tuple[float, ...]) -> ClientResult:
        return ClientResult(len(ttfts), 0, duration, 100 * len(ttfts), len(ttfts), ttfts)

    one = [client(10.0, (1.0,) * 9), client(12.0, (1.0,) * 9)]  # a run lasts 12 s
    two = [client(8.0, (1.0,) * 9 + (50.0,)), client(6.0, (1.0,) * 9)]  # and this one 8 s
    pooled = pool([one, two])
    assert (pooled.completed, pooled.duration_s) == (37, 20.0)
    assert pooled.request_throughput == 37 / 20.0
    assert pooled.ttft_p50_ms == 1000.0 and pooled.ttft_p99_ms > 10_000  # the slow one shows
    assert merge(one) == pool([one])


def test_the_cpu_table_gives_seconds_per_completed_request() -> None:
    from cmx.bench.harness.core import SuiteResult
    from cmx.bench.harness.proc_cpu import REST, CpuUse
    from cmx.bench.suites.e2e.serve_report import report as _report

    key = ("prefix_repetition", 1.0)
    got = {"cmx": {key: _run(1.0, 4_000)}, "none": {key: _run(1.0, 5_000)}}
    cpu = {"cmx": {key: CpuUse(10.0, {"servers": 15.0, REST: 5.0, "clients": 1.0}, 20.0, 2)},
           "none": {key: CpuUse(10.0, {"servers": 18.0, REST: 0.0, "clients": 1.0}, 19.0, 2)}}
    result = SuiteResult("e2e-serve", command="")
    tokens = {"cmx": {key: {"local_compute": 5000.0, "local_cache_hit": 2000.0,
                            "external_kv_transfer": 3000.0}}}
    _report(result, got, cpu, 2, tokens)
    table = result.tables[-1]
    assert table.rows == (("cmx", "prefix_repetition", "1", "1.50", "0.50", "0.10", "2.00",
                           "100%", "500", "200", "300"),
                          ("none", "prefix_repetition", "1", "1.80", "0.00", "0.10", "1.90",
                           "95%", "-", "-", "-"))
    assert "2 rounds, a rate's runs pooled" in result.tables[0].title


def test_prompt_tokens_are_read_by_source_from_the_servers_metrics() -> None:
    from cmx.bench.suites.e2e.vllm_results import prompt_tokens

    text = """# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 2048.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 1024.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 992.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 4064.0
"""
    assert prompt_tokens(text) == {"local_compute": 3072.0, "external_kv_transfer": 992.0}
    assert prompt_tokens("") == {}
