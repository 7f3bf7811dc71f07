"""A tier that restarts in the middle of a store or a load: the operation becomes a miss, and
no load ever returns another key's bytes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from plane import NODE_A, Plane, make_plane
from scenarios import blocks, check, load, restart_tier, small_config

from cmx.tiers import Tier


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE_A,))
    yield p
    p.close()


def test_dram_restart_inside_a_store_never_serves_another_keys_bytes(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    (kb,), pb = blocks(1, seed=11)
    (kc,), pc = blocks(1, seed=12)
    demote = agent.demotion.demote_victims
    stored_c: list[int] = []
    restarted: list[bool] = []

    def restart_then_store_c(tier, grants):
        # kb's DRAM slot was granted by the tier that is about to be replaced.
        if tier is Tier.DRAM and not restarted:
            restarted.append(True)
            restart_tier(plane, NODE_A, Tier.DRAM)
            stored_c.append(agent.store([kc], [None], pc))  # takes the same slot, new arena
        return demote(tier, grants)

    agent.demotion.demote_victims = restart_then_store_c  # type: ignore[method-assign]
    assert agent.store([kb], [None], pb) == 0  # the grant died with its tier: nothing stored
    agent.demotion.demote_victims = demote  # type: ignore[method-assign]
    assert stored_c == [1]
    data, loaded = load(plane, NODE_A, [kc])
    assert len(loaded) == 1 and np.array_equal(data, pc)
    assert load(plane, NODE_A, [kb])[1] == []
    check(plane)


def test_hbm_restart_inside_a_load_never_serves_another_keys_bytes(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    (kb,), pb = blocks(1, seed=21)
    (kc,), pc = blocks(1, seed=22)
    agent.store([kb], [None], pb)
    agent.store([kc], [None], pc)
    demote = agent.demotion.demote_victims
    inner: list[tuple] = []
    restarted: list[bool] = []

    def restart_then_load_c(tier, grants):
        # kb's HBM slot was granted by the tier that is about to be replaced.
        if tier is Tier.HBM and not restarted:
            restarted.append(True)
            restart_tier(plane, NODE_A, Tier.HBM)
            inner.append(load(plane, NODE_A, [kc]))  # fills the same slot, new arena
        return demote(tier, grants)

    agent.demotion.demote_victims = restart_then_load_c  # type: ignore[method-assign]
    data, loaded = load(plane, NODE_A, [kb])
    agent.demotion.demote_victims = demote  # type: ignore[method-assign]
    assert loaded == [] and data.size == 0  # a miss, not a copy into the new arena
    assert np.array_equal(inner[0][0], pc)
    data, loaded = load(plane, NODE_A, [kc])  # now an HBM hit in the new tier
    assert [b.source_tier for b in loaded] == [Tier.HBM]
    assert np.array_equal(data, pc)
    check(plane)
