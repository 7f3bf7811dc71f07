"""Figures, goals and reports of ``cmx bench``, and the slice workload's definition."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from cmx.bench.harness.core import BenchConfig, Figure, Goal, SuiteResult, Table, Verdict, median
from cmx.bench.harness.report import BenchReport, render_markdown, update_docs, write_outputs
from cmx.bench.harness.runner import resolve_suites, suite_command
from cmx.bench.suites.stores.slices import head_pieces, io_size_bytes, share_at_least
from cmx.layout import KVLayout, PayloadOrder

MACHINE = {"cpu": "Test CPU", "cores": 2, "memory_gib": 4.0, "disk": "vda", "filesystem": "ext4",
           "kernel": "6.0", "python": "3.11"}


def figure(samples: tuple[float, ...], base: tuple[float, ...], goal: Goal | None) -> Figure:
    return Figure("nvme", "put", "GB/s", samples, "fio write", base, goal)


def report(*suites: SuiteResult) -> BenchReport:
    return BenchReport(MACHINE, "2025-01-01T00:00:00+00:00", {"reps": 3}, list(suites))


def test_a_figure_is_the_median_over_the_baselines_median() -> None:
    f = figure((1.0, 3.0, 2.0), (4.0, 2.0, 100.0), Goal(">=", 0.85))
    assert (f.value, f.baseline, f.ratio) == (2.0, 4.0, 0.5)
    assert f.verdict is Verdict.MISS
    assert figure((1.8,) * 3, (2.0,) * 3, Goal(">=", 0.85)).verdict is Verdict.PASS
    assert figure((1.0,), (2.0,), None).verdict is Verdict.INFO


def test_goals_bound_either_side_and_reject_other_operators() -> None:
    assert Goal("<=", 1.5).check(1.5) is Verdict.PASS
    assert Goal("<=", 1.5).check(1.51) is Verdict.MISS
    assert str(Goal(">=", 0.8)) == "≥ 0.8"
    with pytest.raises(ValueError):
        Goal("==", 1.0)
    with pytest.raises(ValueError):
        median([])
    assert math.isnan(figure((1.0,), (0.0,), None).ratio)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        BenchConfig(dir=Path("."), reps=0)
    with pytest.raises(ValueError):
        BenchConfig(dir=Path("."), gib=0)


def test_docs_sections_are_rewritten_per_suite_and_hand_text_stays(tmp_path: Path) -> None:
    docs = tmp_path / "BENCHMARKS.md"
    nvme = SuiteResult("nvme", "cmx bench nvme", [figure((1.7,) * 3, (2.0,) * 3, Goal(">=", 0.85))])
    dram = SuiteResult("dram", "cmx bench dram", [figure((5.0,) * 3, (10.0,) * 3, Goal(">=", 0.8))],
                       tables=[Table("detail", ("a", "b"), (("1", "2"),))], notes=["cold"])
    update_docs(docs, report(nvme, dram))
    docs.write_text(docs.read_text() + "\nHand-written closing words.\n")
    first = docs.read_text()
    assert "**PASS**" in first and "**MISS**" in first and "Test CPU, 2 cores" in first
    assert "Command: `cmx bench nvme`" in first and "| 0.85 |" in first

    nvme2 = SuiteResult("nvme", "cmx bench nvme", [figure((1.0,), (2.0,), Goal(">=", 0.85))])
    update_docs(docs, report(nvme2))
    second = docs.read_text()
    assert second.count("<!-- cmx-bench:nvme:begin -->") == 1
    assert "| 0.50 |" in second and "| 0.85 |" not in second
    assert "| 0.50 |" in second.split("cmx-bench:dram")[0]  # nvme's section, in place
    assert "Hand-written closing words." in second and "detail:" in second


def test_outputs_are_json_markdown_and_optional_plots(tmp_path: Path) -> None:
    suite = SuiteResult("dram", "cmx bench dram", [figure((5.0, 6.0), (10.0, 10.0), None)])
    written = write_outputs(report(suite), tmp_path / "out", None, None)
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["suites"][0]["figures"][0]["ratio"] == pytest.approx(0.55)
    assert data["suites"][0]["figures"][0]["verdict"] == "info"
    assert "## `dram`" in render_markdown(report(suite))
    assert written.plot_note or [p.name for p in written.plots] == ["dram.png"]


def test_the_docs_page_shows_each_suites_plot_from_beside_it(tmp_path: Path) -> None:
    suite = SuiteResult("dram", "cmx bench dram", [figure((5.0,), (10.0,), Goal(">=", 0.8))])
    docs = tmp_path / "docs" / "BENCHMARKS.md"
    written = write_outputs(report(suite), tmp_path / "out", None, docs)
    copy = tmp_path / "docs" / "bench" / "dram.png"
    assert copy.read_bytes() == written.plots[0].read_bytes()
    assert "](bench/dram.png)" in docs.read_text().split("cmx-bench:dram:end")[0]


def test_suites_resolve_in_registry_order_and_commands_reproduce_the_settings() -> None:
    assert resolve_suites([])[:4] == ["limits", "nvme", "dram", "slices"]
    assert resolve_suites(["slices", "nvme"]) == ["nvme", "slices"]
    with pytest.raises(ValueError, match="known"):
        resolve_suites(["warp"])
    cmd = suite_command("nvme", BenchConfig(dir=Path("/tmp/b"), reps=5, gib=1.5))
    assert cmd == "cmx bench nvme --reps 5 --gib 1.5 --dir /tmp/b"


@pytest.mark.parametrize("order", list(PayloadOrder))
def test_head_pieces_are_one_heads_k_and_v_of_each_layer_and_token(order: PayloadOrder) -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, block_tokens=5, order=order)
    kv = layout.random_kv(layout.block_tokens, seed=3)  # [L, 2, H, T, D]
    payload = layout.to_payload(kv).numpy()
    head, vec = 2, layout.head_dim * layout.itemsize
    pieces = head_pieces(layout, head)
    assert pieces.shape == (layout.num_layers * layout.block_tokens, 2)
    for layer in range(layout.num_layers):
        for token in range(layout.block_tokens):
            for kv_index in (0, 1):
                off = int(pieces[layer * layout.block_tokens + token, kv_index])
                got = torch.from_numpy(payload[off:off + vec].copy()).view(torch.bfloat16)
                assert torch.equal(got, kv[layer, kv_index, head, token])


def test_io_size_share_reads_numeric_and_labelled_buckets() -> None:
    assert io_size_bytes(4096) == 4096 and io_size_bytes("128K") == 128 << 10
    assert io_size_bytes("1 MiB") == 1 << 20 and io_size_bytes(">=4M") == 4 << 20
    assert share_at_least({64 << 10: 1, 1 << 20: 3}, 128 << 10) == 0.75
    assert math.isnan(share_at_least({}, 1))
    assert np.isclose(share_at_least({"4M": 2}, 128 << 10), 1.0)


def broken_suite(ctx: object) -> SuiteResult:
    raise RuntimeError("the cluster would not start")


def working_suite(ctx: object) -> SuiteResult:
    return SuiteResult("working", "", [figure((5.0,), (10.0,), None)])


def test_a_failing_suite_is_reported_and_the_next_one_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cmx.bench.harness import runner

    monkeypatch.setattr(runner, "SUITES", {"broken": f"{__name__}:broken_suite",
                                           "working": f"{__name__}:working_suite"})
    config = BenchConfig(dir=tmp_path / "work", reps=1, gib=0.01, fio_seconds=0.1,
                         out=tmp_path / "out")
    got = runner.run_bench([], config)
    assert [s.name for s in got.suites] == ["broken", "working"]
    assert got.suites[0].error == "RuntimeError: the cluster would not start"
    assert got.suites[1].error is None and len(got.suites[1].figures) == 1
    docs = tmp_path / "BENCHMARKS.md"
    update_docs(docs, got)
    assert "cmx-bench:broken" not in docs.read_text() and "cmx-bench:working" in docs.read_text()
