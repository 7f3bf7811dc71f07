"""A local hit: the blocks this node holds in memory are pinned in one round trip to its HBM and
DRAM tiers and read where they lie, verified; no directory, no agent, every pin ended."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from plane import Plane, make_plane
from scenarios import LAYOUT, check, held, load, restart_tier, small_config

from cmx.actors.links import LocalLink
from cmx.client import ContextMemory, NamespaceClient
from cmx.keys import Namespace
from cmx.node_plane import NodePlane
from cmx.tiers import Tier

NODE = f"hits-{uuid.uuid4().hex[:6]}"  # arenas named apart from other suites' on this host
T = LAYOUT.block_tokens


class CountingLink(LocalLink):
    """Records which kind of actor each call and tell went to, and the method."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.calls: list[tuple[str, str]] = []

    def call(self, name: str, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        self.calls.append((name.split(":")[1], method))
        return super().call(name, method, *args)

    def tell(self, name: str, method: str, *args: Any) -> None:
        self.calls.append((name.split(":")[1], f"tell {method}"))
        LocalLink.call(self, name, method, *args)


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(NODE,), link_type=CountingLink)
    yield p
    p.close()


def client(plane: Plane) -> NamespaceClient:
    cm = ContextMemory(plane.config, NODE, owns_ray=False)
    cm.link = plane.link  # type: ignore[assignment]
    cm.plane = NodePlane(plane.link, NODE, 5.0)
    return NamespaceClient(cm, Namespace("m", LAYOUT, "t"))


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


def test_a_local_dram_hit_is_one_call_to_each_memory_tier_and_exact(plane: Plane) -> None:
    ns = client(plane)
    toks, kv = stored(plane, ns, 3, seed=1)
    moved = dict(plane.agents[NODE].moved)
    link: CountingLink = plane.link  # type: ignore[assignment]
    link.calls.clear()
    got = ns.load(toks)
    assert torch.equal(got, kv)
    asked = [c for c in link.calls if not c[1].startswith("tell")]
    assert sorted(asked) == [("dram", "pin"), ("hbm", "pin")]  # no directory, no agent
    assert dict(plane.agents[NODE].moved) == moved  # read where it lies, not moved
    assert nothing_held(plane)
    check(plane)


def test_a_block_in_hbm_and_dram_is_read_from_hbm_and_both_pins_end(plane: Plane) -> None:
    ns = client(plane)
    toks, kv = stored(plane, ns, 2, seed=2)
    load(plane, NODE, ns.keys(toks))  # the agent's load leaves an HBM copy of each
    hbm = plane.tiers[(NODE, Tier.HBM)]
    reads = hbm.stats()["hits"]
    assert torch.equal(ns.load(toks), kv)
    assert hbm.stats()["hits"] - reads == 2
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
    assert dram.stats()["quarantined"] == 1
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
