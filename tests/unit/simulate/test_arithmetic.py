"""The seed article's arithmetic, from the same geometry the service stores blocks with."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cmx.simulate import LLAMA3_8B, LLAMA3_70B, ClusterSpec, NodeSpec, SimConfig
from cmx.simulate.hardware import H100, GiB, prefill_cost
from cmx.simulate.workload import TenantSpec, WorkloadSpec

MILLION = 1 << 20


def test_llama3_8b_keeps_128_kib_per_token_and_1m_tokens_outgrow_one_80gb_gpu() -> None:
    assert LLAMA3_8B.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 128 * 1024
    assert LLAMA3_8B.layout(256).block_bytes == 32 << 20  # a 256-token block is 32 MiB
    kv = MILLION * LLAMA3_8B.kv_bytes_per_token
    assert kv == 128 * GiB
    assert kv > H100.hbm_bytes  # 137 GB against 80 GB, before the weights
    assert kv / H100.hbm_bytes == pytest.approx(1.72, abs=0.01)


def test_the_seeds_256_gb_for_1m_tokens_is_the_same_cache_in_4_byte_elements() -> None:
    fp32 = replace(LLAMA3_8B, dtype="float32")
    assert MILLION * fp32.kv_bytes_per_token == 256 * GiB
    assert MILLION * fp32.kv_bytes_per_token > 3 * H100.hbm_bytes  # "more than three times"


def test_70b_at_8k_is_20_gib_without_gqa_and_a_batch_of_32_is_640_gib() -> None:
    mha = replace(LLAMA3_70B, num_kv_heads=LLAMA3_70B.num_q_heads)  # the seed's figure
    per_seq = 8192 * mha.kv_bytes_per_token
    assert per_seq == 20 * GiB
    assert 32 * per_seq == 640 * GiB
    assert 8192 * LLAMA3_70B.kv_bytes_per_token == 2.5 * GiB  # with its 8 KV heads (GQA)


def test_a_1m_context_does_not_fit_a_one_gpu_replica_and_fits_a_two_gpu_one() -> None:
    tenant = TenantSpec("long", context_tokens=(MILLION, MILLION))
    workload = WorkloadSpec((tenant,), rate_per_s=1.0, duration_s=10.0)
    with pytest.raises(ValueError, match="needs 153 GB of HBM"):
        SimConfig(workload, ClusterSpec(nodes=1, node=NodeSpec(gpus_per_replica=1)))
    SimConfig(workload, ClusterSpec(nodes=1, node=NodeSpec(gpus_per_replica=2)))


def test_prefill_cost_is_the_flops_of_the_model_over_the_replicas_rate() -> None:
    node = NodeSpec()
    cost = prefill_cost(LLAMA3_8B, node)
    rate = H100.flops * H100.mfu
    assert cost.per_token_s == pytest.approx(2 * 8.03e9 / rate)
    assert cost.per_pair_s == pytest.approx(4 * 32 * 32 * 128 / rate)
    # Attention dominates a long prefill: at 64K tokens the pairs cost more than the weights.
    n = 65_536
    assert cost.per_pair_s * n * n / 2 > cost.per_token_s * n
    eight = prefill_cost(LLAMA3_8B, node.with_replicas_of(8))
    assert eight.seconds(0, n) < cost.seconds(0, n) / 7
