"""Stores and loads from several threads while the HBM and DRAM tiers and the agent are killed
again and again; and a client killed while it holds a load's pins.

Every load returns the stored bytes or a miss (a shorter prefix), every call stays bounded,
and once the storm is over nothing stays pinned or reserved past the lease time.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from support import LAYOUT
from traffic import Traffic, held, kill, nothing_held, until

from cmx import ContextMemory
from cmx.config import ServiceConfig
from cmx.doors import Load, TierStatsOf
from cmx.links import actor_name
from cmx.protocol import Priority

T = LAYOUT.block_tokens
STORM_S = 20.0
VICTIMS = ("hbm", "dram", "agent")


def test_kill_storm_loads_are_right_or_missing_and_nothing_stays_held(
    cm: Any, config: ServiceConfig
) -> None:
    bound_s = config.load_timeout_s + 2 * config.call_timeout_s
    node = cm.node_id
    kills = 0
    with Traffic(cm, bound_s) as traffic:
        # The first kill waits for a hit: the path works before the storm breaks it.
        assert until(lambda: traffic.hits > 0, bound_s), "no load hit before the storm"
        deadline = time.monotonic() + STORM_S
        while time.monotonic() < deadline:
            kills += kill(actor_name(VICTIMS[kills % len(VICTIMS)], node))
            time.sleep(2.0)
    assert kills >= len(VICTIMS)
    assert traffic.wrong == [] and traffic.errors == []
    assert traffic.slowest < bound_s
    # What the killed holders left goes back within the lease time (and the restarts).
    assert until(lambda: nothing_held(cm, node), config.lease_s + 30), held(cm, node)
    toks, kv = traffic.prefixes[0]
    assert until(lambda: traffic.ns.store(toks, kv).wait() >= 0
                 and torch.equal(traffic.ns.load(toks), kv), 60), "not served after the storm"


class Hoarder:
    """A client that takes a load's pins and never gives them back: then it is killed."""

    def __init__(self, config: ServiceConfig) -> None:
        self.cm = ContextMemory.connect(config=config, start_service=False)

    def hold(self, model: str, salt: str, tokens: Any) -> int:
        ns = self.cm.namespace(model, LAYOUT, salt)
        match = ns.lookup(tokens)
        agent = actor_name("agent", self.cm.node_id)
        result = self.cm.link.call(agent, Load(
            keys=[b.key for b in match.blocks], copies=[list(b.copies) for b in match.blocks],
            priority=Priority.LOAD, owner=f"client:{uuid.uuid4().hex}"))
        return len(result.blocks)


def test_a_client_killed_holding_a_loads_pins_leaves_nothing_pinned(
    cm: Any, config: ServiceConfig
) -> None:
    node = cm.node_id
    toks = np.random.default_rng(12).integers(0, 50_000, 3 * T, dtype=np.uint32)
    ns = cm.namespace("m-hoard", LAYOUT, "t")
    assert ns.store(toks, LAYOUT.random_kv(len(toks), seed=12)).wait() == 3
    assert until(lambda: nothing_held(cm, node), config.lease_s + 30), held(cm, node)
    hoarder = ray.remote(Hoarder).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
    ).remote(config)
    assert ray.get(hoarder.hold.remote("m-hoard", "t", toks), timeout=60) == 3
    hbm = actor_name("hbm", node)
    expired = cm.link.call(hbm, TierStatsOf()).leases.expired
    assert held(cm, node)["hbm"][0] >= 3
    ray.kill(hoarder)
    assert until(lambda: held(cm, node)["hbm"] == (0, 0), config.lease_s + 10)
    assert cm.link.call(hbm, TierStatsOf()).leases.expired - expired >= 3  # the leases ended them
