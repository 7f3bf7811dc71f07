"""Partial loads between nodes over NIXL: a prefix held only on the other node (its DRAM, its
NVMe) or only in the pool, loaded head-wise here, is the slice of the whole load, and only the
selected bytes crossed, over NIXL; a corrupt copy there is a miss and is quarantined there."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
import ray
import torch
from support import LAYOUT, client_on
from test_service_pool import drop_local_copies, reconcile, until

from cmx.actors.agent.pool import POOL_REFRESH_S
from cmx.layout import KVLayout, PayloadOrder
from cmx.links import RAY_NAMESPACE, actor_name
from cmx.selection import Selection
from cmx.storage.arena import SharedArena
from cmx.tiers import Tier

T = LAYOUT.block_tokens
HEAD_MAJOR = KVLayout(num_layers=LAYOUT.num_layers, num_kv_heads=LAYOUT.num_kv_heads,
                      head_dim=LAYOUT.head_dim, dtype=LAYOUT.dtype, block_tokens=T,
                      order=PayloadOrder.HEAD_MAJOR)
NIXL = "nixl-ucx"


def tokens(n_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n_blocks * T, dtype=np.uint32)


def actor(kind: str, node: str) -> Any:
    return ray.get_actor(actor_name(kind, node), namespace=RAY_NAMESPACE)


class Figures:
    """What this node's agent moved, and how: its counters before and after a load."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.before = self._read()

    def _read(self) -> tuple[Counter[str], Counter[str], int]:
        s = ray.get(actor("agent", self.node).stats.remote())
        assert s.transport == NIXL, "the agents have no NIXL here"
        return (Counter(s.moved_bytes), Counter(s.moved_via), s.transport_stats.bytes_read)

    def delta(self) -> tuple[Counter[str], Counter[str], int]:
        moved, via, nbytes = self._read()
        return moved - self.before[0], via - self.before[1], nbytes - self.before[2]


def selected(layout: KVLayout, heads: int) -> int:
    return Selection.of(layout, heads=heads).block_bytes(layout)


def check_head_load(ns: Any, toks: np.ndarray, kv: Any, head: int, source: str) -> None:
    """A one-head load here of a prefix held elsewhere: the slice of the stored KV; only its
    bytes crossed, over NIXL; then the whole load's same slice is equal."""
    n = len(toks) // T
    figures = Figures(ns.cm.node_id)
    got = ns.load(toks, heads=head)
    moved, via, nbytes = figures.delta()
    assert torch.equal(got, kv[:, :, head : head + 1])
    want = n * selected(ns.layout, head)
    assert want < n * ns.layout.block_bytes
    assert nbytes == want  # the transport moved the selected bytes, not the blocks
    assert via[NIXL] == want and via["ray"] == 0
    assert sum(v for k, v in moved.items() if k.endswith(f"@{source}->selection")) == want
    assert sum(v for k, v in moved.items() if k.endswith("->hbm")) == 0  # nothing promoted
    whole = ns.load(toks)
    assert torch.equal(got, whole[:, :, head : head + 1])


def test_a_head_of_a_prefix_in_a_peers_dram_crosses_as_its_ranges(cm: Any, config: Any,
                                                                   nodes: Any) -> None:
    _, worker = nodes
    toks = tokens(4, seed=41)
    kv = HEAD_MAJOR.random_kv(len(toks), seed=41)
    assert ray.get(client_on(worker, config).store.remote("m-nx-dram", HEAD_MAJOR, "t", toks,
                                                          kv)) == 4
    ns = cm.namespace("m-nx-dram", HEAD_MAJOR, "t")
    assert {(b.tier, b.node) for b in ns.lookup(toks).blocks} == {(Tier.DRAM, worker)}
    check_head_load(ns, toks, kv, 1, "peer")


