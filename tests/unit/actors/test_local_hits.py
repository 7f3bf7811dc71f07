"""A local hit: the blocks this node holds in memory are pinned in one round trip to its HBM and
DRAM tiers and read where they lie, verified; no directory, no agent, every pin ended."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from plane import Plane, make_plane, namespace_client
from scenarios import LAYOUT, check, held, load, restart_tier, small_config

from cmx.client import NamespaceClient
from cmx.client.node_plane import PinnedPrefix
from cmx.doors import Request
from cmx.links import LocalLink
from cmx.protocol import arena_name
from cmx.tiers import Tier

R = TypeVar("R")
NODE = f"hits-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens


class CountingLink(LocalLink):
    """Records which kind of actor each call and tell went to, and the method."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.calls: list[tuple[str, str]] = []

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        self.calls.append((name.split(":")[1], request.method))
        return super().call(name, request)

    def tell(self, name: str, request: Request[Any]) -> None:
        self.calls.append((name.split(":")[1], f"tell {request.method}"))
        LocalLink.call(self, name, request)


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=CountingLink)
    yield p
    p.close()


def client(plane: Plane) -> NamespaceClient:
    return namespace_client(plane, NODE, LAYOUT, "t")


def stored(plane: Plane, ns: NamespaceClient, n: int, seed: int) -> tuple[Any, torch.Tensor]:
    """``n`` blocks stored into this node's DRAM by its agent, as a client's store does."""
    toks = np.random.default_rng(seed).integers(0, 50_000, n * T)
    kv = LAYOUT.random_kv(len(toks), seed=seed)
    keys = ns.keys(toks)
    payload = torch.cat(LAYOUT.split_blocks(kv)).numpy()
    parents = [None, *keys[:-1]]
    assert plane.agents[NODE].store(keys, parents, payload, ns.namespace.id) == n
    return toks, kv


def nothing_held(plane: Plane) -> bool:
    return all(held(plane, NODE, t) == (0, 0) for t in (Tier.HBM, Tier.DRAM))


def test_a_local_dram_hit_is_one_call_to_dram_and_exact(plane: Plane) -> None:
    ns = client(plane)
    toks, kv = stored(plane, ns, 3, seed=1)
    moved = dict(plane.agents[NODE].counters.moved)
    link: CountingLink = plane.link  # type: ignore[assignment]
    link.calls.clear()
    got = ns.load(toks)
    assert torch.equal(got, kv)
    asked = [c for c in link.calls if not c[1].startswith("tell")]
    assert asked == [("dram", "pin_columns")]  # no directory, no agent, no HBM
    assert dict(plane.agents[NODE].counters.moved) == moved  # read where it lies, not moved
    assert nothing_held(plane)
    check(plane)


def test_blocks_only_hbm_holds_are_read_from_hbm_after_those_in_dram(plane: Plane) -> None:
    ns = client(plane)
    toks, kv = stored(plane, ns, 3, seed=2)
    keys = ns.keys(toks)
    load(plane, NODE, keys)  # the agent's load leaves an HBM copy of each
    plane.tiers[(NODE, Tier.DRAM)].evict(keys[1:])
    hbm = plane.tiers[(NODE, Tier.HBM)]
    reads = hbm.stats().store.hits
    link: CountingLink = plane.link  # type: ignore[assignment]
    link.calls.clear()
    assert torch.equal(ns.load(toks), kv)
    assert [c for c in link.calls if not c[1].startswith("tell")] == [
        ("dram", "pin_columns"), ("hbm", "pin")]
    assert hbm.stats().store.hits - reads == 2  # HBM asked for the two DRAM lacks, no more
    assert nothing_held(plane)
    check(plane)


def test_a_corrupt_local_copy_ends_the_prefix_and_is_quarantined(plane: Plane) -> None:
    ns = client(plane)
    toks, kv = stored(plane, ns, 3, seed=3)
    keys = ns.keys(toks)
    dram = plane.tiers[(NODE, Tier.DRAM)]
    dram.store.arena.slot_view(dram.store.locate(keys[1]).slot)[7] ^= 0xFF
    got = ns.load(toks)
    assert torch.equal(got, kv[:, :, :, :T])  # the intact block before it, never the bad one
    assert dram.contains(keys) == [True, False, True]
    assert dram.stats().store.quarantined == 1
    assert nothing_held(plane)
    check(plane)


def test_a_prefix_ends_at_the_first_block_not_held_here(plane: Plane) -> None:
    ns = client(plane)
    toks, _ = stored(plane, ns, 3, seed=4)
    keys = ns.keys(toks)
    plane.tiers[(NODE, Tier.DRAM)].evict([keys[1]])
    pins = ns.cm.plane.pin_prefix(keys, "client:test")
    assert [p.pin.key for p in pins] == keys[:1]
    ns.cm.plane.unpin(pins)
    assert nothing_held(plane)  # the pin of the block after the gap was let go too


