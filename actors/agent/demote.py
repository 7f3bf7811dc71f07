"""The agent moving evicted blocks one tier down: HBM -> DRAM -> NVMe.

A scan (a load of more blocks than this node's HBM and DRAM hold together, ``Loads.is_scan``)
does not demote to DRAM the HBM blocks its windows evict that this node's NVMe holds: the scan
would evict them from DRAM in turn before it ends, each taking the place of a DRAM block first,
and their NVMe copy stays, committed. A victim NVMe does not hold is demoted as ever.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cmx.actors.agent.host import HostBytes
from cmx.actors.agent.nvme import NvmeWrites
from cmx.actors.agent.shared import Counters, NodeTiers
from cmx.actors.tiers.arena import Grant, Victim
from cmx.doors import Commit, Contains, ReserveSlots
from cmx.errors import CmxError
from cmx.keys import BlockHash
from cmx.policies.admission import AdmissionPolicy
from cmx.policies.placement import PlacementPolicy
from cmx.tiers import Tier

__all__ = ["Demotion"]

log = logging.getLogger(__name__)


class Demotion:
    def __init__(self, tiers: NodeTiers, host: HostBytes, nvme: NvmeWrites, counters: Counters,
                 placement: PlacementPolicy, nvme_admission: AdmissionPolicy) -> None:
        self.tiers = tiers
        self.host = host
        self.nvme = nvme
        self.counters = counters
        self.placement = placement  # write-through or write-back, over DRAM then NVMe
        self.nvme_admission = nvme_admission  # which blocks DRAM may write to NVMe

    def demote_victims(self, tier: Tier, grants: Sequence[Grant | None]) -> None:
        """Move blocks evicted from ``tier`` one tier down before their slots are rewritten.

        A demotion that fails drops its blocks (a cache may always drop one): the caller's
        write into the slots goes on, and nothing granted on the way is left held."""
        self._demote(tier, grants, scan=False)

    def demote_scan_victims(self, grants: Sequence[Grant | None]) -> None:
        """``demote_victims`` of the HBM grants of a scan's window: those this node's NVMe
        holds stay there alone."""
        self._demote(Tier.HBM, grants, scan=True)

    def _demote(self, tier: Tier, grants: Sequence[Grant | None], scan: bool) -> None:
        victims = [(g, g.victim) for g in grants if g is not None and g.victim is not None]
        if not victims:
            return
        try:
            if tier is Tier.HBM:
                self._demote_to_dram(victims, scan)
            elif tier is Tier.DRAM:
                victims = [(g, v) for g, v in victims if self.placed_below(v.key)]
                items = [(v.key, v.size, v.checksum) for _, v in victims]
                parents = {v.key: v.parent for _, v in victims}
                tags = {v.key: v.namespace for _, v in victims}
                self.nvme.write(Tier.DRAM, items, parents, tags,
                                sources=[self.host.slot_source(g.epoch, g.slot)
                                         for g, _ in victims])
        except (CmxError, OSError) as exc:  # OSError: the NVMe disk failed or filled
            self.counters.dropped["demotion_failed"] += len(victims)
            log.warning("demotion of %d blocks from %s failed: %s", len(victims), tier.value, exc)

    def placed_below(self, key: BlockHash) -> bool:
        """Whether a block DRAM evicts goes to NVMe: the placement's rule, with NVMe admission
        (a block seen fewer than ``nvme_admission_min_count`` times is dropped)."""
        admitted = self.nvme_admission.admit(key)
        if self.placement.on_evict(Tier.DRAM, admitted, has_lower_copy=False) is Tier.NVME:
            return True
        self.counters.dropped["not_admitted_to_nvme"] += 1
        return False

    def _demote_to_dram(self, victims: list[tuple[Grant, Victim]], scan: bool) -> None:
        """Each (HBM grant, the victim in its slot) into DRAM, unless DRAM holds it (or, for
        a scan, NVMe does)."""
        tiers = self.tiers
        todo = [gv for gv, h in zip(victims, self._held_below(victims, scan)) if not h]
        if not todo:
            return
        grants = tiers.call(Tier.DRAM, ReserveSlots(
            items=[(v.key, v.parent) for _, v in todo], owner=tiers.owner))
        try:
            self.demote_victims(Tier.DRAM, grants)
            commits: dict[str, list[tuple[int, int, int | None]]] = {}  # by namespace id
            for (src, v), dst in zip(todo, grants):
                if dst is None:
                    continue
                self.host.copy_slot(src, dst, v.size)
                commits.setdefault(v.namespace, []).append((dst.lease, v.size, v.checksum))
                self.counters.count_move("hbm->dram", "local", v.size)
        except BaseException:
            tiers.give_back(Tier.DRAM, abort=[g.lease for g in grants if g is not None])
            raise
        for namespace, done in commits.items():  # the tag goes down with the block
            tiers.call(Tier.DRAM, Commit(items=done, namespace=namespace))

    def _held_below(self, victims: list[tuple[Grant, Victim]], scan: bool) -> list[bool]:
        """Per victim, whether DRAM holds it, or for a scan NVMe does: both asked at once. An
        NVMe tier that does not answer holds nothing here (its victims go to DRAM)."""
        keys = [v.key for _, v in victims]
        calls = [(Tier.DRAM, Contains(keys=keys))]
        if scan:
            calls.append((Tier.NVME, Contains(keys=keys)))
        answers = self.tiers.call_many(calls, return_exceptions=True)
        if isinstance(answers[0], BaseException):
            raise answers[0]
        have = list(answers[0])
        if scan and not isinstance(answers[1], BaseException):
            on_nvme = [not h and n for h, n in zip(have, answers[1])]
            self.counters.dropped["scan_held_on_nvme"] += sum(on_nvme)
            have = [h or n for h, n in zip(have, on_nvme)]
        elif scan:
            log.warning("NVMe did not say which scan victims it holds: %s", answers[1])
        return have
