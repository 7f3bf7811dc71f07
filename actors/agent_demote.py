"""The agent moving evicted blocks one tier down: HBM -> DRAM -> NVMe."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from cmx.actors.agent_base import AgentBase
from cmx.actors.arena_tier import Grant
from cmx.actors.scheduler import Priority
from cmx.keys import BlockHash
from cmx.storage.nvme.chunks import block_sums
from cmx.tiers import Tier

__all__ = ["Demotion"]

log = logging.getLogger(__name__)


class Demotion(AgentBase):
    def _demote_victims(self, tier: Tier, grants: Sequence[Grant | None]) -> None:
        """Move blocks evicted from ``tier`` one tier down before their slots are rewritten."""
        victims = [g for g in grants if g is not None and g.victim is not None]
        if not victims:
            return
        if tier is Tier.HBM:
            self._demote_to_dram(victims)
        elif tier is Tier.DRAM:
            items = [(g.victim.key, g.victim.size, g.victim.checksum) for g in victims]  # type: ignore[union-attr]
            parents = {g.victim.key: g.victim.parent for g in victims}  # type: ignore[union-attr]
            self._write_nvme(Tier.DRAM, items, parents, slots=[g.slot for g in victims])

    def _demote_to_dram(self, victims: list[Grant]) -> None:
        keys = [g.victim.key for g in victims]  # type: ignore[union-attr]
        have = self._call(Tier.DRAM, "contains", keys)
        todo = [g for g, h in zip(victims, have) if not h]
        if not todo:
            return
        grants = self._call(
            Tier.DRAM, "reserve", [(g.victim.key, g.victim.parent) for g in todo]  # type: ignore[union-attr]
        )
        self._demote_victims(Tier.DRAM, grants)
        _, hbm = self._arenas[Tier.HBM]
        _, dram = self._arenas[Tier.DRAM]
        commits = []
        for src, dst in zip(todo, grants):
            if dst is None:
                continue
            v = src.victim
            np.copyto(dram.slot_view(dst.slot)[: v.size], hbm.slot_view(src.slot)[: v.size])  # type: ignore[union-attr]
            commits.append((v.key, v.size, v.checksum))  # type: ignore[union-attr]
            self.moved["hbm->dram"] += v.size  # type: ignore[union-attr]
            self.moved_via["local"] += v.size  # type: ignore[union-attr]
        self._call(Tier.DRAM, "commit", commits)

    def _write_nvme(
        self, tier: Tier, items: Sequence[tuple[BlockHash, int, int | None]],
        parents: dict[BlockHash, BlockHash | None], slots: Sequence[int] | None = None,
    ) -> None:
        """Write blocks of ``tier``'s arena to NVMe (slots given, or pinned by key)."""
        if not items:
            return
        extents = self._call(
            Tier.NVME, "reserve", [(k, parents.get(k), n) for k, n, _ in items]
        )
        _, arena = self._arenas[tier]
        if slots is None:
            pins = self._call(tier, "pin", [k for k, _, _ in items])
            slot_of = [p.slot if p is not None else None for p in pins]
        else:
            pins, slot_of = None, list(slots)
        try:
            futures = []
            for (key, size, csum), ext, slot in zip(items, extents, slot_of):
                if ext is None or slot is None:
                    continue
                src = arena.slot_view(slot)
                futures.append((key, size, csum, src, self.scheduler.submit(
                    Priority.DEMOTE, lambda ext=ext, src=src: self.nvme.write(ext, src))))
            commits = []
            for key, size, csum, src, fut in futures:
                fut.result()
                whole, chunk_sums = block_sums(src[:size])
                if csum is not None and csum != whole:
                    log.warning("block %s changed in %s; not demoted", key.hex()[:12], tier.value)
                    continue
                commits.append((key, size, whole, chunk_sums))
            self._call(Tier.NVME, "commit", commits)
            self.moved[f"{tier.value}->nvme"] += sum(c[1] for c in commits)
            self.moved_via["nvme"] += sum(c[1] for c in commits)
        finally:
            if pins is not None:
                self._call(tier, "unpin", [p.key for p in pins if p is not None])

