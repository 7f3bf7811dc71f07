"""Break-even gating from made-up measurements: load only where it beats recompute."""

from __future__ import annotations

import pytest

from cmx.policies.breakeven import GB, BreakEven, LinkCost, PrefillCost, source_class

MiB = 1 << 20
BLOCK = 2 * MiB  # 256 tokens of a small model's KV


def gate(per_token_s: float = 1e-3, per_pair_s: float = 0.0, **links: tuple[float, float]):
    return BreakEven(PrefillCost(per_token_s, per_pair_s, 0.0),
                     links=links or {"dram": (0.001, 2 * GB), "nvme@peer": (0.05, 0.05 * GB)})


def test_source_classes_are_seen_from_the_loading_node() -> None:
    assert source_class("dram", "a", here="a") == "dram"
    assert source_class("nvme", "b", here="a") == "nvme@peer"


def test_a_fast_tier_is_loaded_up_to_the_last_grid_line_before_the_end() -> None:
    plan = gate().plan([("dram", BLOCK)] * 16, 256, prompt_tokens=4096, align=512)
    # 16 blocks cover all 4,096 tokens, but one token must be computed: the last grid line
    # before 4,096 is 3,584.
    assert plan.load_tokens == 3584
    assert plan.est_ttft_s < plan.est_recompute_s
    assert plan.patience_s > plan.est_load_s


def test_a_tier_slower_than_recompute_is_never_loaded() -> None:
    # A 2 MiB block over a 50 MB/s link takes 42 ms; its 256 tokens take 256 ms to compute at
    # 1 ms a token (load), or 26 ms at 0.1 ms a token (recompute).
    slow_model = gate(per_token_s=1e-3).plan([("nvme@peer", BLOCK)] * 16, 256, 4096)
    fast_model = gate(per_token_s=1e-4).plan([("nvme@peer", BLOCK)] * 16, 256, 4096)
    assert slow_model.load_tokens > 0
    assert fast_model.load_tokens == 0 and "recompute" in fast_model.reason
    assert fast_model.est_ttft_s == fast_model.est_recompute_s


def test_a_slow_tail_is_cut_off_and_the_fast_head_kept() -> None:
    blocks = [("dram", BLOCK)] * 8 + [("nvme@peer", BLOCK)] * 8
    plan = gate(per_token_s=1e-4).plan(blocks, 256, prompt_tokens=4096)
    assert plan.load_tokens == 8 * 256


def test_a_load_that_saves_under_the_margin_is_not_worth_it() -> None:
    g = BreakEven(PrefillCost(1e-5, 0.0, 0.0), links={"dram": (0.0, 1e12)}, margin=0.5)
    plan = g.plan([("dram", BLOCK)], 256, prompt_tokens=1000)
    # Saves 256 of 1,000 tokens' compute: under the 50% margin.
    assert plan.load_tokens == 0 and "under 50%" in plan.reason


def test_measured_loads_correct_an_optimistic_prior() -> None:
    g = gate(per_token_s=1e-4)
    assert g.plan([("dram", BLOCK)] * 4, 256, prompt_tokens=1100).load_tokens == 1024
    for _ in range(5):  # the link turns out slow: 2 MiB blocks take 0.3 s each
        g.observe_load([("dram", BLOCK)] * 4, 1.2)
    assert g.link("dram").bandwidth < 0.01 * GB
    assert g.plan([("dram", BLOCK)] * 4, 256, prompt_tokens=1100).load_tokens == 0


def test_link_fit_separates_latency_from_bandwidth() -> None:
    link = LinkCost(0.5, 1.0)
    for nbytes in (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB):
        link.observe(nbytes, 0.01 + nbytes / (2 * GB))
    assert link.latency_s == pytest.approx(0.01, rel=1e-3)
    assert link.bandwidth == pytest.approx(2 * GB, rel=1e-3)


def test_prefill_fit_recovers_the_token_pair_and_pass_terms() -> None:
    cost = PrefillCost()
    truth = PrefillCost(2e-4, 3e-8, 5e-3)
    for start, end in ((0, 256), (256, 512), (1024, 1280), (3840, 4096), (0, 64), (512, 513)):
        cost.observe(start, end, truth.seconds(start, end))
    assert cost.snapshot() == pytest.approx(truth.snapshot(), rel=1e-6)
    assert cost.seconds(0, 4096) == pytest.approx(truth.seconds(0, 4096), rel=1e-6)
    assert cost.passes(0, 4096) == 16 and cost.passes(300, 600) == 2


def test_a_fit_never_goes_negative() -> None:
    cost = PrefillCost(chunk=32)
    for start, end, seconds in ((0, 32, 0.004), (32, 64, 0.003), (64, 65, 0.003), (96, 128, 0.004)):
        cost.observe(start, end, seconds)  # overhead-bound: the time hardly depends on n
    assert min(cost.snapshot()) >= 0
    assert cost.seconds(0, 160) == pytest.approx(5 * 0.0035, rel=0.3)


def test_prefill_with_few_shapes_scales_the_prior() -> None:
    prior = PrefillCost(1e-3, 1e-8, 1e-3)
    cost = PrefillCost(1e-3, 1e-8, 1e-3)
    cost.observe(0, 512, 2 * prior.seconds(0, 512))
    assert cost.seconds(0, 512) == pytest.approx(2 * prior.seconds(0, 512))


def test_cut_points_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError):
        gate().plan([("dram", BLOCK)], 256, prompt_tokens=1000, align=100)


def test_gating_off_loads_every_hit_and_waits_for_it() -> None:
    g = BreakEven(PrefillCost(1e-9, 0.0, 0.0), enabled=False)
    plan = g.plan([("nvme@peer", BLOCK)] * 4, 256, prompt_tokens=1100)
    assert plan.load_tokens == 1024 and plan.patience_s == float("inf")
