"""A pool node's side of a partial load: the selected bytes of blocks it holds.

A block in the node's staging arena is checked whole against its checksum and sliced; one only
on its NVMe is read as the chunks that cover the selection (``ExtentSlices``), without
staging it: a partial load leaves the pool's cache as it found it. A copy that fails is
quarantined and answered None.

Over NIXL (``PoolExposure``) the same copies are exposed instead of sent (``slices.expose``):
a staged block stays pinned under a reader's lease and its runs are exposed in place; a
block only on NVMe has its covering chunks read and its selection gathered into an outbox
slot leased to the reader.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from cmx.actors.slices.expose import (
    ExposedSlice,
    Exposure,
    SliceOutbox,
    exposed_ranges,
    selection_checksum,
)
from cmx.actors.slices.reads import ExtentSlices, slice_memory
from cmx.actors.tiers.leases import LeaseKind, Leases
from cmx.checksum import checksum
from cmx.errors import BlockStateError
from cmx.keys import BlockHash
from cmx.selection import Runs, SlicedBlock
from cmx.storage.dram import DramStore
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.storage.nvme.extents import ExtentBooks
from cmx.tiers import Tier

__all__ = ["PoolExposure", "pool_selection"]


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


def _from_nvme(store: ExtentBooks, io: ExtentPlane, key: BlockHash, runs: Runs,
               out: np.ndarray | None = None) -> np.ndarray | None:
    if not store.pin(key):
        return None
    bad: tuple[str, int] | None = None  # where the copy read lies, if it failed
    try:
        entry = store.entry_of(key)
        if entry is None:
            return None
        ext = Extent(key, store.segment_path(entry.seg), entry.offset, entry.length,
                     entry.checksum, 0, entry.chunk_sums)
        data = ExtentSlices(io).read(ext, runs, out)
        bad = (ext.path, ext.offset) if data is None else None
        return data
    finally:
        if key in store:
            store.unpin(key)
        if bad is not None:
            store.quarantine(key, bad)  # that copy: one written since stays


class PoolExposure:
    """A pool node's selections exposed for readers over NIXL. ``unstage_later(key)`` is the
    pool's undo of a reader's pin of a staged block (as its ``stage`` grants)."""

    def __init__(self, node: str, staging: DramStore, store: ExtentBooks, io: ExtentPlane,
                 leases: Leases, outbox: Callable[[], SliceOutbox],
                 unstage_later: Callable[[BlockHash], Callable[[int], None]]) -> None:
        self.node = node
        self.staging = staging
        self.store = store
        self.io = io
        self.leases = leases
        self.outbox = outbox
        self.unstage_later = unstage_later

    def expose(self, keys: Sequence[BlockHash], runs: Runs, owner: str) -> Exposure:
        self.leases.expire()
        out: list[ExposedSlice | None] = []
        later: list[int] = []
        for i, key in enumerate(keys):
            e = self._staged(key, runs, owner)
            if e is None and key in self.store:
                box = self.outbox()
                took = box.take(owner, key)
                if took is None:
                    later.append(i)
                else:
                    e = self._nvme_into(box, took[0], took[1], key, runs)
            out.append(e)
        return Exposure(tuple(out), tuple(later))

    def release(self, exposed: Sequence[ExposedSlice]) -> None:
        box = self.outbox()
        box.end([e.lease for e in exposed if e.region == box.region.name])
        self.leases.end([e.lease for e in exposed if e.region != box.region.name])

    def _staged(self, key: BlockHash, runs: Runs, owner: str) -> ExposedSlice | None:
        if not self.staging.pin(key):
            return None
        ref = self.staging.locate(key)
        view = self.staging.view(key)
        if ref is None or view is None or ref.checksum is None or checksum(view) != ref.checksum:
            try:
                self.staging.unpin(key)
                if ref is not None:  # corrupt: the NVMe copy is asked next
                    self.staging.delete(key)
            except BlockStateError:
                pass  # gone, or pinned by another reader: the next to find it corrupt drops it
            return None
        arena = self.staging.arena
        lease = self.leases.grant(owner, LeaseKind.PIN, key, self.unstage_later(key))
        return ExposedSlice(key, arena.name, exposed_ranges(ref.slot * arena.slot_bytes, runs),
                            selection_checksum(view, runs), Tier.POOL, lease)

    def _nvme_into(self, box: SliceOutbox, slot: int, lease: int, key: BlockHash,
                   runs: Runs) -> ExposedSlice | None:
        try:
            data = _from_nvme(self.store, self.io, key, runs, box.view(slot))
        except BaseException:
            box.end([lease])
            raise
        if data is None:
            box.end([lease])
            return None
        return ExposedSlice(key, box.region.name, ((box.offset(slot), data.nbytes),),
                            checksum(data), Tier.POOL, lease)