def test_a_pin_of_a_restarted_tier_is_never_read(plane: Plane) -> None:
    ns = client(plane)
    toks, _ = stored(plane, ns, 1, seed=5)
    pins = ns.cm.plane.pin_prefix(ns.keys(toks), "client:test")
    assert [p.tier for p in pins] == [Tier.DRAM]
    restart_tier(plane, NODE, Tier.DRAM)  # a new epoch; the old arena's name is unlinked
    with pytest.raises(OSError):
        ns.cm.plane.payload(pins[0])


def test_a_whole_prefix_in_dram_is_pinned_as_columns_naming_what_pin_names(
        plane: Plane) -> None:
    ns = client(plane)
    toks, _ = stored(plane, ns, 3, seed=6)
    keys = ns.keys(toks)
    dram = plane.tiers[(NODE, Tier.DRAM)]
    pins = ns.cm.plane.pin_prefix(keys, "client:test")
    assert isinstance(pins, PinnedPrefix) and len(pins) == 3
    listed = dram.pin(keys, "client:other")
    assert all(q is not None for q in listed)
    assert [replace(p.pin, lease=0, namespace="") for p in pins] == \
        [replace(q, lease=0, namespace="") for q in listed]  # type: ignore[misc]
    assert [bytes(v) for v in ns.cm.plane.payloads(pins)] == \
        [bytes(dram.store.arena.slot_view(q.slot)[: q.size]) for q in listed]  # type: ignore[union-attr]
    assert pins[1:2] == [pins[1]] and pins[-1].pin.key == keys[2]
    dram.unpin([q.lease for q in listed])  # type: ignore[union-attr]
    ns.cm.plane.unpin(pins)
    assert nothing_held(plane)


def test_a_prefix_pinned_as_columns_in_a_restarted_tier_is_never_read(plane: Plane) -> None:
    ns = client(plane)
    toks, _ = stored(plane, ns, 3, seed=7)
    pins = ns.cm.plane.pin_prefix(ns.keys(toks), "client:test")
    assert isinstance(pins, PinnedPrefix)
    restart_tier(plane, NODE, Tier.DRAM)  # a new epoch; the old arena's name is unlinked
    with pytest.raises(OSError):
        ns.cm.plane.payloads(pins)


# -- stores: the engine's KV copied once into granted DRAM slots, never through the object store


@pytest.fixture
def no_object_store(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a store went through the object store")

    monkeypatch.setattr(ray, "put", refuse)


def test_a_store_writes_the_granted_dram_slots_and_loads_back_exact(
    plane: Plane, no_object_store: None
) -> None:
    ns = client(plane)
    toks = np.random.default_rng(6).integers(0, 50_000, 3 * T)
    kv = LAYOUT.random_kv(len(toks), seed=6)
    link: CountingLink = plane.link  # type: ignore[assignment]
    link.calls.clear()
    ns.store(toks, kv)
    assert [c for c in link.calls if c[0] == "agent"] == [
        ("agent", "grant_store"), ("agent", "commit_store")]
    assert plane.tiers[(NODE, Tier.DRAM)].contains(ns.keys(toks)) == [True] * 3
    assert torch.equal(ns.load(toks), kv)
    assert nothing_held(plane)
    check(plane)


def test_a_store_larger_than_dram_streams_through_it_in_windows(
    plane: Plane, no_object_store: None
) -> None:
    ns = client(plane)
    n = 2 * plane.config.dram_bytes // plane.config.block_bytes  # twice what DRAM holds
    toks = np.random.default_rng(7).integers(0, 50_000, n * T)
    kv = LAYOUT.random_kv(len(toks), seed=7)
    ns.store(toks, kv)
    keys = ns.keys(toks)
    assert plane.tiers[(NODE, Tier.DRAM)].contains(keys[-2:]) == [True, True]
    assert nothing_held(plane)
    check(plane)


def test_a_store_granted_by_a_dram_that_restarted_commits_nothing(plane: Plane) -> None:
    ns = client(plane)
    toks, _ = stored(plane, ns, 1, seed=8)  # the client maps this DRAM's arena
    ns.load(toks)
    toks2 = np.random.default_rng(9).integers(0, 50_000, 2 * T)
    kv2 = LAYOUT.random_kv(len(toks2), seed=9)
    agent = plane.agents[NODE]
    keys = ns.keys(toks2)
    grants = agent.grant_store(keys, [None, keys[0]], "client:test")
    fresh = restart_tier(plane, NODE, Tier.DRAM)
    # The writer copies into the old incarnation's arena, still mapped here: memory no tier
    # uses. The new DRAM refuses the commit, so no lookup finds those bytes.
    arena = ns.cm.plane.arena(arena_name(Tier.DRAM, NODE, grants[0].epoch))
    done = []
    for i, g in enumerate(grants):
        slot = arena.slot_view(g.slot)[: LAYOUT.block_bytes]
        LAYOUT.from_payload(slot).copy_(kv2[:, :, :, i * T : (i + 1) * T])
        done.append((g, LAYOUT.block_bytes, 0))
    result = agent.commit_store(keys, [None, keys[0]], done)
    assert result.committed == 0 and result.refused == tuple(keys)
    assert fresh.contains(keys) == [False, False]
    assert held(plane, NODE, Tier.DRAM) == (0, 0)
