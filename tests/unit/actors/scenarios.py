"""What the plane's scenario tests share: a small layout, blocks, loads, restarts, checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from plane import Plane

from cmx.actors.tiers.arena import ArenaTierService
from cmx.actors.tiers.books import make_books
from cmx.config import ServiceConfig
from cmx.keys import BlockHash, Namespace, chain_keys
from cmx.layout import KVLayout
from cmx.links import actor_name
from cmx.protocol import Loaded
from cmx.tiers import Tier, tier_spec

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float16", block_tokens=16)
BLOCK = LAYOUT.block_bytes  # 8 KiB
LEASE_S = 30.0


def small_config(root: Path, **changes: object) -> ServiceConfig:
    """HBM of 4 blocks, DRAM of 8, NVMe of 256: every path is a few blocks away."""
    return ServiceConfig(
        block_bytes=BLOCK, hbm_bytes=4 * BLOCK, dram_bytes=8 * BLOCK, nvme_bytes=256 * BLOCK,
        nvme_dir=str(root), nvme_segment_bytes=16 * BLOCK, directory_shards=2, lease_s=LEASE_S,
    ).replace(**changes)


def blocks(n: int, seed: int) -> tuple[list[BlockHash], np.ndarray]:
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 1000, n * LAYOUT.block_tokens)
    keys = chain_keys(Namespace("m", LAYOUT).digest, toks, LAYOUT.block_tokens)
    return keys, rng.integers(0, 256, n * BLOCK, dtype=np.uint8)


def load(plane: Plane, node: str, keys: list[BlockHash]) -> tuple[np.ndarray, list[Loaded]]:
    """A load as a client does it: read the pinned HBM slots, then release them."""
    agent = plane.agents[node]
    result = agent.load(keys, plane.lookup(keys))
    _, hbm = agent.tiers.current(Tier.HBM)
    data = np.concatenate(
        [hbm.slot_view(b.slot)[: b.size] for b in result.blocks] or [np.empty(0, np.uint8)]
    ).copy()
    agent.release([b.lease for b in result.blocks])
    return data, result.blocks


def restart_tier(plane: Plane, node: str, tier: Tier) -> ArenaTierService:
    """A fresh incarnation of a memory tier in place of the running one (as Ray restarts a
    dead actor): a new epoch, a new arena, empty."""
    svc = make_books(tier_spec(tier), node, plane.config, plane.link, clock=plane.clock)
    assert isinstance(svc, ArenaTierService)
    plane.link._targets[actor_name(tier.value, node)] = svc  # type: ignore[index]
    plane.tiers[(node, tier)] = svc
    return svc


def held(plane: Plane, node: str, tier: Tier) -> tuple[int, int]:
    """(pinned blocks, reserved blocks) of a tier: what nobody may leave behind."""
    stats = plane.tiers[(node, tier)].stats()
    return stats.pinned, stats.reserved


def check(plane: Plane) -> None:
    for tier in plane.tiers.values():
        tier.check_integrity()
    for shard in plane.shards:
        shard.check_integrity()


class Sent:
    """Every entry each shard was sent (applied or resynced), as (key, stored)."""

    def __init__(self, plane: Plane, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entries: list[tuple[bytes, bool]] = []
        for shard in plane.shards:
            for method in ("apply", "resync"):
                monkeypatch.setattr(shard, method, self._noting(getattr(shard, method)))

    def _noting(self, call: Any) -> Any:
        def noted(source: Any, epoch: str, seq: int, entries: Any) -> Any:
            entries = list(entries)
            self.entries += [(bytes(e.key), e.stored) for e in entries]
            return call(source, epoch, seq, entries)
        return noted

    def of(self, key: bytes) -> list[tuple[bytes, bool]]:
        return [e for e in self.entries if e[0] == key]
