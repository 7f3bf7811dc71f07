"""A client's store learns which of its blocks were not stored: a commit refused (the DRAM
tier restarted under it, or the bytes in the slot no longer match what the client wrote) is
named to the client and counted apart from the blocks committed."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
from plane import Plane, make_plane, namespace_client
from scenarios import LAYOUT, check, held, restart_tier, small_config
from writers import StoreLink, during_copy

from cmx.client import NamespaceClient
from cmx.tiers import Tier

NODE = f"commits-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens


@pytest.fixture
def plane(tmp_path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Plane]:
    # StoreLink answers a store's last commit itself: waiting on it is reading it.
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    p = make_plane(small_config(tmp_path, placement="write_through"), nodes=(NODE,),
                   link_type=StoreLink)
    yield p
    p.close()


def client(plane: Plane) -> NamespaceClient:
    return namespace_client(plane, NODE, LAYOUT, "t")


def kv_of(n: int, seed: int) -> tuple[Any, Any]:
    toks = np.random.default_rng(seed).integers(0, 50_000, n * T)
    return toks, LAYOUT.random_kv(len(toks), seed=seed)


def test_a_store_whose_dram_restarted_under_it_is_told_every_block_was_refused(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = client(plane)
    toks, kv = kv_of(2, seed=1)
    fresh: list[Any] = []
    ran = during_copy(monkeypatch, lambda: fresh.append(restart_tier(plane, NODE, Tier.DRAM)),
                      before_write=True)  # the run lands in the arena of the tier that was
    handle = ns.store(toks, kv)
    assert ran() and handle.wait() == 0
    assert handle.refused == tuple(ns.keys(toks))
    assert fresh[0].stats().refused_commits == 2
    assert plane.agents[NODE].stats().store_commits == {"committed": 0, "refused": 2}
    assert ns.load(toks).shape[3] == 0
    check(plane)


def test_a_block_whose_slot_changed_after_its_copy_is_refused_and_its_copy_dropped(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = client(plane)
    toks, kv = kv_of(2, seed=2)
    dram = plane.tiers[(NODE, Tier.DRAM)]

    def stray_write() -> None:  # a late writer's bytes over the slot the client copies into
        [res] = [r for r in dram._reservations.values() if r.key == ns.keys(toks)[0]]
        res.buffer[:64] = 0xAB

    during_copy(monkeypatch, stray_write)
    handle = ns.store(toks, kv)
    assert handle.wait() == 1
    assert handle.refused == tuple(ns.keys(toks)[:1])
    assert dram.contains(ns.keys(toks)) == [False, True]  # the bad copy went
    assert plane.tiers[(NODE, Tier.NVME)].contains(ns.keys(toks)) == [False, True]
    assert plane.agents[NODE].stats().store_commits == {"committed": 1, "refused": 1}
    assert ns.load(toks).shape[3] == 0  # the first block is not stored: nothing to load
    assert held(plane, NODE, Tier.DRAM) == (0, 0)
    check(plane)
