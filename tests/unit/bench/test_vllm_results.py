"""Reading and merging the result files of vLLM's benchmark client, and the client's arguments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cmx.bench.vllm_results import ClientResult, merge, parse_result, percentile, read_result
from cmx.bench.vllm_serve import ServeSettings, client_args


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
