"""The pooled NVMe tier (G4) on three pool nodes: replication, loss, and return.

The pool nodes join the session's shared cluster for this test alone and leave it again whatever
happens, so the suites after it see the cluster (and an empty pool) as they would without it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from pool_support import N, T, drop_local_copies, prompts, reconcile, until
from support import LAYOUT

from cmx.actors.agent.pool import POOL_REFRESH_S
from cmx.policies.rendezvous import owners
from cmx.tiers import Tier


def test_pool_replicas_survive_a_lost_node_and_a_returning_node_offers_its_disk(
    cluster: Any, cm: Any
) -> None:
    added: dict[str, Any] = {}  # pool id -> the node carrying it now
    try:
        _lose_and_return(cluster, cm, added)
    finally:
        for node in added.values():
            try:
                cluster.remove_node(node)
            except Exception:  # noqa: BLE001 - removed by the scenario already
                pass
        # The controller forgets the nodes (their actors, their directory sources) and the
        # agents see an empty pool again before the next suite stores anything.
        assert until(lambda: reconcile()["pool"] == [], 120), "pool nodes stayed members"
        time.sleep(POOL_REFRESH_S + 1)


def _lose_and_return(cluster: Any, cm: Any, added: dict[str, Any]) -> None:
    for pool_id in ("p1", "p2", "p3"):
        added[pool_id] = cluster.add_node(num_cpus=0, labels={"cmx.io/pool": pool_id})
    cluster.wait_for_nodes()
    members = reconcile()["pool"]
    assert len(members) == 3

    two = cm.namespace("m-pool", LAYOUT, "r2", replication=2)
    one = cm.namespace("m-pool", LAYOUT, "r1", replication=1)
    toks2, toks1 = prompts(21), prompts(22)
    kv2 = [LAYOUT.random_kv(T, seed=100 + i) for i in range(N)]
    kv1 = [LAYOUT.random_kv(T, seed=200 + i) for i in range(N)]
    for t, kv in zip(toks2, kv2):
        two.store(t, kv).wait()
    for t, kv in zip(toks1, kv1):
        one.store(t, kv).wait()
    for t in toks2:
        pool_copies = [c for c in two.lookup(t).blocks[0].copies if c.tier is Tier.POOL]
        assert len(pool_copies) == 2
    pool = cm.stats().pool
    assert pool.blocks == 2 * N and pool.under_replicated == N  # r1 blocks have one
    assert len(pool.members) == 3 and pool.used_bytes > 0

    # Only the pool has these blocks now; then one pool node is lost.
    drop_local_copies(cm, two, toks2)
    drop_local_copies(cm, one, toks1)
    # Node ids are new at each run, so which pool node owns what is too: lose the one that
    # owns the most replication-1 blocks (one of three owns at least three of eight).
    first = [one.keys(t)[0] for t in toks1]
    owned = {pid: {k for k in first if owners(k, members, 1) == [n.node_id]}
             for pid, n in added.items()}
    lost_id = max(owned, key=lambda pid: len(owned[pid]))
    lost, lost_keys = added.pop(lost_id), owned[lost_id]
    assert lost_keys
    cluster.remove_node(lost)
    assert lost.node_id not in reconcile()["pool"]

    for t, kv in zip(toks2, kv2):  # replication 2: everything still loads, bit-identical
        assert torch.equal(two.load(t), kv)
    for t, kv in zip(toks1, kv1):  # replication 1: the lost node's blocks miss, the rest load
        got = one.load(t)
        if one.keys(t)[0] in lost_keys:
            assert got.shape[3] == 0
        else:
            assert torch.equal(got, kv)
    # The surviving replicas are copied again in the background.
    two_keys = [two.keys(t)[0] for t in toks2]

    def replicated() -> bool:
        copies = cm.copies(two_keys)
        return all(sum(c.tier is Tier.POOL for c in cs) >= 2 for cs in copies)

    assert until(replicated), "the pool did not re-replicate after losing a node"

    # The lost node comes back with its disk: what it held is found again.
    added[lost_id] = cluster.add_node(num_cpus=0, labels={"cmx.io/pool": lost_id})
    cluster.wait_for_nodes()
    reconcile()
    lost_toks = [(t, kv) for t, kv in zip(toks1, kv1) if one.keys(t)[0] in lost_keys]
    assert until(lambda: all(one.lookup(t).num_tokens == T for t, _ in lost_toks))
    for t, kv in lost_toks:
        assert torch.equal(one.load(t), kv)
