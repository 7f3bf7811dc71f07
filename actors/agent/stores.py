"""The agent's stores: a writer's blocks into DRAM slots granted to it, committed, then placed
(written through to NVMe, copied to the pool) as placement and admission say.

A writer on this node (the client, ``cmx.client.stores``) copies each block once, between
``grant_store`` and ``commit_store``; ``store`` does both here for a payload handed over
whole. A store's committed blocks stay pinned for its owner until they are placed, so a
writer may send its next window's grants while this window commits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from cmx.actors.agent.demote import Demotion
from cmx.actors.agent.host import HostBytes
from cmx.actors.agent.nvme import NvmeWrites
from cmx.actors.agent.pool import PoolWrites
from cmx.actors.agent.shared import Counters, NodeTiers
from cmx.actors.tiers.arena import Grant, Pinned
from cmx.config import ServiceConfig
from cmx.doors import CommitPinned, ReserveSlots
from cmx.keys import BlockHash
from cmx.protocol import StoreCommit
from cmx.tiers import Tier

__all__ = ["Stores", "parents_of"]


class Stores:
    def __init__(self, config: ServiceConfig, tiers: NodeTiers, host: HostBytes,
                 demotion: Demotion, nvme: NvmeWrites, pool: PoolWrites,
                 counters: Counters) -> None:
        self.config = config
        self.tiers = tiers
        self.host = host
        self.demotion = demotion
        self.nvme = nvme
        self.pool = pool
        self.counters = counters

    def store(
        self, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None], payload: np.ndarray,
        namespace: str = "", replicas: int | None = None,
    ) -> int:
        """Copy ``len(keys)`` blocks of ``payload`` (concatenated) into DRAM; returns committed.

        Blocks the pool's admission policy lets in are copied to their pool owners too
        (``replicas`` of them, default ``config.pool_replication``) before this returns.

        Blocks go in windows of half the DRAM arena, so a store larger than DRAM streams
        through it: each window's reservations evict (and demote) the blocks of the last.
        """
        if not keys:
            return 0
        size = payload.nbytes // len(keys)
        window = max(1, self.tiers.current(Tier.DRAM)[0].num_slots // 2)
        done = 0
        for start in range(0, len(keys), window):
            stop = min(start + window, len(keys))
            done += self._store_window(
                keys[start:stop], parents[start:stop], payload[start * size : stop * size], size,
                namespace, replicas or self.config.pool_replication,
            )
        return done

    def _store_window(
        self, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None],
        payload: np.ndarray, size: int, namespace: str, replicas: int,
    ) -> int:
        grants = self.grant_store(keys, parents, self.tiers.owner)
        try:
            done = self.host.copy_in(grants, payload, size)
        except BaseException:
            self.tiers.give_back(Tier.DRAM, abort=[g.lease for g in grants if g is not None])
            raise
        return self.commit_store(keys, parents, done, namespace, replicas).committed

    def grant_store(
        self, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None], owner: str,
    ) -> list[Grant | None]:
        """DRAM slots for ``keys`` (None: already stored, or no room), reserved for ``owner``,
        their evicted blocks already demoted: a writer on this node copies each block into
        its slot, in the arena of the grant's epoch, then calls ``commit_store``."""
        start_time = time.perf_counter()
        grants = self.tiers.call(Tier.DRAM, ReserveSlots(items=list(zip(keys, parents)),
                                                         owner=owner))
        try:
            self.demotion.demote_victims(Tier.DRAM, grants)
        except BaseException:
            self.tiers.give_back(Tier.DRAM, abort=[g.lease for g in grants if g is not None])
            raise
        self.counters.latency["grant_store"].observe(time.perf_counter() - start_time)
        return grants

    def commit_store(
        self, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None],
        done: Sequence[tuple[Grant, int, int]], namespace: str = "", replicas: int | None = None,
        owner: str = "",
    ) -> StoreCommit:
        """Commit the written slots (grant, size, checksum of each) and place the blocks: NVMe
        with write-through, the pool if admitted. A block whose grant's lease ended, or whose
        DRAM incarnation since restarted, is refused; so is one that write-through finds no
        longer matching its checksum (that copy is dropped). Its time is the agent's "store"
        latency: the writer's copy is the writer's.

        Each block is pinned for ``owner`` (the writer; default this agent) as it is
        committed, and stays pinned until its NVMe and pool copies are made, whatever fails:
        the writer's next window, granted beside this, must not evict it first."""
        start_time = time.perf_counter()
        pins = self.tiers.call(Tier.DRAM, CommitPinned(
            items=[(g.lease, n, c) for g, n, c in done], namespace=namespace, wait=True,
            owner=owner or self.tiers.owner))
        try:
            changed, stored, refused = self.place_committed(
                keys, parents, done, pins, namespace, replicas)
        finally:
            self.tiers.give_back(Tier.DRAM, unpin=[p.lease for p in pins if p is not None])
        self.counters.commits["committed"] += stored - len(changed)
        self.counters.commits["refused"] += len(refused) + len(changed)
        self.counters.latency["store"].observe(time.perf_counter() - start_time)
        return StoreCommit(stored - len(changed), tuple(refused + changed))

    def place_committed(
        self, keys: Sequence[BlockHash], parents: Sequence[BlockHash | None],
        done: Sequence[tuple[Grant, int, int]], pins: Sequence[Pinned | None], namespace: str,
        replicas: int | None,
    ) -> tuple[list[BlockHash], int, list[BlockHash]]:
        """Write through and pool the blocks committed (pinned): (keys whose bytes changed,
        blocks committed, keys refused)."""
        stored = [((g.key, n, c), p) for (g, n, c), p in zip(done, pins) if p is not None]
        refused = [g.key for (g, _, _), p in zip(done, pins) if p is None]
        self.counters.count_move("client->dram", "local", sum(n for (_, n, _), _ in stored))
        admission, placement = self.demotion.nvme_admission, self.demotion.placement
        for key in keys:
            admission.record(key)
        through = [(s, p) for s, p in stored
                   if Tier.NVME in placement.on_store(admission.admit(s[0]))]
        changed = self.nvme.write(Tier.DRAM, [s for s, _ in through], parents_of(keys, parents),
                                  dict.fromkeys(keys, namespace), pins=[p for _, p in through])
        self.pool.write([k for (k, _, _), _ in stored if self.pool.admit(k) and k not in changed],
                        parents_of(keys, parents), replicas or self.config.pool_replication,
                        namespace)
        return changed, len(stored), refused


def parents_of(
    keys: Sequence[BlockHash], parents: Sequence[BlockHash | None]
) -> dict[BlockHash, BlockHash | None]:
    return dict(zip(keys, parents))
