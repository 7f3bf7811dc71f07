"""The agent writing blocks to the pool (G4): each block's owners pull it from DRAM here."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from cmx.actors.agent.scheduler import Priority, Scheduler
from cmx.actors.agent.shared import Counters, NodeTiers
from cmx.actors.directory.shard import Copy
from cmx.config import ServiceConfig
from cmx.doors import Ingest, Pin, PoolMembers
from cmx.errors import UnavailableError
from cmx.keys import BlockHash
from cmx.links import actor_name
from cmx.policies.admission import AdmissionPolicy
from cmx.policies.rendezvous import owners
from cmx.protocol import Loaded, Offer, copy_tag
from cmx.tiers import Tier

__all__ = ["PoolWrites"]

log = logging.getLogger(__name__)

POOL_REFRESH_S = 2.0  # how long a view of the pool's membership is reused


class PoolWrites:
    def __init__(self, node: str, config: ServiceConfig, tiers: NodeTiers, link: Any,
                 scheduler: Scheduler, transport: str, counters: Counters,
                 admission: AdmissionPolicy, nvme_admission: AdmissionPolicy) -> None:
        self.node = node
        self.config = config
        self.tiers = tiers
        self.link = link
        self.scheduler = scheduler
        self.transport = transport  # the name pool nodes pull with, for the counters
        self.counters = counters
        self.admission = admission  # which blocks go to the pool
        self.nvme_admission = nvme_admission  # counts each block's uses for NVMe admission
        self._members: list[str] = []
        self._checked = float("-inf")

    def admit(self, key: BlockHash) -> bool:
        self.admission.record(key)
        return self.admission.admit(key)

    def _pool_members(self) -> list[str]:
        now = time.monotonic()
        if now - self._checked > POOL_REFRESH_S:
            try:
                self._members = list(self.link.call("cmx:controller", PoolMembers()))
            except UnavailableError:
                pass  # keep the last membership we saw
            self._checked = now
        return self._members

    def write(
        self, keys: Sequence[BlockHash], parents: dict[BlockHash, BlockHash | None],
        replicas: int, namespace: str = "",
    ) -> int:
        """Have each block's pool owners pull it from this node's DRAM; returns copies made.
        The pool nodes keep ``namespace`` (the blocks' namespace id; where it is "", the DRAM
        copy's) with them, on disk."""
        members = self._pool_members()
        if not members or not keys:
            return 0
        pins = self.tiers.call(Tier.DRAM, Pin(keys=list(keys), owner=self.tiers.owner))
        try:
            by_owner: dict[str, list[Offer]] = {}
            for key, p in zip(keys, pins):
                info = None if p is None else self.tiers.info(p.epoch)
                if p is None or info is None:
                    continue
                offer = Offer(key, parents.get(key), info.arena, p.slot, p.size, p.checksum,
                              copy_tag(namespace, p.namespace))
                for owner in owners(key, members, replicas):
                    by_owner.setdefault(owner, []).append(offer)
            made = 0
            me = actor_name("agent", self.node)
            for owner, offers in by_owner.items():
                try:
                    n = int(self.link.call(
                        actor_name("pool", owner), Ingest(source=me, offers=offers),
                        timeout_s=self.config.load_timeout_s,
                    ))
                except Exception as exc:  # noqa: BLE001 - the pool failing never fails a store
                    log.warning("pool write to %s failed: %s", owner[:8], exc)
                    continue
                made += n
                self.counters.count_move("dram->pool", self.transport,
                                         sum(o.size for o in offers[:n]))
            return made
        finally:
            self.tiers.give_back(Tier.DRAM, unpin=[p.lease for p in pins if p is not None])

    def later(self, loaded: Sequence[Loaded], copies: Sequence[Sequence[Copy]],
              namespace: str = "") -> None:
        """Blocks reused often enough and not yet pooled go to the pool in the background
        (where there is a pool: the load that called this does not wait to find out)."""
        for b in loaded:
            self.nvme_admission.record(b.key)
        todo = [b.key for b, c in zip(loaded, copies)
                if self.admit(b.key) and not any(x.tier is Tier.POOL for x in c)]
        if todo:
            self.scheduler.submit(
                Priority.DEMOTE,
                lambda: self.write(todo, {}, self.config.pool_replication, namespace),
            )

