"""A pool node's side of a partial load: the selected bytes of blocks it holds.

A block in the node's staging arena is checked whole against its checksum and sliced; one only
on its NVMe is read as the chunks that cover the selection (``ExtentSlices``), without
staging it: a partial load leaves the pool's cache as it found it. A copy that fails is
quarantined and answered None.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cmx.actors.slice_reads import ExtentSlices, slice_memory
from cmx.checksum import checksum
from cmx.errors import BlockStateError
from cmx.keys import BlockHash
from cmx.selection import Runs, SlicedBlock
from cmx.storage.dram import DramStore
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.storage.nvme.extents import ExtentBooks
from cmx.tiers import Tier

__all__ = ["pool_selection"]


def pool_selection(node: str, staging: DramStore, store: ExtentBooks, io: ExtentPlane,
                   keys: Sequence[BlockHash], runs: Runs) -> list[SlicedBlock | None]:
    """Selections of ``keys`` from a pool node's staging arena or NVMe (None for a miss or a
    corrupt copy, which is quarantined)."""
    out: list[SlicedBlock | None] = []
    for key in keys:
        data = _from_staging(staging, key, runs)
        if data is None:
            data = _from_nvme(store, io, key, runs)
        out.append(None if data is None
                   else SlicedBlock(key, data, checksum(data), Tier.POOL, node))
    return out


def _from_staging(staging: DramStore, key: BlockHash, runs: Runs) -> np.ndarray | None:
    if not staging.pin(key):
        return None
    bad = False
    try:
        ref = staging.locate(key)
        view = staging.view(key)
        if ref is None or view is None or ref.checksum is None:
            return None
        data = slice_memory(view, ref.checksum, runs)
        bad = data is None
        return data
    finally:
        try:
            staging.unpin(key)
        except BlockStateError:
            pass
        if bad:
            staging.delete(key)


def _from_nvme(store: ExtentBooks, io: ExtentPlane, key: BlockHash,
               runs: Runs) -> np.ndarray | None:
    if not store.pin(key):
        return None
    bad: tuple[str, int] | None = None  # where the copy read lies, if it failed
    try:
        entry = store.entry_of(key)
        if entry is None:
            return None
        ext = Extent(key, store.segment_path(entry.seg), entry.offset, entry.length,
                     entry.checksum, 0, entry.chunk_sums)
        data = ExtentSlices(io).read(ext, runs)
        bad = (ext.path, ext.offset) if data is None else None
        return data
    finally:
        if key in store:
            store.unpin(key)
        if bad is not None:
            store.quarantine(key, bad)  # that copy: one written since stays