def test_a_head_of_a_prefix_on_a_peers_nvme_crosses_as_its_ranges(cm: Any, config: Any,
                                                                 nodes: Any) -> None:
    _, worker = nodes
    blocks = (config.hbm_bytes + config.dram_bytes) // config.block_bytes + 8
    toks = tokens(blocks, seed=42)
    kv = LAYOUT.random_kv(len(toks), seed=42)
    ray.get(client_on(worker, config).store.remote("m-nx-nvme", LAYOUT, "t", toks, kv))
    ns = cm.namespace("m-nx-nvme", LAYOUT, "t")
    where = {(b.tier, b.node) for b in ns.lookup(toks).blocks}
    assert (Tier.NVME, worker) in where and {n for _, n in where} == {worker}
    figures = Figures(cm.node_id)
    check_head_load(ns, toks, kv, 0, "peer")
    assert figures.delta()[0]["nvme@peer->selection"] > 0


def corrupt_in_dram(node: str, key: bytes) -> None:
    """Flip a byte of ``key``'s copy in ``node``'s DRAM arena (this host's shared memory)."""
    dram = actor("dram", node)
    pin = ray.get(dram.pin.remote([key]))[0]
    arena = SharedArena.attach(ray.get(dram.info.remote()).arena)
    try:
        arena.slot_view(pin.slot)[5] ^= 0xFF
    finally:
        arena.close()
        ray.get(dram.unpin.remote([pin.lease]))


def test_a_corrupt_copy_on_the_peer_is_a_miss_and_quarantined_there(cm: Any, config: Any,
                                                                   nodes: Any) -> None:
    _, worker = nodes
    toks = tokens(3, seed=43)
    kv = LAYOUT.random_kv(len(toks), seed=43)
    ray.get(client_on(worker, config).store.remote("m-nx-bad", LAYOUT, "t", toks, kv))
    ns = cm.namespace("m-nx-bad", LAYOUT, "t")
    victim = ns.keys(toks)[1]
    quarantined = ray.get(actor("dram", worker).stats.remote()).store.quarantined
    corrupt_in_dram(worker, victim)
    got = ns.load(toks, heads=1)
    assert torch.equal(got, kv[:, :, 1:2, :T])  # the prefix ends before the corrupt block
    assert ray.get(actor("dram", worker).stats.remote()).store.quarantined == quarantined + 1
    assert ns.lookup(toks).num_blocks == 1


@pytest.fixture
def pool_node(cluster: Any) -> Any:
    """One pool node in the session's cluster, for one test; gone again after it."""
    node = cluster.add_node(num_cpus=0, labels={"cmx.io/pool": "px"})
    cluster.wait_for_nodes()
    try:
        assert until(lambda: len(reconcile()["pool"]) == 1, 120), "the pool node did not join"
        time.sleep(POOL_REFRESH_S + 1)  # the agents see the new member
        yield reconcile()["pool"][0]
    finally:
        cluster.remove_node(node)
        assert until(lambda: reconcile()["pool"] == [], 120), "the pool node stayed a member"
        time.sleep(POOL_REFRESH_S + 1)


def test_a_head_of_a_prefix_only_in_the_pool_crosses_as_its_ranges(cm: Any, config: Any,
                                                                  nodes: Any,
                                                                  pool_node: str) -> None:
    _, worker = nodes
    toks = [tokens(1, seed=44 + i) for i in range(3)]
    kvs = [HEAD_MAJOR.random_kv(T, seed=44 + i) for i in range(3)]
    ns = cm.namespace("m-nx-pool", HEAD_MAJOR, "t")
    remote = client_on(worker, config)
    for t, kv in zip(toks, kvs):
        ray.get(remote.store.remote("m-nx-pool", HEAD_MAJOR, "t", t, kv))
    drop_local_copies(cm, ns, toks)
    for t, kv in zip(toks, kvs):
        assert {(b.tier, b.node) for b in ns.lookup(t).blocks} == {(Tier.POOL, pool_node)}
        ray.get(actor("pool", pool_node).drop_staging.remote())  # from the pool's disk
        check_head_load(ns, t, kv, 1, "pool")
    ray.get(actor("pool", pool_node).check_integrity.remote())
