"""The agent's NVMe writes: the bytes of the NVMe tier, whose books live in the tier actor.

The tier reserves extents; the host's bytes write them. On a host (``HostBytes``: the NVMe
store's own parts, ``cmx.storage.nvme.dataplane.ExtentPlane``) a whole list goes per call, so
a demotion or a write-through keeps up to the I/O engine's ``queue_depth`` (16) I/Os in
flight instead of one block per agent worker. From a DPU (``dpu.agent.NixlHost``) each block
is one call to the host's endpoint (NIXL's POSIX backend there), one agent worker's job: at
most ``agent_workers`` blocks in flight. The tier's compaction copies go through here as
well (``move_extents``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from cmx.actors.agent.host import HostBytes
from cmx.actors.agent.shared import Counters, NodeTiers
from cmx.actors.tiers.arena import Pinned
from cmx.doors import CommitExtents, Pin, QuarantinePinned, ReserveExtents
from cmx.keys import BlockHash
from cmx.storage.nvme.dataplane import Extent, ExtentPlane
from cmx.tiers import Tier

__all__ = ["Extent", "NvmeWrites", "make_nvme_plane"]

log = logging.getLogger(__name__)


def make_nvme_plane() -> ExtentPlane:
    """The agent's NVMe data plane: the I/O engine the store's benchmarks measure."""
    return ExtentPlane()


class NvmeWrites:
    def __init__(self, tiers: NodeTiers, host: HostBytes, counters: Counters) -> None:
        self.tiers = tiers
        self.host = host
        self.counters = counters

    def move_extents(self, pairs: Sequence[tuple[Extent, Extent]]) -> list[bool | None]:
        """Compaction's copies, for the NVMe tier (which only decides them): each block from
        its old extent to its new one, verified; None for a block whose bytes failed."""
        done = self.host.copy_extents(pairs)
        self.counters.count_move("nvme->nvme", "nvme",
                                 sum(src.size for (src, _), ok in zip(pairs, done) if ok))
        return done

    def write(
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
        tiers = self.tiers
        mine: list[Pinned | None] = []  # pinned here, unpinned here
        if sources is None:
            if pins is None:
                pins = mine = tiers.call(tier, Pin(keys=[k for k, _, _ in items],
                                                   owner=tiers.owner))
            srcs = [self.host.slot_source(p.epoch, p.slot) if p is not None else None
                    for p in pins]
        else:
            srcs = list(sources)
        extents: list[Extent | None] = []
        try:
            t0 = time.perf_counter()
            wanted = [(k, parents.get(k), n, tags.get(k, "")) for k, n, _ in items]
            extents = tiers.call(Tier.NVME, ReserveExtents(items=wanted, owner=tiers.owner))
            todo = [(e, csum, src) for (_, _, csum), e, src in zip(items, extents, srcs)
                    if e is not None and src is not None]
            if not todo:  # every block is on NVMe already (write-through), or no room
                return changed
            t1 = time.perf_counter()
            sums = self.host.write_extents([t[0] for t in todo], [t[2] for t in todo])
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
            tiers.give_back(Tier.NVME, abort=[e.lease for e in extents
                                              if e is not None and e.lease not in done])
            extents = []
            tiers.call(Tier.NVME, CommitExtents(items=commits))
            latency = self.counters.latency
            latency["nvme_write"].observe(t2 - t1)
            latency["nvme_books"].observe(t1 - t0 + time.perf_counter() - t2)
            self.counters.count_move(f"{tier.value}->nvme", "nvme", sum(c[1] for c in commits))
            if bad := [p for p in pins or () if p is not None and p.key in changed]:
                tiers.call(tier, QuarantinePinned(pins=bad))  # while pinned: that copy goes
            return changed
        finally:
            tiers.give_back(Tier.NVME, abort=[e.lease for e in extents if e is not None])
            tiers.give_back(tier, unpin=[p.lease for p in mine if p is not None])
