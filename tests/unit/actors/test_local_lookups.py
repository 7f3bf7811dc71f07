"""A lookup answers the prefix this node holds in memory from its tiers' own books and asks the
directory only for the rest; a copy the books do not hold committed is never reported here."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from plane import Plane, make_plane, namespace_client
from scenarios import LAYOUT, check, held, small_config

from cmx.client import NamespaceClient
from cmx.doors import FindCopies, Lookup, Request
from cmx.keys import split_keys
from cmx.links import LocalLink
from cmx.tiers import Tier

R = TypeVar("R")
RUN = uuid.uuid4().hex[:5]
HERE, PEER = f"lookups-h-{RUN}", f"lookups-p-{RUN}"  # arenas named apart from other suites'
T = LAYOUT.block_tokens


class DirectoryCountingLink(LocalLink):
    """Records every key each directory shard is asked to look up, one list per call."""

    def __init__(self, targets: dict[str, Any]) -> None:
        super().__init__(targets)
        self.asked: list[list[bytes]] = []

    def call(self, name: str, request: Request[R], timeout_s: float | None = None) -> R:
        if name.startswith("cmx:dir:") and isinstance(request, Lookup):
            self.asked.append(list(request.keys))
        if name.startswith("cmx:dir:") and isinstance(request, FindCopies):
            self.asked.append(split_keys(request.keys))
        return super().call(name, request)

    def asked_keys(self) -> list[bytes]:
        return [k for call in self.asked for k in call]


def make(tmp_path: Path, **config: object) -> Plane:
    return make_plane(small_config(tmp_path, **config), nodes=(HERE, PEER),
                      link_type=DirectoryCountingLink)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    p = make(tmp_path)
    yield p
    p.close()


def link_of(plane: Plane) -> DirectoryCountingLink:
    assert isinstance(plane.link, DirectoryCountingLink)
    return plane.link


def prompt(n: int, seed: int) -> Any:
    return np.random.default_rng(seed).integers(0, 50_000, n * T)


def store(plane: Plane, node: str, ns: NamespaceClient, toks: Any, n: int) -> list[bytes]:
    """The first ``n`` blocks of ``toks`` stored into ``node``'s DRAM by its agent."""
    keys = ns.keys(toks)[:n]
    payload = np.random.default_rng(n).integers(0, 256, n * LAYOUT.block_bytes, dtype=np.uint8)
    assert plane.agents[node].store(keys, [None, *keys[:-1]], payload, ns.namespace.id) == n
    return list(keys)


def test_a_prefix_held_here_costs_no_directory_call(plane: Plane) -> None:
    ns = namespace_client(plane, HERE, LAYOUT, "t")
    toks = prompt(3, seed=1)
    keys = store(plane, HERE, ns, toks, 3)
    link_of(plane).asked.clear()
    lookups = [s.lookups for s in plane.shards]
    match = ns.lookup(toks, here_first=True)
    assert [b.key for b in match.blocks] == keys
    assert {(b.tier, b.node) for b in match.blocks} == {(Tier.DRAM, HERE)}
    assert match.num_tokens == 3 * T
    assert link_of(plane).asked == []
    assert [s.lookups for s in plane.shards] == lookups
    assert held(plane, HERE, Tier.DRAM) == (0, 0)  # a lookup pins nothing
    check(plane)


def test_a_prefix_partly_here_asks_the_directory_only_for_the_rest(plane: Plane) -> None:
    ns = namespace_client(plane, HERE, LAYOUT, "t")
    toks = prompt(4, seed=2)
    keys = store(plane, PEER, ns, toks, 4)
    store(plane, HERE, ns, toks, 2)
    link_of(plane).asked.clear()
    match = ns.lookup(toks, here_first=True)
    assert [(b.tier, b.node) for b in match.blocks] == [
        (Tier.DRAM, HERE), (Tier.DRAM, HERE), (Tier.DRAM, PEER), (Tier.DRAM, PEER)]
    assert sorted(link_of(plane).asked_keys()) == sorted(keys[2:])
    assert len(link_of(plane).asked) <= plane.config.directory_shards  # one call per shard
    check(plane)


