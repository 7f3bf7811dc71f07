"""``cmx demo``'s tables fit an 80-column terminal with every column."""

from __future__ import annotations

from rich.console import Console

from cmx.deploy.demo import LLMDemoResult, RequestRow
from cmx.deploy.render import print_llm_demo

MiB = 1 << 20


def test_the_demo_report_fits_80_columns() -> None:
    rows = [
        RequestRow(1, 1, "doc A q1", "R1", 2910, 0, 0, "none", 3.3, 3.2, True, False),
        RequestRow(2, 2, "doc A q2", "R2", 2932, 2816, 2816, "done", 0.4, 3.0, True, False),
        RequestRow(3, 6, "chat X t3", "R2", 1958, 1280, 0, "none", 2.1, 1.9, False, True),
    ]
    tier = {"used_bytes": MiB, "capacity_bytes": 256 * MiB, "blocks": 1, "hits": 2,
            "evictions": 0}
    stats = {"nodes": {"n1": {"tiers": {"hbm": {**tier, "emulated": True}, "dram": tier},
                              "agent": {"moved_bytes": {"dram@peer->hbm": 27 * MiB},
                                        "moved_via": {"nixl-ucx": 27 * MiB}}}}}
    result = LLMDemoResult(rows, {"R1": "head", "R2": "worker"}, stats, {"n1": "head"},
                           "SmolLM2-135M-Instruct", 40.0, 60.0)
    console = Console(width=80, record=True)
    print_llm_demo(console, result)
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    for header in ("request", "prompt", "cached", "memory", "TTFT", "no cache", "gain", "same"):
        assert header in text
    assert "2,816*" in text and "local" in text and "hbm (emulated)" in text
    words = " ".join(text.split())
    assert "Model: SmolLM2-135M-Instruct" in words
    assert "Same output with and without the cache: 2/3" in words
    assert not result.ok
