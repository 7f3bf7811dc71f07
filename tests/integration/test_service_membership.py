"""Nodes that join and leave, and an agent placed on its host's DPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import ray
import torch
from support import LAYOUT, client_on

from cmx.links import RAY_NAMESPACE, actor_name

T = LAYOUT.block_tokens


def loads_whole(ns: Any, toks: Any, kv: Any, tries: int = 5) -> bool:
    """A load under a bound may miss (a shorter prefix) on a loaded machine; never wrong bytes."""
    for _ in range(tries):
        got = ns.load(toks)
        assert torch.equal(got, kv[:, :, :, : got.shape[3]])
        if got.shape == kv.shape:
            return True
    return False


def controller() -> Any:
    return ray.get_actor("cmx:controller", namespace=RAY_NAMESPACE)


def test_join_with_dpu_then_leave(cluster: Any, cm: Any, config: Any) -> None:
    # The DPU's raylet registers before its host's, as it boots with the host's power-on.
    dpu = cluster.add_node(
        num_cpus=0, labels={config.dpu_label: "bluefield-4", config.host_label: "rack1-h7"}
    )
    cluster.wait_for_nodes()
    host = cluster.add_node(num_cpus=0, labels={config.host_label: "rack1-h7"})
    cluster.wait_for_nodes()
    result = ray.get(controller().reconcile.remote(), timeout=180)
    assert host.node_id in result["nodes"]
    assert dpu.node_id not in result["nodes"]  # a DPU hosts an agent, not tiers

    agent = ray.get_actor(actor_name("agent", host.node_id), namespace=RAY_NAMESPACE)
    placement = ray.get(agent.placement.remote())
    assert placement == {"node": host.node_id, "placed_on": dpu.node_id, "dpu": True}

    # A replica on the new host stores; the head node finds and loads it.
    toks = np.random.default_rng(11).integers(0, 50_000, 3 * T, dtype=np.uint32)
    kv = LAYOUT.random_kv(len(toks), seed=11)
    remote = client_on(host.node_id, config)
    assert ray.get(remote.store.remote("m-join", LAYOUT, "t", toks, kv)) == 3
    ns = cm.namespace("m-join", LAYOUT, "t")
    assert {b.node for b in ns.lookup(toks).blocks} == {host.node_id}
    assert loads_whole(ns, toks, kv)
    assert cm.stats().nodes[host.node_id].agent.dpu is True

    # The host leaves: its copies are forgotten. The head's HBM kept what it loaded, so the
    # prefix still loads whole from there; nothing points at the departed node.
    ray.kill(remote)
    cluster.remove_node(host)
    cluster.remove_node(dpu)
    result = ray.get(controller().reconcile.remote(), timeout=60)
    assert host.node_id in result["gone"] or host.node_id not in result["nodes"]
    match = ns.lookup(toks)
    assert all(c.node != host.node_id for b in match.blocks for c in b.copies)
    assert loads_whole(ns, toks, kv)