def test_an_uncommitted_block_here_is_not_a_hit(plane: Plane) -> None:
    ns = namespace_client(plane, HERE, LAYOUT, "t")
    toks = prompt(2, seed=3)
    keys = store(plane, HERE, ns, toks, 1)
    dram = plane.tiers[(HERE, Tier.DRAM)]
    grant = dram.reserve([(ns.keys(toks)[1], keys[0])], "writer:test")[0]
    assert ns.lookup(toks, here_first=True).num_blocks == 1
    dram.abort([grant.lease])
    check(plane)


def test_a_copy_evicted_before_the_directory_heard_is_not_reported(plane: Plane) -> None:
    ns = namespace_client(plane, HERE, LAYOUT, "t")
    n = plane.config.dram_bytes // plane.config.block_bytes  # DRAM full
    toks = prompt(n, seed=4)
    keys = store(plane, HERE, ns, toks, n)
    dram = plane.tiers[(HERE, Tier.DRAM)]
    # A reservation evicts the least recently used block; its removal is sent to the
    # directory only with the tier's next commit or heartbeat.
    grant = dram.reserve([(b"\x01" * 32, None)], "writer:test")[0]
    gone = [i for i, found in enumerate(dram.contains(keys)) if not found]
    assert len(gone) == 1
    assert any(c.node == HERE for c in plane.lookup([keys[gone[0]]])[0])  # still listed
    match = ns.lookup(toks, here_first=True)
    assert match.num_blocks == gone[0]
    dram.abort([grant.lease])
    check(plane)


def test_a_copy_quarantined_while_pinned_is_not_reported(plane: Plane) -> None:
    ns = namespace_client(plane, HERE, LAYOUT, "t")
    toks = prompt(3, seed=5)
    keys = store(plane, HERE, ns, toks, 3)
    dram = plane.tiers[(HERE, Tier.DRAM)]
    pins = dram.pin([keys[1]], "reader:test")
    dram.quarantine([keys[1]])  # goes at its last unpin; the directory lists it till then
    assert plane.lookup([keys[1]])[0]
    assert ns.lookup(toks, here_first=True).num_blocks == 1
    dram.unpin([p.lease for p in pins])
    assert ns.lookup(toks, here_first=True).num_blocks == 1
    check(plane)


def test_a_namespace_finds_none_of_another_tenants_blocks_here(plane: Plane) -> None:
    mine = namespace_client(plane, HERE, LAYOUT, "t")
    theirs = namespace_client(plane, HERE, LAYOUT, "u")
    toks = prompt(3, seed=6)
    store(plane, HERE, mine, toks, 3)
    assert theirs.lookup(toks, here_first=True).num_blocks == 0
    assert mine.lookup(toks, here_first=True).num_blocks == 3


def test_a_tier_that_does_not_answer_leaves_the_lookup_to_the_directory(plane: Plane) -> None:
    ns = namespace_client(plane, HERE, LAYOUT, "t")
    toks = prompt(2, seed=7)
    keys = store(plane, PEER, ns, toks, 2)
    targets: dict[str, Any] = plane.link._targets  # type: ignore[assignment]
    dram = targets.pop(f"cmx:dram:{HERE}")
    try:
        match = ns.lookup(toks, here_first=True)
    finally:
        targets[f"cmx:dram:{HERE}"] = dram
    assert [b.key for b in match.blocks] == keys
    assert {b.node for b in match.blocks} == {PEER}


def test_a_load_by_a_match_whose_local_blocks_went_reads_them_where_they_are_now(
    plane: Plane,
) -> None:
    ns = namespace_client(plane, HERE, LAYOUT, "t")
    toks = prompt(3, seed=8)
    kv = LAYOUT.random_kv(len(toks), seed=8)
    keys = ns.keys(toks)
    payload = torch.cat(LAYOUT.split_blocks(kv)).numpy()
    for node in (PEER, HERE):
        assert plane.agents[node].store(keys, [None, *keys[:-1]], payload, ns.namespace.id) == 3
    match = ns.lookup(toks, here_first=True)
    assert {(b.tier, b.node) for b in match.blocks} == {(Tier.DRAM, HERE)}
    plane.tiers[(HERE, Tier.DRAM)].evict(keys)  # gone from here between lookup and load
    assert torch.equal(ns.load(toks, match), kv)  # from the peer, looked up afresh
    check(plane)
