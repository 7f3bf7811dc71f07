"""A lookup kept in columns (keys, the tiers' held tables and the directory's answer as arrays,
``cmx.copy_table``) finds the very Match a lookup block by block finds: the same blocks, each
with the same copies in the same order and the same best copy, here first or not, with copies
in both memory tiers, on a peer, and one gone here before the directory heard."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from plane import Plane, make_plane, namespace_client
from scenarios import LAYOUT, check, small_config

from cmx.client import NamespaceClient
from cmx.client.matches import (
    BlockLocation,
    Blocks,
    Match,
    block_keys,
    block_places,
    held_here,
    in_memory_here,
)
from cmx.keys import BlockHash
from cmx.protocol import Copy, best_copy
from cmx.tiers import Tier

RUN = uuid.uuid4().hex[:5]
HERE, PEER = f"columns-h-{RUN}", f"columns-p-{RUN}"  # arenas named apart from other suites'
T = LAYOUT.block_tokens
MEMORY = (Tier.DRAM, Tier.HBM)


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path), nodes=(HERE, PEER))
    yield p
    p.close()


def reference(plane: Plane, ns: NamespaceClient, toks: np.ndarray, here_first: bool) -> Match:
    """The lookup block by block, from the tiers' books and the shards' ``lookup`` lists."""
    keys = ns.keys(toks)
    books = {t: plane.tiers[(HERE, t)].held(keys) for t in MEMORY}

    def here(i: int) -> list[Copy]:
        return [Copy(t, HERE, *books[t][i]) for t in MEMORY if books[t][i] is not None]

    def location(key: BlockHash, copies: list[Copy]) -> BlockLocation:
        best = best_copy(copies, HERE)
        return BlockLocation(key, best.tier, best.node, tuple(copies))

    first = 0
    while here_first and first < len(keys) and here(first):
        first += 1
    blocks = [location(keys[i], here(i)) for i in range(first)]
    for i in range(first, len(keys)):
        copies = plane.lookup([keys[i]])[0]
        if here_first:  # a copy here the books no longer hold is not reported
            mine = {c.tier for c in here(i)}
            copies = [c for c in copies
                      if c.node != HERE or c.tier not in MEMORY or c.tier in mine]
        if not copies:
            break
        blocks.append(location(keys[i], copies))
    return Match(len(blocks) * T, tuple(blocks))


def stored(plane: Plane, node: str, ns: NamespaceClient, toks: np.ndarray, n: int) -> None:
    keys = ns.keys(toks)[:n]
    payload = np.random.default_rng(n).integers(0, 256, n * LAYOUT.block_bytes, dtype=np.uint8)
    assert plane.agents[node].store(keys, [None, *keys[:-1]], payload, ns.namespace.id) == n


def scattered(plane: Plane) -> tuple[NamespaceClient, np.ndarray]:
    """Six blocks on the peer; the first three here in DRAM, the first also in HBM (a load
    put it there), and the third quarantined here while pinned: the directory still lists
    that copy, the tier's books no longer hold it."""
    ns = namespace_client(plane, HERE, LAYOUT, "t")
    toks = np.random.default_rng(4).integers(0, 50_000, 6 * T + 5)  # and a partial block
    stored(plane, PEER, ns, toks, 6)
    stored(plane, HERE, ns, toks, 3)
    keys = ns.keys(toks)
    agent = plane.agents[HERE]
    agent.release([b.lease for b in agent.load(keys[:1], plane.lookup(keys[:1])).blocks])
    plane.tiers[(HERE, Tier.HBM)].publisher.flush()  # a load's copy is published behind it
    dram = plane.tiers[(HERE, Tier.DRAM)]
    dram.pin(keys[2:3], "reader:test")
    dram.quarantine(keys[2:3])
    assert (Tier.DRAM, HERE) in {(c.tier, c.node) for c in plane.lookup(keys[2:3])[0]}
    return ns, toks


@pytest.mark.parametrize("here_first", [True, False])
def test_a_lookup_in_columns_is_the_lookup_block_by_block(plane: Plane, here_first: bool) -> None:
    ns, toks = scattered(plane)
    match = ns.lookup(toks, here_first)
    want = reference(plane, ns, toks, here_first)
    assert want.num_blocks == 6  # the peer holds them all
    assert {c.tier for c in want.blocks[0].copies if c.node == HERE} == set(MEMORY)
    assert match == want and tuple(match.blocks) == want.blocks
    # here first, the copy the books let go is not reported; from the directory alone it is
    assert held_here(match, HERE) == held_here(want, HERE) == (2 if here_first else 3)
    assert held_here(match, PEER) == held_here(want, PEER) == 0
    check(plane)


def test_a_lookup_of_a_prefix_nobody_holds_and_of_no_tokens(plane: Plane) -> None:
    ns, toks = scattered(plane)
    other = namespace_client(plane, HERE, LAYOUT, "u")
    for client, tokens in ((other, toks), (ns, toks[: T - 1]), (ns, toks[:0])):
        for here_first in (True, False):
            match = client.lookup(tokens, here_first)
            assert match == Match(0, ()) and not match.blocks and match.num_blocks == 0


def test_blocks_read_as_the_tuple_of_their_locations(plane: Plane) -> None:
    ns, toks = scattered(plane)
    blocks = ns.lookup(toks, True).blocks
    assert isinstance(blocks, Blocks)
    locations = tuple(blocks)
    assert blocks == locations and locations == blocks and hash(blocks) == hash(locations)
    assert blocks[-1] == locations[-1] and blocks[1] is blocks[1]  # made once, then kept
    assert blocks[2:5] == locations[2:5] and blocks[2:5][1:] == locations[3:5]
    assert blocks[::2] == locations[::2] and blocks[4:2] == () and len(blocks[1:]) == 5
    assert [in_memory_here(b, HERE) for b in blocks[1:]] == \
        [in_memory_here(b, HERE) for b in locations[1:]]
    with pytest.raises(IndexError):
        blocks[6]
    assert blocks != locations[:-1] and blocks != locations[::-1]


def test_blocks_give_their_keys_and_places_from_the_columns(plane: Plane) -> None:
    ns, toks = scattered(plane)
    blocks = ns.lookup(toks, True).blocks
    assert isinstance(blocks, Blocks)
    for part in (blocks, blocks[2:5], blocks[4:2]):
        locations = tuple(part)
        assert block_keys(part) == [b.key for b in locations]
        assert block_places(part) == [(b.tier, b.node) for b in locations]
        assert block_keys(locations) == block_keys(part)
        assert block_places(locations) == block_places(part)
    assert len({tier for tier, _ in block_places(blocks)}) > 1  # the columns name other tiers
