"""The agent's NVMe data path: the bytes of the NVMe tier, whose books live in the tier actor.

The tier pins (reads) or reserves (writes) extents; the agent moves their bytes with the
NVMe store's own parts (``cmx.storage.nvme.dataplane.ExtentPlane``: ``BlockReader`` over
``ExtentIo``), a whole list of extents per call, so a prefix, a promotion for a peer or a
demotion keeps ``queue_depth`` I/Os in flight instead of one block per agent worker. The
tier's compaction copies go through here as well (``move_extents``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from cmx.actors.agent_base import AgentBase
from cmx.actors.arena_tier import Pinned
from cmx.actors.scheduler import Priority
from cmx.keys import BlockHash
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.tiers import Tier

__all__ = ["Extent", "NvmeTransfers", "make_nvme_plane"]

log = logging.getLogger(__name__)


def make_nvme_plane() -> ExtentPlane:
    """The agent's NVMe data plane: the I/O engine the store's benchmarks measure."""
    return ExtentPlane()


class NvmeTransfers(AgentBase):
    def _read_extents(self, extents: Sequence[Extent], dsts: Sequence[np.ndarray],
                      priority: Priority) -> list[bool]:
        """Read pinned NVMe extents into ``dsts``, all in one job of the scheduler's class
        ``priority``; per block whether it checked out. A block that did not is quarantined
        at the tier (a miss here, never served)."""
        if not extents:
            return []
        ok: list[bool] = self.scheduler.submit(
            priority, lambda: self.nvme.read_many(extents, dsts)).result()
        if bad := [e for e, good in zip(extents, ok) if not good]:
            log.warning("%d NVMe blocks failed their checksum; quarantined", len(bad))
            self.corrupt["nvme"] += len(bad)
            self._call(Tier.NVME, "quarantine_extents", bad)  # these copies, not their keys
        return ok

    def move_extents(self, pairs: Sequence[tuple[Extent, Extent]]) -> list[bool | None]:
        """Compaction's copies, for the NVMe tier (which only decides them): each block from
        its old extent to its new one, verified; None for a block whose bytes failed."""
        done = self._copy_extents(pairs)
        moved = sum(src.size for (src, _), ok in zip(pairs, done) if ok)
        self.moved["nvme->nvme"] += moved
        self.moved_via["nvme"] += moved
        return done

    def _copy_extents(self, pairs: Sequence[tuple[Extent, Extent]]) -> list[bool | None]:
        """Compaction's copies through this agent's own NVMe plane."""
        return self.nvme.copy_many(pairs)

    def _write_nvme(
        self, tier: Tier, items: Sequence[tuple[BlockHash, int, int | None]],
        parents: dict[BlockHash, BlockHash | None], tags: dict[BlockHash, str],
        sources: Sequence[Any] | None = None, pins: Sequence[Pinned | None] | None = None,
    ) -> list[BlockHash]:
        """Write blocks to NVMe: from ``sources`` (slots of ``tier``'s arena whose blocks are
        no longer in it), from the caller's ``pins`` of them in ``tier`` (the caller ends
        them), or else pinned in ``tier`` by key here. All the writes are in flight at once;
        a block whose bytes do not match ``items``' checksum is not committed, and a copy
        pinned in ``tier`` is quarantined there. ``tags``: namespace ids, kept on disk with
        the blocks. Returns the keys of the blocks whose bytes did not match."""
        changed: list[BlockHash] = []
        if not items:
            return changed
        mine: list[Pinned | None] = []  # pinned here, unpinned here
        if sources is None:
            if pins is None:
                pins = mine = self._call(tier, "pin", [k for k, _, _ in items], self.owner)
            srcs = [self._slot_source(p.epoch, p.slot) if p is not None else None for p in pins]
        else:
            srcs = list(sources)
        extents: list[Extent | None] = []
        try:
            t0 = time.perf_counter()
            wanted = [(k, parents.get(k), n, tags.get(k, "")) for k, n, _ in items]
            extents = self._call(Tier.NVME, "reserve", wanted, self.owner)
            todo = [(e, csum, src) for (_, _, csum), e, src in zip(items, extents, srcs)
                    if e is not None and src is not None]
            if not todo:  # every block is on NVMe already (write-through), or no room
                return changed
            t1 = time.perf_counter()
            sums = self._write_extents([t[0] for t in todo], [t[2] for t in todo])
            t2 = time.perf_counter()
            commits = []
            for (ext, csum, _), (whole, chunk_sums) in zip(todo, sums):
                if csum is not None and csum != whole:
                    log.warning("block %s changed in %s; not demoted", ext.key.hex()[:12],
                                tier.value)
                    changed.append(BlockHash(ext.key))
                    continue
                commits.append((ext.lease, ext.size, whole, chunk_sums))
            done = {c[0] for c in commits}
            self._give_back(Tier.NVME, abort=[e.lease for e in extents
                                              if e is not None and e.lease not in done])
            extents = []
            self._call(Tier.NVME, "commit", commits)
            self.latency["nvme_write"].observe(t2 - t1)
            self.latency["nvme_books"].observe(t1 - t0 + time.perf_counter() - t2)
            self.moved[f"{tier.value}->nvme"] += sum(c[1] for c in commits)
            self.moved_via["nvme"] += sum(c[1] for c in commits)
            if bad := [p for p in pins or () if p is not None and p.key in changed]:
                self._call(tier, "quarantine_pinned", bad)  # while pinned: that copy goes
            return changed
        finally:
            self._give_back(Tier.NVME, abort=[e.lease for e in extents if e is not None])
            self._give_back(tier, unpin=[p.lease for p in mine if p is not None])

    def _slot_source(self, epoch: str, slot: int) -> Any:
        """What an NVMe write reads a memory slot's bytes from: the slot, mapped here."""
        return self._arena(epoch).slot_view(slot)

    def _write_extents(self, extents: Sequence[Extent], sources: Sequence[Any]
                       ) -> list[tuple[int, bytes]]:
        """Write each source's front to its extent, all in flight at once; per block its
        checksums (block, chunks)."""
        return self.scheduler.submit(
            Priority.DEMOTE, lambda: self.nvme.write_many(extents, sources)).result()
