"""Partial loads through the service: the selected layers and heads of a prefix, exact bytes,
from every tier and from another node; only their bytes moved; bad selections refused."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import ray
import torch
from support import LAYOUT, client_on

from cmx.layout import KVLayout, PayloadOrder
from cmx.links import RAY_NAMESPACE, actor_name
from cmx.selection import Selection, SelectionError

T = LAYOUT.block_tokens
HEAD_MAJOR = KVLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                      head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, block_tokens=T,
                      order=PayloadOrder.HEAD_MAJOR)


def tokens(n_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * T, dtype=np.uint32)


def moved(node: str) -> Counter[str]:
    agent = ray.get_actor(actor_name("agent", node), namespace=RAY_NAMESPACE)
    return Counter(ray.get(agent.stats.remote()).moved_bytes)


def sel_bytes(layout: KVLayout, layers: Any, heads: Any) -> int:
    return Selection.of(layout, layers, heads).block_bytes(layout)


@pytest.mark.parametrize("layout", [LAYOUT, HEAD_MAJOR], ids=["layer_major", "head_major"])
def test_a_selection_from_dram_then_hbm_is_the_slice_of_the_stored_kv(cm: Any,
                                                                      layout: KVLayout) -> None:
    node = cm.node_id
    toks = tokens(3, seed=21)
    kv = layout.random_kv(len(toks), seed=21)
    ns = cm.namespace(f"m-sel-{layout.order.value}", layout, "t")
    assert ns.store(toks, kv).wait() == 3
    before = moved(node)
    got = ns.load(toks, heads=1)
    assert torch.equal(got, kv[:, :, 1:2])
    after = moved(node)
    assert after["dram->selection"] - before["dram->selection"] == 3 * sel_bytes(layout, None, 1)
    assert after["dram->hbm"] == before["dram->hbm"]  # nothing promoted

    assert ray.get(ns.prefetch(toks), timeout=60) == 3  # a copy in HBM too
    before = moved(node)
    got = ns.load(toks, layers=range(1, 3), heads=0)
    assert torch.equal(got, kv[1:3, :, 0:1])
    after = moved(node)
    assert after["hbm->selection"] - before["hbm->selection"] == 3 * sel_bytes(layout, range(1, 3),
                                                                                0)


def test_a_selection_of_a_prefix_spilled_to_nvme_reads_it_there(cm: Any, config: Any) -> None:
    node = cm.node_id
    blocks = (config.hbm_bytes + config.dram_bytes) // config.block_bytes + 8
    toks = tokens(blocks, seed=22)
    kv = HEAD_MAJOR.random_kv(len(toks), seed=22)
    ns = cm.namespace("m-sel-nvme", HEAD_MAJOR, "t")
    ns.store(toks, kv).wait()
    where = [b.tier.value for b in ns.lookup(toks).blocks]
    assert "nvme" in where
    before = moved(node)
    got = ns.load(toks, heads=1)
    assert torch.equal(got, kv[:, :, 1:2])
    after = moved(node)
    assert after["nvme->selection"] > before["nvme->selection"]
    assert sum(after[k] - before[k] for k in after if k.endswith("->selection")) == (
        blocks * sel_bytes(HEAD_MAJOR, None, 1))
    assert [b.tier.value for b in ns.lookup(toks).blocks] == where  # nothing promoted


def test_a_selection_from_another_node_moves_only_its_bytes(cm: Any, config: Any,
                                                            nodes: Any) -> None:
    head, worker = nodes
    toks = tokens(4, seed=23)
    kv = LAYOUT.random_kv(len(toks), seed=23)
    remote = client_on(worker, config)
    assert ray.get(remote.store.remote("m-sel-peer", LAYOUT, "t", toks, kv)) == 4
    ns = cm.namespace("m-sel-peer", LAYOUT, "t")
    assert {b.node for b in ns.lookup(toks).blocks} == {worker}
    before = moved(head)
    got = ns.load(toks, layers=2, heads=[0, 1])
    assert torch.equal(got, kv[2:3])
    after = moved(head)
    assert after["dram@peer->selection"] - before["dram@peer->selection"] == (
        4 * sel_bytes(LAYOUT, 2, None))
    assert sum(after[k] - before[k] for k in after if k.endswith("->hbm")) == 0


@pytest.mark.parametrize("layers, heads", [(LAYOUT.num_layers, None), (None, 2),
                                           (None, [0, 2]), (slice(0, 4, 2), None), ("1", 0)])
def test_a_bad_selection_raises_and_moves_nothing(cm: Any, layers: Any, heads: Any) -> None:
    toks = tokens(2, seed=24)
    ns = cm.namespace("m-sel-bad", LAYOUT, "t")
    ns.store(toks, LAYOUT.random_kv(len(toks), seed=24)).wait()
    before = moved(cm.node_id)
    with pytest.raises(SelectionError):
        ns.load(toks, layers=layers, heads=heads)
    assert moved(cm.node_id) == before


def test_a_miss_in_the_middle_ends_the_selected_prefix(cm: Any) -> None:
    toks = tokens(3, seed=25)
    kv = LAYOUT.random_kv(len(toks), seed=25)
    ns = cm.namespace("m-sel-tail", LAYOUT, "t")
    ns.store(toks[: 2 * T], kv[:, :, : 2 * T]).wait()
    got = ns.load(toks, heads=0)
    assert torch.equal(got, kv[:, :, 0:1, : 2 * T])
