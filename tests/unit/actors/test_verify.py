"""Bytes are verified where they are used: a corrupt copy is a miss and is quarantined at its
source, so it is never offered again."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from plane import NODE_A, NODE_B, Plane, make_plane
from scenarios import BLOCK, LAYOUT, blocks, check, load, small_config

from cmx.actors.agent.core import OffloadAgent
from cmx.client.copy_out import copy_verified
from cmx.keys import BlockHash
from cmx.tiers import Tier


@pytest.fixture
def plane(tmp_path) -> Iterator[Plane]:
    p = make_plane(small_config(tmp_path))
    yield p
    p.close()


def corrupt(plane: Plane, node: str, tier: Tier, key: BlockHash) -> None:
    """Flip one byte of a memory tier's copy of ``key``, behind the tier's back."""
    svc = plane.tiers[(node, tier)]
    ref = svc.store.locate(key)
    svc.store.arena.slot_view(ref.slot)[100] ^= 0xFF


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (random payload bytes make NaNs, which equal nothing)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def offered(plane: Plane, key: BlockHash) -> set[tuple[Tier, str]]:
    return {(c.tier, c.node) for c in plane.lookup([key])[0]}


def test_a_corrupt_peer_copy_is_quarantined_and_never_returned(plane: Plane) -> None:
    keys, payload = blocks(3, seed=51)
    plane.agents[NODE_B].store(keys, [None, *keys[:-1]], payload)
    corrupt(plane, NODE_B, Tier.DRAM, keys[1])
    data, loaded = load(plane, NODE_A, keys)
    assert len(loaded) == 1 and np.array_equal(data, payload[:BLOCK])
    assert keys[1] not in plane.tiers[(NODE_B, Tier.DRAM)].store
    assert (Tier.DRAM, NODE_B) not in offered(plane, keys[1])
    assert plane.tiers[(NODE_B, Tier.DRAM)].stats().store.quarantined == 1
    for _ in range(2):  # never offered again: a miss from then on
        data, loaded = load(plane, NODE_A, keys[1:])
        assert loaded == []
    check(plane)


def test_the_consumer_finds_a_block_corrupted_after_it_was_verified(plane: Plane) -> None:
    """A DRAM copy that went bad after it was stored: the reader's check catches it, and
    both the HBM copy it read and the DRAM copy that one came from are dropped."""
    agent: OffloadAgent = plane.agents[NODE_A]
    keys, payload = blocks(2, seed=52)
    agent.store(keys, [None, keys[0]], payload)
    corrupt(plane, NODE_A, Tier.DRAM, keys[1])
    result = agent.load(keys, plane.lookup(keys))
    arena = agent.tiers.current(Tier.HBM)[1]
    out = torch.zeros(LAYOUT.shape(2 * LAYOUT.block_tokens), dtype=LAYOUT.torch_dtype())
    intact, bad = copy_verified(LAYOUT, arena, result.blocks, out, 0)
    assert intact == 1 and [b.key for b in bad] == [keys[1]]
    first = LAYOUT.from_payload(payload[:BLOCK])
    assert same_bits(out[:, :, :, : LAYOUT.block_tokens], first)
    assert not out[:, :, :, LAYOUT.block_tokens :].any()  # nothing of the bad block used
    agent.release([b.lease for b in result.blocks], bad)
    assert offered(plane, keys[1]) == set()
    assert keys[1] not in plane.tiers[(NODE_A, Tier.HBM)].store
    assert keys[1] not in plane.tiers[(NODE_A, Tier.DRAM)].store
    check(plane)


def test_a_copy_quarantined_while_pinned_goes_at_its_last_unpin(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    keys, payload = blocks(1, seed=53)
    agent.store(keys, [None], payload)
    dram = plane.tiers[(NODE_A, Tier.DRAM)]
    (pin,) = dram.pin(keys, "client:x")
    assert dram.quarantine(keys) == 1
    assert dram.pin(keys, "client:y") == [None]  # nobody new reads it
    assert keys[0] in dram.store
    dram.unpin([pin.lease])
    assert keys[0] not in dram.store and offered(plane, keys[0]) == set()
    check(plane)


def test_copy_verified_uses_nothing_past_a_bad_block(plane: Plane) -> None:
    agent = plane.agents[NODE_A]
    keys, payload = blocks(3, seed=54)
    agent.store(keys, [None, *keys[:-1]], payload)
    result = agent.load(keys, plane.lookup(keys))
    arena = agent.tiers.current(Tier.HBM)[1]
    arena.slot_view(result.blocks[0].slot)[0] ^= 1  # the first block is bad
    out = torch.zeros(LAYOUT.shape(3 * LAYOUT.block_tokens), dtype=LAYOUT.torch_dtype())
    intact, bad = copy_verified(LAYOUT, arena, result.blocks, out, 0)
    assert (intact, [b.key for b in bad]) == (0, [keys[0]])
    assert not out.any()
    agent.release([b.lease for b in result.blocks], bad)
    data, loaded = load(plane, NODE_A, keys)
    assert loaded == []  # its only copies were in HBM and DRAM: both dropped
    assert BLOCK == payload.nbytes // 3
    check(plane)
