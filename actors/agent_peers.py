"""The agent serving other nodes: pin blocks here so a peer pulls them in one transfer."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from cmx.actors.agent_nvme import Extent, NvmeTransfers
from cmx.actors.arena_tier import Grant, Pinned
from cmx.actors.scheduler import Priority
from cmx.actors.transport import PeerInfo
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.protocol import Staged
from cmx.tiers import Tier

__all__ = ["PeerServing"]


class PeerServing(NvmeTransfers):
    # Provided by the class this one is combined with (Demotion); declared
    # here, without a value, so that it does not shadow that in the method order.
    _demote_victims: Callable[[Tier, Sequence[Grant | None]], None]
    _read_pinned: Callable[
        [Tier, Sequence[Pinned | Extent], Sequence[Grant], Priority], list[bool]]

    def stage(self, keys: Sequence[BlockHash], owner: str) -> list[Staged | None]:
        """Pin each block in a memory arena here for ``owner`` (a peer agent), promoting NVMe
        blocks into DRAM. The pins are leases: a peer that dies before ``unstage`` holds them
        only until they expire."""
        start_time = time.perf_counter()
        out: list[Staged | None] = [None] * len(keys)
        # Both memory tiers are asked at once; a block in both is read from HBM.
        for tier, pins in self._pin_memory(keys, owner):
            unused = []  # pins of blocks staged from HBM already, or of an arena gone since
            for i, p in enumerate(pins):
                if p is None:
                    continue
                if out[i] is not None or p.epoch not in self._epochs:
                    unused.append(p.lease)
                    continue
                region = self._epochs[p.epoch][0].arena
                out[i] = Staged(keys[i], tier, region, p.slot, p.size, p.checksum, tier, p.lease,
                                p.namespace)
            if unused:
                self._give_back(tier, unpin=unused)
        todo = [i for i, s in enumerate(out) if s is None]
        if todo:
            for i, s in self._promote([keys[i] for i in todo], owner).items():
                out[todo[i]] = s
        self.latency["stage"].observe(time.perf_counter() - start_time)
        return out

    def unstage(self, staged: Sequence[Staged]) -> None:
        by_tier: dict[Tier, list[int]] = {}
        for s in staged:
            by_tier.setdefault(s.tier, []).append(s.lease)
        for tier, leases in by_tier.items():
            self._give_back(tier, unpin=leases)

    def quarantine_staged(self, staged: Sequence[Staged]) -> None:
        """A peer found these staged copies corrupt: drop them here."""
        by_tier: dict[Tier, list[BlockHash]] = {}
        for s in staged:
            by_tier.setdefault(s.tier, []).append(s.key)
        for tier, keys in by_tier.items():
            self._call(tier, "quarantine", keys)

    def quarantine_copies(self, keys: Sequence[BlockHash], tier: Tier) -> None:
        """A reader found the copies of ``tier`` here corrupt where it used them."""
        self._call(tier, "quarantine", list(keys))

    def _promote(self, keys: list[BlockHash], owner: str) -> dict[int, Staged]:
        """NVMe -> DRAM for blocks a peer wants; each returned block is pinned in DRAM for
        ``owner``. The DRAM copy keeps the NVMe copy's namespace id (a drop finds it)."""
        pins = self._call(Tier.NVME, "pin", keys, self.owner)
        present = [(i, p) for i, p in enumerate(pins) if p is not None]
        grants = []
        try:
            grants = self._call(Tier.DRAM, "reserve", [(keys[i], None) for i, _ in present],
                                self.owner)
            self._demote_victims(Tier.DRAM, grants)
            todo = [(i, p, g) for (i, p), g in zip(present, grants) if g is not None]
            good = self._read_pinned(  # all at once, verified
                Tier.NVME, [p for _, p, _ in todo], [g for _, _, g in todo], Priority.LOAD)
            ok = [t for t, fine in zip(todo, good) if fine]
            done = {g.lease for _, _, g in ok}
            self._give_back(Tier.DRAM, abort=[g.lease for g in grants
                                              if g is not None and g.lease not in done])
            grants = []
            repinned = self._commit_tagged(
                Tier.DRAM, [(p.tag, (g.lease, p.size, p.checksum)) for _, p, g in ok], True,
                owner)
            self.moved["nvme->dram"] += sum(p.size for _, p, _ in ok)
            self.moved_via["nvme"] += sum(p.size for _, p, _ in ok)
            return {
                i: Staged(g.key, Tier.DRAM, self._epochs[rp.epoch][0].arena, rp.slot, rp.size,
                          rp.checksum, Tier.NVME, rp.lease, rp.namespace)
                for (i, _, g), rp in zip(ok, repinned)
                if rp is not None and rp.epoch in self._epochs
            }
        finally:
            self._give_back(Tier.DRAM, abort=[g.lease for g in grants if g is not None])
            self._give_back(Tier.NVME, unpin=[p.lease for _, p in present])

    def read_slots(self, slots: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """The fallback transport's server side: copies of whole slots of local arenas."""
        arenas = {info.arena: arena for info, arena in self._arenas.values()}
        missing = {region for region, _ in slots} - arenas.keys()
        if missing:
            raise UnavailableError(f"no region {sorted(missing)} here")
        return [arenas[region].slot_view(slot).copy() for region, slot in slots]

    def peer_info(self) -> PeerInfo:
        return self.transport.info()

