"""The agent serving other nodes: pin blocks here so a peer pulls them in one transfer."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from cmx.actors.agent_base import AgentBase
from cmx.actors.arena_tier import Grant, Pinned
from cmx.actors.scheduler import Priority
from cmx.actors.transport import PeerInfo
from cmx.actors.wire import Staged
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.tiers import Tier

__all__ = ["PeerServing"]


class PeerServing(AgentBase):
    def stage(self, keys: Sequence[BlockHash]) -> list[Staged | None]:
        """Pin each block in a memory arena here, promoting NVMe blocks into DRAM."""
        start_time = time.perf_counter()
        out: list[Staged | None] = [None] * len(keys)
        # Both memory tiers are asked at once; a block in both is read from HBM.
        tiers = (Tier.HBM, Tier.DRAM)
        answers = self._call_many([(tier, "pin", (list(keys),)) for tier in tiers])
        twice: list[BlockHash] = []
        for tier, pins in zip(tiers, answers):
            info, _ = self._arenas[tier]
            for i, p in enumerate(pins):
                if p is None:
                    continue
                if out[i] is not None:
                    twice.append(keys[i])
                    continue
                out[i] = Staged(keys[i], tier, info.arena, p.slot, p.size, p.checksum or 0, tier)
        if twice:
            self._call(Tier.DRAM, "unpin", twice)
        todo = [i for i, s in enumerate(out) if s is None]
        if todo:
            for i, s in self._promote([keys[i] for i in todo]).items():
                out[todo[i]] = s
        self.latency["stage"].observe(time.perf_counter() - start_time)
        return out

    def unstage(self, staged: Sequence[Staged]) -> None:
        by_tier: dict[Tier, list[BlockHash]] = {}
        for s in staged:
            by_tier.setdefault(s.tier, []).append(s.key)
        for tier, keys in by_tier.items():
            self._call(tier, "unpin", keys)

    def _promote(self, keys: list[BlockHash]) -> dict[int, Staged]:
        """NVMe -> DRAM for blocks a peer wants; each returned block is pinned in DRAM."""
        pins = self._call(Tier.NVME, "pin", keys)
        present = [(i, p) for i, p in enumerate(pins) if p is not None]
        try:
            grants = self._call(Tier.DRAM, "reserve", [(keys[i], None) for i, _ in present])
            self._demote_victims(Tier.DRAM, grants)
            info, dram = self._arenas[Tier.DRAM]
            ok: list[tuple[int, Pinned, Grant]] = []
            for (i, p), g in zip(present, grants):
                if g is None:
                    continue
                dst = dram.slot_view(g.slot)
                if self.scheduler.submit(
                    Priority.LOAD, lambda p=p, dst=dst: self._read_local(Tier.NVME, p, dst)
                ).result():
                    ok.append((i, p, g))
                else:
                    self._call(Tier.DRAM, "abort", [g.key])
            self._call(Tier.DRAM, "commit", [(g.key, p.size, p.checksum) for _, p, g in ok])
            self.moved["nvme->dram"] += sum(p.size for _, p, _ in ok)
            self.moved_via["nvme"] += sum(p.size for _, p, _ in ok)
            repinned = self._call(Tier.DRAM, "pin", [g.key for _, _, g in ok])
            return {
                i: Staged(g.key, Tier.DRAM, info.arena, rp.slot, rp.size, rp.checksum or 0,
                          Tier.NVME)
                for (i, _, g), rp in zip(ok, repinned) if rp is not None
            }
        finally:
            self._call(Tier.NVME, "unpin", [p.key for _, p in present])

    def read_slots(self, slots: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """The fallback transport's server side: copies of whole slots of local arenas."""
        arenas = {info.arena: arena for info, arena in self._arenas.values()}
        missing = {region for region, _ in slots} - arenas.keys()
        if missing:
            raise UnavailableError(f"no region {sorted(missing)} here")
        return [arenas[region].slot_view(slot).copy() for region, slot in slots]

    def peer_info(self) -> PeerInfo:
        return self.transport.info()

