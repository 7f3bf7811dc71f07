"""NvmeStore.put_many: many blocks' writes in flight at once, the same books as put."""

from __future__ import annotations

import numpy as np
import pytest

from cmx.buffers import aligned_empty
from cmx.errors import BlockTooLargeError
from cmx.keys import block_hash
from cmx.storage import NvmeStore

BLOCK = 64 * 1024


def key(i: int) -> bytes:
    return block_hash(b"put-many", np.array([i], dtype="<u4"))


def aligned(seed: int, n: int = BLOCK) -> np.ndarray:
    buf = aligned_empty(n)
    buf[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return buf


def test_put_many_stores_aligned_and_unaligned_blocks_and_survives_reopen(tmp_path) -> None:
    store = NvmeStore(tmp_path, capacity_bytes=64 * BLOCK, block_bytes=BLOCK)
    odd = np.random.default_rng(9).integers(0, 256, BLOCK - 100, dtype=np.uint8)
    items = [(key(i), aligned(i), key(i - 1) if i else None) for i in range(8)]
    items.append((key(8), odd, key(7)))
    assert store.put_many(items) == [True] * 9
    assert store.put_many(items[:2]) == [False, False]  # already there: nothing changes
    store.check_integrity()
    store.close()
    store = NvmeStore(tmp_path, capacity_bytes=64 * BLOCK, block_bytes=BLOCK)
    for k, data, _ in items:
        assert np.array_equal(store.get(k), data)
    store.check_integrity()
    store.close()


def test_put_many_rejects_an_oversized_block_before_writing_anything(tmp_path) -> None:
    store = NvmeStore(tmp_path, capacity_bytes=64 * BLOCK, block_bytes=BLOCK)
    with pytest.raises(BlockTooLargeError):
        store.put_many([(key(1), aligned(1), None), (key(2), aligned(2, 2 * BLOCK), None)])
    assert len(store) == 0
    store.check_integrity()
    store.close()
