"""The layer-pipelined load suite's pure parts: the figures a run's steps become, and the check
that the paged caches hold the stored KV."""

from __future__ import annotations

import pytest
import torch

from cmx.bench.harness.core import Verdict
from cmx.bench.suites.layers import StepTimes, layer_figures, mismatched_layers
from cmx.layout import KVLayout


def steps(*pairs: tuple[float, float]) -> list[StepTimes]:
    return [StepTimes(first, every) for first, every in pairs]


def test_layer_zero_over_the_last_layer_is_judged_against_the_goal() -> None:
    grouped = steps((0.02, 0.10), (0.03, 0.12), (0.025, 0.11))
    whole = steps((0.09, 0.09), (0.10, 0.10), (0.11, 0.11))
    first, every, gain = layer_figures("DRAM", grouped, whole, groups=4)
    assert first.value == pytest.approx(25.0) and first.baseline == pytest.approx(110.0)
    assert first.ratio == pytest.approx(25 / 110)
    assert first.verdict is Verdict.PASS
    assert "4 groups" in first.name and "DRAM" in first.name
    assert every.ratio == pytest.approx(110 / 100) and every.verdict is Verdict.INFO
    assert gain.ratio == pytest.approx(25 / 100) and gain.verdict is Verdict.INFO


def test_a_first_layer_that_waits_for_most_of_the_load_misses() -> None:
    grouped = steps((0.08, 0.10), (0.09, 0.10))
    whole = steps((0.10, 0.10), (0.10, 0.10))
    assert layer_figures("NVMe", grouped, whole)[0].verdict is Verdict.MISS


def test_each_ratio_carries_its_bootstrap_interval_in_its_note() -> None:
    grouped = steps((0.02, 0.10), (0.04, 0.10), (0.03, 0.10))
    whole = steps((0.10, 0.10), (0.10, 0.10), (0.10, 0.10))
    first, every, gain = layer_figures("DRAM", grouped, whole)
    assert "0.300 [0.200, 0.400] (95%)" in first.note
    assert "1.000 [1.000, 1.000] (95%)" in every.note
    assert "whole prefix first, layer 0 ready at 100.0 ms" in every.note
    assert "0.300 [0.200, 0.400] (95%)" in gain.note


def test_steps_must_pair_up() -> None:
    with pytest.raises(ValueError):
        layer_figures("DRAM", steps((0.1, 0.2)), [])
    with pytest.raises(ValueError):
        layer_figures("DRAM", [], [])


def test_the_paged_caches_are_checked_block_by_block_against_the_stored_kv() -> None:
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16",
                      block_tokens=2)
    T, D, ids = layout.block_tokens, layout.head_dim, [3, 0, 2]
    stored = layout.random_kv(len(ids) * T, seed=1)
    caches = [torch.zeros(5, 2, T, 2 * D, dtype=torch.bfloat16) for _ in range(3)]
    for layer, cache in enumerate(caches):
        for i, block in enumerate(ids):  # vLLM CPU layout: a block's K rows, then its V rows
            kv = stored[layer][:, :, i * T : (i + 1) * T]  # [2, heads, T, dim]
            cache[block] = kv.permute(1, 0, 2, 3).reshape(layout.num_kv_heads, T, 2 * D)
    assert mismatched_layers(caches, ids, stored, D) == []
    caches[1][2, 1, 1, 7] += 1  # the last element of one block of layer 1
    assert mismatched_layers(caches, ids, stored, D) == [1]
    assert mismatched_layers(caches, [0, 3, 2], stored, D) == [0, 1, 2]  # blocks swapped
