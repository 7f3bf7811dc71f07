"""The service on a two-node local Ray cluster: store anywhere, find and load everywhere."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import ray
import torch
from support import LAYOUT, client_on

from cmx import LayoutMismatchError
from cmx.links import RAY_NAMESPACE, actor_name
from cmx.stats import AgentStats
from cmx.tiers import Tier

T = LAYOUT.block_tokens


def tokens(n_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * T, dtype=np.uint32)


def agent_stats(node: str) -> AgentStats:
    agent = ray.get_actor(actor_name("agent", node), namespace=RAY_NAMESPACE)
    return ray.get(agent.stats.remote())


def test_store_on_one_node_load_bit_identical_on_the_other(
    cm: Any, config: Any, nodes: Any
) -> None:
    head, worker = nodes
    toks = tokens(6, seed=1)
    kv = LAYOUT.random_kv(len(toks), seed=1)
    ns = cm.namespace("m-cross", LAYOUT, "t")
    assert ns.store(toks, kv).wait() == 6

    remote = client_on(worker, config)
    assert ray.get(remote.node.remote()) == worker
    where = ray.get(remote.lookup.remote("m-cross", LAYOUT, "t", toks))
    assert len(where) == 6 and all(node == head for _, node in where)

    before = agent_stats(worker).moved_via.get("nixl-ucx", 0)
    got = ray.get(remote.load.remote("m-cross", LAYOUT, "t", toks))
    assert torch.equal(got, kv)
    moved = agent_stats(worker).moved_via.get("nixl-ucx", 0) - before
    assert moved >= 6 * LAYOUT.block_bytes


def test_partial_tail_is_not_stored_and_lookup_stops_at_first_miss(cm: Any) -> None:
    ns = cm.namespace("m-tail", LAYOUT, "t")
    toks = tokens(3, seed=2)
    kv = LAYOUT.random_kv(3 * T, seed=2)
    ns.store(toks[: 2 * T + 5], kv[:, :, :, : 2 * T + 5]).wait()
    assert ns.lookup(toks).num_tokens == 2 * T
    other = toks.copy()
    other[0] += 1  # a different first block changes every key after it
    assert ns.lookup(other).num_tokens == 0
    assert torch.equal(ns.load(toks), kv[:, :, :, : 2 * T])


def test_prefix_larger_than_hbm_and_dram_demotes_to_nvme_and_loads_whole(
    cm: Any, config: Any
) -> None:
    blocks = (config.hbm_bytes + config.dram_bytes) // config.block_bytes + 8
    toks = tokens(blocks, seed=3)
    kv = LAYOUT.random_kv(len(toks), seed=3)
    ns = cm.namespace("m-big", LAYOUT, "t")
    ns.store(toks, kv).wait()
    match = ns.lookup(toks)
    assert match.num_tokens == len(toks)
    tiers = {b.tier.value for b in match.blocks}
    assert "nvme" in tiers
    got = ns.load(toks)
    assert got.shape == kv.shape
    assert torch.equal(got, kv)


def test_every_byte_moved_went_through_an_agent(cm: Any) -> None:
    """What a store and a load move, counted by the test itself, is what the agent moved and
    what the tiers took in: no byte reaches a tier by another way. A local DRAM hit is read
    where it lies: the client copies it out, nothing is moved into HBM."""
    node = cm.node_id
    toks = tokens(3, seed=9)
    kv = LAYOUT.random_kv(len(toks), seed=9)
    ns = cm.namespace("m-bytes", LAYOUT, "t")
    before = cm.stats().nodes[node]
    assert ns.store(toks, kv).wait() == 3
    assert torch.equal(ns.load(toks), kv)
    after = cm.stats().nodes[node]
    moved = Counter(after.agent.moved_bytes)
    moved.subtract(before.agent.moved_bytes)
    n = 3 * LAYOUT.block_bytes
    assert moved["client->dram"] == n  # the three blocks stored, once each
    assert moved["dram->hbm"] == 0  # loaded from DRAM, where the store left them
    for tier in (Tier.HBM, Tier.DRAM, Tier.NVME):
        took = after.tiers[tier].store.bytes_written - before.tiers[tier].store.bytes_written
        assert took == sum(v for k, v in moved.items() if k.endswith(f"->{tier.value}")), tier
    assert after.tiers[Tier.HBM].emulated is True


def test_tenants_never_see_each_others_blocks(cm: Any) -> None:
    toks = tokens(2, seed=4)
    kv_a = LAYOUT.random_kv(len(toks), seed=41)
    kv_b = LAYOUT.random_kv(len(toks), seed=42)
    a = cm.namespace("m-tenant", LAYOUT, "tenant-a")
    b = cm.namespace("m-tenant", LAYOUT, "tenant-b")
    a.store(toks, kv_a).wait()
    assert b.lookup(toks).num_tokens == 0
    assert b.load(toks).shape[3] == 0
    b.store(toks, kv_b).wait()
    assert torch.equal(a.load(toks), kv_a)
    assert torch.equal(b.load(toks), kv_b)


def test_bad_input_raises_and_stores_nothing(cm: Any) -> None:
    ns = cm.namespace("m-bad", LAYOUT, "t")
    toks = tokens(1, seed=5)
    with pytest.raises(LayoutMismatchError, match="dtype"):
        ns.store(toks, LAYOUT.random_kv(T).to(torch.float32))
    with pytest.raises(LayoutMismatchError, match="shape"):
        ns.store(toks, LAYOUT.random_kv(T)[:, :, :1])
    with pytest.raises(LayoutMismatchError, match="1-D"):
        ns.lookup(np.zeros((2, T), dtype=np.int64))
    assert ns.lookup(toks).num_tokens == 0


def test_drop_namespace_evicts_only_that_tenant(cm: Any) -> None:
    toks = tokens(3, seed=6)
    keep = cm.namespace("m-drop", LAYOUT, "keep")
    drop = cm.namespace("m-drop", LAYOUT, "drop")
    keep.store(toks, LAYOUT.random_kv(len(toks), seed=61)).wait()
    drop.store(toks, LAYOUT.random_kv(len(toks), seed=62)).wait()
    assert cm.drop_namespace(drop.namespace) >= 3
    assert drop.lookup(toks).num_tokens == 0
    assert keep.lookup(toks).num_tokens == len(toks)


def test_prefetch_moves_the_prefix_into_hbm(cm: Any, config: Any, nodes: Any) -> None:
    head, worker = nodes
    toks = tokens(3, seed=8)
    kv = LAYOUT.random_kv(len(toks), seed=8)
    remote = client_on(worker, config)
    assert ray.get(remote.store.remote("m-prefetch", LAYOUT, "t", toks, kv)) == 3
    ns = cm.namespace("m-prefetch", LAYOUT, "t")
    assert ray.get(ns.prefetch(toks), timeout=30) == 3
    match = ns.lookup(toks)
    assert all(b.tier.value == "hbm" and b.node == head for b in match.blocks)
    assert torch.equal(ns.load(toks), kv)
