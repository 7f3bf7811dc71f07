"""Blocks to store from, for the suites that drive a store directly: distinct chained keys,
and a pool of page-aligned random payloads (several, so consecutive puts differ)."""

from __future__ import annotations

import numpy as np

from cmx.bench.harness.core import MiB
from cmx.buffers import aligned_empty
from cmx.keys import BlockHash, block_hash

__all__ = ["POOL_BYTES", "block_keys", "payload_pool"]

POOL_BYTES = 256 * MiB  # a pool's bytes in all, by default


def block_keys(n: int, salt: bytes) -> list[BlockHash]:
    """``n`` distinct chained keys (the token ids are just the block index)."""
    keys, parent = [], salt
    for i in range(n):
        parent = block_hash(parent, np.array([i], dtype="<u4"))
        keys.append(parent)
    return keys


def payload_pool(block_bytes: int, total: int = POOL_BYTES) -> list[np.ndarray]:
    """Page-aligned random blocks to put from; several, so consecutive puts differ."""
    rng = np.random.default_rng(1)
    pool = []
    for _ in range(max(2, min(64, total // block_bytes))):
        buf = aligned_empty(block_bytes)
        buf[:] = rng.integers(0, 256, size=block_bytes, dtype=np.uint8)
        pool.append(buf)
    return pool
