"""The agent serving other nodes: pin blocks here so a peer pulls them in one transfer."""

from __future__ import annotations

import time
from collections.abc import Sequence

from cmx.actors.agent.demote import Demotion
from cmx.actors.agent.loads import LocalReads
from cmx.actors.agent.scheduler import Priority
from cmx.actors.agent.shared import Counters, NodeTiers
from cmx.doors import PinExtents, QuarantineKeys, ReserveSlots
from cmx.keys import BlockHash
from cmx.protocol import Staged
from cmx.tiers import Holds, Tier, node_tiers

__all__ = ["PeerServing"]


class PeerServing:
    def __init__(self, tiers: NodeTiers, reads: LocalReads, demotion: Demotion,
                 counters: Counters) -> None:
        self.tiers = tiers
        self.reads = reads
        self.demotion = demotion
        self.counters = counters

    def stage(self, keys: Sequence[BlockHash], owner: str) -> list[Staged | None]:
        """Pin each block in a memory arena here for ``owner`` (a peer agent), promoting NVMe
        blocks (and those of any other extents tier, fastest first) into DRAM. The pins are
        leases: a peer that dies before ``unstage`` holds them only until they expire."""
        start_time = time.perf_counter()
        out: list[Staged | None] = [None] * len(keys)
        # The memory tiers are asked at once; a block in several is read from the fastest.
        for tier, pins in self.tiers.pin_memory(keys, owner):
            unused = []  # pins of blocks staged from HBM already, or of an arena gone since
            for i, p in enumerate(pins):
                if p is None:
                    continue
                info = self.tiers.info(p.epoch)
                if out[i] is not None or info is None:
                    unused.append(p.lease)
                    continue
                out[i] = Staged(keys[i], tier, info.arena, p.slot, p.size, p.checksum, tier,
                                p.lease, p.namespace)
            if unused:
                self.tiers.give_back(tier, unpin=unused)
        todo = [i for i, s in enumerate(out) if s is None]
        for tier in node_tiers(Holds.EXTENTS):
            if not todo:
                break
            for i, s in self._promote(tier, [keys[i] for i in todo], owner).items():
                out[todo[i]] = s
            todo = [i for i in todo if out[i] is None]
        self.counters.latency["stage"].observe(time.perf_counter() - start_time)
        return out

    def unstage(self, staged: Sequence[Staged]) -> None:
        by_tier: dict[Tier, list[int]] = {}
        for s in staged:
            by_tier.setdefault(s.tier, []).append(s.lease)
        for tier, leases in by_tier.items():
            self.tiers.give_back(tier, unpin=leases)

    def quarantine_staged(self, staged: Sequence[Staged]) -> None:
        """A peer found these staged copies corrupt: drop them here."""
        by_tier: dict[Tier, list[BlockHash]] = {}
        for s in staged:
            by_tier.setdefault(s.tier, []).append(s.key)
        for tier, keys in by_tier.items():
            self.tiers.call(tier, QuarantineKeys(keys=keys))

    def quarantine_copies(self, keys: Sequence[BlockHash], tier: Tier) -> None:
        """A reader found the copies of ``tier`` here corrupt where it used them."""
        self.tiers.call(tier, QuarantineKeys(keys=list(keys)))

    def _promote(self, tier: Tier, keys: list[BlockHash], owner: str) -> dict[int, Staged]:
        """``tier`` (NVMe, an extents tier) -> DRAM for blocks a peer wants; each returned
        block is pinned in DRAM for ``owner``. The DRAM copy keeps the extent's namespace id
        (a drop finds it)."""
        tiers = self.tiers
        pins = tiers.call(tier, PinExtents(keys=keys, owner=tiers.owner))
        present = [(i, p) for i, p in enumerate(pins) if p is not None]
        grants = []
        try:
            grants = tiers.call(Tier.DRAM, ReserveSlots(
                items=[(keys[i], None) for i, _ in present], owner=tiers.owner))
            self.demotion.demote_victims(Tier.DRAM, grants)
            todo = [(i, p, g) for (i, p), g in zip(present, grants) if g is not None]
            good = self.reads.read(  # all at once, verified
                tier, [p for _, p, _ in todo], [g for _, _, g in todo], Priority.LOAD)
            ok = [t for t, fine in zip(todo, good) if fine]
            done = {g.lease for _, _, g in ok}
            tiers.give_back(Tier.DRAM, abort=[g.lease for g in grants
                                              if g is not None and g.lease not in done])
            grants = []
            repinned = tiers.commit_tagged(
                Tier.DRAM, [(p.tag, (g.lease, p.size, p.checksum)) for _, p, g in ok], True,
                owner)
            self.counters.count_move(f"{tier.value}->dram", tier.value,
                                     sum(p.size for _, p, _ in ok))
            regions = {rp.epoch: tiers.info(rp.epoch) for rp in repinned if rp is not None}
            return {
                i: Staged(g.key, Tier.DRAM, info.arena, rp.slot, rp.size, rp.checksum,
                          tier, rp.lease, rp.namespace)
                for (i, _, g), rp in zip(ok, repinned)
                if rp is not None and (info := regions[rp.epoch]) is not None
            }
        finally:
            tiers.give_back(Tier.DRAM, abort=[g.lease for g in grants if g is not None])
            tiers.give_back(tier, unpin=[p.lease for _, p in present])
